#!/usr/bin/env bash
# The retrieval task at 16K tokens on one H200 in ~3.5 minutes, by a length curriculum:
#   stage 1: learn the lookup at SHORT_LEN tokens (many rows per step), stopping once the
#            validation accuracy reaches S1_TARGET or after S1_MINUTES;
#   stage 2: --init-from stage 1's parameters, train at LONG_LEN (16384) tokens with whatever
#            is left of BUDGET_S, and evaluate there (step 0 = the stage 1 model unchanged).
# Usage: OUT=gpu_out ./scripts/retrieval_gpu.sh   (every knob below is an env var)
# Writes $OUT/retrieval-short/ and $OUT/retrieval-16k/ (metrics.jsonl, loss.png, checkpoint),
# their logs (one per kernel tried) and $OUT/retrieval_summary.json; the last line printed is
# the summary.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
py=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-210}      # whole script, compilation included
SHORT_LEN=${SHORT_LEN:-1024}; LONG_LEN=${LONG_LEN:-16384}
S1_MINUTES=${S1_MINUTES:-1.0}; S1_TARGET=${S1_TARGET:-0.9}
IMPL=${IMPL:-auto}             # pallas_flash implementation (auto: Mosaic on the H200)
PRESET=${PRESET:-h200-retrieval}
# Extra flags for each stage, applied last (a CPU smoke test: PRESET=cpu-demo S1_FLAGS=...).
S1_FLAGS=${S1_FLAGS:-}; S2_FLAGS=${S2_FLAGS:-}
S1="$OUT/retrieval-short"; S2="$OUT/retrieval-16k"
rm -rf "$S1" "$S2"  # a new run must not find the previous run's checkpoints
t0=$SECONDS

stage1() {  # $1: implementation
  "$py" -m train --preset "$PRESET" --implementation "$1" --seq-len "$SHORT_LEN" \
    --batch-size 128 --steps 3000 --warmup-steps 50 --lr 2e-3 --eval-every 50 \
    --eval-batches 2 --target-accuracy "$S1_TARGET" --max-minutes "$S1_MINUTES" \
    --out-dir "$S1" $S1_FLAGS 2>&1 | tee "$OUT/retrieval-short-$1.log"
  return "${PIPESTATUS[0]}"
}

stage2() {  # $1: implementation
  # Whatever is left, less ~35 s for start-up, final eval and checkpoint outside its timer.
  local minutes
  minutes=$(awk -v b="$BUDGET_S" -v e="$((SECONDS - t0))" \
    'BEGIN { m = (b - e - 35) / 60; printf "%.2f", (m < 0.5 ? 0.5 : m) }')
  echo "=== stage 2: $LONG_LEN tokens, --max-minutes $minutes ($((SECONDS - t0)) s so far)"
  "$py" -m train --preset "$PRESET" --implementation "$1" --init-from "$S1" \
    --seq-len "$LONG_LEN" --batch-size 16 --steps 600 --warmup-steps 20 --lr 1e-3 \
    --eval-every 50 --eval-batches 8 --target-accuracy 0.99 --max-minutes "$minutes" \
    --out-dir "$S2" $S2_FLAGS 2>&1 | tee "$OUT/retrieval-16k-$1.log"
  return "${PIPESTATUS[0]}"
}

# A kernel that fails to compile should not cost the whole run: the Triton kernels take the
# same shapes, so each stage is retried once with them. A stage has failed when it left no
# finished checkpoint (stage 1) or no training step (stage 2), whatever its exit status.
has_checkpoint() { ls "$1/checkpoints" 2>/dev/null | grep -qx '[0-9][0-9]*'; }
trained() { grep -q '"kind": "train"' "$1/metrics.jsonl" 2>/dev/null; }
echo "=== stage 1: $SHORT_LEN tokens"
stage1 "$IMPL"
if ! has_checkpoint "$S1" && [ "$IMPL" != triton ]; then
  echo "=== stage 1 failed with --implementation $IMPL; retrying with triton"
  IMPL=triton; rm -rf "$S1"
  stage1 "$IMPL"
fi
if ! has_checkpoint "$S1"; then
  echo "RETRIEVAL FAILED: stage 1 left no checkpoint (see $OUT/retrieval-short-$IMPL.log)"
  exit 1
fi
stage2 "$IMPL"; rc2=$?
if ! trained "$S2" && [ "$IMPL" != triton ] && [ $((SECONDS - t0)) -lt $((BUDGET_S - 60)) ]; then
  echo "=== stage 2 failed with --implementation $IMPL; retrying with triton"
  rm -rf "$S2"; stage2 triton; rc2=$?
fi

"$py" - "$S1" "$S2" "$OUT/retrieval_summary.json" "$((SECONDS - t0))" "$rc2" "$LONG_LEN" <<'EOF'
"""One-line summary of both stages from their metrics.jsonl; also written as JSON."""
import json, pathlib, sys

s1, s2, out, seconds, rc2, long_len = sys.argv[1:]

def stage(run_dir):
  path = pathlib.Path(run_dir) / "metrics.jsonl"
  rows = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
  cfg = next((r["config"] for r in rows if r["kind"] == "config"), {})
  evals = [r for r in rows if r["kind"] == "eval"]
  steps = max((r["step"] + 1 for r in rows if r["kind"] == "train"), default=0)
  best = max(evals, key=lambda r: r["val_accuracy"]) if evals else {}
  return dict(seq_len=cfg.get("seq_len"), steps=steps,
              first_accuracy=evals[0]["val_accuracy"] if evals else None,
              accuracy=evals[-1]["val_accuracy"] if evals else None,
              best_accuracy=best.get("val_accuracy"), best_step=best.get("step"))

a, b = stage(s1), stage(s2)
summary = dict(stage1=a, stage2=b, chance=0.1, seconds=int(seconds), stage2_rc=int(rc2))
pathlib.Path(out).write_text(json.dumps(summary, indent=1) + "\n")
pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"
print(f"RETRIEVAL at {b['seq_len'] or long_len} tokens: val_accuracy {pct(b['accuracy'])} "
      f"per digit (chance 10.0%) after {b['steps']} steps there; "
      f"{pct(b['first_accuracy'])} before them, best {pct(b['best_accuracy'])} "
      f"(step {b['best_step']}); "
      f"stage 1 at {a['seq_len']} tokens: {pct(a['accuracy'])} after {a['steps']} steps; "
      f"{seconds} s in all" + ("" if rc2 == "0" else f"; stage 2 exited with {rc2}"))
EOF
