"""Causal fwd+bwd at arbitrary (GQA) shapes: the mosaic split and fused backwards and cuDNN.

On the GPU machine, from the repository root:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/gqa_fwdbwd.py [--out DIR] [B,T,H,K,D ...]

The benchmark's shapes are multi-head only; the training preset h200-long runs 2x16384 tokens
with 8 query and 4 kv heads of dimension 128. For each shape: mosaic with the tuned config
(the split backward, the default) and with config.FUSED_DEFERRED (the opt-in fused backward),
and cuDNN; the gradients of each against cuDNN's (max relative error), then TFLOP/s (causal:
3.5 x the forward's 2·B·H·T²·D) timed as `pallas_flash.bench` times. Writes
DIR/gqa_fwdbwd.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench import timing
from pallas_flash.mosaic_gpu import config as mconfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mosaic_gpu_check import fwd_bwd, rel_err  # noqa: E402


def _impls(d: int, t: int):
  def ours(config):
    return lambda q, k, v: pallas_flash.flash_attention(
        q, k, v, is_causal=True, implementation="mosaic", config=config)

  split = mconfig.tuned(d, True, t)
  cudnn = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
      q, k, v, is_causal=True, implementation="cudnn")
  return {"mosaic": ours(split),
          "mosaic_fused": ours(dataclasses.replace(split, **mconfig.FUSED_DEFERRED)),
          "cudnn": cudnn}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("shapes", nargs="*", default=["2,16384,8,4,128", "2,16384,8,8,128"])
  args = parser.parse_args()
  rows = []
  for shape in args.shapes:
    b, t, h, kh, d = (int(x) for x in shape.split(","))
    ks = jax.random.split(jax.random.key(0), 4)
    q, do = (jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in (ks[0], ks[3]))
    k, v = (jax.random.normal(kk, (b, t, kh, d), jnp.bfloat16) for kk in ks[1:3])
    flops = 4 * b * h * t * t * d / 2 * 3.5
    fns = {name: jax.jit(fwd_bwd(attn)) for name, attn in _impls(d, t).items()}
    want = fns["cudnn"](q, k, v, do)
    for name, fn in fns.items():
      errs = [rel_err(x, y) for x, y in zip(fn(q, k, v, do), want)]
      compiled, _ = timing.compile_step(fn, (q, k, v, do))
      sec = timing.time_compiled(compiled, (q, k, v, do)).median_s
      row = dict(shape=[b, t, h, kh, d], impl=name, ms=sec * 1e3, tflops=flops / sec / 1e12,
                 rel_err_vs_cudnn=errs)
      rows.append(row)
      print(f"{b}x{t} H{h}/K{kh} D{d} causal {name:22s} {sec * 1e3:8.3f} ms "
            f"{row['tflops']:6.0f} TFLOP/s  rel err vs cuDNN (o, dq, dk, dv) "
            f"{[f'{e:.1e}' for e in errs]}", flush=True)
  with open(os.path.join(args.out, "gqa_fwdbwd.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f,
              indent=1)


if __name__ == "__main__":
  main()
