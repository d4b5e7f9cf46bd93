"""Split-KV decode attention in lax loops: the CPU default and the Triton kernel's twin.

It follows the kernel's plan (GQA-packed rows, the same key blocks per partial: one partial per
sequence without runs, the balanced partition of config.balanced_partition with them), so
CPU tests of merging and ragged splits exercise the real partition: one `while_loop` steps all
partial slots together, each gathering its sequence's next key block (through the page table
when paged) and updating an online softmax; the slots of each sequence are then merged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash.call import MASK_VALUE
from pallas_flash.decode import config as decode_config
from pallas_flash.decode.call import DecodeInfo, DecodeParams, sequence_lengths
from pallas_flash.decode.config import XlaDecodeConfig

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


def programs_per_sm(info: DecodeInfo, config: XlaDecodeConfig) -> int:
  """One: the xla path runs off-GPU, where choose_runs splits nothing."""
  del info, config
  return 1


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
  """(seq, start, end), [J] each: every partial slot's sequence and [start, end) key blocks,
  for query rows row0 .. row0 + rows - 1 of sequences holding `lengths` tokens.

  The rows see keys [lo, hi) with hi = n - Tq + t_last + 1 and lo = n - Tq + t_first - window.
  No runs: slot b holds sequence b's blocks (J = B). N runs (params.programs): the Triton
  kernel's balanced partition of the concatenated blocks, program i's share of sequence b in slot
  i + b (J = B + N - 1; slots that no pair uses are empty, start = end).
  """
  t_first = row0 // params.group
  t_last = min((row0 + rows - 1) // params.group, params.q_len - 1)
  hi = jnp.maximum(lengths - params.q_len + t_last + 1, 0)
  lo = jnp.zeros_like(hi)
  if params.window is not None:
    lo = jnp.clip(lengths - params.q_len + t_first - params.window, 0, None)
  blk_lo, blk_hi = lo // block_kv, -(-hi // block_kv)
  blk_hi = jnp.maximum(blk_hi, blk_lo)
  b = lengths.shape[0]
  if params.programs is None:
    return jnp.arange(b), blk_lo, blk_hi
  programs = params.programs
  counts = blk_hi - blk_lo
  part = decode_config.balanced_partition(counts, programs)
  program = jnp.arange(b + programs - 1)[:, None] - jnp.arange(b)[None, :]  # [J, B]
  first, last = decode_config.sequence_share(part, part.starts[None, :], counts[None, :],
                                             program)
  held = (program >= 0) & (program < programs) & (last > first)  # one pair per slot at most
  seq = jnp.argmax(held, axis=1)
  pick = lambda x: jnp.take_along_axis(x, seq[:, None], axis=1)[:, 0]  # noqa: E731
  used = held.any(axis=1)
  return (seq, jnp.where(used, blk_lo[seq] + pick(first), 0),
          jnp.where(used, blk_lo[seq] + pick(last), 0))


def _rows_of(keys, b_idx, info_paged, page_table, page_size, num_pages, capacity):
  """Flat row indices (into the [rows, K, D] view of the cache) of key positions [J, bk] of
  sequences b_idx [J, 1]."""
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
  """[B, K, M, D] / [B, K, M] -> [B, Tq, H, D] / [B, H, Tq]."""
  b, kh, m, d = o.shape
  g = m // q_len
  o = o.reshape(b, kh, q_len, g, d).transpose(0, 2, 1, 3, 4).reshape(b, q_len, -1, d)
  lse = lse.reshape(b, kh, q_len, g).transpose(0, 1, 3, 2).reshape(b, -1, q_len)
  return o, lse


def attend(q, key_cache, value_cache, lengths, page_table, *, params: DecodeParams,
           config: XlaDecodeConfig, kv_descale=None):
  """Split-KV attention; the contract is in pallas_flash.decode.call. Each sequence's
  partials are combined by merge_attention_states' rule (_merge_slots)."""
  kh = key_cache.shape[2]
  o, lse, seq = _partials(_pack(q, kh), key_cache, value_cache, lengths, page_table,
                          params=params, config=config, kv_descale=kv_descale)
  if params.programs is not None:
    o, lse = _merge_slots(o, lse, seq, q.shape[0])
  out, lse = _unpack(o, lse, params.q_len)
  return out.astype(q.dtype), lse


def _merge_slots(o, lse, seq, batch: int):
  """Partials o [J, K, M, D], lse [J, K, M] of sequences seq [J] -> each sequence's result
  [B, K, M, D], [B, K, M]: merge_attention_states' rule over the slots of each sequence."""
  m = jax.ops.segment_max(lse, seq, num_segments=batch)
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # a finite shift: all-empty rows get weights 0, not NaN
  w = jnp.exp(lse - m[seq])  # empty partials (lse -inf) weigh nothing
  total = jax.ops.segment_sum(w, seq, num_segments=batch)
  acc = jax.ops.segment_sum(w[..., None] * o, seq, num_segments=batch)
  empty = total == 0.0
  safe = jnp.where(empty, 1.0, total)
  return acc / safe[..., None], jnp.where(empty, -jnp.inf, m + jnp.log(safe))


def _partials(q, key_cache, value_cache, lengths, page_table, *, params: DecodeParams,
              config: XlaDecodeConfig, kv_descale=None):
  """q [B, K, M, D] packed -> float32 o [J, K, M, D], lse [J, K, M] of the J partial slots
  (split_ranges), and each slot's sequence [J]. kv_descale: None, or an FP8 cache's float32
  [2, K] factors, applied to each gathered block."""
  _, kh, m, d = q.shape
  bk = config.block_kv
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
  seq, start, end = split_ranges(lengths, params=params, rows=m, block_kv=bk)  # [J]
  n = lengths[seq]  # [J]
  q_pos = n[:, None] - params.q_len + jnp.arange(m)[None, :] // params.group  # [J, M]
  qf = q[seq].astype(jnp.float32) * params.scale  # [J, K, M, D]

  def step(i, carry):
    m_prev, l_prev, acc = carry  # [J, K, M], same, [J, K, M, D]
    j = start + i  # [J] block index of each slot
    keys = j[:, None] * bk + jnp.arange(bk)  # [J, bk]
    rows = _rows_of(keys, seq[:, None], paged, page_table, page_size, num_pages, capacity)
    in_cache = keys < n[:, None]  # NaN past the length stays out
    visible = ((j < end)[:, None, None] & (keys[:, None, :] <= q_pos[:, :, None])
               & in_cache[:, None, :])  # [J, M, bk]
    if params.window is not None:
      visible &= keys[:, None, :] >= q_pos[:, :, None] - params.window
    k, v = k_flat[rows].astype(jnp.float32), v_flat[rows].astype(jnp.float32)
    if kv_descale is not None:  # [J, bk, K, D] times each kv head's factor
      k, v = k * kv_descale[0][:, None], v * kv_descale[1][:, None]
    k = jnp.where(in_cache[..., None, None], k, 0.0)
    v = jnp.where(in_cache[..., None, None], v, 0.0)
    s = jnp.einsum("jkmd,jnkd->jkmn", qf, k, precision=_HI)  # k, v: [J, bk, K, D]
    if params.logits_soft_cap is not None:
      s = params.logits_soft_cap * jnp.tanh(s / params.logits_soft_cap)
    visible = visible[:, None]  # [J, 1, M, bk]
    s = jnp.where(visible, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(-1))
    p = jnp.where(visible, jnp.exp(s - m_next[..., None]), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    acc = alpha[..., None] * acc + jnp.einsum("jkmn,jnkd->jkmd", p, v, precision=_HI)
    return m_next, alpha * l_prev + p.sum(-1), acc

  shape = (seq.shape[0], kh, m)
  carry = (jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
           jnp.zeros((*shape, d), jnp.float32))
  m_run, l_run, acc = lax.fori_loop(0, jnp.max(end - start), step, carry)
  empty = l_run == 0.0
  l_safe = jnp.where(empty, 1.0, l_run)
  o = acc / l_safe[..., None]
  lse = jnp.where(empty, -jnp.inf, m_run + jnp.log(l_safe))
  return o, lse, seq
