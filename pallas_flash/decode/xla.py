"""Split-KV decode attention in lax loops: the CPU default and the Triton kernel's twin.

It follows the kernel's plan exactly (the same splits, the same block ranges per sequence,
GQA-packed rows), so CPU tests of merging and ragged splits exercise the real partition: one
`while_loop` steps all S splits of all sequences together, each gathering its next key block
(through the page table when paged) and updating an online softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash.call import MASK_VALUE
from pallas_flash.decode.call import DecodeInfo, DecodeParams, sequence_lengths
from pallas_flash.decode.config import XlaDecodeConfig
from pallas_flash.merge import merge_attention_states

CONFIG_TYPE = XlaDecodeConfig
_HI = lax.Precision.HIGHEST
# Score elements (float32) one step may hold at most, when the config leaves block_kv open.
_STEP_ELEMENTS = 1 << 22


def unsupported_reason(info: DecodeInfo, config: XlaDecodeConfig | None) -> str | None:
  del info, config
  return None


def config_for(info: DecodeInfo, config: XlaDecodeConfig | None) -> XlaDecodeConfig:
  """The config the call runs: block_kv as given, else sized to the call."""
  return XlaDecodeConfig(block_kv=_block_kv(info, config))


def tiles(config: XlaDecodeConfig) -> tuple[int | None, int]:
  """(block_m, block_kv); block_m None: all rows of a sequence and kv head move together."""
  return None, config.block_kv


def _block_kv(info: DecodeInfo, config: XlaDecodeConfig | None) -> int:
  if config is not None and config.block_kv is not None:
    return config.block_kv
  per_key = info.batch * info.num_kv_heads * info.rows
  block = max(16, min(256, _STEP_ELEMENTS // max(per_key, 1)))
  return 1 << (block.bit_length() - 1)


def split_ranges(lengths, *, params: DecodeParams, rows: int, block_kv: int, row0=0):
  """[start, end) key blocks of each split for query rows row0 .. row0 + rows - 1: [S, B] each.

  The rows see keys [lo, hi) with hi = n - Tq + t_last + 1 and lo = n - Tq + t_first - window;
  those blocks are cut into S runs of ceil(blocks / S) (the last ones may be empty).
  """
  t_first = row0 // params.group
  t_last = min((row0 + rows - 1) // params.group, params.q_len - 1)
  hi = jnp.maximum(lengths - params.q_len + t_last + 1, 0)
  lo = jnp.zeros_like(hi)
  if params.window is not None:
    lo = jnp.clip(lengths - params.q_len + t_first - params.window, 0, None)
  blk_lo, blk_hi = lo // block_kv, -(-hi // block_kv)
  blk_hi = jnp.maximum(blk_hi, blk_lo)
  per = -(-(blk_hi - blk_lo) // params.num_splits)
  split = jnp.arange(params.num_splits)[:, None]
  start = jnp.minimum(blk_lo[None] + split * per[None], blk_hi[None])
  return start, jnp.minimum(start + per[None], blk_hi[None])


def _rows_of(keys, b_idx, info_paged, page_table, page_size, num_pages, capacity):
  """Flat row indices (into the [rows, K, D] view of the cache) of key positions [S, B, bk]."""
  keys = jnp.clip(keys, 0, capacity - 1)
  if not info_paged:
    return b_idx * capacity + keys
  slot = jnp.minimum(keys // page_size, page_table.shape[1] - 1)
  page = jnp.clip(page_table[b_idx, slot], 0, num_pages - 1)
  return page * page_size + keys % page_size


def _pack(q: jax.Array, num_kv_heads: int) -> jax.Array:
  """[B, Tq, H, D] -> [B, K, Tq * G, D]: row t * G + g is token t of head k * G + g."""
  b, t, h, d = q.shape
  g = h // num_kv_heads
  return q.reshape(b, t, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(
      b, num_kv_heads, t * g, d)


def _unpack(o: jax.Array, lse: jax.Array, q_len: int) -> tuple[jax.Array, jax.Array]:
  """Partials [S, B, K, M, D] / [S, B, K, M] -> [S, B, Tq, H, D] / [S, B, H, Tq]."""
  s, b, kh, m, d = o.shape
  g = m // q_len
  o = o.reshape(s, b, kh, q_len, g, d).transpose(0, 1, 3, 2, 4, 5).reshape(s, b, q_len, -1, d)
  lse = lse.reshape(s, b, kh, q_len, g).transpose(0, 1, 2, 4, 3).reshape(s, b, -1, q_len)
  return o, lse


def attend(q, key_cache, value_cache, lengths, page_table, *, params: DecodeParams,
           config: XlaDecodeConfig):
  """Split-KV attention; the contract is in pallas_flash.decode.call. The S splits' partials
  are combined by merge_attention_states."""
  kh = key_cache.shape[2]
  o, lse = _unpack(*_partials(_pack(q, kh), key_cache, value_cache, lengths, page_table,
                              params=params, config=config), params.q_len)
  if o.shape[0] > 1:
    out, lse = merge_attention_states(o, lse)
  else:
    out, lse = o[0], lse[0]
  return out.astype(q.dtype), lse


def _partials(q, key_cache, value_cache, lengths, page_table, *, params: DecodeParams,
              config: XlaDecodeConfig):
  """q [B, K, M, D] packed -> float32 (o [S, B, K, M, D], lse [S, B, K, M]) per split."""
  b, kh, m, d = q.shape
  s_num, bk = params.num_splits, config.block_kv
  paged = params.page_size is not None
  if paged:
    num_pages, page_size = key_cache.shape[:2]
    capacity = page_table.shape[1] * page_size
  else:
    num_pages = page_size = None
    capacity = key_cache.shape[1]
  lengths = sequence_lengths(lengths, q_len=params.q_len, appends=params.appends,
                             capacity=capacity)
  k_flat = key_cache.reshape(-1, kh, d)  # [B*L or P*page, K, D]
  v_flat = value_cache.reshape(-1, kh, d)
  start, end = split_ranges(lengths, params=params, rows=m, block_kv=bk)  # [S, B]
  q_pos = (lengths[:, None] - params.q_len + jnp.arange(m)[None, :] // params.group)  # [B, M]
  qf = q.astype(jnp.float32) * params.scale
  b_idx = jnp.arange(b)[None, :, None]

  def step(i, carry):
    m_prev, l_prev, acc = carry  # [S, B, K, M], same, [S, B, K, M, D]
    j = start + i  # [S, B] block index of each split
    keys = j[..., None] * bk + jnp.arange(bk)  # [S, B, bk]
    rows = _rows_of(keys, b_idx, paged, page_table, page_size, num_pages, capacity)
    visible = ((j < end)[..., None, None]
               & (keys[:, :, None, :] <= q_pos[None, :, :, None])
               & (keys[:, :, None, :] < lengths[None, :, None, None]))  # [S, B, M, bk]
    if params.window is not None:
      visible &= keys[:, :, None, :] >= q_pos[None, :, :, None] - params.window
    in_cache = (keys < lengths[None, :, None])[..., None, None]  # NaN past the length stays out
    k = jnp.where(in_cache, k_flat[rows].astype(jnp.float32), 0.0)  # [S, B, bk, K, D]
    v = jnp.where(in_cache, v_flat[rows].astype(jnp.float32), 0.0)
    s = jnp.einsum("bkmd,sbnkd->sbkmn", qf, k, precision=_HI)
    if params.logits_soft_cap is not None:
      s = params.logits_soft_cap * jnp.tanh(s / params.logits_soft_cap)
    visible = visible[:, :, None]  # [S, B, 1, M, bk]
    s = jnp.where(visible, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(-1))
    p = jnp.where(visible, jnp.exp(s - m_next[..., None]), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    acc = alpha[..., None] * acc + jnp.einsum("sbkmn,sbnkd->sbkmd", p, v, precision=_HI)
    return m_next, alpha * l_prev + p.sum(-1), acc

  shape = (s_num, b, kh, m)
  carry = (jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
           jnp.zeros((*shape, d), jnp.float32))
  m_run, l_run, acc = lax.fori_loop(0, jnp.max(end - start), step, carry)
  empty = l_run == 0.0
  l_safe = jnp.where(empty, 1.0, l_run)
  o = acc / l_safe[..., None]
  lse = jnp.where(empty, -jnp.inf, m_run + jnp.log(l_safe))
  return o, lse
