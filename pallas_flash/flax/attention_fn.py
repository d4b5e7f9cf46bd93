"""An `attention_fn` for Flax's own attention layers that runs the flash kernels.

`flax.nnx.MultiHeadAttention(attention_fn=...)` and `flax.linen.MultiHeadDotProductAttention(
attention_fn=...)` call it exactly like `flax.nnx.dot_product_attention`. Calls that map onto
`pallas_flash.flash_attention` (no dense mask or bias, no active dropout, no weight sowing) run the
kernels; anything else falls back to Flax's dense attention, with a one-time warning naming why.

A dense `mask` is never inspected (it is a traced array), so a causal mask built with
`nnx.make_causal_mask` still takes the dense path: pass `is_causal=True` to the layer call or use
`make_attention_fn(is_causal=True)` and drop the mask to get the kernels.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from pallas_flash.api import flash_attention


@functools.cache
def _warn_once(reason: str) -> None:
  """Warns once per distinct reason per process (cleared in tests with `_warn_once.cache_clear`)."""
  warnings.warn(
      f"pallas_flash attention_fn falls back to dense (materialising) attention: {reason}. "
      "This uses O(T*S) memory.", stacklevel=4)


def _fallback_reason(*, bias, mask, dropout_rate, deterministic, module, linen_only) -> str | None:
  """Why a call cannot run on the flash kernels, or None when it can."""
  if bias is not None:
    return "an attention `bias` was given (flash kernels take no dense bias)"
  if mask is not None:
    return ("a dense `mask` was given (use is_causal=True / segment ids instead of "
            "make_causal_mask to run the kernels)")
  if dropout_rate > 0.0 and not deterministic:
    return f"attention dropout is active (dropout_rate={dropout_rate})"
  if module is not None:
    return "attention weights are sown (sow_weights=True) and the kernels never form them"
  if linen_only:
    return f"custom einsum arguments {sorted(linen_only)} were given"
  return None


def _promote(query, key, value, dtype):
  """Casts q/k/v to one dtype as Flax's promote_dtype does: `dtype`, else their result type."""
  dtype = dtype or jnp.result_type(query, key, value)
  return tuple(jnp.asarray(x, dtype) for x in (query, key, value))


def _flatten_batch(x: jax.Array) -> jax.Array:
  """[batch..., L, H, D] -> [prod(batch...), L, H, D]; rank 3 stays unbatched."""
  if x.ndim <= 4:
    return x
  return x.reshape(math.prod(x.shape[:-3]), *x.shape[-3:])


def _dense(query, key, value, *, kwargs: dict, linen_kw: dict, module, is_causal: bool):
  """Flax's own dense attention: linen's when the call came from linen, else nnx's."""
  from flax import linen, nnx  # local: importing pallas_flash must not require flax

  from_linen = isinstance(module, linen.Module) or any(
      v is not None for k, v in linen_kw.items() if k != "force_fp32_for_softmax")
  if from_linen:  # linen's dot_product_attention has no is_causal: express it as a mask
    if is_causal:
      kwargs["mask"] = _and_mask(kwargs["mask"], _causal_mask(query.shape[-3], key.shape[-3]))
    return linen.dot_product_attention(query, key, value, module=module, **kwargs, **linen_kw)
  return nnx.dot_product_attention(query, key, value, module=module, is_causal=is_causal,
                                   **kwargs)


def flash_attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum: Any = None,
    attn_weights_value_einsum: Any = None,
    *,
    scale: float | None = None,
    implementation: str | None = None,
    config: Any = None,
    query_segment_ids: jax.Array | None = None,
    key_value_segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Drop-in `attention_fn` for `nnx.MultiHeadAttention` and `linen.MultiHeadDotProductAttention`.

  Every argument named like `flax.nnx.dot_product_attention`'s (linen filters the keywords it
  passes by this signature, so they are all spelled out) means what it means there. The
  keyword-only ones configure the kernels; bind them with `make_attention_fn`.

  Args:
    query: [batch..., T, H, D]; key, value: [batch..., S, K, D] with H % K == 0.
    bias, mask: broadcastable to [batch..., H, T, S]; either one forces the dense fallback.
    dropout_rate, deterministic, dropout_rng, broadcast_dropout: active dropout (rate > 0 and
      not deterministic) forces the dense fallback.
    dtype: compute dtype q/k/v are cast to (Flax semantics); default their result type.
    precision: used by the dense fallback only (the kernels accumulate in float32).
    module: a module to sow attention weights into; forces the dense fallback.
    is_causal: causal masking (nnx passes it through from `MultiHeadAttention.__call__`).
    force_fp32_for_softmax: accepted for linen; the kernels' softmax is always float32.
    qk_attn_weights_einsum, attn_weights_value_einsum: linen hooks; force the dense fallback.
    scale: softmax scale, default 1/sqrt(D).
    implementation, config: passed to `pallas_flash.flash_attention`.
    query_segment_ids, key_value_segment_ids: [batch..., T] / [batch..., S] packed-document ids.

  Returns:
    [batch..., T, H, D] in the compute dtype.
  """
  query, key, value = _promote(query, key, value, dtype)
  linen_only = {n for n, v in (("qk_attn_weights_einsum", qk_attn_weights_einsum),
                               ("attn_weights_value_einsum", attn_weights_value_einsum))
                if v is not None}
  reason = _fallback_reason(bias=bias, mask=mask, dropout_rate=dropout_rate,
                            deterministic=deterministic, module=module, linen_only=linen_only)
  if reason is not None:
    _warn_once(reason)
    if query_segment_ids is not None:
      mask = _and_mask(mask, _segment_mask(query_segment_ids, key_value_segment_ids))
    if scale is not None:  # Flax's dense attention scales by 1/sqrt(D): fold the difference in q
      query = query * jnp.asarray(scale * math.sqrt(query.shape[-1]), query.dtype)
    kwargs = dict(bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
                  dropout_rng=dropout_rng, dropout_rate=dropout_rate,
                  deterministic=deterministic, dtype=dtype, precision=precision)
    linen_kw = dict(force_fp32_for_softmax=force_fp32_for_softmax,
                    qk_attn_weights_einsum=qk_attn_weights_einsum,
                    attn_weights_value_einsum=attn_weights_value_einsum)
    return _dense(query, key, value, kwargs=kwargs, linen_kw=linen_kw, module=module,
                  is_causal=is_causal)
  batch_shape = query.shape[:-3]
  q, k, v = map(_flatten_batch, (query, key, value))
  q_seg, kv_seg = (None if s is None else s.reshape(-1, s.shape[-1]) if s.ndim > 2 else s
                   for s in (query_segment_ids, key_value_segment_ids))
  out = flash_attention(q, k, v, scale=scale, is_causal=is_causal, query_segment_ids=q_seg,
                        key_value_segment_ids=kv_seg, implementation=implementation,
                        config=config)
  return out.reshape(*batch_shape, *out.shape[-3:])


def _causal_mask(t: int, s: int) -> jax.Array:
  """[1, 1, T, S] top-left causal mask, as jax.nn.dot_product_attention defines it."""
  return (jnp.arange(t)[:, None] >= jnp.arange(s)[None, :])[None, None]


def _and_mask(mask, other):
  return other if mask is None else jnp.logical_and(mask, other)


def _segment_mask(q_seg, kv_seg):
  """Dense [batch..., 1, T, S] form of segment ids [batch..., T] / [batch..., S]."""
  kv_seg = q_seg if kv_seg is None else kv_seg
  return (q_seg[..., :, None] == kv_seg[..., None, :])[..., None, :, :]


def make_attention_fn(*, is_causal: bool | None = None, scale: float | None = None,
                      implementation: str | None = None, config: Any = None):
  """`flash_attention_fn` with kernel options bound, ready for `attention_fn=`.

  Args:
    is_causal: force causal masking on every call (for layers whose caller cannot pass
      `is_causal`, such as linen's); None keeps the per-call value.
    scale: softmax scale, default 1/sqrt(D).
    implementation, config: passed to `pallas_flash.flash_attention`.

  Returns:
    A function with `flax.nnx.dot_product_attention`'s signature.
  """
  kernel_kw = dict(scale=scale, implementation=implementation, config=config)
  bound_causal = is_causal
  if is_causal is None:
    return functools.partial(flash_attention_fn, **kernel_kw)

  @functools.wraps(flash_attention_fn)
  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                   precision=None, module=None, force_fp32_for_softmax=False,
                   qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                   is_causal=None):
    del is_causal  # the bound value wins over the caller's
    return flash_attention_fn(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
        deterministic, dtype, precision, module, bound_causal, force_fp32_for_softmax,
        qk_attn_weights_einsum, attn_weights_value_einsum, **kernel_kw)

  del attention_fn.__wrapped__  # inspect.signature must see this wrapper's parameters (linen)
  return attention_fn
