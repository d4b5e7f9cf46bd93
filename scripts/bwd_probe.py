"""The Mosaic backward alone (no forward), timed per config variant and shape, on the GPU.

  PYTHONPATH=. python3 scripts/bwd_probe.py --shapes 1x16384x8x128,2x16384x8x128 \
      --variant split:fused_backward=False --variant fused:fused_backward=True,... [--halves]

Each shape's residuals (o, lse) come from one forward (blockwise XLA); every variant's jitted
backward is timed interleaved (bench.timing.time_interleaved) and checked against the first
variant's gradients. --halves adds, per variant at batch > 1, the same backward run as one call per
batch entry (concatenated): whether a batch-B call costs B batch-1 calls. TFLOP/s count the
backward's 5 tile matmuls (2.5x the forward's FLOPs; causal halves them). Rows go to stdout
and <--out>/bwd_probe.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench import timing, variants
from pallas_flash.mosaic_gpu import backward, config as mconfig
from pallas_flash.call import AttentionParams


def _backward_fn(params, config):
  def run(q, k, v, o, lse, do):
    return backward(q, k, v, None, None, o, lse, do, None, params=params, config=config)
  return run


def _by_batch_entry(fn):
  """fn over each batch entry separately, the results concatenated along batch."""
  def run(*args):
    parts = [fn(*(a[i:i + 1] for a in args)) for i in range(args[0].shape[0])]
    return tuple(jnp.concatenate(p, axis=0) for p in zip(*parts))
  return run


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", required=True, help="BxTxHxD[xK],...")
  ap.add_argument("--variant", action="append", required=True, help="name:key=value,...")
  ap.add_argument("--causal", default="yes", choices=("yes", "no"))
  ap.add_argument("--halves", action="store_true")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args()
  causal = args.causal == "yes"
  rows = []
  for name in args.shapes.split(","):
    spec = variants.parse_shape(name)
    b, t, h, d = spec.batch, spec.seq_len, spec.num_heads, spec.head_dim
    kh = spec.num_kv_heads or h
    keys = jax.random.split(jax.random.key(t + h + b), 4)
    q, do = (jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (b, t, kh, d), jnp.bfloat16) for kk in keys[2:])
    # Residuals from the blockwise XLA path (any platform; the same o and lse contract).
    o, lse = pallas_flash.flash_attention(q, k, v, is_causal=causal, implementation="xla",
                                          return_residuals=True)
    params = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
    base = mconfig.tuned(d, causal, t)
    fns = {}
    for item in args.variant:
      vname, _, overrides = item.partition(":")
      fn = _backward_fn(params, mconfig.with_overrides(base, overrides))
      fns[vname] = jax.jit(fn)
      if args.halves and b > 1:
        fns[vname + "_per_entry"] = jax.jit(_by_batch_entry(fn))
    inputs = (q, k, v, o, lse, do)
    got = {n: f(*inputs) for n, f in fns.items()}
    first = next(iter(got.values()))
    err = {n: max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32)))
                        / (float(jnp.max(jnp.abs(r.astype(jnp.float32)))) + 1e-30))
                  for g, r in zip(gs, first)) for n, gs in got.items()}
    times = timing.time_interleaved(fns, inputs, iters=args.iters)
    flop = 2.5 * 4 * b * h * t * t * d * (0.5 if causal else 1.0)
    row = dict(shape=name, causal=causal,
               ms={n: round(tm.median_s * 1e3, 4) for n, tm in times.items()},
               tflops={n: round(flop / tm.median_s / 1e12, 1) for n, tm in times.items()},
               max_rel_err_vs_first=err)
    print(json.dumps(row), flush=True)
    rows.append(row)
  with open(os.path.join(args.out, "bwd_probe.json"), "w") as fh:
    json.dump(rows, fh, indent=1)


if __name__ == "__main__":
  main()
