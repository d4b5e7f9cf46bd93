"""Where the Mosaic fwd+bwd time goes: each kernel of the split path timed on its own.

On the GPU machine, from the repository root:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/mosaic_bwd_kernels.py [--out DIR]
      [--shapes B,T,H,D ...] [key=value ...]

For each shape (bf16, S = T, K = H), causal and not, with the tuned config (overridden by the
key=value MosaicConfig pairs): the forward kernel, the dQ kernel (statistics from XLA, and
with delta / lse2 computed in the kernel), the dK/dV kernel, the XLA preprocessing the
in-kernel form replaces, and the whole jitted VJP, each compiled ahead of time and timed as
`pallas_flash.bench` times (median of loops of back-to-back calls). Prints milliseconds and
the TFLOP/s of the matmuls each kernel issues (forward 2, dQ 3, dK/dV 4, the fused backward
(`FUSED`, opt-in, timed for comparison) 5 tile products per tile pair: 2·B·H·T·S·D FLOPs
each, halved when causal; fwd+bwd counted as 7, the benchmark's 3.5 x forward) next to the
share of the fwd+bwd step,
and writes DIR/mosaic_bwd_kernels.json. Before timing, the split kernels' dq, dk, dv are
compared with the VJP's (same kernels, so they must agree to the bit). At head dim 256 the
kernels are backward_wide's (no fused kernel): their dQ kernel takes the row statistics from
XLA, which this script computes in a jit of its own, so dq and dk (which use delta) may differ
from the VJP's in the last bits; dv must still be equal.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import sys

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench import timing
from pallas_flash.mosaic_gpu import config as mconfig
from pallas_flash.call import AttentionParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mosaic_gpu_check import rel_err  # noqa: E402
from mosaic_ptxas import parse_overrides  # noqa: E402

LOG2E = math.log2(math.e)
# The module, not the function `backward` that the package re-exports under its name.
backward = importlib.import_module("pallas_flash.mosaic_gpu.backward")
backward_fused = importlib.import_module("pallas_flash.mosaic_gpu.backward_fused")
backward_wide = importlib.import_module("pallas_flash.mosaic_gpu.backward_wide")
# The single-kernel backward in its fastest measured form (opt-in), timed for comparison.
FUSED = mconfig.FUSED_DEFERRED


def kernels(b, t, h, d, causal, overrides):
  """{name: (jitted fn, args, tile products per tile pair or None)} for one shape."""
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in ks)
  params = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  config = dataclasses.replace(mconfig.tuned(d, causal, t), **overrides)
  assert t % 256 == 0, "whole tiles only: no padding in the timed calls"

  def attn(q, k, v):
    return pallas_flash.flash_attention(q, k, v, is_causal=causal, implementation="mosaic",
                                        config=config, return_residuals=True)

  o, lse = jax.jit(attn)(q, k, v)

  def vjp(q, k, v, do):
    return jax.vjp(lambda *a: attn(*a)[0], q, k, v)[1](do)

  lse_inf, delta = backward._xla_row_stats(o, lse, do, None)
  lse2 = lse_inf * LOG2E
  fns = dict(
      fwd=(jax.jit(attn), (q, k, v), 2),
      xla_preprocessing=(jax.jit(lambda o, lse, do: backward._xla_row_stats(o, lse, do, None)),
                         (o, lse, do), None))
  if d > 128:
    # backward_wide's kernels: its dQ kernel takes the statistics from XLA; no fused kernel.
    kp_dq, kp_dkdv = backward_wide.kernel_params(q, k, params, config, t_pad=t, s_pad=t)
    dkdv_call, dkdv_stats = backward_wide._dkdv_call, (lse2, delta)
  else:
    kp_dq, kp_dkdv = backward.split_kernel_params(q, k, params, config, t_pad=t, s_pad=t)
    # The dK/dV kernel gets the statistics the dQ kernel computed, as in the VJP.
    _, lse2_k, delta_k = jax.jit(lambda *a: backward._dq_call(*a, None, kp=kp_dq))(
        q, k, v, do, o, lse)
    dkdv_call, dkdv_stats = backward._dkdv_call, (lse2_k, delta_k)
  fns["dq_xla_stats"] = (jax.jit(lambda q, k, v, do, lse2, delta: backward._dq_call(
      q, k, v, do, None, lse2, delta, kp=kp_dq)), (q, k, v, do, lse2, delta), 3)
  if d <= 128:
    fns["dq_in_kernel"] = (jax.jit(lambda q, k, v, do, o, lse: backward._dq_call(
        q, k, v, do, o, lse, None, kp=kp_dq)), (q, k, v, do, o, lse), 3)
  fns["dkdv"] = (jax.jit(lambda q, k, v, do, lse2, delta: dkdv_call(
      q, k, v, do, lse2, delta, kp=kp_dkdv)), (q, k, v, do, *dkdv_stats), 4)
  if d <= 128:
    fused_config = dataclasses.replace(config, **FUSED)

    def fused(q, k, v, lse_inf, do, delta):
      return backward_fused.backward(q, k, v, lse_inf, do, delta, params=params,
                                     config=fused_config)

    # The fused kernel with its XLA pieces (dQ's zeroing, scaling and cast), 5 products.
    fns["fused_bwd"] = (jax.jit(fused), (q, k, v, lse_inf, do, delta), 5)
  # The benchmark's convention: fwd+bwd = 3.5 x the forward's 2 products per pair.
  fns["fwd_bwd"] = (jax.jit(vjp), (q, k, v, do), 7)
  return fns


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--shapes", nargs="*", default=["4,4096,16,128", "1,16384,16,128"])
  parser.add_argument("overrides", nargs="*", help="MosaicConfig key=value")
  args = parser.parse_args()
  # `--shapes A B key=value` puts the overrides into --shapes' list: take them back out.
  shapes = [x for x in args.shapes if "=" not in x]
  overrides = parse_overrides([x for x in args.shapes if "=" in x] + args.overrides)
  rows = []
  for shape in shapes:
    b, t, h, d = (int(x) for x in shape.split(","))
    for causal in (False, True):
      fns = kernels(b, t, h, d, causal, overrides)
      # The split kernels are the VJP's own: their results must be bitwise the VJP's.
      if "dq_in_kernel" in fns:
        dq = fns["dq_in_kernel"][0](*fns["dq_in_kernel"][1])[0]  # (dq, lse2, delta)
      else:
        dq = fns["dq_xla_stats"][0](*fns["dq_xla_stats"][1])
      dk, dv = fns["dkdv"][0](*fns["dkdv"][1])
      want = fns["fwd_bwd"][0](*fns["fwd_bwd"][1])
      same = [bool(jnp.array_equal(x, y)) for x, y in zip((dq, dk, dv), want)]
      # The fused kernel sums dQ in another order (float32 atomics): close, not equal.
      fused_err = ([rel_err(x, y) for x, y in zip(fns["fused_bwd"][0](*fns["fused_bwd"][1]),
                                                   want)] if "fused_bwd" in fns else [])
      pair = 2 * b * h * t * t * d * (0.5 if causal else 1.0)
      step = None
      for name, (fn, fargs, products) in fns.items():
        compiled, _ = timing.compile_step(fn, fargs)
        sec = timing.time_compiled(compiled, fargs).median_s
        row = dict(shape=[b, t, h, d], causal=causal, kernel=name, ms=sec * 1e3,
                   bitwise_equal_to_vjp=same if name == "fwd_bwd" else None,
                   rel_err_to_vjp=fused_err if name == "fused_bwd" else None)
        if products:
          row["tflops"] = pair * products / sec / 1e12
        rows.append(row)
        step = sec if name == "fwd_bwd" else step
      for row in rows[-len(fns):]:
        row["share_of_fwd_bwd"] = row["ms"] / 1e3 / step
        tf = f"{row['tflops']:6.0f} TFLOP/s" if "tflops" in row else " " * 14
        print(f"{b}x{t}x{h}x{d} causal={causal!s:5} {row['kernel']:18s} {row['ms']:8.3f} ms "
              f"{tf}  {row['share_of_fwd_bwd']:5.1%} of fwd+bwd", flush=True)
      print(f"  split kernels bitwise equal to the VJP's dq, dk, dv: {same}; fused "
            f"backward's max rel err against them: {[f'{e:.1e}' for e in fused_err]}",
            flush=True)
  with open(os.path.join(args.out, "mosaic_bwd_kernels.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                   overrides=overrides, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
