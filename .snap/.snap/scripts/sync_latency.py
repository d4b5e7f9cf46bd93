"""What one synchronised attention call costs beyond its steady-state time, ours against cuDNN.

On the GPU machine, from the repository root:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/sync_latency.py [--shape 2,16384,8,128,4]
      [--modes fwd,fwdbwd] [--causal] [--calls 30]

The eleventh session found a synchronised training step 10-15 ms slower with our kernels than
with cuDNN's at the same steady-state step time (train.compare's sync_latency_ms). This times
the attention step alone, per implementation and mode, in rounds that alternate the
implementations: `steady` = seconds per call of back-to-back calls synchronised once, `sync` =
median wall time of a call followed by block_until_ready, after a 50 ms idle gap (as between
logged training steps), `dispatch` = median time for the call itself to return. Outputs are
compared with cuDNN's first. Rows go to stdout and $OUT/sync_latency.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax

from pallas_flash.bench import shapes, timing

sys.path.insert(0, os.path.dirname(__file__))
import mosaic_gpu_check as mgc  # noqa: E402  (rel_err)


def _steady(fn, args, calls: int) -> float:
  """Seconds per call of back-to-back calls, after a warm-up call."""
  jax.block_until_ready(fn(*args))
  return timing.seconds_per_call(fn, args, calls)


def _synced(fn, args, calls: int, gap_s: float) -> tuple[float, float]:
  """(median wall of call + sync, median time for the call to return), idle gap_s before
  each call."""
  walls, dispatch = [], []
  for _ in range(calls):
    time.sleep(gap_s)
    t0 = time.perf_counter()
    out = fn(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    walls.append(time.perf_counter() - t0)
    dispatch.append(t1 - t0)
  return statistics.median(walls), statistics.median(dispatch)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shape", default="2,16384,8,128,4", help="B,T,H,D[,kv heads]")
  ap.add_argument("--modes", default="fwd,fwdbwd")
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--calls", type=int, default=30)
  ap.add_argument("--gap-ms", type=float, default=50.0)
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--impls", default="mosaic,cudnn")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args()
  b, t, h, d, *kv = (int(x) for x in args.shape.split(","))
  spec = shapes.ShapeSpec(name="latency", batch=b, seq_len=t, num_heads=h, head_dim=d,
                          num_kv_heads=kv[0] if kv else 0)
  q, k, v, do = shapes.make_inputs(spec, jax.numpy.bfloat16, 0)
  impls, rows = args.impls.split(","), []
  for mode in args.modes.split(","):
    fns = {i: timing.compile_step(timing.make_step(i, mode=mode, is_causal=args.causal),
                                  (q, k, v, do))[0] for i in impls}
    outs = {i: jax.tree.leaves(f(q, k, v, do)) for i, f in fns.items()}
    err = max(mgc.rel_err(a, r) for a, r in zip(outs[impls[0]], outs[impls[-1]]))
    del outs
    for rnd in range(args.rounds):
      for impl in impls[rnd % len(impls):] + impls[:rnd % len(impls)]:
        steady = _steady(fns[impl], (q, k, v, do), args.calls)
        sync, dispatch = _synced(fns[impl], (q, k, v, do), args.calls, args.gap_ms / 1e3)
        row = dict(mode=mode, causal=args.causal, shape=args.shape, impl=impl, round=rnd,
                   err_vs_last=err, steady_ms=1e3 * steady, sync_ms=1e3 * sync,
                   dispatch_ms=1e3 * dispatch, latency_ms=1e3 * (sync - steady))
        rows.append(row)
        print(json.dumps(row), flush=True)
  with open(os.path.join(args.out, "sync_latency.json"), "w") as fh:
    json.dump(rows, fh, indent=1)


if __name__ == "__main__":
  main()
