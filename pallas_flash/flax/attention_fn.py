"""An `attention_fn` for Flax's own attention layers that runs the flash kernels.

`flax.nnx.MultiHeadAttention(attention_fn=...)` and `flax.linen.MultiHeadDotProductAttention(
attention_fn=...)` call it exactly like `flax.nnx.dot_product_attention`. Calls run on the kernels
of `pallas_flash.flash_attention`, including a dense `bias` or boolean `mask` and dropout with
`broadcast_dropout=False`. Four things fall back to Flax's dense attention (linen's inside a
linen module, else nnx's), with a one-time warning naming why: dropout with
`broadcast_dropout=True` (Flax's default: one [T, S] dropout mask shared by every batch element
and head; the kernels draw an independent mask per (batch, head, row, column) from a hash and
cannot share one), sowing attention weights (`sow_weights=True`; the kernels never form them),
linen's custom einsum arguments, and dtypes the kernels lack (float64, complex64).

A dense `bias` or `mask` runs in the kernels without storing [B, H, T, S] probabilities, but it
is still a T x S input (and the bias gradient a T x S output). A causal mask built with
`make_causal_mask` is never recognised as causal (it is a traced array), so it costs a dense mask
read and disables block skipping: pass `is_causal=True` to the layer call or use
`make_attention_fn(is_causal=True)` and drop the mask for the cheapest path.

Cached decoding (`decode=True` in Flax's layers): each step calls the attention with one query
token against the whole cache and a mask hiding the cache positions not written yet. Such a
call (one query, more keys, a mask, no bias or segment ids) runs `pallas_flash.decode_attention`
with each sequence's length read from its mask (the last visible key + 1): split-KV over the
cache, every query head of a kv head served by one read of it. The query is the newest token,
so causality (a bound `is_causal=True`, whose top-left rule would show it key 0 only) is the
mask's. A mask that also hides keys before the last visible one (left padding) cannot be
expressed as a length: the step then returns NaN rather than a wrong answer; pass
`cache_steps=False` to `make_attention_fn` to run such steps on `flash_attention` with the
dense mask instead (the mask is their causality there too).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from pallas_flash import validation
from pallas_flash.api import flash_attention
from pallas_flash.backends import check_implementation
from pallas_flash.decode import decode_attention
from pallas_flash.validation import SUPPORTED_DTYPES


@functools.cache
def _warn_once(reason: str) -> None:
  """Warns once per distinct reason per process (cleared in tests with `_warn_once.cache_clear`)."""
  warnings.warn(
      f"pallas_flash attention_fn falls back to dense (materialising) attention: {reason}. "
      "This uses O(T*S) memory.", stacklevel=4)


def _dropout_active(dropout_rate, deterministic) -> bool:
  return dropout_rate > 0.0 and not deterministic


def _fallback_reason(*, dtype, dropout_rate, deterministic, broadcast_dropout, module,
                     linen_only) -> str | None:
  """Why a call cannot run on the flash kernels, or None when it can."""
  if jnp.dtype(dtype) not in [jnp.dtype(t) for t in SUPPORTED_DTYPES]:
    return (f"the kernels compute in bfloat16, float16 or float32, and the layer's dtype is "
            f"{jnp.dtype(dtype)}; pass dtype=jnp.float32 to the layer to run them")
  if _dropout_active(dropout_rate, deterministic) and broadcast_dropout:
    return (f"attention dropout (dropout_rate={dropout_rate}) with broadcast_dropout=True shares "
            "one [T, S] dropout mask over batch and heads, while the kernels draw an independent "
            "mask per (batch, head, row, column); pass broadcast_dropout=False to the layer to "
            "run dropout in the kernels")
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
  """[batch..., L, H, D] -> [prod(batch...), L, H, D] (rank 3 gets a batch of 1)."""
  return x.reshape(math.prod(x.shape[:-3]), *x.shape[-3:])


def _flatten_dense(name: str, x, batch_shape: tuple[int, ...]):
  """A Flax bias/mask, broadcastable to [batch..., H, T, S], as [prod(batch...)|1, H|1, T|1, S|1].

  Batch axes that are all 1 stay one broadcast axis (the kernels read one copy); batch axes that
  are only partly broadcast are expanded to `batch_shape` before flattening, so the flattened
  index matches the one q/k/v get from `_flatten_batch`.
  """
  if x is None:
    return None
  x = jnp.asarray(x)
  if name == "mask" and x.dtype != jnp.bool_:  # Flax's make_attention_mask gives float 0/1
    x = x != 0  # as jnp.where(mask, ...) reads it
  n = len(batch_shape)
  if x.ndim > n + 3:
    raise ValueError(f"`{name}` of shape {x.shape} has more axes than [batch..., heads, q_len, "
                     f"kv_len] with batch {batch_shape}.")
  x = x.reshape((1,) * (n + 3 - x.ndim) + x.shape)
  lead, tail = x.shape[:n], x.shape[n:]
  if any(a not in (1, b) for a, b in zip(lead, batch_shape)):
    raise ValueError(f"`{name}` of shape {x.shape} does not broadcast over batch {batch_shape}.")
  if all(a == 1 for a in lead):
    return x.reshape(1, *tail)
  return jnp.broadcast_to(x, batch_shape + tail).reshape(math.prod(batch_shape), *tail)


def _dense(query, key, value, *, kwargs: dict, linen_kw: dict, module, is_causal: bool):
  """Flax's own dense attention: linen's when the call came from linen, else nnx's."""
  from flax import linen, nnx  # local: importing pallas_flash must not require flax

  from_linen = isinstance(module, linen.Module) or _inside_linen_module() or any(
      v is not None for k, v in linen_kw.items() if k != "force_fp32_for_softmax")
  if from_linen:  # linen's dot_product_attention has no is_causal: express it as a mask
    if is_causal:
      kwargs["mask"] = _and_mask(kwargs["mask"], _causal_mask(query.shape[-3], key.shape[-3]))
    return linen.dot_product_attention(query, key, value, module=module, **kwargs, **linen_kw)
  return nnx.dot_product_attention(query, key, value, module=module, is_causal=is_causal,
                                   **kwargs)


def _inside_linen_module() -> bool:
  """Whether a linen module's method is running: its layers call attention_fn with the same
  arguments nnx's pass, and differ in their dense attention (nnx's softmax is float32)."""
  from flax.linen import module as linen_module
  stack = getattr(getattr(linen_module, "_context", None), "module_stack", None)
  return bool(stack) and stack[-1] is not None


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
    cache_steps: bool = True,
) -> jax.Array:
  """Drop-in `attention_fn` for `nnx.MultiHeadAttention` and `linen.MultiHeadDotProductAttention`.

  Every argument named like `flax.nnx.dot_product_attention`'s (linen filters the keywords it
  passes by this signature, so they are all spelled out) means what it means there. The
  keyword-only ones configure the kernels; bind them with `make_attention_fn`.

  Args:
    query: [batch..., T, H, D]; key, value: [batch..., S, K, D] with H % K == 0.
    bias, mask: broadcastable to [batch..., H, T, S] (`mask` boolean, True = attend); run in
      the kernels (bias differentiable). A row whose mask hides every key gets zeros here, where
      Flax's dense attention averages all values.
    dropout_rate, deterministic, dropout_rng, broadcast_dropout: active dropout (rate > 0 and
      not deterministic) runs in the kernels when broadcast_dropout=False (an independent mask
      per batch, head, row and column, as Flax draws it then, but from a hash of dropout_rng, so
      not Flax's bits); broadcast_dropout=True falls back to dense attention.
    dtype: compute dtype q/k/v are cast to (Flax semantics); default their result type.
    precision: used by the dense fallback only (the kernels accumulate in float32).
    module: a module to sow attention weights into; forces the dense fallback.
    is_causal: causal masking (nnx passes it through from `MultiHeadAttention.__call__`).
    force_fp32_for_softmax: accepted for linen; the kernels' softmax is always float32.
    qk_attn_weights_einsum, attn_weights_value_einsum: linen hooks; force the dense fallback.
    scale: softmax scale, default 1/sqrt(D).
    implementation, config: passed to `pallas_flash.flash_attention`.
    query_segment_ids, key_value_segment_ids: [batch..., T] / [batch..., S] packed-document ids.
    cache_steps: run cached decode steps (one query, more keys, a mask, no bias or segment
      ids: what Flax's layers call with decode=True) on `decode_attention` with lengths read
      from the mask (see the module docstring); False runs them on `flash_attention` with the
      dense mask.

  Returns:
    [batch..., T, H, D] in the compute dtype.
  """
  validation.check_dropout_rate(dropout_rate)
  for name, x in (("query", query), ("key", key), ("value", value)):
    if getattr(x, "ndim", 0) < 3:
      raise ValueError(f"`{name}` must be [batch..., length, num_heads, head_dim] (rank >= 3), "
                       f"got shape {getattr(x, 'shape', None)}.")
  query, key, value = _promote(query, key, value, dtype)
  linen_only = {n for n, v in (("qk_attn_weights_einsum", qk_attn_weights_einsum),
                               ("attn_weights_value_einsum", attn_weights_value_einsum))
                if v is not None}
  reason = _fallback_reason(dtype=query.dtype, dropout_rate=dropout_rate,
                            deterministic=deterministic, broadcast_dropout=broadcast_dropout,
                            module=module, linen_only=linen_only)
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
  cache_step = mask is not None and q.shape[1] == 1 < k.shape[1] and query_segment_ids is None
  if cache_step:
    # The newest token against the cache: its mask is the causality; a bound is_causal's
    # top-left rule would show it key 0 only.
    is_causal = False
  if cache_step and cache_steps and bias is None:
    out = _cache_step(q, k, v, _flatten_dense("mask", mask, batch_shape), scale=scale,
                      implementation=implementation)
    return out.reshape(*batch_shape, *out.shape[-3:])
  q_seg, kv_seg = (None if s is None else jnp.asarray(s).reshape(-1, s.shape[-1])
                   for s in (query_segment_ids, key_value_segment_ids))
  dropout_kw = {}
  if _dropout_active(dropout_rate, deterministic):
    dropout_kw = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  out = flash_attention(q, k, v, _flatten_dense("bias", bias, batch_shape),
                        _flatten_dense("mask", mask, batch_shape), scale=scale,
                        is_causal=is_causal, query_segment_ids=q_seg,
                        key_value_segment_ids=kv_seg, implementation=implementation,
                        config=config, **dropout_kw)
  return out.reshape(*batch_shape, *out.shape[-3:])


def _cache_step(q, k, v, mask, *, scale, implementation) -> jax.Array:
  """One query token [B, 1, H, D] against a cache k/v [B, S, K, D] whose visible keys the mask
  [B|1, H|1, 1, S] gives, on decode_attention: the length of each sequence is its last visible
  key + 1. NaN where the mask hides a key before that (a length cannot express it).

  Differentiable: the backward is flash_attention's with the dense mask (decode kernels have
  none), so a one-query training call that happens to look like a cache step still trains.
  """
  b, s_len = q.shape[0], k.shape[1]
  # "mosaic" takes decode_attention's automatic choice: its Mosaic kernel runs only when
  # named there (decode/api.py's BY_NAME_ONLY: level with the Triton kernel on the H200).
  impl = None if implementation in (None, "mosaic") else implementation

  def dense(q, k, v, mask):
    return flash_attention(q, k, v, mask=mask, scale=scale, implementation=implementation)

  @jax.custom_vjp
  def step(q, k, v, mask):
    visible = jnp.broadcast_to(mask[:, :, 0, :], (b, mask.shape[1], s_len))  # [B, H|1, S]
    positions = jnp.arange(1, s_len + 1, dtype=jnp.int32)
    lengths = jnp.max(jnp.where(visible, positions, 0), axis=(1, 2))  # [B]
    holes = jnp.any(~visible & (positions <= lengths[:, None, None]), axis=(1, 2))
    out = decode_attention(q, k, v, lengths, scale=scale, implementation=impl)
    return jnp.where(holes[:, None, None, None], jnp.nan, out)

  def step_fwd(q, k, v, mask):
    return step(q, k, v, mask), (q, k, v, mask)

  def step_bwd(res, cot):
    q, k, v, mask = res
    return (*jax.vjp(lambda q, k, v: dense(q, k, v, mask), q, k, v)[1](cot), None)

  step.defvjp(step_fwd, step_bwd)
  return step(q, k, v, mask)


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
                      implementation: str | None = None, config: Any = None,
                      cache_steps: bool = True):
  """`flash_attention_fn` with kernel options bound, ready for `attention_fn=`.

  Args:
    is_causal: force causal masking on every call (for layers whose caller cannot pass
      `is_causal`, such as linen's); None keeps the per-call value.
    scale: softmax scale, default 1/sqrt(D).
    implementation, config: passed to `pallas_flash.flash_attention`.
    cache_steps: run cached decode steps on `decode_attention` (see flash_attention_fn).

  Returns:
    A function with `flax.nnx.dot_product_attention`'s signature.
  """
  check_implementation(implementation)  # when the layer is built, not at its first call
  kernel_kw = dict(scale=scale, implementation=implementation, config=config,
                   cache_steps=cache_steps)
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
