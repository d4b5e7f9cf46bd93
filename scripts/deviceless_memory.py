"""XLA's memory plan of a model-like gradient with the Mosaic kernels, for an H200, on a CPU.

After `./scripts/setup_deviceless.sh`, from the repository root:

  PYTHONPATH=.cuda-aot:. JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 .venv/bin/python \
      scripts/deviceless_memory.py [--shape 2,16384,8,4] [--layers 12] [--remat] \
      [--variant split:fused_backward=False --variant fused:...]

Compiles, without running, the gradient of a stack of `--layers` blocks (Q/K/V projections,
causal attention with `implementation="mosaic"`, an output projection and a residual) for a
described H200 (scripts/h200_target_config.txtpb), and prints each variant's temporary memory
from the compiled executable's memory analysis. --remat wraps each block in jax.checkpoint
with the model's policy (models.transformer.keep_attention_outputs). Variants are MosaicConfig
overrides of `config.call_config`'s choice for the shape ("default" is that choice). It showed
that XLA fused the fused backward's dQ memsets of all layers into one, live at once (+1.4 GiB
at 2x16384x8x128 over 12 layers; fused.fused_call now keeps them apart).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from mosaic_ptxas import abstract_h200, parse_overrides  # beside this script, on sys.path


def temp_gib(config, *, shape, layers: int, remat: bool) -> float:
  """Temporary memory (GiB) of the compiled gradient of `layers` blocks at shape (B, T, H, K),
  head_dim 128, bf16, the attention run with `config`."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import use_abstract_mesh

  import pallas_flash
  from models.transformer import keep_attention_outputs

  b, t, h, kh = shape
  d, width = 128, h * 128
  sharding, mesh = abstract_h200()

  def block(w, x):
    """x [B, T, H·D] -> x + proj(attention(x))."""
    q = (x @ w[0]).reshape(b, t, h, d)
    k = (x @ w[1]).reshape(b, t, kh, d)
    v = (x @ w[2]).reshape(b, t, kh, d)
    o = pallas_flash.flash_attention(q, k, v, is_causal=True, implementation="mosaic",
                                     config=config)
    return x + jax.nn.gelu(o.reshape(b, t, width) @ w[3])

  step = jax.checkpoint(block, policy=keep_attention_outputs) if remat else block

  def loss(ws, x):
    for w in ws:
      x = step(w, x)
    return x.astype(jnp.float32).sum()

  def spec(*dims):
    return jax.ShapeDtypeStruct(dims, jnp.bfloat16, sharding=sharding)

  ws = [(spec(width, width), spec(width, kh * d), spec(width, kh * d), spec(width, width))
        for _ in range(layers)]
  with use_abstract_mesh(mesh):
    traced = jax.jit(jax.grad(loss)).trace(ws, spec(b, t, width))
  compiled = traced.lower(lowering_platforms=("cuda",)).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**30


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shape", default="2,16384,8,4", help="B,T,H,K (head_dim 128)")
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--remat", action="store_true")
  ap.add_argument("--variant", action="append", default=[], help="name:key=value,...")
  args = ap.parse_args()

  from pallas_flash.mosaic_gpu import config as mconfig
  from pallas_flash.call import AttentionParams

  shape = tuple(int(x) for x in args.shape.split(","))
  params = AttentionParams(scale=128 ** -0.5, is_causal=True, has_segments=False)
  default = mconfig.call_config(128, params, shape[1], shape[0])
  variants = [("default", "")] + [v.partition(":")[::2] for v in args.variant]
  for name, overrides in variants:
    config = dataclasses.replace(default, **parse_overrides(filter(None, overrides.split(","))))
    gib = temp_gib(config, shape=shape,
                   layers=args.layers, remat=args.remat)
    print(json.dumps(dict(variant=name, overrides=overrides, shape=args.shape,
                          layers=args.layers, remat=args.remat, temp_gib=round(gib, 3))),
          flush=True)


if __name__ == "__main__":
  main()
