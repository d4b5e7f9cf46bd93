"""The split tail of the Mosaic split backward (MosaicConfig.bwd_split_tail), on the GPU.

On the GPU machine, from the repository root:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/bwd_split_tail_bench.py
      [--shapes 1x16384x16x128,...] [--variants dq,dkdv,dq+dkdv] [--parts 0]

First checks forced splits (wave_ctas) of both backward kernels on small shapes against the float32
reference's gradients (the GPU test's cases: odd lengths, padded keys, GQA, float16, both launch
orders, the XLA statistics path), then per timed shape (non-causal) the VJP of the tuned config
("default": no backward split unless the table has it), of each variant ("dq", "dkdv", "dq+dkdv":
the kernels split) and cuDNN: the gradients against "default" and run to run (bitwise), then TFLOP/s
in interleaved rounds (bench.timing.time_interleaved). Rows go to stdout and
$OUT/bwd_split_tail.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench import shapes, variants
from pallas_flash.mosaic_gpu import config as mconfig
from pallas_flash.call import AttentionParams
from pallas_flash.reference import attention_reference

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(__file__), os.path.join(_ROOT, "tests")]
import mosaic_gpu_check as mgc  # noqa: E402  (rel_err, inputs)
# Small grids whose last waves are split: the GPU test's cases.
from mosaic.test_mosaic_split_tail import BWD_GPU_CASES as FORCED  # noqa: E402

backward_module = importlib.import_module("pallas_flash.mosaic_gpu.backward")


def vjp_fn(cfg):
  def attn(q, k, v):
    return pallas_flash.flash_attention(q, k, v, implementation="mosaic", config=cfg)
  return jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))


def check_forced(rows):
  for b, t, s, h, kh, d, dtype, kw in FORCED:
    q, k, v, do = mgc.inputs(b, t, s, h, kh, d, dtype, seed=t + s)[:4]
    cfg = dataclasses.replace(mconfig.tuned(d, False, s), bwd_split_tail="dq,dkdv", **kw)
    p = AttentionParams(scale=d ** -0.5, is_causal=False, has_segments=False)
    sp = backward_module.planned_tail_splits(q, k, p, cfg)
    got = vjp_fn(cfg)(q, k, v, do)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    ref = jax.jit(lambda q, k, v, do: jax.vjp(
        lambda *a: attention_reference(*a, None, None, params=p)[0], q, k, v)[1](do))(*f32)
    errs = {n: mgc.rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), got, ref)}
    row = dict(check="forced", shape=[b, t, s, h, kh, d], dtype=jnp.dtype(dtype).name,
               config=kw, parts=[x and (x.parts, x.main, x.tiles) for x in sp], errs=errs)
    tol = 4e-3 if dtype == jnp.float16 else 2e-2
    row["ok"] = all(e <= tol for e in errs.values()) and all(x is not None for x in sp)
    rows.append(row)
    print(json.dumps(row), flush=True)


def bench_shape(name, names, parts, iters, rows):
  spec = variants.parse_shape(name)
  t, d = spec.seq_len, spec.head_dim
  q, k, v, do = shapes.make_inputs(spec, jnp.bfloat16, 0)
  tuned = mconfig.tuned(d, False, t)
  base = dataclasses.replace(tuned, bwd_split_tail="")
  configs = {"default": tuned, "unsplit": base}
  for var in names:
    configs[var] = dataclasses.replace(base, bwd_split_tail=var.replace("+", ","),
                                       tail_parts=parts)
  p = AttentionParams(scale=d ** -0.5, is_causal=False, has_segments=False)
  info = {n: [x and x.parts for x in backward_module.planned_tail_splits(q, k, p, c)]
          for n, c in configs.items()}
  fns = {n: vjp_fn(c) for n, c in configs.items()}
  row = dict(shape=name, mode="fwdbwd", parts=info,
             **variants.compare(fns, (q, k, v, do), spec, mode="fwdbwd", is_causal=False,
                                baseline="unsplit", iters=iters))
  rows.append(row)
  print(json.dumps(row), flush=True)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default="1x16384x16x128,4x4096x16x128,1x32768x16x128,"
                                      "2x16384x8x128x4,4x4096x32x64")
  ap.add_argument("--variants", default="dq,dkdv,dq+dkdv")
  ap.add_argument("--parts", type=int, default=0)
  ap.add_argument("--iters", type=int, default=7)
  ap.add_argument("--skip-check", action="store_true")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args()
  rows = []
  try:
    if not args.skip_check:
      check_forced(rows)
    for name in args.shapes.split(","):
      bench_shape(name, args.variants.split(","), args.parts, args.iters, rows)
  finally:
    with open(os.path.join(args.out, "bwd_split_tail.json"), "w") as fh:
      json.dump(rows, fh, indent=1)


if __name__ == "__main__":
  main()
