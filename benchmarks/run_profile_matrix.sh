#!/usr/bin/env bash
# The profile / bench-model acceptance matrix on one GPU, job by job, everything under OUT.
#
#   bash benchmarks/run_profile_matrix.sh OUT [JOB ...]
#
# JOBs (default: all, in this order):
#   tests          the GPU tests of tests/test_profile.py (custom ops under inductor, GPU profile) and
#                  tests/test_attention_flex.py (flex tier: head dim 256, Gemma-2 eager / inductor / graph decode)
#   MODEL          gemmtune bench-model --model MODEL --layers 4 (stock, optimize, compile, compile+optimize)
#   MODEL+op       the same plus a compile+optimize contender with the fused ops as custom ops
#   compile-ops    benchmarks/bench_compile_ops.py: per op, inductor-fused reference vs custom op
#   attention      benchmarks/bench_attention_softcap.py: softcapped attention, eager tier vs flex_attention
# Each job writes OUT/<job>.log (and bench-model's OUT/<model>/report.{md,json,png}); the speed
# tables are printed at the end.
set -u
OUT=${1:?usage: run_profile_matrix.sh OUT [JOB ...]}
shift
JOBS=("$@")
[ ${#JOBS[@]} -eq 0 ] && JOBS=(tests llama-3-8b+op qwen2.5-7b gemma-2-9b compile-ops)
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
T0=$SECONDS
for job in "${JOBS[@]}"; do
  t=$SECONDS
  case $job in
    tests)
      timeout 420 python -m pytest -q -m gpu tests/test_profile.py tests/test_attention_flex.py >"$OUT/tests.log" 2>&1 ;;
    compile-ops)
      timeout 400 python benchmarks/bench_compile_ops.py --model llama-3-8b --out "$OUT/compile_ops.md" \
        >"$OUT/compile-ops.log" 2>&1 ;;
    attention)
      timeout 400 python benchmarks/bench_attention_softcap.py --out "$OUT/attention_softcap.md" \
        >"$OUT/attention.log" 2>&1 ;;
    *+op)
      m=${job%+op}
      timeout 480 python -m gemmtune.cli.main bench-model --model "$m" --layers 4 --compile-ops ref \
        --compile-ops op -o "$OUT/$m" >"$OUT/$m.log" 2>&1 ;;
    *)
      timeout 400 python -m gemmtune.cli.main bench-model --model "$job" --layers 4 -o "$OUT/$job" \
        >"$OUT/$job.log" 2>&1 ;;
  esac
  echo "== $job: exit $? after $((SECONDS - t)) s"
done
echo "== total $((SECONDS - T0)) s"
for job in "${JOBS[@]}"; do
  m=${job%+op}
  case $job in
    tests) tail -n 3 "$OUT/tests.log" ;;
    compile-ops) [ -f "$OUT/compile_ops.md" ] && sed -n '/^| variant/,$p' "$OUT/compile_ops.md" ;;
    attention) [ -f "$OUT/attention_softcap.md" ] && sed -n '/^| B /,$p' "$OUT/attention_softcap.md" || tail -n 20 "$OUT/attention.log" ;;
    *) [ -f "$OUT/$m/report.md" ] && { echo "## $m"; sed -n '/^## Speed/,/^## Time by/p' "$OUT/$m/report.md" | head -n -1;
         sed -n '/^## Errors/,/^Command/p' "$OUT/$m/report.md"; } || tail -n 20 "$OUT/$m.log" ;;
  esac
done
