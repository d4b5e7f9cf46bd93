"""A native NNX multi-head attention layer on the flash kernels.

Parameters are named and shaped like `flax.nnx.MultiHeadAttention`'s (`query`, `key`, `value`:
`LinearGeneral` kernels [in, H|K, D] and biases [H|K, D]; `out`: kernel [H, D, out], bias [out]),
so `nnx.update(flax_layer, nnx.state(flash_layer, nnx.Param))` moves weights either way.
What it adds over `nnx.MultiHeadAttention(attention_fn=...)`: segment ids for packed documents,
per-document rotary positions, and the kernel `implementation`/`config` as constructor arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_flash.api import flash_attention
from pallas_flash.flax.rotary import apply_rotary

# The signature every attention function this layer calls must have (pallas_flash.flash_attention
# has it; models/ wraps jax.nn.dot_product_attention to it for baselines):
#   fn(query [B, T, H, D], key [B, S, K, D], value [B, S, K, D], *, is_causal: bool,
#      query_segment_ids: [B, T] | None, key_value_segment_ids: [B, S] | None) -> [B, T, H, D]
AttentionFn = Callable[..., jax.Array]


class FlashMultiHeadAttention(nnx.Module):
  """Multi-head (GQA/MQA) attention: q/k/v projections, rotary, flash attention, out projection.

  Attributes:
    num_heads: H query heads; num_kv_heads: K key/value heads (H % K == 0).
    head_dim: D = qkv_features // num_heads.
    is_causal: default causality of `__call__`.
    rope_theta: rotary base period, or None for no rotary embedding.
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      qkv_features: int | None = None,
      out_features: int | None = None,
      num_kv_heads: int | None = None,
      *,
      is_causal: bool = False,
      rope_theta: float | None = None,
      use_bias: bool = True,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      kernel_init: nnx.Initializer = nnx.initializers.lecun_normal(),
      out_kernel_init: nnx.Initializer | None = None,
      bias_init: nnx.Initializer = nnx.initializers.zeros_init(),
      kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
      out_kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
      implementation: str | None = None,
      config: Any = None,
      attention_fn: AttentionFn | None = None,
      rngs: nnx.Rngs,
  ):
    """Builds the projections.

    Args:
      num_heads, in_features, qkv_features, out_features, num_kv_heads, use_bias, dtype,
        param_dtype, kernel_init, out_kernel_init, bias_init, kernel_metadata,
        out_kernel_metadata: as in `nnx.MultiHeadAttention` (`dtype` is the compute dtype,
        e.g. bfloat16 over float32 parameters; metadata carries sharding annotations).
      is_causal: default for `__call__`.
      rope_theta: apply rotary embeddings to q and k with this base period (None: none).
      implementation, config: passed to `pallas_flash.flash_attention`.
      attention_fn: replaces `pallas_flash.flash_attention` (same keyword signature, see
        `AttentionFn`); `implementation`/`config` are then not used.
      rngs: parameter initialisation.
    """
    qkv_features = qkv_features or in_features
    num_kv_heads = num_kv_heads or num_heads
    if qkv_features % num_heads:
      raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads "
                       f"({num_heads}).")
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads "
                       f"({num_kv_heads}).")
    self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
    self.head_dim = qkv_features // num_heads
    if rope_theta is not None and self.head_dim % 2:
      raise ValueError(f"Rotary embeddings need an even head_dim, got {self.head_dim}.")
    self.in_features = in_features
    self.is_causal, self.rope_theta = is_causal, rope_theta
    self.attention_fn = attention_fn or functools.partial(
        flash_attention, implementation=implementation, config=config)
    linear = functools.partial(
        nnx.LinearGeneral, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
        bias_init=bias_init, use_bias=use_bias, kernel_metadata=kernel_metadata, rngs=rngs)
    self.query = linear(in_features, out_features=(num_heads, self.head_dim))
    self.key = linear(in_features, out_features=(num_kv_heads, self.head_dim))
    self.value = linear(in_features, out_features=(num_kv_heads, self.head_dim))
    self.out = nnx.LinearGeneral(
        in_features=(num_heads, self.head_dim), out_features=out_features or in_features,
        axis=(-2, -1), dtype=dtype, param_dtype=param_dtype,
        kernel_init=out_kernel_init or kernel_init, bias_init=bias_init, use_bias=use_bias,
        kernel_metadata=out_kernel_metadata or kernel_metadata, rngs=rngs)

  def __call__(
      self,
      inputs_q: jax.Array,
      inputs_kv: jax.Array | None = None,
      *,
      segment_ids: jax.Array | None = None,
      kv_segment_ids: jax.Array | None = None,
      positions: jax.Array | None = None,
      kv_positions: jax.Array | None = None,
      is_causal: bool | None = None,
  ) -> jax.Array:
    """Attends from `inputs_q` to `inputs_kv` (self-attention when None).

    Args:
      inputs_q: [B, T, in_features]; inputs_kv: [B, S, in_features] or None.
      segment_ids: [B, T] int32 document ids; a query sees only keys of its document.
      kv_segment_ids: [B, S]; defaults to segment_ids (self-attention).
      positions: [B, T] rotary positions, default arange(T) (pass per-document positions for
        packed sequences); kv_positions: [B, S], default `positions` for self-attention.
      is_causal: overrides the constructor's default.

    Returns:
      [B, T, out_features] in the compute dtype.
    """
    self_attention = inputs_kv is None
    inputs_kv = inputs_q if self_attention else inputs_kv
    query = self.query(inputs_q)  # [B, T, H, D]
    key = self.key(inputs_kv)  # [B, S, K, D]
    value = self.value(inputs_kv)  # [B, S, K, D]
    if self.rope_theta is not None:
      query, key = self._rotate(query, key, positions, kv_positions, self_attention)
    if segment_ids is not None and kv_segment_ids is None:
      kv_segment_ids = segment_ids
    x = self.attention_fn(
        query, key, value, is_causal=self.is_causal if is_causal is None else is_causal,
        query_segment_ids=segment_ids, key_value_segment_ids=kv_segment_ids)  # [B, T, H, D]
    return self.out(x)

  def _rotate(self, query, key, positions, kv_positions, self_attention: bool):
    """Rotary embeddings on q [B, T, H, D] and k [B, S, K, D]."""
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(query.shape[-3]), query.shape[:-2])
    if kv_positions is None:
      kv_positions = positions if self_attention else jnp.broadcast_to(
          jnp.arange(key.shape[-3]), key.shape[:-2])
    return (apply_rotary(query, positions, theta=self.rope_theta),
            apply_rotary(key, kv_positions, theta=self.rope_theta))
