#!/usr/bin/env bash
# bench-model's decode parity on a GPU: every contender's teacher-forced decode against stock on the
# given presets (4 layers, bf16, the default contenders and scenarios), then one run with a deliberately
# broken contender (--test-break optimize: its attention ignores the KV cache), which must exit 1.
#
#   benchmarks/bench_model_parity.sh llama-3-8b gemma-2-9b      # presets, or config.json paths
#   benchmarks/bench_model_parity.sh --broken-only
#
# Outputs in $OUT: <model>/report.{md,json,png} and <model>.log per preset, broken/ and broken.log;
# summary.txt lists each run's exit code.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/parity_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
G=(python3 -m gemmtune.cli.main)
broken_only=0
[ "${1:-}" = "--broken-only" ] && { broken_only=1; shift; }
if [ $broken_only = 0 ]; then
    for m in "$@"; do
        "${G[@]}" bench-model -m "$m" --layers 4 -o "$OUT/$m" > "$OUT/$m.log" 2>&1
        echo "bench-model $m: rc=$?" | tee -a "$OUT/summary.txt"
    done
fi
"${G[@]}" bench-model -m llama-3-8b --layers 4 --contenders stock,optimize --no-profile --test-break optimize \
    -o "$OUT/broken" > "$OUT/broken.log" 2>&1
echo "bench-model llama-3-8b --test-break optimize: rc=$? (1 expected)" | tee -a "$OUT/summary.txt"
