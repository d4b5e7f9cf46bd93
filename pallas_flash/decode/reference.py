"""The decode oracle: the cache made contiguous, the append and the end-aligned causal mask in
plain jnp with float32 scores over every cache position. Tests compare every backend to it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_flash import fp8

_HI = jax.lax.Precision.HIGHEST


def _rope(x, positions, theta=None, cos=None, sin=None):
  """Rotate-half rotary embedding of x [B, T, N, D] at positions [B, T], in float32."""
  x = x.astype(jnp.float32)
  if theta is not None:
    d = x.shape[-1]
    inv = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    ang = positions.astype(jnp.float32)[..., None] * inv
    cos_p, sin_p = jnp.cos(ang), jnp.sin(ang)
  else:
    cos_p, sin_p = cos[positions], sin[positions]
  half = cos_p.shape[-1]
  cos_p, sin_p = cos_p[:, :, None], sin_p[:, :, None]
  a, b = x[..., :half], x[..., half:2 * half]
  return jnp.concatenate([a * cos_p - b * sin_p, b * cos_p + a * sin_p, x[..., 2 * half:]], -1)


def decode_reference(query, key_cache, value_cache, cache_seqlens, *, page_table=None,
                     new_key=None, new_value=None, rotary=None, scale=None,
                     local_window_size=None, logits_soft_cap=None, kv_descale=None):
  """Decode attention with the full [B, H, Tq, L] score matrix.

  Takes `decode_attention`'s arguments (already valid: lengths within the cache, pages within
  the pool; a window as int or (left, right); kv_descale, with float8_e4m3fn caches, a pair of
  [] or [K] factors) and returns (out [B, Tq, H, D] in query.dtype, lse [B, H, Tq] float32,
  key_cache, value_cache) with the new tokens appended (quantised into an FP8 cache:
  fp8.to_e4m3 of x / descale; the attention reads every cached entry as float32(x8) *
  descale).
  """
  kh = key_cache.shape[2]
  k_scale = v_scale = None
  if kv_descale is not None:  # [K, 1] factors of the [..., K, D] entries
    k_scale, v_scale = (jnp.broadcast_to(jnp.asarray(x, jnp.float32), (kh,))[:, None]
                        for x in kv_descale)
    if new_key is not None:  # rotated in float32 (below), then quantised, as the append does
      new_key = new_key.astype(jnp.float32)
  b, t, h, d = query.shape
  g = h // kh
  lens = jnp.asarray(cache_seqlens, jnp.int32)
  if page_table is not None:  # the pool read through each sequence's page list: [B, L, K, D]
    ps = key_cache.shape[1]
    j = jnp.arange(page_table.shape[1] * ps)
    pages = jnp.clip(page_table[:, j // ps], 0, key_cache.shape[0] - 1)
    k_seq, v_seq = key_cache[pages, j % ps], value_cache[pages, j % ps]
  else:
    k_seq, v_seq = key_cache, value_cache
  cap = k_seq.shape[1]
  theta = cos = sin = None
  if isinstance(rotary, (tuple, list)):
    cos, sin = (jnp.asarray(x, jnp.float32) for x in rotary)
  elif rotary is not None:
    theta = float(rotary)
  if new_key is not None:
    pos = lens[:, None] + jnp.arange(t)[None, :]  # [B, Tq]
    nk = new_key if rotary is None else _rope(new_key, pos, theta, cos, sin).astype(new_key.dtype)
    nv = new_value
    if k_scale is not None:
      nk, nv = fp8.to_e4m3(nk, k_scale), fp8.to_e4m3(new_value, v_scale)
    rows = jnp.arange(b)[:, None]
    k_seq = k_seq.at[rows, pos].set(nk, mode="drop")
    v_seq = v_seq.at[rows, pos].set(nv, mode="drop")
    if page_table is not None:
      page = page_table[rows, pos // ps]
      key_cache = key_cache.at[page, pos % ps].set(nk)
      value_cache = value_cache.at[page, pos % ps].set(nv)
    else:
      key_cache, value_cache = k_seq, v_seq
    lens = lens + t
  q_pos = lens[:, None] - t + jnp.arange(t)[None, :]  # [B, Tq]
  q = query if rotary is None else _rope(query, jnp.maximum(q_pos, 0), theta, cos, sin)
  key_pos = jnp.arange(cap)
  valid = key_pos[None, :] < lens[:, None]  # [B, L]
  # Unused cache slots may hold anything (NaN included): zero them so 0 * NaN never happens.
  k32, v32 = k_seq.astype(jnp.float32), v_seq.astype(jnp.float32)
  if k_scale is not None:
    k32, v32 = k32 * k_scale, v32 * v_scale
  k32 = jnp.where(valid[:, :, None, None], k32, 0.0)
  v32 = jnp.where(valid[:, :, None, None], v32, 0.0)
  q32 = q.astype(jnp.float32).reshape(b, t, kh, g, d)
  s = jnp.einsum("btkgd,blkd->bkgtl", q32, k32, precision=_HI).reshape(b, h, t, cap)
  s = s * (1.0 / math.sqrt(d) if scale is None else scale)
  if logits_soft_cap is not None:
    s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
  see = (key_pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]  # [B, Tq, L]
  if local_window_size is not None:
    left = (local_window_size if isinstance(local_window_size, int) else local_window_size[0])
    see = see & (key_pos[None, None, :] >= q_pos[:, :, None] - left)
  s = jnp.where(see[:, None], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  l = p.sum(-1, keepdims=True)
  p = p / jnp.where(l == 0.0, 1.0, l)
  o = jnp.einsum("bkgtl,blkd->btkgd", p.reshape(b, kh, g, t, cap), v32, precision=_HI)
  lse = jnp.where(l[..., 0] == 0.0, -jnp.inf, m[..., 0] + jnp.log(jnp.maximum(l[..., 0], 1e-38)))
  return o.reshape(b, t, h, d).astype(query.dtype), lse, key_cache, value_cache
