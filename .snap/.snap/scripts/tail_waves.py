"""Does the last, partial wave of CTAs cost what its share of idle SMs predicts?

On the GPU machine, from the repository root:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/tail_waves.py [--seq-len 16384]
      [--heads 16,33] [--modes fwd,fwdbwd] [--causal]

times ours (mosaic) and cuDNN, interleaved (bench.timing.time_interleaved), at one sequence
length for several head counts. A non-causal call of T/128 q tiles per head and H heads
launches H·T/128 equal CTAs on the GPU's SMs: 16 heads at 16K are 2048 CTAs = 15.5 waves of
132, so the SMs idle through half of the last wave (ceiling 15.5/16 = 97 %), while 33 heads are
exactly 32 waves. If TFLOP/s per head count follow waves/ceil(waves), the tail is where the
difference goes. Output is checked against cuDNN (bf16 relative error) before timing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import jax
import jax.numpy as jnp

from pallas_flash.bench import flops, shapes, timing

sys.path.insert(0, os.path.dirname(__file__))
import mosaic_gpu_check as mgc  # noqa: E402  (the shared error helper)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seq-len", type=int, default=16384)
  p.add_argument("--heads", default="16,33")
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--modes", default="fwd,fwdbwd")
  p.add_argument("--causal", action="store_true")
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--impls", default="mosaic,cudnn", help="ours, then the baseline")
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  args = p.parse_args()
  sms = getattr(jax.devices()[0], "core_count", 132)  # SMs; 132 on H100 / H200
  impls = args.impls.split(",")
  rows = []
  for h in (int(x) for x in args.heads.split(",")):
    spec = shapes.ShapeSpec(name=f"h{h}", batch=1, seq_len=args.seq_len, num_heads=h,
                            head_dim=args.head_dim)
    q, k, v, do = shapes.make_inputs(spec, jnp.bfloat16, 0)
    ctas = h * math.ceil(args.seq_len / 128)
    waves = ctas / sms
    for mode in args.modes.split(","):
      steps = {impl: timing.make_step(impl, mode=mode, is_causal=args.causal)
               for impl in impls}
      compiled = {impl: timing.compile_step(s, (q, k, v, do))[0] for impl, s in steps.items()}
      outs = {impl: jax.tree.leaves(c(q, k, v, do)) for impl, c in compiled.items()}
      err = max(mgc.rel_err(a, b) for a, b in zip(outs[impls[0]], outs[impls[1]]))
      del outs
      t = timing.time_interleaved(compiled, (q, k, v, do), iters=args.iters)
      f = flops.attention_flops(spec, is_causal=args.causal, mode=mode)
      row = dict(heads=h, seq_len=args.seq_len, mode=mode, causal=args.causal, ctas=ctas,
                 waves=round(waves, 3), wave_ceiling=round(waves / math.ceil(waves), 3),
                 err_vs_cudnn=err, **{f"{impl}_tflops": round(flops.tflops(f, x.median_s), 1)
                                      for impl, x in t.items()})
      row["ratio"] = round(row[f"{impls[0]}_tflops"] / row[f"{impls[1]}_tflops"], 3)
      rows.append(row)
      print(json.dumps(row), flush=True)
    del q, k, v, do
  with open(os.path.join(args.out, "tail_waves.json"), "w") as fh:
    json.dump(rows, fh, indent=1)


if __name__ == "__main__":
  main()
