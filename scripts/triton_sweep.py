"""Sweeps Triton block sizes, warps and stages on a GPU; prints TFLOP/s per config.

Run on the GPU machine: PYTHONPATH=. python3 scripts/triton_sweep.py --json $OUT/sweep.json
Its winners go into pallas_flash/triton/config.py:TUNED with the date and this command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench import flops, shapes, timing
from pallas_flash.triton.config import default_config

FWD = [dict(block_q=bq, block_kv=bk, num_warps=w, num_stages=st)
       for bq, bk, w, st in ((128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (128, 64, 4, 4),
                             (128, 128, 8, 3), (128, 128, 8, 2), (128, 128, 4, 3), (64, 64, 4, 3),
                             (64, 128, 4, 3), (128, 32, 4, 3))]
BWD = [dict(block_q_dkv=a, block_kv_dkv=b, block_q_dq=c, block_kv_dq=d, num_warps_bwd=w,
            num_stages_bwd=st)
       for a, b, c, d, w, st in ((64, 64, 64, 64, 4, 2), (32, 64, 64, 32, 4, 2),
                                 (64, 128, 128, 64, 8, 2), (32, 128, 128, 32, 8, 2),
                                 (32, 128, 128, 32, 4, 2))]


def _run(spec, mode, causal, cfg):
  def attn(q, k, v):
    return pallas_flash.flash_attention(q, k, v, is_causal=causal, implementation="triton",
                                        config=cfg)

  def step(q, k, v, do):
    if mode == "fwd":
      return attn(q, k, v)
    return jax.vjp(attn, q, k, v)[1](do)

  args = shapes.make_inputs(spec, jnp.bfloat16)
  compiled, _ = timing.compile_step(jax.jit(step), args)
  t = timing.time_compiled(compiled, args, iters=5)
  return flops.tflops(flops.attention_flops(spec, is_causal=causal, mode=mode), t.median_s)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--json")
  parser.add_argument("--mode", default="fwd,fwdbwd")
  parser.add_argument("--shapes", default="b4_t4k_h16_d128", help="comma-separated shape names")
  args = parser.parse_args()
  specs = {s.name: s for s in shapes.select_shapes("anchors")}
  rows = []
  for name in args.shapes.split(","):
    spec = specs[name]
    for causal in (False, True):
      for mode in args.mode.split(","):
        base = default_config(spec.head_dim, causal, jnp.bfloat16)
        variants = FWD if mode == "fwd" else BWD
        for v in variants:
          cfg = dataclasses.replace(base, **v)
          try:
            tf = _run(spec, mode, causal, cfg)
          except Exception as e:  # noqa: BLE001 (a config that fails to compile is a result)
            tf = None
            print(f"  {name} {mode} causal={causal} {v}: {type(e).__name__}: {str(e)[:120]}")
          rows.append(dict(shape=name, mode=mode, causal=causal, tflops=tf, **v))
          print(f"{name:20s} {mode:6s} causal={causal!s:5s} {tf if tf is None else round(tf, 1)!s:>7s}"
                f"  {v}", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
