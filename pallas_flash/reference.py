"""The one oracle: plain, materialising attention in jnp with float32 accumulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash import _tiling, dropout
from pallas_flash.call import AttentionParams, FeatureArrays


def visible_mask(
    q_seg: jax.Array | None, kv_seg: jax.Array | None, *, q_len: int, kv_len: int, is_causal: bool,
    params: AttentionParams | None = None, dense_mask: jax.Array | None = None,
) -> jax.Array | None:
  """Which keys each query may see: [B|1, H|1, T, S] bool, or None when all are visible."""
  mask = None
  if q_seg is not None:
    mask = (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]  # [B, 1, T, S]
  band = params.band if params is not None else (None, 0 if is_causal else None)
  band = band_mask(jnp.arange(q_len), jnp.arange(kv_len), band)  # [T, S]
  if band is not None:
    mask = band[None, None] if mask is None else mask & band
  if dense_mask is not None:
    mask = dense_mask if mask is None else mask & dense_mask
  return mask


band_mask = _tiling.band_mask


def logits_modifiers(logits, *, params: AttentionParams, arrays: FeatureArrays, q_len: int,
                     kv_len: int):
  """Soft cap, ALiBi and bias applied to scaled logits [B, H, T, S] (see params for the order)."""
  c = params.logits_soft_cap
  if c is not None and not params.bias_in_cap:
    logits = c * jnp.tanh(logits / c)
  if params.has_alibi:
    dist = jnp.abs(jnp.arange(q_len)[:, None] - jnp.arange(kv_len)[None, :])  # [T, S]
    slopes = arrays.alibi_slopes.astype(jnp.float32)
    logits = logits - slopes[None, :, None, None] * dist.astype(jnp.float32)
  if params.has_bias:
    logits = logits + arrays.bias.astype(jnp.float32)
  if params.bias_in_cap:
    logits = c * jnp.tanh(logits / c)
  return logits


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    *,
    params: AttentionParams,
    arrays: FeatureArrays | None = None,
    sinks: jax.Array | None = None,
    precision: jax.lax.Precision = jax.lax.Precision.HIGHEST,
) -> tuple[jax.Array, jax.Array]:
  """Attention with the full [B, H, T, S] score matrix, differentiable by plain autodiff.

  Args:
    q: [B, T, H, D]; k, v: [B, S, K, D] with H % K == 0.
    q_seg, kv_seg: [B, T] / [B, S] int32 segment ids, or both None.
    params: scale, masking and the optional features.
    arrays: the features' arrays (bias, dense mask, ALiBi slopes, dropout seed).
    sinks: [H] float: one extra logit per head in every row's softmax, with a zero value.

  Returns:
    o [B, T, H, D] in q.dtype (zeros on fully masked rows) and lse [B, H, T] float32 (-inf there;
    with sinks, the sink's logit).
  """
  arrays = arrays or FeatureArrays()
  b, t, h, d = q.shape
  s_len, kh = k.shape[1], k.shape[2]
  g = h // kh
  qf = q.astype(jnp.float32).reshape(b, t, kh, g, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", qf, k.astype(jnp.float32), precision=precision)
  logits = logits.reshape(b, h, t, s_len) * params.scale  # [B, H, T, S]
  logits = logits_modifiers(logits, params=params, arrays=arrays, q_len=t, kv_len=s_len)
  mask = visible_mask(q_seg, kv_seg, q_len=t, kv_len=s_len, is_causal=params.is_causal,
                      params=params, dense_mask=arrays.mask)
  if arrays.block_mask is not None:  # evaluated densely: [B|1, 1, T, S]
    fn_mask = arrays.block_mask.dense()[:, None]
    mask = fn_mask if mask is None else mask & fn_mask
  if mask is not None:
    logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  if sinks is not None:  # the sink's column: a logit [1, H, 1, 1] whose value row is zero
    sink = sinks.astype(jnp.float32)[None, :, None, None]
    m = jnp.maximum(m, sink)
  # A fully masked row has m = -inf; shift by 0 there so that exp gives 0, not NaN.
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  p = jnp.exp(logits - m)
  l = jnp.sum(p, axis=-1, keepdims=True)  # [B, H, T, 1]
  if sinks is not None:
    l = l + jnp.exp(sink - m)
  l_safe = jnp.where(l == 0.0, 1.0, l)
  p = p / l_safe
  if params.dropout_rate > 0.0:
    keep = dropout.keep_mask(arrays.dropout_seed, b, h, t, s_len, params.dropout_rate)
    p = jnp.where(keep, p / (1.0 - params.dropout_rate), 0.0)
  p = p.reshape(b, kh, g, t, s_len)
  o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32), precision=precision)
  o = o.reshape(b, t, h, v.shape[3]).astype(q.dtype)
  lse = jnp.where(l[..., 0] == 0.0, -jnp.inf, m[..., 0] + jnp.log(l_safe[..., 0]))
  return o, lse
