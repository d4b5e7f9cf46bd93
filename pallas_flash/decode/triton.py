"""Split-KV decode attention as a Triton-lowered Pallas kernel (GPU; interpretable on CPU).

One program owns `block_m` GQA-packed query rows of one (sequence, kv head) (all G heads of the
kv head and all Tq tokens: M = Tq * G rows, padded to 16) and one of S splits of that sequence's
key range; it streams `block_kv`-key tiles of K and V once for all its rows, so the cache is read
once per kv head, not once per query head. Key rows are gathered by index: a contiguous cache
reads rows start .. start + block_kv, a paged one looks each row's page up in the page table, so
a tile may span pages of any size in any order. Tiles wholly visible to every row run without
masks; the ones at the sequence's end (and at the window's start) mask scores and load zeros
past the length, so stale or NaN cache slots never reach the output.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_flash.call import MASK_VALUE
from pallas_flash.decode import config as decode_config
from pallas_flash.decode.call import DecodeInfo, DecodeParams
from pallas_flash.decode.config import TritonDecodeConfig
from pallas_flash.triton import common

CONFIG_TYPE = TritonDecodeConfig
MAX_HEAD_DIM = 256


def unsupported_reason(info: DecodeInfo, config: TritonDecodeConfig | None, *,
                       interpret: bool) -> str | None:
  del config
  if info.head_dim > MAX_HEAD_DIM:
    return f"head_dim {info.head_dim} > {MAX_HEAD_DIM} is not supported by the Triton kernel"
  if interpret:
    return None
  if info.platform != "gpu":
    return f"needs an NVIDIA GPU (platform is {info.platform!r}); 'interpret' runs it anywhere"
  if info.compute_capability is not None and info.compute_capability < (8, 0):
    return f"needs compute capability >= 8.0 (Ampere), this GPU is {info.compute_capability}"
  return None


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


def tiles(config: TritonDecodeConfig) -> tuple[int, int]:
  """(block_m, block_kv) of a resolved config."""
  return config.block_m, config.block_kv


@dataclasses.dataclass(frozen=True, kw_only=True)
class _KernelParams:
  """Static facts of the kernel body."""

  params: DecodeParams
  num_kv_heads: int
  head_dim: int  # D of the cache (columns past it are masked)
  block_m: int
  block_kv: int
  capacity: int  # L: n_b is clamped to [0, L]
  num_pages: int | None
  max_pages: int | None
  approx_tanh: bool

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


def _col_index(cols, p: _KernelParams):
  """(column indices to address D features with, their mask or None).

  The index stays a bare iota whenever D is a power of two: Triton vectorises an access only
  along an axis it can prove contiguous, and a clamp (jnp.minimum) would hide that.
  """
  if p.head_dim == cols.shape[0]:
    return cols, None
  return jnp.minimum(cols, p.head_dim - 1), (cols < p.head_dim)[None, :]


def _and(a, b):
  return b if a is None else a if b is None else a & b


def _load_rows(ref, rows, cols, row_ok, p: _KernelParams):
  """ref[rows, cols] as [block_kv, D_pad], zeros where a row is not in the cache. Padding
  columns (D not a power of two) repeat column D - 1: the query's padding columns are zero,
  so scores ignore them, and outputs there equal column D - 1's (see _store_rows)."""
  cols, _ = _col_index(cols, p)
  view = ref.at[rows[:, None], cols[None, :]]
  return view[...] if row_ok is None else pltriton.load(view, mask=row_ok[:, None], other=0)


def _tile_rows(row0, p: _KernelParams):
  """GQA-packed rows row0 .. row0 + block_m - 1: (token t, head g of the kv head's group),
  row r being token r // G, head r % G.

  Padding rows (r >= M) repeat the last real row, so they compute and write exactly its
  values: stores stay correct wherever masked-off lanes do write (the interpreter's scatter).
  """
  real = jnp.minimum(row0 + lax.broadcasted_iota(jnp.int32, (p.block_m,), 0), p.rows - 1)
  return real // p.params.group, real % p.params.group


def _load_q(q_ref, t, g, cols, p: _KernelParams):
  """The tile's query rows [block_m, D_pad] from q_ref [Tq, G, D] (zeros past D)."""
  cols, col_ok = _col_index(cols, p)
  view = q_ref.at[t[:, None], g[:, None], cols[None, :]]
  return view[...] if col_ok is None else pltriton.load(view, mask=col_ok, other=0)


def _store_rows(o_ref, lse_ref, o, lse, t, g, cols, p: _KernelParams):
  """Writes a tile's rows into o_ref [Tq, G, D] and lse_ref [G, Tq]: the output's
  [B, Tq, H, D] and [B, H, Tq] layouts, seen per (sequence, kv head).

  Unmasked: padding rows and columns address the last real row / column and hold exactly its
  values, so their writes repeat it (a masked store would be as cheap on a GPU, but the
  interpreter's masked scatter writes stale values for masked-off duplicates).
  """
  cols, _ = _col_index(cols, p)
  o_ref[t[:, None], g[:, None], cols[None, :]] = o.astype(o_ref.dtype)
  lse_ref[g, t] = lse


def _decode_kernel(lengths_ref, q_ref, k_ref, v_ref, pt_ref, o_ref, lse_ref, *,
                   p: _KernelParams):
  """One row tile of one (sequence, kv head) against one split of its keys.

  Refs after BlockSpec slicing: lengths_ref [B] int32 (cache_seqlens as passed: n_b follows
  as in call.sequence_lengths); q_ref [Tq, G, D] (this sequence's query heads of this kv head);
  k_ref / v_ref [L, D] (this sequence and kv head of a contiguous cache) or [P * page_size, D]
  (this kv head of the pool); pt_ref [max_pages] int32 (this sequence's page table, None
  when contiguous). With one split, o_ref [Tq, G, D] and lse_ref [G, Tq] are the final outputs
  (query dtype; float32); with S splits, o_ref [block_m, D_pad] and lse_ref [block_m] are this
  split's float32 partials, normalised over its keys (_merge_kernel combines them).
  Grid: (row tiles, S splits, B * K).
  """
  mi, si, bh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  prm, bm, bk = p.params, p.block_m, p.block_kv
  n = jnp.clip(lengths_ref[bh // p.num_kv_heads], 0, p.capacity)  # call.sequence_lengths
  if prm.appends:
    n = jnp.minimum(n + prm.q_len, p.capacity)
  row0 = mi * bm
  t, g = _tile_rows(row0, p)
  q_pos = n - prm.q_len + t
  t_first = row0 // prm.group
  t_last = jnp.minimum((row0 + bm - 1) // prm.group, prm.q_len - 1)
  # Keys the tile's real rows see: [lo, hi); blocks of them split into S runs.
  hi = jnp.maximum(n - prm.q_len + t_last + 1, 0)
  lo = 0 if prm.window is None else jnp.maximum(n - prm.q_len + t_first - prm.window, 0)
  blk_lo = lo // bk
  blk_hi = jnp.maximum((hi + bk - 1) // bk, blk_lo)
  per = (blk_hi - blk_lo + prm.num_splits - 1) // prm.num_splits
  start = jnp.minimum(blk_lo + si * per, blk_hi)
  end = jnp.minimum(start + per, blk_hi)
  # Blocks every row of the tile sees whole: below the first row's position, and (window)
  # at or above the last row's window start. The rest is masked.
  full_hi = jnp.maximum(n - prm.q_len + t_first + 1, 0) // bk
  full_lo = 0
  if prm.window is not None:
    full_lo = (jnp.maximum(n - prm.q_len + t_last - prm.window, 0) + bk - 1) // bk
  mid_lo = jnp.clip(full_lo, start, end)
  mid_hi = jnp.clip(full_hi, mid_lo, end)
  d_pad = common.padded_head_dim(p.head_dim)
  cols = lax.broadcasted_iota(jnp.int32, (d_pad,), 0)
  q = _load_q(q_ref, t, g, cols, p)  # [block_m, D_pad]

  def step(j, carry, *, masked: bool):
    m_prev, l_prev, acc = carry
    keys = j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
    in_cache = keys < n if masked else None
    rows = jnp.where(in_cache, keys, 0) if masked else keys
    if prm.page_size is not None:
      slot = jnp.minimum(rows // prm.page_size, p.max_pages - 1)
      page = jnp.clip(pt_ref[slot], 0, p.num_pages - 1)
      rows = page * prm.page_size + rows % prm.page_size
    k = _load_rows(k_ref, rows, cols, in_cache, p)
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
    v = _load_rows(v_ref, rows, cols, in_cache, p)
    acc = alpha[:, None] * acc + common.dot(probs.astype(v.dtype), v)
    return m_next, alpha * l_prev + probs.sum(axis=1), acc

  carry = (jnp.full((bm,), MASK_VALUE, jnp.float32), jnp.zeros((bm,), jnp.float32),
           jnp.zeros((bm, d_pad), jnp.float32))
  carry = lax.fori_loop(start, mid_lo, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(mid_lo, mid_hi, functools.partial(step, masked=False), carry)
  m, l, acc = lax.fori_loop(mid_hi, end, functools.partial(step, masked=True), carry)
  empty = l == 0.0  # an empty split (or a query that sees no key): o = 0, lse = -inf
  l_safe = jnp.where(empty, 1.0, l)
  o = acc * (1.0 / l_safe)[:, None]
  lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * common.LN2)
  if prm.num_splits == 1:
    _store_rows(o_ref, lse_ref, o, lse, t, g, cols, p)
  else:
    o_ref[...] = o
    lse_ref[...] = lse


def _merge_kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, p: _KernelParams):
  """Combines the S splits of one row tile (merge_attention_states' rule, one pass).

  Refs: o_ref [S, block_m, D_pad] and lse_ref [S, block_m] float32 partials; out_ref [Tq, G, D]
  and lse_out_ref [G, Tq] as the decode kernel's single-split outputs. Grid: (row tiles,
  B * K).
  """
  t, g = _tile_rows(pl.program_id(0) * p.block_m, p)
  cols = lax.broadcasted_iota(jnp.int32, (o_ref.shape[-1],), 0)

  def body(s, carry):
    m_prev, total, acc = carry
    lse = lse_ref[s]
    empty = lse == -jnp.inf
    m_next = jnp.maximum(m_prev, jnp.where(empty, MASK_VALUE, lse))
    alpha = jnp.exp(m_prev - m_next)
    w = jnp.where(empty, 0.0, jnp.exp(lse - m_next))  # an empty split weighs nothing
    return m_next, alpha * total + w, alpha[:, None] * acc + w[:, None] * o_ref[s]

  bm = p.block_m
  m, total, acc = lax.fori_loop(0, p.params.num_splits, body, (
      jnp.full((bm,), MASK_VALUE, jnp.float32), jnp.zeros((bm,), jnp.float32),
      jnp.zeros((bm, o_ref.shape[-1]), jnp.float32)))
  empty = total == 0.0
  safe = jnp.where(empty, 1.0, total)
  _store_rows(out_ref, lse_out_ref, acc * (1.0 / safe)[:, None],
              jnp.where(empty, -jnp.inf, m + jnp.log(safe)), t, g, cols, p)


def attend(q, key_cache, value_cache, lengths, page_table, *, params: DecodeParams,
           config: TritonDecodeConfig, interpret: bool):
  """Split-KV decode attention; the contract is in pallas_flash.decode.call. `config` is
  resolved (config_for). One kernel when there is one split; with S splits the decode kernel
  writes float32 partials and _merge_kernel combines them into the final layout."""
  b, tq, h, d = q.shape
  kh = key_cache.shape[2]
  g = h // kh
  bm, bk = tiles(config)
  d_pad = common.padded_head_dim(d)
  m_pad = -(-tq * g // bm) * bm
  paged = params.page_size is not None
  if paged:
    num_pages, max_pages = key_cache.shape[0], page_table.shape[1]
    capacity = max_pages * params.page_size
    key_cache = key_cache.reshape(-1, kh, d)  # [P * page_size, K, D]: a free view of the pool
    value_cache = value_cache.reshape(-1, kh, d)
    kv_spec = pl.BlockSpec((key_cache.shape[0], None, d), lambda mi, si, bh: (0, bh % kh, 0))
    pt_spec = pl.BlockSpec((None, page_table.shape[1]), lambda mi, si, bh: (bh // kh, 0))
  else:
    num_pages = max_pages = None
    capacity = key_cache.shape[1]
    kv_spec = pl.BlockSpec((None, capacity, None, d),
                           lambda mi, si, bh: (bh // kh, 0, bh % kh, 0))
    pt_spec = None
  kp = _KernelParams(params=params, num_kv_heads=kh, head_dim=d, block_m=bm, block_kv=bk,
                     capacity=capacity, num_pages=num_pages, max_pages=max_pages,
                     approx_tanh=not interpret and jnp.dtype(q.dtype).itemsize == 2)
  s_num = params.num_splits
  q = q.reshape(b, tq, kh, g, d)  # free views: the kernels address rows (t, g) directly
  # Per (sequence, kv head): q / out [Tq, G, D], lse [G, Tq] (index maps for grids whose last
  # axis is B * K).
  slab = lambda *_, bh: (bh // kh, 0, bh % kh, 0, 0)  # noqa: E731
  lse_slab = lambda *_, bh: (bh // kh, bh % kh, 0, 0)  # noqa: E731
  out_shapes = [jax.ShapeDtypeStruct((b, tq, kh, g, d), q.dtype),
                jax.ShapeDtypeStruct((b, kh, g, tq), jnp.float32)]
  final_specs = [pl.BlockSpec((None, tq, None, g, d), lambda mi, si, bh: slab(bh=bh)),
                 pl.BlockSpec((None, None, g, tq), lambda mi, si, bh: lse_slab(bh=bh))]
  if s_num == 1:
    out_specs, partial_shapes = final_specs, out_shapes
  else:
    out_specs = [pl.BlockSpec((None, None, None, bm, d_pad),
                              lambda mi, si, bh: (si, bh // kh, bh % kh, mi, 0)),
                 pl.BlockSpec((None, None, None, bm), lambda mi, si, bh: (si, bh // kh, bh % kh,
                                                                          mi))]
    partial_shapes = [jax.ShapeDtypeStruct((s_num, b, kh, m_pad, d_pad), jnp.float32),
                      jax.ShapeDtypeStruct((s_num, b, kh, m_pad), jnp.float32)]
  o, lse = pl.pallas_call(
      functools.partial(_decode_kernel, p=kp),
      grid=(m_pad // bm, s_num, b * kh),
      in_specs=[pl.BlockSpec(lengths.shape, lambda *_: (0,)),
                pl.BlockSpec((None, tq, None, g, d), lambda mi, si, bh: slab(bh=bh)),
                kv_spec, kv_spec, pt_spec],
      out_specs=out_specs,
      out_shape=partial_shapes,
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      name="pallas_flash_decode",
  )(lengths, q, key_cache, value_cache, page_table)
  if s_num > 1:
    o, lse = pl.pallas_call(
        functools.partial(_merge_kernel, p=kp),
        grid=(m_pad // bm, b * kh),
        in_specs=[pl.BlockSpec((s_num, None, None, bm, d_pad),
                               lambda mi, bh: (0, bh // kh, bh % kh, mi, 0)),
                  pl.BlockSpec((s_num, None, None, bm), lambda mi, bh: (0, bh // kh, bh % kh,
                                                                        mi))],
        out_specs=[pl.BlockSpec((None, tq, None, g, d), lambda mi, bh: slab(bh=bh)),
                   pl.BlockSpec((None, None, g, tq), lambda mi, bh: lse_slab(bh=bh))],
        out_shape=out_shapes,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="pallas_flash_decode_merge",
    )(o, lse)
  return o.reshape(b, tq, h, d), lse.reshape(b, h, tq)


__all__ = ["CONFIG_TYPE", "attend", "config_for", "tiles", "unsupported_reason"]
