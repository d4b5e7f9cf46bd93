"""Attention functions the model can run on: ours, and jax.nn's cuDNN and XLA baselines.

Every function has the `pallas_flash.flax.AttentionFn` signature:
  fn(q [B, T, H, D], k [B, S, K, D], v [B, S, K, D], *, is_causal,
     query_segment_ids [B, T] | None, key_value_segment_ids [B, S] | None) -> [B, T, H, D]
The choice is made here, from config, never inside the layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import pallas_flash

# "ours": pallas_flash.flash_attention (its `implementation` picks the kernel);
# "cudnn" / "xla": jax.nn.dot_product_attention(implementation=...), the baselines.
ATTENTION_KINDS = ("ours", "cudnn", "xla")


def _jax_nn_attention(q, k, v, *, is_causal, query_segment_ids, key_value_segment_ids,
                      implementation):
  """jax.nn.dot_product_attention; segment ids become a dense [B, 1, T, S] mask (it has none)."""
  mask = None
  if query_segment_ids is not None:
    mask = (query_segment_ids[:, :, None] == key_value_segment_ids[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal,
                                      implementation=implementation)


def _per_device(fn, mesh: Mesh, axis: str):
  """Runs `fn` on each device's batch shard.

  Pallas kernels are opaque custom calls that GSPMD cannot partition (it would gather the whole
  batch onto every device), so attention runs under shard_map with the batch split on `axis`.
  """
  spec = P(axis)

  def call(q, k, v, *, is_causal, query_segment_ids, key_value_segment_ids):
    segs = () if query_segment_ids is None else (query_segment_ids, key_value_segment_ids)

    def local(q, k, v, *segs):
      qs, ks = segs if segs else (None, None)
      return fn(q, k, v, is_causal=is_causal, query_segment_ids=qs, key_value_segment_ids=ks)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * (3 + len(segs)), out_specs=spec,
                         check_vma=False)(q, k, v, *segs)

  return call


@functools.cache  # one function object per setting: nnx.jit caches compilations on it
def make_attention(kind: str = "ours", *, implementation: str | None = None, config=None,
                   mesh: Mesh | None = None, batch_axis: str = "data"):
  """The attention function for `kind`, split over `mesh`'s batch axis when it has >1 device.

  config: a backend config for every call (None: each call's default).
  """
  if kind == "ours":
    fn = functools.partial(pallas_flash.flash_attention, implementation=implementation,
                           config=config)
  elif kind in ("cudnn", "xla"):
    if implementation is not None:
      raise ValueError(f"--implementation selects among pallas_flash kernels; it does not apply "
                       f"to attention={kind!r}.")
    fn = functools.partial(_jax_nn_attention, implementation=kind)
  else:
    raise ValueError(f"Unknown attention {kind!r}; choose one of {ATTENTION_KINDS}.")
  if mesh is not None and mesh.size > 1:
    fn = _per_device(fn, mesh, batch_axis)
  return fn


def check_attention_runs(kind: str, *, implementation: str | None, dtype, head_dim: int,
                         num_heads: int, num_kv_heads: int, seq_len: int) -> None:
  """Fails fast, with the library's reason, if `kind` cannot run these shapes on this device."""
  shape = lambda h: jax.ShapeDtypeStruct((1, seq_len, h, head_dim), dtype)  # noqa: E731
  q, kv = shape(num_heads), shape(num_kv_heads)
  seg = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  if kind == "ours":
    fn = functools.partial(make_attention(kind, implementation=implementation), is_causal=True)
    try:  # tracing runs the API's checks and implementation choice without computing anything
      jax.eval_shape(lambda q, k, v, s: fn(q, k, v, query_segment_ids=s,
                                           key_value_segment_ids=s), q, kv, kv, seg)
    except (NotImplementedError, ValueError, TypeError) as e:
      raise SystemExit(f"attention='ours' (implementation={implementation!r}) cannot run here: "
                       f"{e}") from None
  elif kind == "cudnn" and jax.devices()[0].platform != "gpu":
    raise SystemExit("attention='cudnn' needs an NVIDIA GPU; this machine has "
                     f"{jax.devices()[0].platform}.")
