"""MosaicConfig variants against the tuned config and cuDNN, on the GPU.

On the GPU machine, from the repository root:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/config_ab.py
      --variant fold:dkdv_fold_stats=True [--variant name:k=v,k=v ...]
      [--shapes 2x16384x8x128x4,...] [--causal yes,no] [--mode fwdbwd] [--iters 8]
      [--orders balanced,rotating] [--min-loop-ms 50] [--segments N] [--window LEFT]

Per shape, causality and mode: the config a call without one runs (`config.call_config`,
"default"), each variant (that config with its overrides) and cuDNN, compared with "default"
(max relative error) and with their own second run (bitwise), then timed in interleaved
rounds (bench.variants.compare), once per round order in --orders (bench.timing.round_orders;
a variant without overrides, "twin:", measures the method's noise). Overrides are
config.with_overrides' "key=value,...".
--segments N packs each sequence as N equal documents (segment ids) for our rows; cuDNN's row
stays dense, and TFLOP/s count the dense work, so only our rows compare with each other.
--window LEFT gives every row, cuDNN's too, local_window_size=(LEFT, 0) (causal only), and
TFLOP/s count the band's work (bench.flops.window_flops). The
variants' correctness against the float32 reference is the GPU tests' job. Rows go to stdout
and $OUT/config_ab.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench import flops, shapes, variants
from pallas_flash.mosaic_gpu import config as mconfig
from pallas_flash.call import AttentionParams


def step(cfg, causal: bool, mode: str, seg=None, window=None):
  def attn(q, k, v):
    return pallas_flash.flash_attention(q, k, v, is_causal=causal, implementation="mosaic",
                                        config=cfg, query_segment_ids=seg,
                                        local_window_size=window)
  if mode == "fwd":
    return jax.jit(lambda q, k, v, do: attn(q, k, v))
  return jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--variant", action="append", required=True, help="name:key=value,...")
  ap.add_argument("--shapes", default="2x16384x8x128x4,1x16384x16x128,4x4096x16x128")
  ap.add_argument("--causal", default="yes,no")
  ap.add_argument("--mode", default="fwdbwd")
  ap.add_argument("--iters", type=int, default=8)
  ap.add_argument("--orders", default="balanced")
  ap.add_argument("--min-loop-ms", type=float, default=50.0)
  ap.add_argument("--segments", type=int, default=0, help="equal documents per sequence")
  ap.add_argument("--window", type=int, default=None, help="left window (causal rows only)")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args()
  named = [v.partition(":")[::2] for v in args.variant]  # (name, "k=v,...")
  window = None if args.window is None else (args.window, 0)
  if window and args.causal != "yes":
    ap.error("--window runs causal rows only: pass --causal yes")
  rows = []
  try:
    for name in args.shapes.split(","):
      spec = variants.parse_shape(name)
      inputs = shapes.make_inputs(spec, jnp.bfloat16, 0)
      seg = None
      if args.segments:
        doc = -(-spec.seq_len // args.segments)
        seg = jnp.broadcast_to(jnp.arange(spec.seq_len, dtype=jnp.int32) // doc,
                               (spec.batch, spec.seq_len))
      for causal in (c == "yes" for c in args.causal.split(",")):
        # The config a call without one runs (its backward fused for long causal calls).
        tuned = mconfig.call_config(
            spec.head_dim, AttentionParams(scale=1.0, is_causal=causal,
                                           has_segments=seg is not None, local_window=window),
            spec.seq_len, spec.batch)
        configs = {"default": tuned,
                   **{n: mconfig.with_overrides(tuned, kw) for n, kw in named}}
        for mode, order in itertools.product(args.mode.split(","), args.orders.split(",")):
          fns = {n: step(c, causal, mode, seg, window) for n, c in configs.items()}
          band = {} if window is None else dict(
              cudnn_kwargs={"local_window_size": window},
              flop_count=flops.window_flops(spec, left=window[0], mode=mode))
          row = dict(shape=name, causal=causal, mode=mode, order=order, segments=args.segments,
                     window=window, min_loop_ms=args.min_loop_ms,
                     variants={n: kw for n, kw in named},
                     **variants.compare(fns, inputs, spec, mode=mode, is_causal=causal,
                                        baseline="default", iters=args.iters, order=order,
                                        min_loop_s=args.min_loop_ms / 1e3, **band))
          rows.append(row)
          print(json.dumps(row), flush=True)
      del inputs
  finally:
    with open(os.path.join(args.out, "config_ab.json"), "w") as fh:
      json.dump(rows, fh, indent=1)


if __name__ == "__main__":
  main()
