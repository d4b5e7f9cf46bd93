#!/usr/bin/env bash
# Everything the GPU machine checks and measures, in one call: ./scripts/gpu_suite.sh STAGE...
# Stages: env tests mosaic-tests sweep bench long memory features fused retrieval profile ptxas
# mosaic-sweep bwd-kernels decode (the decode grid; DECODE_ARGS e.g. --quick) decode-tests (PTXAS_VARIANTS: scripts/mosaic_ptxas.py variants, default all;
# PTXAS_SHAPE B,T,H,D; MOSAIC_VARIANTS: mosaic_gpu_check.py --sweep variants, default the
# split backward against the opt-in deferred fused one; BWD_OVERRIDES: MosaicConfig key=value for
# bwd-kernels; GPU_MARK: the tests stage's marker expression, e.g. "gpu and not fused" for the
# default kernels' cases only; GPU_TESTS: its paths). Results go to $OUT (default ./gpu_out).
# Each stage is cut off after ${STAGE_LIMIT_S:-900} s (timeout rc 124).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
py=python3
candidates=default,bwd_fused_defer_inline_r240
MOSAIC_VARIANTS="${MOSAIC_VARIANTS:-$candidates}"
status=0
run() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS
  timeout "${STAGE_LIMIT_S:-900}" "$@" 2>&1 | tee "$OUT/$name.log"; local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"; [ "$rc" = 0 ] || status=1; }
for stage in "$@"; do
  case $stage in
    env) run env bash -c "nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv; \
           $py -c 'import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())'; git rev-parse HEAD 2>/dev/null || true" ;;
    tests) run tests $py -m pytest -q -m "${GPU_MARK:-gpu}" -n 4 -p no:cacheprovider ${GPU_TESTS:-tests} ;;
    mosaic-tests) run mosaic-tests $py -m pytest -q -m gpu -p no:cacheprovider tests/mosaic \
                    tests/test_gpu_features.py ;;
    features) run features $py scripts/features_bench.py --json "$OUT/features.json" ;;
    fused) run fused $py scripts/fused_bwd_check.py --json "$OUT/fused.json" ;;
    retrieval) run retrieval bash scripts/retrieval_gpu.sh ;;
    profile) run profile bash -c "$py scripts/mosaic_profile.py --out '$OUT' --shape 1,4096,16,128 \
               && $py scripts/mosaic_profile.py --out '$OUT' --shape 1,4096,16,128 --causal" ;;
    ptxas) run ptxas bash -c "$py scripts/mosaic_ptxas.py --out /tmp/pf_ptxas --reps 50 \
             --shape ${PTXAS_SHAPE:-4,4096,16,128} \
             ${PTXAS_VARIANTS:-} && cp /tmp/pf_ptxas/ptxas/report.json '$OUT/ptxas_report.json'" ;;
    sweep) run sweep $py scripts/triton_sweep.py --json "$OUT/sweep.json" ;;
    mosaic-sweep) run mosaic-sweep $py scripts/mosaic_gpu_check.py --out "$OUT" --skip-check --sweep \
                    --variants "$MOSAIC_VARIANTS" ;;
    bwd-kernels) run bwd-kernels $py scripts/mosaic_bwd_kernels.py --out "$OUT" ${BWD_OVERRIDES:-} ;;
    bench) run bench $py -m pallas_flash.bench --shapes "${SHAPES:-anchors}" --impl "${IMPLS:-triton,mosaic,cudnn,jax_xla}" --json "$OUT/bench.json" ;;
    decode) run decode $py -m pallas_flash.bench --decode ${DECODE_ARGS:-} --json "$OUT/decode.json" ;;
    decode-tests) run decode-tests $py -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_decode.py ;;
    long) run long $py -m pallas_flash.bench --shapes long --impl "${IMPLS:-triton,mosaic,cudnn}" --json "$OUT/bench_long.json" ;;
    memory) XLA_PYTHON_CLIENT_MEM_FRACTION=.95 run memory $py -m pallas_flash.bench --memory --impl "${MEM_IMPLS:-triton}" \
              --max-seq "${MAX_SEQ:-262144}" --json "$OUT/memory.json" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
exit $status
