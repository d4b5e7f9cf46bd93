"""Sweeps Triton block sizes, warps and stages on a GPU; prints TFLOP/s per config.

Run on the GPU machine: PYTHONPATH=. python3 scripts/triton_sweep.py --json $OUT/sweep.json
Its winners go into pallas_flash/triton/config.py:TUNED with the date and this command.
`--features plain,softcap,dropout` sweeps the same configs with soft-capping (30) or dropout
(0.1) on, `--short` a pruned forward list, `--causal yes|no|both` the masking.
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


def _bwd(*tiles):
  """(block_q_dkv, block_kv_dkv, block_q_dq, block_kv_dq, warps, stages) -> config overrides."""
  return [dict(block_q_dkv=a, block_kv_dkv=b, block_q_dq=c, block_kv_dq=d, num_warps_bwd=w,
               num_stages_bwd=st) for a, b, c, d, w, st in tiles]


BWD = _bwd((64, 64, 64, 64, 4, 2), (32, 64, 64, 32, 4, 2), (64, 128, 128, 64, 8, 2),
           (32, 128, 128, 32, 8, 2), (32, 128, 128, 32, 4, 2), (64, 64, 64, 64, 8, 2),
           (64, 64, 64, 64, 4, 3), (64, 64, 64, 64, 8, 3))
BWD_EXTRA = BWD[5:]  # --bwd-extra: only the variants added after the first sweep
# --bwd-d256: head dim 256 (the Mosaic backend's backward there, fourteenth session), where a
# 64x64 tile pair's float32 dK and dV already take 2 x 64 x 256 x 4 bytes.
BWD_D256 = _bwd((32, 32, 32, 32, 4, 2), (32, 32, 32, 32, 4, 1), (32, 64, 64, 32, 4, 2),
                (32, 64, 64, 32, 8, 2), (32, 64, 64, 32, 4, 1), (64, 64, 64, 64, 8, 1),
                (16, 64, 64, 16, 4, 2), (64, 32, 32, 64, 4, 2),
                # run7's best was the last: more of its kind.
                (64, 32, 32, 64, 8, 2), (64, 32, 32, 64, 4, 3), (128, 32, 32, 128, 4, 2),
                (128, 32, 32, 128, 8, 2), (64, 16, 16, 64, 4, 2), (128, 16, 16, 128, 4, 2))
BWD_D256_MORE = BWD_D256[8:]  # --bwd-d256 --bwd-extra


FWD_SHORT = [FWD[i] for i in (4, 0, 1, 7)]
FEATURES = {"plain": {}, "softcap": {"logits_soft_cap": 30.0},
            "dropout": {"dropout_rate": 0.1, "dropout_rng": jax.random.key(0)}}


def _run(spec, mode, causal, cfg, feature="plain"):
  def attn(q, k, v):
    return pallas_flash.flash_attention(q, k, v, is_causal=causal, implementation="triton",
                                        config=cfg, **FEATURES[feature])

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
  parser.add_argument("--features", default="plain", help=f"comma list of {sorted(FEATURES)}")
  parser.add_argument("--causal", default="both", choices=("yes", "no", "both"))
  parser.add_argument("--short", action="store_true", help="the pruned forward config list")
  parser.add_argument("--bwd-extra", action="store_true",
                      help="only BWD_EXTRA (with --bwd-d256: BWD_D256_MORE) backward configs")
  parser.add_argument("--bwd-d256", action="store_true", help="the BWD_D256 backward configs")
  args = parser.parse_args()
  specs = {s.name: s for s in shapes.SHAPES}
  causals = {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]
  rows = []
  for name in args.shapes.split(","):
    spec = specs[name]
    for feature in args.features.split(","):
      for causal in causals:
        for mode in args.mode.split(","):
          base = default_config(spec.head_dim, causal, jnp.bfloat16,
                                feature=None if feature == "plain" else feature)
          variants = ((FWD_SHORT if args.short else FWD) if mode == "fwd" else
                      (BWD_D256_MORE if args.bwd_extra else BWD_D256) if args.bwd_d256 else
                      BWD_EXTRA if args.bwd_extra else BWD)
          for v in variants:
            cfg = dataclasses.replace(base, **v)
            try:
              tf = _run(spec, mode, causal, cfg, feature)
            except Exception as e:  # noqa: BLE001 (a config that fails to compile is a result)
              tf = None
              print(f"  {name} {mode} causal={causal} {v}: {type(e).__name__}: {str(e)[:120]}")
            rows.append(dict(shape=name, feature=feature, mode=mode, causal=causal, tflops=tf,
                             **v))
            print(f"{name:18s} {feature:8s} {mode:6s} causal={causal!s:5s} "
                  f"{tf if tf is None else round(tf, 1)!s:>7s}  {v}", flush=True)
            if args.json:  # rewritten after every row: a run cut short keeps what it measured
              with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
