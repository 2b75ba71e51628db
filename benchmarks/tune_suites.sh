#!/usr/bin/env bash
# Tune and bench the decode / prefill suites, and time tuning all of llama-3-8b, on the GPU.
#
#   benchmarks/tune_suites.sh decode    # llama-3-8b tp1, llama-3-70b tp8, qwen3-32b tp4; M 1,2,4,8,16
#   benchmarks/tune_suites.sh prefill   # llama-3-8b tp1, llama-3-70b tp8; M 32..8192 (powers of two)
#   benchmarks/tune_suites.sh time8b    # every llama-3-8b shape at the default ladder 1..8192, timed
#   benchmarks/tune_suites.sh smoke     # llama-3-8b (no lm_head) at M 1,64,1024: a quick end-to-end check
#   benchmarks/tune_suites.sh heldout gemma-2-9b:1   # the default ladder 1..8192, then `bench --ms` at
#                                       # 1..4096 and the Ms between (3, 12, ... 3072): issue 13's check
#   benchmarks/tune_suites.sh tiny      # tiny-llama: checks this script anywhere (CPU too)
#   benchmarks/tune_suites.sh all       # the first three (longer than one 10-minute device call)
#
# Run each suite as its own device call (one call may last 10 minutes). Outputs: $OUT/<suite>_tuned.csv,
# <suite>_bench.{json,png}, <suite>.log, and everything (profiles, bench CSVs) in $OUT/<suite>.tar.gz.
# Extra arguments for `gemmtune tune` go in $TUNE_ARGS (e.g. "--libtype torch,skinny --top 3").
# Models can be given after the suite name to split a long suite over calls, e.g.
#   TUNED=$PWD/prefill_tuned.csv benchmarks/tune_suites.sh prefill llama-3-8b:1
#   TUNED=$PWD/prefill_tuned.csv benchmarks/tune_suites.sh prefill llama-3-70b:8
# With $TUNED set, that table is resumed (shapes already in it are skipped) and updated in place; copy
# the returned <suite>_tuned.csv there between calls. Set NOBENCH=1 to skip the bench step.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/suites_out}
WORK=${WORK:-/tmp/gemmtune_suites}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
G=(python3 -m gemmtune.cli.main)
TUNE_ARGS=${TUNE_ARGS:-}

shapes() {  # shapes OUTFILE NSETS MODEL:TP [MODEL:TP ...] -- one untuned CSV for several models
  local out=$1 nsets=$2
  shift 2
  : >"$out.tmp"
  for mt in "$@"; do
    "${G[@]}" shapes -m "${mt%%:*}" --tp "${mt##*:}" --nsets "$nsets" ${SHAPES_ARGS:-} -o "$WORK/part.csv" 2>>"$WORK/shapes.log"
    if [ -s "$out.tmp" ]; then tail -n +2 "$WORK/part.csv" >>"$out.tmp"; else cat "$WORK/part.csv" >"$out.tmp"; fi
  done
  mv "$out.tmp" "$out"
  echo "$(($(wc -l <"$out") - 1)) shapes in $out"
}

suite() {  # suite NAME NSETS MODEL:TP...
  local name=$1 nsets=$2
  shift 2
  local log="$OUT/$name.log" tuned=${TUNED:-$WORK/${name}_tuned.csv}
  {
    echo "== $name: $* at M=$nsets ($(date -u +%FT%TZ))"
    python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
    shapes "$WORK/${name}_shapes.csv" "$nsets" "$@"
    local t0=$SECONDS
    # shellcheck disable=SC2086
    "${G[@]}" tune "$WORK/${name}_shapes.csv" -o "$tuned" \
      --profile-file "$WORK/${name}_profile.csv" --no-progress $TUNE_ARGS
    echo "tune wall time: $((SECONDS - t0)) s"
    if [ "$name" != time8b ] && [ -z "${NOBENCH:-}" ]; then
      # shellcheck disable=SC2086
      "${G[@]}" bench "$tuned" -o "$WORK/${name}_bench" ${BENCH_ARGS:-}
    fi
  } 2>&1 | tee "$log"
  [ "$tuned" -ef "$OUT/${name}_tuned.csv" ] || cp "$tuned" "$OUT/${name}_tuned.csv"
  for f in "$WORK/${name}_bench.json" "$WORK/${name}_bench.png"; do [ -f "$f" ] && cp "$f" "$OUT/"; done
  tar -C "$WORK" -czf "$OUT/$name.tar.gz" $(cd "$WORK" && ls "${name}"_*.csv "${name}"_*.json 2>/dev/null)
}

which=${1:-smoke}
shift || true
models() { if [ $# -gt 0 ]; then echo "$@"; else echo "$DEFAULT"; fi; }
case "$which" in
  decode) suite decode 1,2,4,8,16 $(DEFAULT="llama-3-8b:1 llama-3-70b:8 qwen3-32b:4" models "$@") ;;
  prefill) suite prefill 32..8192 $(DEFAULT="llama-3-8b:1 llama-3-70b:8" models "$@") ;;
  time8b) suite time8b 1..8192 llama-3-8b:1 ;;
  smoke) SHAPES_ARGS=--no-lm-head suite smoke 1,64,1024 llama-3-8b:1 ;;
  heldout)
    [ $# -gt 0 ] || { echo "usage: $0 heldout MODEL:TP [MODEL:TP ...]" >&2; exit 2; }
    BENCH_ARGS="--ms 1..4096,3,12,24,48,96,192,384,768,1536,3072" suite heldout 1..8192 "$@"
    ;;
  tiny) suite tiny 1,8 $(DEFAULT="tiny-llama:1 tiny-llama:2" models "$@") ;; # seconds, runs on the CPU too
  all)
    "$0" decode
    "$0" prefill
    "$0" time8b
    ;;
  *)
    echo "usage: $0 decode|prefill|time8b|smoke|heldout MODEL:TP|tiny|all" >&2
    exit 2
    ;;
esac
