#!/usr/bin/env bash
# What the GPU machine checks and measures, in one call: ./scripts/gpu_suite.sh STAGE...
# Stages: env tests bench features long memory retrieval ptxas decode (the decode grid;
# DECODE_ARGS, e.g. --quick) decode-tests fp8 (FP8_ARGS: --fp8 (default), --fp8-training or
# --fp8-features).
# tests: GPU_MARK its marker expression (default "gpu"), GPU_K its -k expression (default all),
#   GPU_TESTS its paths, GPU_WORKERS its pytest-xdist workers (default 8: compiling is CPU-bound;
#   on the H200 machine's 16 cores 8 workers ran 26 cases in 3.5 min, 25-40 s a case alone).
#   The decode cases (3-8 GiB of caches each; eight workers ran the H200 out of memory) run in
#   decode-tests on DECODE_WORKERS workers (default 2), not here. (xdist_group marks do not
#   keep them together: --dist loadgroup stops grouping on pytest 9.2, pytest-xdist #1386.)
# bench: SHAPES and IMPLS; features: FEATURES (bench/features.py rows, default all) and IMPLS;
# ptxas: PTXAS_SHAPE B,T,H,D and PTXAS_VARIANTS (scripts/mosaic_ptxas.py variants).
# Results go to $OUT (default ./gpu_out). Each stage is cut off after ${STAGE_LIMIT_S:-900} s.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
py=python3
status=0
run() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS
  timeout "${STAGE_LIMIT_S:-900}" "$@" 2>&1 | tee "$OUT/$name.log"; local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"; [ "$rc" = 0 ] || status=1; }
for stage in "$@"; do
  case $stage in
    env) run env bash -c "nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv; \
           $py -c 'import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())'; git rev-parse HEAD 2>/dev/null || true" ;;
    tests) run tests $py -m pytest -q -m "${GPU_MARK:-gpu}" -k "${GPU_K:-}" -n "${GPU_WORKERS:-8}" -p no:cacheprovider --ignore=tests/test_gpu_decode.py ${GPU_TESTS:-tests} ;;
    bench) run bench $py -m pallas_flash.bench --shapes "${SHAPES:-anchors}" --impl "${IMPLS:-mosaic,cudnn}" --json "$OUT/bench.json" ;;
    features) run features $py -m pallas_flash.bench --features "${FEATURES:-all}" --impl "${IMPLS:-mosaic,cudnn}" \
                --json "$OUT/features.json" ;;
    long) run long $py -m pallas_flash.bench --shapes long --impl "${IMPLS:-mosaic,cudnn}" --json "$OUT/bench_long.json" ;;
    memory) XLA_PYTHON_CLIENT_MEM_FRACTION=.95 run memory $py -m pallas_flash.bench --memory --impl "${MEM_IMPLS:-mosaic}" \
              --max-seq "${MAX_SEQ:-262144}" --json "$OUT/memory.json" ;;
    retrieval) run retrieval bash scripts/retrieval_gpu.sh ;;
    ptxas) run ptxas bash -c "$py scripts/mosaic_ptxas.py --out /tmp/pf_ptxas --reps 50 \
             --shape ${PTXAS_SHAPE:-4,4096,16,128} \
             ${PTXAS_VARIANTS:-} && cp /tmp/pf_ptxas/ptxas/report.json '$OUT/ptxas_report.json'" ;;
    decode) run decode $py -m pallas_flash.bench --decode ${DECODE_ARGS:-} --json "$OUT/decode.json" ;;
    fp8) run fp8 $py -m pallas_flash.bench ${FP8_ARGS:---fp8} --json "$OUT/fp8.json" ;;
    decode-tests) run decode-tests $py -m pytest -q -m gpu -n "${DECODE_WORKERS:-2}" -p no:cacheprovider tests/test_gpu_decode.py ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
exit $status
