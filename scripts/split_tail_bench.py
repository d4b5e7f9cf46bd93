"""The split tail of the non-causal Mosaic forward (MosaicConfig.fwd_split_tail), on the GPU.

On the GPU machine, from the repository root:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/split_tail_bench.py [--parts 0,5,9,17]
      [--shapes 1x16384x16x128,...] [--fwdbwd]

First checks the split kernel against the float32 reference on small shapes whose tail is forced
(wave_ctas) to split (the GPU test's cases: odd lengths, padded keys, GQA, float16, both launch
orders) and on each timed shape against the unsplit kernel and cuDNN; then times the forward of each
shape in interleaved rounds (bench.timing.time_interleaved): the tuned config as it is ("default"),
the grid kernel without the split ("grid"), with it for each --parts value (0: the cost model's
choice, "split") and cuDNN; --fwdbwd adds the same for the VJP. Rows go to stdout and
$OUT/split_tail.json.
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
# Small grids whose last wave is split: the GPU test's cases.
from mosaic.test_mosaic_split_tail import GPU_CASES as FORCED  # noqa: E402

forward_module = importlib.import_module("pallas_flash.mosaic_gpu.forward")


# Head dim 128's long non-causal default has 192-key tiles, beside which the split's staging
# tile does not fit (config.TUNED): the split is measured with the 128-key tiles it ran with.
KEYS_128 = {128: dict(block_kv=128, fwd_q_registers=True)}


def run(cfg, q, k, v):
  return jax.jit(lambda q, k, v: pallas_flash.flash_attention(
      q, k, v, implementation="mosaic", config=cfg, return_residuals=True))(q, k, v)


def check_forced(rows):
  for b, t, s, h, kh, d, dtype, wave, hf, parts in FORCED:
    q, k, v = mgc.inputs(b, t, s, h, kh, d, dtype, seed=t + s)[:3]
    cfg = dataclasses.replace(mconfig.tuned(d, False, s), fwd_persistent=False,
                              fwd_split_tail=True, wave_ctas=wave, heads_fastest=hf,
                              tail_parts=parts, **KEYS_128.get(d, {}))
    p = AttentionParams(scale=d ** -0.5, is_causal=False, has_segments=False)
    split = forward_module.tail_split(q, cfg, p, -(-s // cfg.block_kv), False)
    o, lse = run(cfg, q, k, v)
    ro, rlse = jax.jit(lambda q, k, v: attention_reference(q, k, v, None, None, params=p))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    row = dict(check="forced", shape=[b, t, s, h, kh, d], dtype=jnp.dtype(dtype).name,
               wave_ctas=wave, heads_fastest=hf, parts=split and split.parts,
               main=split and split.main, tiles=split and split.tiles,
               o_err=mgc.rel_err(o, ro), lse_err=float(jnp.abs(lse - rlse).max()))
    row["ok"] = row["o_err"] <= (2e-3 if dtype == jnp.float16 else 1e-2) and \
        row["lse_err"] <= 1e-3 and split is not None
    rows.append(row)
    print(json.dumps(row), flush=True)


def bench_shape(name, parts_list, fwdbwd, iters, rows):
  spec = variants.parse_shape(name)
  t, d = spec.seq_len, spec.head_dim
  q, k, v, do = shapes.make_inputs(spec, jnp.bfloat16, 0)
  tuned = mconfig.tuned(d, False, t)
  grid = dataclasses.replace(tuned, fwd_persistent=False, fwd_split_tail=False,
                             **KEYS_128.get(d, {}))
  configs = {"default": tuned, "grid": grid}
  for parts in parts_list:
    configs[f"split{parts or ''}"] = dataclasses.replace(grid, fwd_split_tail=True,
                                                         tail_parts=parts)
  p = AttentionParams(scale=d ** -0.5, is_causal=False, has_segments=False)
  info = {n: forward_module.tail_split(q, c, p, -(-t // c.block_kv), False)
          for n, c in configs.items()}
  modes = ["fwd"] + (["fwdbwd"] if fwdbwd else [])
  for mode in modes:
    fns = {}
    for n, c in configs.items():
      attn = lambda q, k, v, c=c: pallas_flash.flash_attention(  # noqa: E731
          q, k, v, implementation="mosaic", config=c)
      if mode == "fwd":
        fns[n] = jax.jit(lambda q, k, v, do, attn=attn: attn(q, k, v))
      else:
        fns[n] = jax.jit(lambda q, k, v, do, attn=attn: jax.vjp(attn, q, k, v)[1](do))
    row = dict(shape=name, mode=mode, parts={n: s and s.parts for n, s in info.items()},
               **variants.compare(fns, (q, k, v, do), spec, mode=mode, is_causal=False,
                                  baseline="grid", iters=iters))
    rows.append(row)
    print(json.dumps(row), flush=True)
  del q, k, v, do


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default="1x16384x16x128,1x32768x16x128,2x16384x8x128x4,"
                                      "1x8192x16x128,4x4096x16x128")
  ap.add_argument("--parts", default="0")
  ap.add_argument("--fwdbwd", action="store_true")
  ap.add_argument("--iters", type=int, default=7)
  ap.add_argument("--skip-check", action="store_true")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args()
  rows = []
  try:
    if not args.skip_check:
      check_forced(rows)
    for name in args.shapes.split(","):
      bench_shape(name, [int(x) for x in args.parts.split(",")], args.fwdbwd, args.iters, rows)
  finally:
    with open(os.path.join(args.out, "split_tail.json"), "w") as fh:
      json.dump(rows, fh, indent=1)


if __name__ == "__main__":
  main()
