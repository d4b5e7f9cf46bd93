"""A native NNX multi-head attention layer on the flash kernels.

Parameters are named and shaped like `flax.nnx.MultiHeadAttention`'s (`query`, `key`, `value`:
`LinearGeneral` kernels [in, H|K, D] and biases [H|K, D]; `out`: kernel [H, D, out], bias [out]),
so `nnx.update(flax_layer, nnx.state(flash_layer, nnx.Param))` moves weights either way.
What it adds over `nnx.MultiHeadAttention(attention_fn=...)`: segment ids for packed documents,
per-document rotary positions, the structured masks and logit transforms the kernels compute
without any T x S array (`local_window_size`, `logits_soft_cap`, `alibi_slopes`) and the kernel
`implementation`/`config`, all as constructor arguments; and a KV cache for generation
(`init_cache`, then `__call__(..., decode=True)` for the prompt and each new token) on
`pallas_flash.decode_attention`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_flash import validation
from pallas_flash.api import flash_attention
from pallas_flash.decode import IMPLEMENTATIONS as DECODE_IMPLEMENTATIONS
from pallas_flash.decode import decode_attention
from pallas_flash.decode import validation as decode_validation
from pallas_flash.flax.rotary import apply_rotary

# The signature every attention function this layer calls must have (pallas_flash.flash_attention
# has it; models/ wraps jax.nn.dot_product_attention to it for baselines):
#   fn(query [B, T, H, D], key [B, S, K, D], value [B, S, K, D], *, is_causal: bool,
#      query_segment_ids: [B, T] | None, key_value_segment_ids: [B, S] | None) -> [B, T, H, D]
# plus, only when the layer sets them, `local_window_size`, `logits_soft_cap` and `alibi_slopes`
# keywords as `pallas_flash.flash_attention` takes them.
AttentionFn = Callable[..., jax.Array]


def alibi_slopes(num_heads: int) -> tuple[float, ...]:
  """The ALiBi paper's slopes: 2**(-8 (h + 1) / H) for a power-of-two H; otherwise those of the
  nearest smaller power of two n followed by every other slope of 2n (Press et al., 2022)."""
  def geometric(n):
    return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

  n = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = geometric(n) + geometric(2 * n)[0::2][:num_heads - n]
  return tuple(slopes)


class FlashMultiHeadAttention(nnx.Module):
  """Multi-head (GQA/MQA) attention: q/k/v projections, rotary, flash attention, out projection.

  Attributes:
    num_heads: H query heads; num_kv_heads: K key/value heads (H % K == 0).
    head_dim: D = qkv_features // num_heads.
    is_causal: default causality of `__call__`.
    rope_theta: rotary base period, or None for no rotary embedding.
    local_window_size, logits_soft_cap: as passed to the constructor (None: unused).
    alibi: the per-head ALiBi slopes as a tuple of floats, or None.
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
      local_window_size: int | tuple[int, int] | None = None,
      logits_soft_cap: float | None = None,
      alibi: bool | Sequence[float] | None = None,
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
      decode_implementation: str | None = None,
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
      local_window_size: sliding-window attention, as `pallas_flash.flash_attention` takes it:
        an int w (= (w, w)) or (left, right); query i sees keys i - left .. i + right (with
        causal masking, (W - 1, 0) is a causal window of W tokens). Key blocks outside the
        window are skipped.
      logits_soft_cap: c > 0 caps each scaled logit s to c * tanh(s / c) (Gemma 2).
      alibi: ALiBi position bias -slope[h] * |i - j| on the logits, computed in the kernels:
        True for `alibi_slopes(num_heads)`, or one slope per query head (fixed, not trained).
      implementation, config: passed to `pallas_flash.flash_attention`.
      attention_fn: replaces `pallas_flash.flash_attention` (same keyword signature, see
        `AttentionFn`); `implementation`/`config` are then not used. Cached decoding
        (`decode=True`) always runs `pallas_flash.decode_attention`.
      decode_implementation: `decode_attention`'s implementation for `decode=True` calls.
      rngs: parameter initialisation.
    """
    qkv_features = qkv_features or in_features
    validation.check_positive_int("num_heads", num_heads)
    validation.check_positive_int("num_kv_heads", num_kv_heads, none="MHA")
    num_kv_heads = num_kv_heads or num_heads
    if rope_theta is not None and (not isinstance(rope_theta, (int, float))
                                   or not math.isfinite(rope_theta) or rope_theta <= 0):
      raise ValueError(f"`rope_theta` must be a positive base period (e.g. 10000.0) or None, got "
                       f"{rope_theta!r}.")
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
    if alibi is True:
      alibi = alibi_slopes(num_heads)
    elif alibi is False:
      alibi = None
    if alibi is not None:
      alibi = tuple(float(x) for x in alibi)
      if len(alibi) != num_heads:
        raise ValueError(f"`alibi` needs one slope per query head ({num_heads}), got "
                         f"{len(alibi)}.")
    if isinstance(local_window_size, list):
      local_window_size = tuple(local_window_size)
    validation.check_layer_options(local_window_size=local_window_size,
                                   logits_soft_cap=logits_soft_cap,
                                   implementation=implementation)
    if decode_implementation not in (None, *DECODE_IMPLEMENTATIONS):
      raise ValueError(f"Unknown decode_implementation={decode_implementation!r}; choose one of "
                       f"{DECODE_IMPLEMENTATIONS} or None for automatic.")
    # Static Python values (tuples, floats): part of the module's structure, not its state.
    self.local_window_size, self.logits_soft_cap = local_window_size, logits_soft_cap
    self.alibi = alibi
    self.attention_fn = attention_fn or functools.partial(
        flash_attention, implementation=implementation, config=config)
    self.decode_implementation = decode_implementation
    # The KV cache (init_cache): None until then.
    self.cached_key: nnx.Cache | None = nnx.data(None)
    self.cached_value: nnx.Cache | None = nnx.data(None)
    self.cache_seqlens: nnx.Cache | None = nnx.data(None)
    self.page_table: nnx.Cache | None = nnx.data(None)
    self.kv_descale: nnx.Cache | None = nnx.data(None)  # [2, K] with an FP8 cache
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
      decode: bool = False,
  ) -> jax.Array:
    """Attends from `inputs_q` to `inputs_kv` (self-attention when None).

    Args:
      inputs_q: [B, T, in_features]; inputs_kv: [B, S, in_features] or None.
      segment_ids: [B, T] int32 document ids; a query sees only keys of its document.
      kv_segment_ids: [B, S]; defaults to segment_ids (self-attention).
      positions: [B, T] rotary positions, default arange(T) (pass per-document positions for
        packed sequences); kv_positions: [B, S], default `positions` for self-attention.
      is_causal: overrides the constructor's default.
      decode: append this call's T tokens to the KV cache (`init_cache` first) and attend
        causally over the cache, the new tokens at positions cache_seqlens .. + T - 1 (rotary
        there too): the prompt once, then one token per step. Self-attention only; no
        segment ids, positions or ALiBi.

    Returns:
      [B, T, out_features] in the compute dtype.
    """
    if decode:
      return self._decode(inputs_q, inputs_kv, segment_ids, positions)
    self_attention = inputs_kv is None
    inputs_kv = inputs_q if self_attention else inputs_kv
    self._check_features(inputs_q=inputs_q, inputs_kv=inputs_kv)
    if segment_ids is not None and kv_segment_ids is None and (
        inputs_kv.shape[-2] != inputs_q.shape[-2]):
      raise ValueError(f"`kv_segment_ids` [B, S] is required with `segment_ids` when the key "
                       f"length ({inputs_kv.shape[-2]}) differs from the query length "
                       f"({inputs_q.shape[-2]}); it defaults to `segment_ids` only when they "
                       "match.")
    query = self.query(inputs_q)  # [B, T, H, D]
    key = self.key(inputs_kv)  # [B, S, K, D]
    value = self.value(inputs_kv)  # [B, S, K, D]
    if self.rope_theta is not None:
      query, key = self._rotate(query, key, positions, kv_positions, self_attention)
    if segment_ids is not None and kv_segment_ids is None:
      kv_segment_ids = segment_ids
    x = self.attention_fn(
        query, key, value, is_causal=self.is_causal if is_causal is None else is_causal,
        query_segment_ids=segment_ids, key_value_segment_ids=kv_segment_ids,
        **self._feature_kwargs())  # [B, T, H, D]
    return self.out(x)

  def init_cache(self, batch_size: int, max_length: int, *, dtype: Any = None,
                 page_size: int | None = None, kv_descale: tuple[Any, Any] | None = None
                 ) -> None:
    """Allocates an empty KV cache for `batch_size` sequences of up to `max_length` tokens.

    Contiguous [B, max_length, K, D] buffers, or with `page_size` a page pool
    [B * max_length / page_size, page_size, K, D] and a page table giving sequence b pages
    b * n .. b * n + n - 1 (`page_table` can be replaced, e.g. by a serving engine's
    allocator). dtype: the cache's, default the layer's compute dtype (`dtype`, else the
    parameters'); jnp.float8_e4m3fn for an FP8 cache, whose `kv_descale` (key, value factors,
    [] or [num_kv_heads], decode_attention's) default to (1.0, 1.0), vLLM's uncalibrated
    choice: keys and values then keep e4m3's 3-bit mantissa from 2**-6 to 448 in magnitude.
    Calling it again starts empty.
    """
    sizes = {"batch_size": batch_size, "max_length": max_length}
    if page_size is not None:
      sizes["page_size"] = page_size
    for name, n in sizes.items():
      validation.check_positive_int(name, n)
    dtype = jnp.dtype(dtype or self.query.dtype or self.query.param_dtype)
    if kv_descale is None and dtype == jnp.dtype(jnp.float8_e4m3fn):
      kv_descale = (1.0, 1.0)
    # [2, K]: key factors, value factors, checked as decode_attention checks them (here, with
    # the values in hand: a jitted decode step could not).
    descale = decode_validation.check_kv_descale(kv_descale, dtype, self.num_kv_heads)
    self.kv_descale = nnx.data(None) if descale is None else nnx.Cache(descale)
    shape = (batch_size, max_length, self.num_kv_heads, self.head_dim)
    if page_size is not None:
      if max_length % page_size:
        raise ValueError(f"max_length ({max_length}) must be a multiple of page_size "
                         f"({page_size}).")
      pages = max_length // page_size
      shape = (batch_size * pages, page_size, self.num_kv_heads, self.head_dim)
      self.page_table = nnx.Cache(jnp.arange(batch_size * pages, dtype=jnp.int32).reshape(
          batch_size, pages))
    else:
      self.page_table = nnx.data(None)
    self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
    self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
    self.cache_seqlens = nnx.Cache(jnp.zeros((batch_size,), jnp.int32))

  def _decode(self, inputs, inputs_kv, segment_ids, positions) -> jax.Array:
    """Appends the T new tokens of `inputs` [B, T, in] and attends over the cache."""
    if self.cached_key is None:
      raise ValueError("decode=True needs a KV cache: call init_cache(batch_size, max_length) "
                       "first.")
    unsupported = [name for name, given in (("inputs_kv", inputs_kv is not None),
                                            ("segment_ids", segment_ids is not None),
                                            ("positions", positions is not None),
                                            ("alibi", self.alibi is not None)) if given]
    if unsupported:
      raise ValueError(f"decode=True does not take {', '.join(unsupported)}: the cache gives "
                       "the positions, and decode_attention is causal self-attention without "
                       "segments or ALiBi.")
    self._check_features(inputs=inputs)
    query = self.query(inputs)  # [B, T, H, D]
    descale = None if self.kv_descale is None else tuple(self.kv_descale[...])  # (keys', values')
    # The query's and the new tokens' dtype: the cache's, or the compute dtype for an FP8
    # cache (decode_attention quantises the new tokens into it).
    dtype = query.dtype if descale is not None else self.cached_key.dtype
    key = self.key(inputs).astype(dtype)  # [B, T, K, D]
    value = self.value(inputs).astype(dtype)
    table = None if self.page_table is None else self.page_table[...]
    x, k_cache, v_cache = decode_attention(
        query.astype(dtype), self.cached_key[...], self.cached_value[...],
        self.cache_seqlens[...], page_table=table, new_key=key, new_value=value,
        rotary=self.rope_theta, local_window_size=self.local_window_size,
        logits_soft_cap=self.logits_soft_cap, kv_descale=descale,
        implementation=self.decode_implementation)
    self.cached_key[...], self.cached_value[...] = k_cache, v_cache
    self.cache_seqlens[...] = self.cache_seqlens[...] + inputs.shape[1]
    return self.out(x.astype(query.dtype))

  def _check_features(self, **inputs) -> None:
    for name, x in inputs.items():
      if x.shape[-1] != self.in_features:
        raise ValueError(f"`{name}` has {x.shape[-1]} features (last axis), but the layer was "
                         f"built with in_features={self.in_features}.")

  def _feature_kwargs(self) -> dict:
    """The optional attention features this layer uses (none: a plain AttentionFn suffices)."""
    kw = {}
    if self.local_window_size is not None:
      kw["local_window_size"] = self.local_window_size
    if self.logits_soft_cap is not None:
      kw["logits_soft_cap"] = self.logits_soft_cap
    if self.alibi is not None:
      kw["alibi_slopes"] = jnp.asarray(self.alibi, jnp.float32)
    return kw

  def _rotate(self, query, key, positions, kv_positions, self_attention: bool):
    """Rotary embeddings on q [B, T, H, D] and k [B, S, K, D]."""
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(query.shape[-3]), query.shape[:-2])
    if kv_positions is None:
      kv_positions = positions if self_attention else jnp.broadcast_to(
          jnp.arange(key.shape[-3]), key.shape[:-2])
    return (apply_rotary(query, positions, theta=self.rope_theta),
            apply_rotary(key, kv_positions, theta=self.rope_theta))
