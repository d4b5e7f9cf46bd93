"""Split-KV decode attention as a Triton-lowered Pallas kernel (GPU; interpretable on CPU).

One program owns `block_m` GQA-packed query rows of one kv head (all G heads of the kv head and
all Tq tokens: M = Tq * G rows, padded to 16) and a run of key blocks: with one split, all the
keys of one sequence; with N balanced runs (params.programs), 1 / N of the batch's key blocks
laid end to end, which may cover part of one sequence or several (_split_kernel), so ragged
batches keep every program equally busy. It streams `block_kv`-key tiles of K and V once for all
its rows, so the cache is read once per kv head, not once per query head. Key rows are gathered
by index: a contiguous cache reads rows start .. start + block_kv, a paged one looks each row's
page up in the page table, so a tile may span pages of any size in any order. Tiles wholly
visible to every row run without masks; the ones at the sequence's end (and at the window's
start) mask scores and load zeros past the length, so stale or NaN cache slots never reach the
output.

An FP8 (e4m3) cache reaches the kernels as 16-bit words, two features each (fp8_words), and is
unpacked in registers: Pallas-Triton addresses an array of at most 2^32 bytes with int32
element offsets, which overflow for a one-byte array of more than 2^31 elements (a 2-4 GiB
cache read the wrong rows or faulted); counted in words they stay below 2^31.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_flash.call import MASK_VALUE
from pallas_flash.decode import config as decode_config
from pallas_flash.decode.call import DecodeInfo, DecodeParams, cache_layout
from pallas_flash.decode.config import TritonDecodeConfig
from pallas_flash.triton import common

CONFIG_TYPE = TritonDecodeConfig
MAX_HEAD_DIM = 256


def unsupported_reason(info: DecodeInfo, config: TritonDecodeConfig | None, *,
                       interpret: bool) -> str | None:
  del config
  if info.head_dim > MAX_HEAD_DIM:
    return f"head_dim {info.head_dim} > {MAX_HEAD_DIM} is not supported by the Triton kernel"
  if info.fp8_cache and info.head_dim % 2:
    return (f"an FP8 cache with an odd head_dim ({info.head_dim}): the kernel reads e4m3 "
            f"features in pairs")
  if interpret:
    return None
  cc = info.compute_capability
  if info.fp8_cache and cc is not None and cc < (8, 9):
    return (f"an FP8 cache: Triton converts float8_e4m3fn from compute capability 8.9 on; this "
            f"GPU is sm_{cc[0]}{cc[1]}")
  return common.platform_reason(info.platform, cc)


def default_config(info: DecodeInfo) -> TritonDecodeConfig:
  """decode_config's tiles for the call's rows, with halved key tiles for float32 or D > 128
  (their tiles take twice the registers and shared memory)."""
  base = (decode_config.DECODE_TRITON if info.rows <= decode_config.PREFILL_ROWS
          else decode_config.PREFILL_TRITON)
  if jnp.dtype(info.dtype).itemsize == 4 or info.head_dim > 128:
    base = dataclasses.replace(base, block_kv=64, num_stages=2)
  return base


def config_for(info: DecodeInfo, config: TritonDecodeConfig | None) -> TritonDecodeConfig:
  """The config the call runs: `config`'s fields, default_config's where None, the tiles shrunk
  to the call's rows and cache (Triton tiles are powers of two >= 16)."""
  base = default_config(info)
  given = {} if config is None else {f.name: getattr(config, f.name)
                                     for f in dataclasses.fields(config)
                                     if getattr(config, f.name) is not None}
  full = dataclasses.replace(base, **given)
  return dataclasses.replace(
      full, block_m=max(16, min(full.block_m, common.pl_next_pow2(info.rows))),
      block_kv=max(16, min(full.block_kv, common.pl_next_pow2(info.capacity))))


# Shared memory of one SM (an H100 / H200: 228 KiB, of which each CTA reserves 1 KiB).
SM_SHARED_BYTES = 228 * 1024


def programs_per_sm(info: DecodeInfo, config: TritonDecodeConfig) -> int:
  """The kernel's CTAs that fit one SM's shared memory: Triton's pipeline holds num_stages - 1
  K and V tiles, plus up to 10 KiB with the CTA's reserve (compiled for an H200 at 128-key
  tiles and 3 stages, D = 128: 139 KB with bf16 caches, one CTA per SM; 74 KB with e4m3 ones,
  three)."""
  tiles_bytes = (max(config.num_stages - 1, 1) * 2 * config.block_kv * info.head_dim
                 * jnp.dtype(info.cache_dtype).itemsize)
  return max(1, SM_SHARED_BYTES // (tiles_bytes + 10 * 1024))


def tiles(config: TritonDecodeConfig) -> tuple[int, int]:
  """(block_m, block_kv) of a resolved config."""
  return config.block_m, config.block_kv


@dataclasses.dataclass(frozen=True, kw_only=True)
class _KernelParams:
  """Static facts of the kernel body."""

  params: DecodeParams
  batch: int
  num_kv_heads: int
  head_dim: int  # D of the cache (columns past it are masked)
  block_m: int
  block_kv: int
  capacity: int  # L: n_b is clamped to [0, L]
  num_pages: int | None
  max_pages: int | None
  approx_tanh: bool
  fp8_cache: bool = False  # K and V as e4m3 words (fp8_words), attended in halves
  fp8_ptx: bool = False  # the words converted by inline PTX (_unpack_words; off-GPU: jnp)

  @property
  def width(self) -> int:
    """Columns of the kernel's query, output and partial tiles (D_pad): an FP8 cache's halves
    take at least 16 words each (a dot's smallest K)."""
    d_pad = common.padded_head_dim(self.head_dim)
    return max(d_pad, 32) if self.fp8_cache else d_pad

  @property
  def rows(self) -> int:
    return self.params.q_len * self.params.group

  @property
  def scale_log2(self) -> float:
    return self.params.scale * common.LOG2E


def _scores(qk, p: _KernelParams):
  """Scores of a tile in log2 units (soft-capped when asked)."""
  cap = p.params.logits_soft_cap
  if cap is None:
    return qk * p.scale_log2
  if p.approx_tanh:
    t = pltriton.approx_tanh(qk * (p.params.scale / cap))
  else:  # tanh(x) = 1 - 2 / (1 + e^2x), saturating cleanly to +-1
    t = 1.0 - 2.0 / (1.0 + jnp.exp2(qk * (2.0 * common.LOG2E * p.params.scale / cap)))
  return t * (cap * common.LOG2E)


def _col_index(cols, width: int):
  """(column indices to address `width` columns with, their mask or None).

  The index stays a bare iota whenever width is a power of two: Triton vectorises an access
  only along an axis it can prove contiguous, and a clamp (jnp.minimum) would hide that.
  """
  if width == cols.shape[0]:
    return cols, None
  return jnp.minimum(cols, width - 1), (cols < width)[None, :]


def _load_rows(ref, rows, cols, row_ok):
  """ref[rows, cols] as [block_kv, len(cols)] (D_pad), zeros where a row is not in the cache.
  Padding columns (D not a power of two) repeat column D - 1: the query's padding columns are
  zero, so scores ignore them, and outputs there equal column D - 1's (see _store_rows)."""
  cols, _ = _col_index(cols, ref.shape[-1])
  view = ref.at[rows[:, None], cols[None, :]]
  return view[...] if row_ok is None else pltriton.load(view, mask=row_ok[:, None], other=0)


def fp8_words(cache):
  """An e4m3 cache [..., D] (D even) as uint16 [..., D / 2], a free view: word j holds feature
  2j in its low byte and 2j + 1 in its high byte."""
  pairs = cache.reshape(*cache.shape[:-1], cache.shape[-1] // 2, 2)
  return lax.bitcast_convert_type(pairs, jnp.uint16)


class _HalfQuery(NamedTuple):
  """A row tile's query for an FP8 cache: its even and odd features [block_m, width / 2] in
  the dots' dtype, and the factor (a power of two) its scaling multiplies the scores by."""

  lo: Any
  hi: Any
  factor: Any


# e4m3 pairs to f16 pairs in one instruction (sm_89+): the word's low byte becomes the low half.
_CVT_E4M3X2 = "cvt.rn.f16x2.e4m3x2 $0, $1;"


def _unpack_words(words, dtype, *, ptx: bool):
  """words uint16 [n, W] (fp8_words) -> (even, odd) features [n, W] in `dtype`, exact: every
  e4m3 value is an f16. ptx: one cvt per word (the GPU; FP8 caches run on sm_89+ only), else
  jnp's conversions (the interpreter, which runs no PTX)."""
  if ptx:
    # Triton's integers are signless: int16 in, int32 (two f16) out.
    [pair] = pltriton.elementwise_inline_asm(
        _CVT_E4M3X2, args=[lax.bitcast_convert_type(words, jnp.int16)], constraints="=r,h",
        pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.int32)])
    lo, hi = (lax.bitcast_convert_type(x.astype(jnp.int16), jnp.float16)
              for x in (pair, pair >> 16))
  else:
    lo, hi = (lax.bitcast_convert_type(b.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float16)
              for b in (words & 0xFF, words >> 8))
  return lo.astype(dtype), hi.astype(dtype)


def _join_halves(lo, hi, words: int):
  """Even and odd features [n, W_pad] -> [n, 2 W_pad], feature 2j + i from half i, column j.
  Past the cache's `words` both halves of a padding column take the odd half (the last word's
  repeat holds features D - 2 and D - 1): every padding column then holds feature D - 1, as
  _store_rows needs."""
  if lo.shape[1] != words:
    lo = jnp.where((lax.broadcasted_iota(jnp.int32, (lo.shape[1],), 0) < words)[None, :], lo, hi)
  return jnp.stack([lo, hi], axis=-1).reshape(lo.shape[0], 2 * lo.shape[1])


def _load_half_query(q_ref, t, g, p: _KernelParams, seq=None) -> _HalfQuery:
  """The tile's query rows split into even and odd features (zeros past D), for an FP8 cache's
  halves. 16-bit queries take f16 dots: the tile is scaled by a power of two that maps its
  largest |q| into [2^13, 2^14) (no overflow, and bf16's range is kept), undone on the scores."""
  w = lax.broadcasted_iota(jnp.int32, (p.width // 2,), 0)

  def load(cols):
    index = (t[:, None], g[:, None], jnp.minimum(cols, p.head_dim - 1)[None, :])
    view = q_ref.at[index if seq is None else (seq, *index)]
    return pltriton.load(view, mask=(cols < p.head_dim)[None, :], other=0).astype(jnp.float32)

  lo, hi = load(2 * w), load(2 * w + 1)
  if jnp.dtype(q_ref.dtype).itemsize == 4:
    return _HalfQuery(lo, hi, 1.0)
  top = jnp.maximum(jnp.max(jnp.max(jnp.abs(lo), axis=1), axis=0),
                    jnp.max(jnp.max(jnp.abs(hi), axis=1), axis=0))
  factor = jnp.exp2(jnp.floor(jnp.log2(jnp.maximum(top, 2.0 ** -100))) - 13.0)
  return _HalfQuery((lo / factor).astype(jnp.float16), (hi / factor).astype(jnp.float16),
                    factor)


def _tile_rows(row0, p: _KernelParams, n: int | None = None):
  """GQA-packed rows row0 .. row0 + n - 1 (n: block_m unless given): (token t, head g of the
  kv head's group), row r being token r // G, head r % G.

  Padding rows (r >= M) repeat the last real row, so they compute and write exactly its
  values: stores stay correct wherever masked-off lanes do write (the interpreter's scatter).
  """
  n = p.block_m if n is None else n
  real = jnp.minimum(row0 + lax.broadcasted_iota(jnp.int32, (n,), 0), p.rows - 1)
  return real // p.params.group, real % p.params.group


def _load_q(q_ref, t, g, cols, p: _KernelParams, seq=None):
  """The tile's query rows [block_m, D_pad] from q_ref [Tq, G, D], or from sequence `seq` of
  q_ref [B, Tq, G, D] (zeros past D)."""
  cols, col_ok = _col_index(cols, p.head_dim)
  index = (t[:, None], g[:, None], cols[None, :])
  view = q_ref.at[index if seq is None else (seq, *index)]
  return view[...] if col_ok is None else pltriton.load(view, mask=col_ok, other=0)


def _store_rows(o_ref, lse_ref, o, lse, t, g, cols, p: _KernelParams):
  """Writes a tile's rows into o_ref [Tq, G, D] and lse_ref [G, Tq]: the output's
  [B, Tq, H, D] and [B, H, Tq] layouts, seen per (sequence, kv head).

  Unmasked: padding rows and columns address the last real row / column and hold exactly its
  values, so their writes repeat it (a masked store would be as cheap on a GPU, but the
  interpreter's masked scatter writes stale values for masked-off duplicates).
  """
  cols, _ = _col_index(cols, p.head_dim)
  o_ref[t[:, None], g[:, None], cols[None, :]] = o.astype(o_ref.dtype)
  lse_ref[g, t] = lse


def _tile_tokens(row0, p: _KernelParams):
  """(first, last) query token of the row tile starting at row0 (padding rows excluded)."""
  return row0 // p.params.group, jnp.minimum((row0 + p.block_m - 1) // p.params.group,
                                             p.params.q_len - 1)


def _tokens_held(seqlens, p: _KernelParams):
  """n_b from cache_seqlens as passed (call.sequence_lengths): scalars or vectors."""
  n = jnp.clip(seqlens, 0, p.capacity)
  return jnp.minimum(n + p.params.q_len, p.capacity) if p.params.appends else n


def _visible_blocks(n, t_first, t_last, p: _KernelParams):
  """[lo, hi) key blocks that tokens t_first .. t_last of a sequence holding n tokens see
  (scalars or [B] vectors): keys [n - Tq + t_first - window, n - Tq + t_last + 1)."""
  prm, bk = p.params, p.block_kv
  hi = jnp.maximum(n - prm.q_len + t_last + 1, 0)
  lo = 0 if prm.window is None else jnp.maximum(n - prm.q_len + t_first - prm.window, 0)
  return lo // bk, jnp.maximum((hi + bk - 1) // bk, lo // bk)


def _sequence_blocks(lengths_ref, t_first, t_last, p: _KernelParams):
  """Visible key blocks [B_pad] of every sequence for tokens t_first .. t_last; B_pad is B
  rounded up to a power of two (Triton's vectors) and padding lanes hold no block."""
  b = lengths_ref.shape[0]
  idx = lax.broadcasted_iota(jnp.int32, (common.pl_next_pow2(b),), 0)
  seqlens = pltriton.load(lengths_ref.at[jnp.minimum(idx, b - 1)], mask=idx < b, other=0)
  lo, hi = _visible_blocks(_tokens_held(seqlens, p), t_first, t_last, p)
  return jnp.where(idx < b, hi - lo, 0)


def _pick(vector, i):
  """vector[i] for a traced i (Triton vectors take no dynamic scalar index); 0 past the end."""
  return jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, vector.shape, 0) == i, vector, 0))


def _cache_rows(keys, pt_ref, seq, p: _KernelParams):
  """Rows of the kernel's [rows, D] view of the cache holding key positions `keys` of
  sequence `seq` (None: the view is this sequence's own, pt_ref its page-table row)."""
  ps = p.params.page_size
  if ps is None:
    return keys if seq is None else seq * p.capacity + keys
  slot = jnp.minimum(keys // ps, p.max_pages - 1)
  page = pt_ref[slot] if seq is None else pt_ref[seq, slot]
  return jnp.clip(page, 0, p.num_pages - 1) * ps + keys % ps


def _attend_blocks(q, k_ref, v_ref, rows_of, start, end, *, n, row0, p: _KernelParams,
                   descale=None):
  """Online softmax of one row tile over key blocks [start, end) of one sequence.

  q [block_m, D_pad] holds rows row0 .. row0 + block_m - 1 of a sequence holding n tokens;
  rows_of(keys [block_kv]) -> their rows in k_ref / v_ref ([rows, D]). Returns float32 o
  [block_m, D_pad] normalised over the range's keys and lse [block_m] (natural log); a row
  that sees none of them gets o = 0, lse = -inf. descale: None, or an FP8 cache's (key, value)
  factors of this kv head (scalars), k_ref / v_ref then its words (fp8_words) and q a
  _HalfQuery: each word tile splits into its even and odd features (_unpack_words), two dots
  form the scores (q_even·k_evenᵀ + q_odd·k_oddᵀ) and P·V fills two accumulators, joined once at
  the end (_join_halves), so no tile is interleaved inside the loop; the scores take the key
  factor and the output the value factor.
  """
  prm, bm, bk = p.params, p.block_m, p.block_kv
  t, _ = _tile_rows(row0, p)
  t_first, t_last = _tile_tokens(row0, p)
  q_pos = n - prm.q_len + t
  # Blocks every row of the tile sees whole: below the first row's position, and (window)
  # at or above the last row's window start. The rest is masked.
  full_hi = jnp.maximum(n - prm.q_len + t_first + 1, 0) // bk
  full_lo = 0
  if prm.window is not None:
    full_lo = (jnp.maximum(n - prm.q_len + t_last - prm.window, 0) + bk - 1) // bk
  mid_lo = jnp.clip(full_lo, start, end)
  mid_hi = jnp.clip(full_hi, mid_lo, end)
  cols = lax.broadcasted_iota(jnp.int32, (p.width,), 0)
  wcols = lax.broadcasted_iota(jnp.int32, (p.width // 2,), 0)  # an FP8 cache's words

  def halves(ref, rows, in_cache):
    return _unpack_words(_load_rows(ref, rows, wcols, in_cache), q.lo.dtype, ptx=p.fp8_ptx)

  def tile_rows(j):
    """Rows of key block j (keys past the length read row 0's, which the masks drop)."""
    keys = j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
    return rows_of(jnp.where(keys < n, keys, 0))

  # Each step computes the next block's rows (carried): a paged cache's come from a page-table
  # load, which in the step's own K/V address chain left Triton's pipeliner one K/V buffer in
  # place of its stages (docs/decode.md, "Paged tiles in the pipeline").
  def step(j, carry, *, masked: bool):
    m_prev, l_prev, acc, rows = carry
    rows_next = tile_rows(j + 1)
    keys = j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
    in_cache = keys < n if masked else None
    if p.fp8_cache:
      k_lo, k_hi = halves(k_ref, rows, in_cache)
      s = _scores((common.dot(q.lo, k_lo, trans_b=True) + common.dot(q.hi, k_hi, trans_b=True))
                  * (descale[0] * q.factor), p)
    else:
      k = _load_rows(k_ref, rows, cols, in_cache)
      s = _scores(common.dot(q, k, trans_b=True), p)  # [block_m, block_kv]
    if masked:
      visible = (keys[None, :] <= q_pos[:, None]) & in_cache[None, :]
      if prm.window is not None:
        visible &= keys[None, :] >= q_pos[:, None] - prm.window
      s = jnp.where(visible, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp2(m_prev - m_next)  # FA2 Alg. 1: rescale what was summed under the old max
    probs = jnp.exp2(s - m_next[:, None])
    if masked:  # a row with no visible key yet has m_next == MASK_VALUE, where exp2 gives 1
      probs = jnp.where(visible, probs, 0.0)
    if p.fp8_cache:
      v_lo, v_hi = halves(v_ref, rows, in_cache)
      pc = probs.astype(v_lo.dtype)
      acc = (alpha[:, None] * acc[0] + common.dot(pc, v_lo),
             alpha[:, None] * acc[1] + common.dot(pc, v_hi))
    else:
      v = _load_rows(v_ref, rows, cols, in_cache)
      acc = alpha[:, None] * acc + common.dot(probs.astype(v.dtype), v)
    return m_next, alpha * l_prev + probs.sum(axis=1), acc, rows_next

  zeros = jnp.zeros((bm, p.width // 2 if p.fp8_cache else p.width), jnp.float32)
  carry = (jnp.full((bm,), MASK_VALUE, jnp.float32), jnp.zeros((bm,), jnp.float32),
           (zeros, zeros) if p.fp8_cache else zeros, tile_rows(start))
  carry = lax.fori_loop(start, mid_lo, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(mid_lo, mid_hi, functools.partial(step, masked=False), carry)
  m, l, acc, _ = lax.fori_loop(mid_hi, end, functools.partial(step, masked=True), carry)
  if p.fp8_cache:
    acc = _join_halves(*acc, k_ref.shape[-1])
  empty = l == 0.0  # an empty range (or a query that sees no key): o = 0, lse = -inf
  l_safe = jnp.where(empty, 1.0, l)
  inv_l = 1.0 / l_safe if descale is None else descale[1] / l_safe
  return (acc * inv_l[:, None],
          jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * common.LN2))


def _descale(descale_ref, kv_head):
  """(key, value) factors of one kv head from an FP8 cache's [2, K] float32 descale_ref, or
  None without one."""
  if descale_ref is None:
    return None
  return descale_ref[0, kv_head], descale_ref[1, kv_head]


def _decode_kernel(lengths_ref, q_ref, k_ref, v_ref, pt_ref, descale_ref, o_ref, lse_ref, *,
                   p: _KernelParams):
  """One split: one row tile of one (sequence, kv head) against all the keys it sees.

  Refs after BlockSpec slicing: lengths_ref [B] int32 (cache_seqlens as passed: n_b follows
  as in call.sequence_lengths); q_ref [Tq, G, D] (this sequence's query heads of this kv
  head); k_ref / v_ref [L, D] (this sequence and kv head of a contiguous cache) or
  [P * page_size, D] (this kv head of the pool); pt_ref [max_pages] int32 (this sequence's
  page table, None when contiguous); descale_ref [2, K] float32 (an FP8 cache's factors, whose
  k_ref / v_ref hold D / 2 words; else None); o_ref [Tq, G, D] and lse_ref [G, Tq], the final
  outputs (query dtype; float32). Grid: (row tiles, 1, B * K).
  """
  mi, bh = pl.program_id(0), pl.program_id(2)
  row0 = mi * p.block_m
  n = _tokens_held(lengths_ref[bh // p.num_kv_heads], p)
  t, g = _tile_rows(row0, p)
  start, end = _visible_blocks(n, *_tile_tokens(row0, p), p)
  cols = lax.broadcasted_iota(jnp.int32, (p.width,), 0)
  q = (_load_half_query(q_ref, t, g, p) if p.fp8_cache
       else _load_q(q_ref, t, g, cols, p))  # [block_m, D_pad]
  o, lse = _attend_blocks(q, k_ref, v_ref, lambda keys: _cache_rows(keys, pt_ref, None, p),
                          start, end, n=n, row0=row0, p=p,
                          descale=_descale(descale_ref, bh % p.num_kv_heads))
  _store_rows(o_ref, lse_ref, o, lse, t, g, cols, p)


def _split_kernel(lengths_ref, q_ref, k_ref, v_ref, pt_ref, descale_ref, o_ref, lse_ref, *,
                  p: _KernelParams):
  """Balanced runs: one row tile of one kv head against one program's share of the batch's keys.

  The visible key blocks of all B sequences, concatenated in sequence order, are cut into
  N = params.programs runs of equal length (config.balanced_partition): program i takes run
  i, which may end inside a sequence or span several, and writes one float32 partial per
  sequence it touches, to slot i + b (unique: the (program, sequence) pairs form a staircase).
  _merge_kernel combines each sequence's slots. With equal lengths each program holds one
  sequence's 1 / S, as a per-sequence split would; ragged batches stay balanced.

  Refs after BlockSpec slicing: lengths_ref [B] int32 (cache_seqlens as passed); q_ref
  [B, Tq, G, D] (this kv head's query heads of every sequence); k_ref / v_ref [B * L, D] or
  [P * page_size, D] (this kv head, rows flattened); pt_ref [B, max_pages] int32 (None when
  contiguous); descale_ref as in _decode_kernel; o_ref [B + N - 1, block_m, D_pad] and lse_ref
  [B + N - 1, block_m], the partial slots of this row tile and kv head. Grid: (row tiles, N,
  K).
  """
  mi, program = pl.program_id(0), pl.program_id(1)
  row0 = mi * p.block_m
  t_first, t_last = _tile_tokens(row0, p)
  counts = _sequence_blocks(lengths_ref, t_first, t_last, p)
  part = decode_config.balanced_partition(counts, p.params.programs)
  first, stop = decode_config.program_sequences(part, counts, program)
  t, g = _tile_rows(row0, p)
  cols = lax.broadcasted_iota(jnp.int32, (p.width,), 0)
  descale = _descale(descale_ref, pl.program_id(2))

  def one_sequence(seq, seq_start):
    n = _tokens_held(lengths_ref[seq], p)
    blk_lo, blk_hi = _visible_blocks(n, t_first, t_last, p)
    share_lo, share_hi = decode_config.sequence_share(part, seq_start, blk_hi - blk_lo, program)
    q = (_load_half_query(q_ref, t, g, p, seq=seq) if p.fp8_cache
         else _load_q(q_ref, t, g, cols, p, seq=seq))
    o, lse = _attend_blocks(q, k_ref, v_ref, lambda keys: _cache_rows(keys, pt_ref, seq, p),
                            blk_lo + share_lo, blk_lo + share_hi, n=n, row0=row0, p=p,
                            descale=descale)
    o_ref[program + seq] = o
    lse_ref[program + seq] = lse
    return seq_start + part.extent(blk_hi - blk_lo)

  lax.fori_loop(first, stop, one_sequence, _pick(part.starts, first))


# Floats of one merge step's [chunk, rows, D_pad] partials: 128 registers a thread at the
# merge's 4 warps.
MERGE_CHUNK_FLOATS = 16384


def merge_rows(rows: int, block_m: int) -> int:
  """Rows of a partial tile the merge kernel reads: a single row tile's rows rounded up to a
  power of two (Triton's tiles), not the split kernel's padded block_m (16, or 64 on Mosaic):
  a decode step at G = 4 holds 4 real rows."""
  return block_m if rows > block_m else common.pl_next_pow2(rows)


def merge_chunk(slots: int, rows: int, d_pad: int) -> int:
  """Partial slots the merge kernel loads at once: as many [rows, D_pad] slots as
  MERGE_CHUNK_FLOATS holds, a power of two (Triton's tiles) and at most the slots there are
  (windows stay in bounds). Its loads are masked to the sequence's slots, so a wide window
  costs registers, not traffic, and one step takes a ragged batch's longest sequence too.
  Merged so, B = 1 and 8 merge in 2.0-3.4 µs where the split count's chunks of padded rows took
  3.5-11.8 (one H100, 2026-12-07, docs/decode.md)."""
  fit = max(1, MERGE_CHUNK_FLOATS // (rows * d_pad))
  return min(1 << (fit.bit_length() - 1), 1 << (slots.bit_length() - 1))


def _merge_kernel(lengths_ref, o_ref, lse_ref, out_ref, lse_out_ref, *, p: _KernelParams,
                  rows: int, chunk: int):
  """Combines one sequence's partial slots for one row tile (merge_attention_states' rule,
  online over chunks of `chunk` slots): the slots program + b of the programs whose runs hold
  its blocks.

  Refs: lengths_ref [B] int32; o_ref [B + N - 1, rows, D_pad] and lse_ref [B + N - 1, rows]
  float32 partials of this row tile and kv head (rows: merge_rows); out_ref [Tq, G, D] and
  lse_out_ref [G, Tq] as the decode kernel's outputs. Grid: (row tiles, B * K).
  """
  mi, seq = pl.program_id(0), pl.program_id(1) // p.num_kv_heads
  row0 = mi * p.block_m
  t, g = _tile_rows(row0, p, rows)
  counts = _sequence_blocks(lengths_ref, *_tile_tokens(row0, p), p)
  part = decode_config.balanced_partition(counts, p.params.programs)
  slot_lo, slot_hi = decode_config.sequence_slots(part, _pick(part.starts, seq),
                                                  _pick(counts, seq), seq)
  cols = lax.broadcasted_iota(jnp.int32, (o_ref.shape[-1],), 0)
  last = o_ref.shape[0] - chunk  # windows start at most here: every load is in bounds

  def body(i, carry):
    """Slots [c, min(c + chunk, slot_hi)), c = slot_lo + i * chunk, of the in-bounds window
    [start, start + chunk); its other slots (unwritten ones may hold NaN) are masked off the
    loads."""
    m_prev, total, acc = carry
    c = slot_lo + i * chunk
    start = jnp.minimum(c, last)
    idx = start + lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    mine = (idx >= c) & (idx < slot_hi)
    lse = pltriton.load(lse_ref.at[pl.ds(start, chunk)], mask=mine[:, None],
                        other=-jnp.inf)  # [chunk, rows]
    empty = lse == -jnp.inf
    m_next = jnp.maximum(m_prev, jnp.max(jnp.where(empty, MASK_VALUE, lse), axis=0))
    alpha = jnp.exp(m_prev - m_next)
    w = jnp.where(empty, 0.0, jnp.exp(lse - m_next[None, :]))  # an empty partial weighs nothing
    o = pltriton.load(o_ref.at[pl.ds(start, chunk)], mask=mine[:, None, None],
                      other=0.0)  # [chunk, rows, D_pad]
    return (m_next, alpha * total + jnp.sum(w, axis=0),
            alpha[:, None] * acc + jnp.sum(w[:, :, None] * o, axis=0))

  m, total, acc = lax.fori_loop(0, (slot_hi - slot_lo + chunk - 1) // chunk, body, (
      jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
      jnp.zeros((rows, o_ref.shape[-1]), jnp.float32)))
  empty = total == 0.0
  safe = jnp.where(empty, 1.0, total)
  _store_rows(out_ref, lse_out_ref, acc * (1.0 / safe)[:, None],
              jnp.where(empty, -jnp.inf, m + jnp.log(safe)), t, g, cols, p)


def attend(q, key_cache, value_cache, lengths, page_table, *, params: DecodeParams,
           config: TritonDecodeConfig, interpret: bool, kv_descale=None):
  """Split-KV decode attention; the contract is in pallas_flash.decode.call. `config` is
  resolved (config_for). One kernel without runs (one program per sequence); with runs _split_kernel
  writes float32 partials over balanced runs of the batch's keys and _merge_kernel combines
  them into the final layout."""
  b, tq, h, d = q.shape
  kh = key_cache.shape[2]
  g = h // kh
  bm, bk = tiles(config)
  capacity, num_pages, max_pages = cache_layout(key_cache, page_table, params)
  kp = _KernelParams(params=params, batch=b, num_kv_heads=kh, head_dim=d, block_m=bm,
                     block_kv=bk, capacity=capacity, num_pages=num_pages, max_pages=max_pages,
                     approx_tanh=not interpret and jnp.dtype(q.dtype).itemsize == 2,
                     fp8_cache=kv_descale is not None, fp8_ptx=not interpret)
  q = q.reshape(b, tq, kh, g, d)  # free views: the kernels address rows (t, g) directly
  if kv_descale is not None:
    key_cache, value_cache = fp8_words(key_cache), fp8_words(value_cache)
  call = _one_split if params.programs is None else _balanced_splits
  o, lse = call(q, key_cache, value_cache, lengths, page_table, kv_descale, kp=kp,
                config=config, interpret=interpret)
  return o.reshape(b, tq, h, d), lse.reshape(b, h, tq)


def _final_specs(kh: int, tq: int, g: int, d: int):
  """BlockSpecs of out [B, Tq, K, G, D] and lse [B, K, G, Tq] for a grid (row tiles, ...,
  B * K): the (sequence, kv head) slab of each."""
  return [pl.BlockSpec((None, tq, None, g, d), lambda *ids: (ids[-1] // kh, 0, ids[-1] % kh, 0, 0)),
          pl.BlockSpec((None, None, g, tq), lambda *ids: (ids[-1] // kh, ids[-1] % kh, 0, 0))]


def _final_shapes(q):
  b, tq, kh, g, d = q.shape
  return [jax.ShapeDtypeStruct((b, tq, kh, g, d), q.dtype),
          jax.ShapeDtypeStruct((b, kh, g, tq), jnp.float32)]


def _compiler_params(config: TritonDecodeConfig):
  return pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


def _one_split(q, key_cache, value_cache, lengths, page_table, kv_descale, *,
               kp: _KernelParams, config: TritonDecodeConfig, interpret: bool):
  """q [B, Tq, K, G, D] -> out [B, Tq, K, G, D], lse [B, K, G, Tq]: one kernel, each program
  one row tile of one (sequence, kv head)."""
  b, tq, kh, g, d = q.shape
  dc = key_cache.shape[-1]  # D, or D / 2 words of an FP8 cache
  if page_table is not None:
    key_cache = key_cache.reshape(-1, kh, dc)  # [P * page_size, K, D]: a free view of the pool
    value_cache = value_cache.reshape(-1, kh, dc)
    kv_spec = pl.BlockSpec((key_cache.shape[0], None, dc), lambda mi, si, bh: (0, bh % kh, 0))
    pt_spec = pl.BlockSpec((None, page_table.shape[1]), lambda mi, si, bh: (bh // kh, 0))
  else:
    kv_spec = pl.BlockSpec((None, kp.capacity, None, dc),
                           lambda mi, si, bh: (bh // kh, 0, bh % kh, 0))
    pt_spec = None
  final = _final_specs(kh, tq, g, d)
  return pl.pallas_call(
      functools.partial(_decode_kernel, p=kp),
      grid=(-(-kp.rows // kp.block_m), 1, b * kh),
      in_specs=[pl.BlockSpec(lengths.shape, lambda *_: (0,)), final[0], kv_spec, kv_spec,
                pt_spec, _descale_spec(kv_descale)],
      out_specs=final,
      out_shape=_final_shapes(q),
      compiler_params=_compiler_params(config),
      interpret=interpret,
      name="pallas_flash_decode",
  )(lengths, q, key_cache, value_cache, page_table, kv_descale)


def _descale_spec(kv_descale):
  """The whole [2, K] descale array to every program (None without one)."""
  return None if kv_descale is None else pl.BlockSpec(kv_descale.shape, lambda *_: (0, 0))


def _balanced_splits(q, key_cache, value_cache, lengths, page_table, kv_descale, *,
                     kp: _KernelParams, config: TritonDecodeConfig, interpret: bool):
  """q [B, Tq, K, G, D] -> out [B, Tq, K, G, D], lse [B, K, G, Tq]: _split_kernel over
  N = params.programs programs per (row tile, kv head), then _merge_kernel."""
  b, tq, kh, g, d = q.shape
  bm = kp.block_m
  d_pad = kp.width
  tiles_m = -(-kp.rows // bm)
  programs = kp.params.programs
  slots = b + programs - 1
  # [rows, K, D]: a free view of the pool or of the contiguous cache (row b * L + key); D / 2
  # words for an FP8 cache.
  dc = key_cache.shape[-1]
  key_cache = key_cache.reshape(-1, kh, dc)
  value_cache = value_cache.reshape(-1, kh, dc)
  kv_spec = pl.BlockSpec((key_cache.shape[0], None, dc), lambda mi, i, k: (0, k, 0))
  pt_spec = None if page_table is None else pl.BlockSpec(page_table.shape, lambda *_: (0, 0))
  partial_shapes = [jax.ShapeDtypeStruct((kh, slots, tiles_m * bm, d_pad), jnp.float32),
                    jax.ShapeDtypeStruct((kh, slots, tiles_m * bm), jnp.float32)]
  # The partial slots of one (row tile, kv head), for grids (row tiles, ..., K) and
  # (row tiles, B * K).
  o_slots = lambda mi, k: (k, 0, mi, 0)  # noqa: E731
  lse_slots = lambda mi, k: (k, 0, mi)  # noqa: E731
  lengths_spec = pl.BlockSpec(lengths.shape, lambda *_: (0,))
  o, lse = pl.pallas_call(
      functools.partial(_split_kernel, p=kp),
      grid=(tiles_m, programs, kh),
      in_specs=[lengths_spec,
                pl.BlockSpec((b, tq, None, g, d), lambda mi, i, k: (0, 0, k, 0, 0)),
                kv_spec, kv_spec, pt_spec, _descale_spec(kv_descale)],
      out_specs=[pl.BlockSpec((None, slots, bm, d_pad), lambda mi, i, k: o_slots(mi, k)),
                 pl.BlockSpec((None, slots, bm), lambda mi, i, k: lse_slots(mi, k))],
      out_shape=partial_shapes,
      compiler_params=_compiler_params(config),
      interpret=interpret,
      name="pallas_flash_decode",
  )(lengths, q, key_cache, value_cache, page_table, kv_descale)
  return merge_partials(q, lengths, o, lse, kp=kp, interpret=interpret)


def merge_partials(q, lengths, o, lse, *, kp: _KernelParams, interpret: bool):
  """_merge_kernel over the partials of balanced runs: o [K, B + N - 1, row tiles * block_m,
  D_pad] and lse [K, B + N - 1, row tiles * block_m] float32, program i's share of sequence b
  in slot i + b (N = params.programs runs of the partition kp's block_kv and rows give) ->
  out [B, Tq, K, G, D] in q's dtype and lse [B, K, G, Tq]. q: the [B, Tq, K, G, D] query
  (its shape and dtype). Also the Mosaic decode kernel's merge (decode/mosaic.py)."""
  b, tq, kh, g, d = q.shape
  bm = kp.block_m
  tiles_m = -(-kp.rows // bm)
  slots, d_pad = o.shape[1], o.shape[3]
  rows = merge_rows(kp.rows, bm)  # with one row tile, mi = 0 and block 0 is its real rows
  o_slots = lambda mi, k: (k, 0, mi, 0)  # noqa: E731
  lse_slots = lambda mi, k: (k, 0, mi)  # noqa: E731
  lengths_spec = pl.BlockSpec(lengths.shape, lambda *_: (0,))
  return pl.pallas_call(
      functools.partial(_merge_kernel, p=kp, rows=rows,
                        chunk=merge_chunk(slots, rows, d_pad)),
      grid=(tiles_m, b * kh),
      in_specs=[lengths_spec,
                pl.BlockSpec((None, slots, rows, d_pad), lambda mi, bh: o_slots(mi, bh % kh)),
                pl.BlockSpec((None, slots, rows), lambda mi, bh: lse_slots(mi, bh % kh))],
      out_specs=_final_specs(kh, tq, g, d),
      out_shape=_final_shapes(q),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret,
      name="pallas_flash_decode_merge",
  )(lengths, o, lse)


__all__ = ["CONFIG_TYPE", "attend", "config_for", "tiles", "unsupported_reason"]
