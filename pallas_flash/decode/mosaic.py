"""Split-KV decode attention as a Mosaic GPU (Hopper, sm_90) kernel: TMA-fed K/V ring, wgmma.

One CTA owns the M = Tq * G GQA-packed query rows of one kv head, padded to 64 (one wgmma
tile: row r is token r // G of query head k * G + r % G), and one of N balanced runs
of the batch's key blocks (decode/config.py's `balanced_partition`, the same runs as the
Triton kernel's `_split_kernel`). It has two warpgroups (FA3's warp specialisation). The
producer walks the run's (sequence, key block) pairs and TMA-loads their `block_kv`-key K and
V tiles into a ring of `num_stages` shared memory slots, refilling a slot as soon as the
consumer released it, across sequence boundaries: a run that touches several sequences keeps
the ring full instead of draining and refilling it per sequence. The consumer, for each
sequence its run touches (a piece), takes the query tile (its TMA load issued as the previous
piece's last matmul retired), and per tile waits for it, scores it (S = Q·Kᵀ, SMEM
operands), soft-maxes online in registers, accumulates (O += P·V, P from registers; in
interpret mode P is staged through shared memory) and releases the slot once both matmuls
retired. Both warpgroups derive the pieces' blocks from the same table entries, so they walk
the same pairs. Tiles that every row sees whole run without masks; the ones at the
sequence's end (and at the window's start) mask scores, and zero the V rows past the length
in shared memory first, so stale or NaN slots never reach the output (0 · NaN). Each (run,
sequence) piece, an empty one too, writes a float32 partial (o, lse) to slot run + b, and
the Triton merge kernel (decode/triton.py's `merge_partials`) combines each sequence's
slots, with one split too (N = B runs).

Before the Mosaic kernel, one Triton program per (sequence, kv head) packs the query tiles;
the first also writes the runs' table (each sequence's length, first visible block, block
count and start in the concatenation; each run's first and last sequence) from the B lengths:
a call is three launches (_prepare_kernel, _decode_kernel, the merge). Paged caches are read
page by page: a tile of block_kv keys is one TMA copy when pages hold at least block_kv keys
(a tile is then part of one page), else block_kv / page_size copies, one per page, completing
on the same barrier.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

from pallas_flash.call import MASK_VALUE
from pallas_flash.decode import config as decode_config
from pallas_flash.decode import triton as decode_triton
from pallas_flash.decode.call import DecodeInfo, DecodeParams, cache_layout
from pallas_flash.decode.config import MosaicDecodeConfig
from pallas_flash.mosaic_gpu.sm90 import common

CONFIG_TYPE = MosaicDecodeConfig
ROWS = 64  # query rows of a CTA: one wgmma M tile
HEAD_DIMS = (64, 128)
# Shared memory of one CTA at most (an H100 / H200's 227 KiB per block, less barriers).
SMEM_BUDGET = 227 * 1024 - 1024
LN2 = math.log(2.0)
O_COLS = 64  # columns of the float32 o staging buffer
# setmaxnreg of the two warpgroups (the kernel starts at 240 per thread). The consumer holds
# the scores, O and the softmax statistics; the producer computes page addresses and issues
# the TMA copies: 80 is the least at which ptxas spills nothing with pages of 16 at D = 128
# (40 to 72 spill 8 bytes a tile there). With one consumer the register file is not short.
CONSUMER_REGISTERS = 240
PRODUCER_REGISTERS = 80


def _smem_bytes(d: int, block_kv: int, stages: int, itemsize: int) -> int:
  """Q, the K/V ring, the float32 o and lse staging (P's staging only in interpret mode)."""
  return (ROWS * d * itemsize + 2 * stages * block_kv * d * itemsize + ROWS * O_COLS * 4
          + ROWS * 4)


def _default_stages(info: DecodeInfo, block_kv: int) -> int:
  """As many ring stages as fit, at most 4: with 128-key tiles 4 at D = 64 (128 KiB of K/V)
  and 3 at D = 128 (192 KiB); first guesses, not yet measured on the GPU."""
  itemsize = jnp.dtype(info.dtype).itemsize
  return next((s for s in (4, 3) if _smem_bytes(info.head_dim, block_kv, s, itemsize)
               <= SMEM_BUDGET), 2)


def config_for(info: DecodeInfo, config: MosaicDecodeConfig | None) -> MosaicDecodeConfig:
  """`config`'s fields, defaults where None: 128-key tiles (the Triton kernel's, so that both
  get the same runs), 64 where the cache's capacity holds no whole number of them;
  _default_stages."""
  given = config or MosaicDecodeConfig()
  block_kv = given.block_kv or (128 if info.capacity % 128 == 0 else 64)
  return dataclasses.replace(given, block_kv=block_kv,
                             num_stages=given.num_stages or _default_stages(info, block_kv))


def _call_smem_bytes(info: DecodeInfo, config: MosaicDecodeConfig) -> int:
  """_smem_bytes of a call at a resolved config."""
  return _smem_bytes(info.head_dim, config.block_kv, config.num_stages,
                     jnp.dtype(info.dtype).itemsize)


def programs_per_sm(info: DecodeInfo, config: MosaicDecodeConfig) -> int:
  """The kernel's CTAs that fit one SM's shared memory, 1 KiB of it reserved per CTA (one at
  the default stages)."""
  return max(1, decode_triton.SM_SHARED_BYTES // (_call_smem_bytes(info, config) + 1024))


def tiles(config: MosaicDecodeConfig) -> tuple[int, int]:
  """(block_m, block_kv) of a resolved config: all M <= 64 rows at once."""
  return ROWS, config.block_kv


def unsupported_reason(info: DecodeInfo, config: MosaicDecodeConfig | None) -> str | None:
  interpret = config is not None and config.interpret
  if not interpret:
    if info.platform != "gpu":
      return (f"the Mosaic decode kernel needs an NVIDIA GPU (platform is {info.platform!r}); "
              "MosaicDecodeConfig(interpret=True) runs it in the interpreter anywhere")
    if info.compute_capability not in (None, (9, 0)):
      cc = info.compute_capability
      return f"the Mosaic decode kernel is for Hopper (sm_90); this GPU is sm_{cc[0]}{cc[1]}"
  if info.fp8_cache:
    return "an FP8 cache: the Mosaic decode kernel reads caches in the query's dtype only"
  if info.rows > ROWS:
    return (f"Tq * G = {info.rows} query rows per kv head > {ROWS} (one wgmma tile); the "
            "Triton kernel tiles more rows")
  if info.head_dim not in HEAD_DIMS:
    return f"head_dim {info.head_dim} is not one of the Mosaic decode kernel's {HEAD_DIMS}"
  if jnp.dtype(info.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(info.dtype).name}: the Mosaic decode kernel takes bf16 or f16"
  resolved = config_for(info, config)
  bk = resolved.block_kv
  if info.capacity % bk:
    return (f"cache capacity {info.capacity} is not a multiple of block_kv {bk} (TMA tiles "
            "must lie inside the cache)")
  if info.paged:
    ps = info.page_size
    if ps % 8 or not (ps % bk == 0 or bk % ps == 0):
      return (f"page_size {ps}: the Mosaic decode kernel takes page sizes that are multiples "
              f"of 8 and divide or are divided by block_kv {bk}")
  need = _call_smem_bytes(info, resolved)
  if need > SMEM_BUDGET:
    return (f"block_kv {bk} x {resolved.num_stages} stages need {need} B of shared memory "
            f"> {SMEM_BUDGET}")
  return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class _KernelParams:
  """Static facts of the kernel body."""

  params: DecodeParams
  dtype: jnp.dtype
  head_dim: int
  block_kv: int
  stages: int
  batch: int
  programs: int  # N runs per kv head
  num_pages: int | None
  max_pages: int | None
  interpret: bool  # read by common.accumulate: P staged through SMEM instead of RS wgmma

  @property
  def c(self) -> float:
    """scale·log2(e): scores times c are in log2 units for exp2."""
    return self.params.scale * math.log2(math.e)

  @property
  def copies(self) -> int:
    """TMA copies per K (or V) tile: one, or one per page when pages are shorter."""
    ps = self.params.page_size
    return 1 if ps is None or ps >= self.block_kv else self.block_kv // ps


def _soft_cap(s, p: _KernelParams):
  """Raw scores through the soft cap c, kept in raw-score units: (c/scale)·tanh(s·scale/c)."""
  cap = p.params.logits_soft_cap
  if cap is None:
    return s
  return jnp.tanh(s * (p.params.scale / cap)) * (cap / p.params.scale)


def _tile_copies(refs, seq, kh, j, pt_ref, p: _KernelParams):
  """Per ref of `refs` (K, V), [(GMEM source, row offset in the tile)] of key block j of
  sequence `seq`, kv head kh; a paged tile's page ids are read once for both."""
  bk, ps = p.block_kv, p.params.page_size
  if ps is None:
    return [[(ref.at[seq, pl.ds(j * bk, bk), kh], None)] for ref in refs]

  def page(slot):  # the pool page of the sequence's page-table entry `slot`, clamped
    return jnp.clip(pt_ref[seq, slot], 0, p.num_pages - 1)

  if ps >= bk:
    key = j * bk
    pg = page(jnp.minimum(lax.div(key, ps), p.max_pages - 1))
    return [[(ref.at[pg, pl.ds(lax.rem(key, ps), bk), kh], None)] for ref in refs]
  # The tile's pages are consecutive table entries (one base address for their loads).
  first = jnp.minimum(j * p.copies, p.max_pages - p.copies)
  pages = [page(first + c) for c in range(p.copies)]
  return [[(ref.at[pg, pl.ds(0, ps), kh], c * ps) for c, pg in enumerate(pages)]
          for ref in refs]


class _Ring(NamedTuple):
  """The K/V ring: `stages` slots of block_kv keys each, with per slot a barrier that the TMA
  copies of its K (k_full) and V (v_full) tile complete, and one the consumer arrives on once
  both matmuls that read the slot retired (empty)."""

  k: Any
  v: Any
  k_full: Any
  v_full: Any
  empty: Any


def _piece_blocks(tab_ref, seq, run, per, p: _KernelParams):
  """(n, lo, hi): sequence seq's length and the key blocks [lo, hi) of it that run `run`
  holds (lo == hi: none), from the table's entries, the same for both warpgroups."""
  n, blk_lo, count, start = (tab_ref[ROWS + k * p.batch + seq] for k in range(4))
  lo = blk_lo + jnp.clip(run * per - start, 0, count)
  hi = blk_lo + jnp.clip((run + 1) * per - start, 0, count)
  return n, lo, hi


def _decode_kernel(tab_ref, q_ref, k_ref, v_ref, *refs, p: _KernelParams):
  """One run of the batch's key blocks for one kv head. Grid (K, N), names ("k", "i"); two
  warpgroups ("wg"): the consumer (0) and the producer (1).

  tab_ref: the rows' token offsets and the runs' table (_prepare_kernel);
  q_ref [B, K, 64, D] (GQA-packed rows; padding rows repeat the last); k_ref / v_ref
  [B, L, K, D] or the pool [P, page_size, K, D] (then pt_ref [B, max_pages] follows); o_ref
  [K, B + N - 1, R, D] and lse_ref [K, B + N - 1, R] float32, the partial slots of the first
  R = _partial_rows(M) rows.
  """
  paged = p.params.page_size is not None
  pt_ref = refs[0] if paged else None
  refs = refs[1:] if paged else refs
  (o_ref, lse_ref, q_smem, k_ring, v_ring, p_smem, o_smem, lse_smem, q_bar, k_full, v_full,
   empty) = refs
  ring = _Ring(k_ring, v_ring, k_full, v_full, empty)
  kh, run, wg = lax.axis_index("k"), lax.axis_index("i"), lax.axis_index("wg")
  runs = ROWS + 4 * p.batch  # the table's run entries
  first, stop = tab_ref[runs + run], tab_ref[runs + p.programs + run]
  per = tab_ref[runs + 2 * p.programs]
  pieces = functools.partial(_piece_blocks, tab_ref, run=run, per=per, p=p)

  @pl.when(wg == 0)
  def _consumer():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    _consume(q_ref, o_ref, lse_ref, tab_ref, q_smem, p_smem, o_smem, lse_smem, q_bar, ring,
             pieces, kh=kh, run=run, first=first, stop=stop, p=p)

  @pl.when(wg == 1)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    _produce(k_ref, v_ref, pt_ref, ring, pieces, kh=kh, first=first, stop=stop, p=p)


def _produce(k_ref, v_ref, pt_ref, ring: _Ring, pieces, *, kh, first, stop, p: _KernelParams):
  """The producer warpgroup: walks the run's (sequence, key block) pairs in the consumer's
  order and TMA-loads the g-th pair's K and V tiles into slot g % stages once the consumer
  released the pair `stages` before it, so the ring stays full across sequence boundaries."""
  stages = p.stages

  def piece(seq, g):
    _, lo, hi = pieces(seq)

    def tile(j, g):
      slot = lax.rem(g, stages)
      pl.when(g >= stages)(lambda: plgpu.barrier_wait(ring.empty.at[slot]))
      copies = _tile_copies((k_ref, v_ref), seq, kh, j, pt_ref, p)
      for srcs, buf, full in zip(copies, (ring.k, ring.v), (ring.k_full, ring.v_full)):
        for src, row in srcs:
          dst = buf.at[slot] if row is None else buf.at[slot, pl.ds(row, p.params.page_size)]
          plgpu.copy_gmem_to_smem(src, dst, full.at[slot])
      return g + 1

    return lax.fori_loop(lo, hi, tile, g)

  total = lax.fori_loop(first, stop, piece, 0)
  common.observe_last_releases([ring.empty], total, stages)


def _consume(q_ref, o_ref, lse_ref, tab_ref, q_smem, p_smem, o_smem, lse_smem, q_bar,
             ring: _Ring, pieces, *, kh, run, first, stop, p: _KernelParams):
  """The consumer warpgroup: per (run, sequence) piece, the query tile, the online softmax
  over the piece's key blocks as the producer delivers them, and the float32 partial."""
  prm, bk = p.params, p.block_kv
  tok = plgpu.load(tab_ref.at[pl.ds(0, ROWS)], layout=common.ROW, optimized=False)

  def load_q(seq):
    plgpu.copy_gmem_to_smem(q_ref.at[seq, kh], q_smem, q_bar)

  pl.when(first < stop)(functools.partial(load_q, first))

  def piece(seq, g0):
    n, lo, hi = pieces(seq)
    plgpu.barrier_wait(q_bar)
    q_pos = tok + n  # [64] ROW: each row's query position
    step = functools.partial(_step, q_smem, p_smem, ring, q_pos=q_pos, n=n, g0=g0 - lo, p=p)
    # Blocks that every row sees whole: below the first token's position and, with a
    # window, at or above the last token's window start. The rest is masked.
    full_hi = jnp.maximum(n - prm.q_len + 1, 0) // bk
    full_lo = 0
    if prm.window is not None:
      full_lo = (jnp.maximum(n - 1 - prm.window, 0) + bk - 1) // bk
    mid_lo = jnp.clip(full_lo, lo, hi)
    mid_hi = jnp.clip(full_hi, mid_lo, hi)
    carry = (plgpu.layout_cast(jnp.zeros((ROWS, p.head_dim), jnp.float32), plgpu.Layout.WGMMA),
             plgpu.layout_cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32), common.ROW),
             plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), common.ROW))
    carry = lax.fori_loop(lo, mid_lo, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(mid_lo, mid_hi, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(mid_hi, hi, functools.partial(step, masked=True), carry)
    # Every Q·Kᵀ of the piece retired (its scores are in registers): the next piece's query
    # lands in q_smem while this one's partial is written.
    pl.when(seq + 1 < stop)(functools.partial(load_q, seq + 1))
    _write_partial(*carry, o_smem, lse_smem, o_ref.at[kh, run + seq], lse_ref.at[kh, run + seq],
                   p)
    return g0 + hi - lo

  lax.fori_loop(first, stop, piece, 0)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _step(q_smem, p_smem, ring: _Ring, j, carry, *, q_pos, n, g0, masked: bool,
          p: _KernelParams):
  """Key block j of a piece, the run's (g0 + j)-th tile (fori_loop body; carry (acc [64, D],
  m [64], l [64]), FA2 Alg. 1 in log2 units)."""
  prm, bk, d = p.params, p.block_kv, p.head_dim
  acc, m, l = carry
  slot = lax.rem(g0 + j, p.stages)
  plgpu.barrier_wait(ring.k_full.at[slot])
  s = common.smem_matmul(q_smem, ring.k.at[slot].T, (ROWS, bk))  # [64, block_kv]
  s = _soft_cap(s, p)  # before the mask: a hidden score must stay -inf
  if masked:
    keys = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 1, layout=plgpu.Layout.WGMMA) + j * bk
    pos = lax.broadcast_in_dim(q_pos, (ROWS, bk), [0])
    visible = keys <= pos
    if prm.window is not None:
      visible &= keys >= pos - prm.window
    s = jnp.where(visible, s, -jnp.inf)
  # m starts at the finite MASK_VALUE, so -inf scores give 0.
  probs, m_new, l, alpha = common.online_softmax(s, m, l, p.c)
  probs = probs.astype(p.dtype)
  acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
  plgpu.barrier_wait(ring.v_full.at[slot])
  if masked:
    # Slots past the length may hold NaN or inf: P is 0 there, but 0 * NaN is not. The tile
    # is zeroed there 64 rows at a time (a whole 128-row tile in registers spills); the
    # producer refills the slot only after this step released it.
    @pl.when((j + 1) * bk > n)
    def _():
      for r0 in range(0, bk, ROWS):
        chunk = ring.v.at[slot, pl.ds(r0, ROWS)]
        v = plgpu.load(chunk, layout=plgpu.Layout.WGMMA)
        rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, d), 0, layout=plgpu.Layout.WGMMA)
        chunk[...] = jnp.where(rows + (j * bk + r0) < n, v, jnp.zeros_like(v))
      plgpu.commit_smem()  # the generic-proxy writes, before the wgmma reads the tile
  acc = common.accumulate(acc, probs, p_smem, ring.v.at[slot], p)
  # Both matmuls that read the slot retired (their results are in registers): release it.
  plgpu.barrier_arrive(ring.empty.at[slot])
  return acc, m_new, l


def _write_partial(acc, m, l, o_smem, lse_smem, o_dst, lse_dst, p: _KernelParams):
  """Normalises a piece's (acc, m, l) and TMA-stores it to its partial slot: o_dst [R, D],
  lse_dst [R] (natural log). An empty share, or a row that sees none of its keys, gives
  o = 0, lse = -inf."""
  empty = l == 0.0
  safe = jnp.where(empty, 1.0, l)
  o = acc * lax.broadcast_in_dim(1.0 / safe, acc.shape, [0])
  # Only the partial's first R rows (M rounded up to a power of two >= 16) are written: the
  # merge reads no padding row past them. o leaves through a float32 buffer of O_COLS
  # columns, one column block at a time (a whole [64, 128] float32 tile would cost the ring
  # a stage at D = 128).
  prows = pl.ds(0, o_dst.shape[0])
  for c0 in range(0, p.head_dim, O_COLS):
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last stores have read o_smem
    o_smem[...] = o[:, c0:c0 + O_COLS]
    if c0 == 0:
      lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(safe)) * LN2)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[prows], o_dst.at[:, pl.ds(c0, O_COLS)],
                            commit_group=False)
    if c0 == 0:
      plgpu.copy_smem_to_gmem(lse_smem.at[prows], lse_dst, commit_group=False)
    plgpu.commit_smem_to_gmem_group()


def _partial_rows(rows: int) -> int:
  """Rows of a partial slot: M rounded up to a power of two, at least 16 (the merge kernel's
  Triton tiles), at most the CTA's 64. Padding rows repeat the last real row."""
  return min(ROWS, max(16, 1 << (rows - 1).bit_length()))


# Runs per step of _prepare_kernel's run table: [RUN_CHUNK, B] comparisons at a time.
RUN_CHUNK = 32


def table_size(batch: int, programs: int) -> int:
  return ROWS + 4 * batch + 2 * programs + 1


def _prepare_kernel(lengths_ref, q_ref, tab_ref, qp_ref, *, p: decode_triton._KernelParams,
                    programs: int):
  """The Mosaic kernel's inputs, in one Triton launch. Grid (B * K,).

  Program i packs the query rows of (sequence i // K, kv head i % K), q_ref [Tq, G, D], into
  qp_ref [64, D] (row r: token r // G, head r % G; padding rows repeat the last real row, so
  that they compute its values: the merge kernel writes them onto it). Program 0 also writes
  the table tab_ref, int32: at r < 64 row r's token offset t(r) - Tq (its query position is
  n_b plus it); then per sequence b, at 64 + b, 64 + B + b, 64 + 2B + b and 64 + 3B + b, n_b,
  its first visible block, its visible blocks and their start in the concatenation; per run
  i, at 64 + 4B + i and 64 + 4B + N + i, the first and stop sequence it touches; last, the
  blocks per run. The partition is decode_config's, on the counts the merge kernel recomputes
  from the same lengths (`_sequence_blocks`).
  """
  t, g = decode_triton._tile_rows(0, p)
  cols = lax.broadcasted_iota(jnp.int32, (p.head_dim,), 0)
  qp_ref[...] = decode_triton._load_q(q_ref, t, g, cols, p)

  @pl.when(pl.program_id(0) == 0)
  def _():
    tab_ref[lax.broadcasted_iota(jnp.int32, (ROWS,), 0)] = t - p.params.q_len
    b = p.batch
    idx = lax.broadcasted_iota(jnp.int32, (1 << (b - 1).bit_length(),), 0)
    real = idx < b
    seqlens = pltriton.load(lengths_ref.at[jnp.minimum(idx, b - 1)], mask=real, other=0)
    n = decode_triton._tokens_held(seqlens, p)
    blk_lo, blk_hi = decode_triton._visible_blocks(n, 0, p.params.q_len - 1, p)
    counts = jnp.where(real, blk_hi - blk_lo, 0)
    part = decode_config.balanced_partition(counts, programs)
    extents = part.extent(counts)
    # Padding lanes store lane B - 1's values at its index (the interpreter's scatter writes
    # masked-off duplicates too, so every lane writes, and duplicates agree).
    dst = jnp.minimum(idx, b - 1)
    for k, v in enumerate((n, jnp.zeros_like(n) + blk_lo, counts, part.starts)):
      tab_ref[ROWS + k * b + dst] = jnp.where(real, v, decode_triton._pick(v, b - 1))
    ends = jnp.where(real, part.starts + extents, jnp.iinfo(jnp.int32).max)[None, :]
    starts = jnp.where(real, part.starts, jnp.iinfo(jnp.int32).max)[None, :]
    total = jnp.sum(extents)
    runs = ROWS + 4 * b
    for c0 in range(0, programs, RUN_CHUNK):
      run = jnp.minimum(c0 + lax.broadcasted_iota(jnp.int32, (RUN_CHUNK,), 0), programs - 1)
      lo = run * part.per
      hi = jnp.minimum(lo + part.per, total)
      tab_ref[runs + run] = jnp.sum((ends <= lo[:, None]).astype(jnp.int32), axis=1)
      tab_ref[runs + programs + run] = jnp.sum((starts < hi[:, None]).astype(jnp.int32),
                                               axis=1)
    tab_ref[runs + 2 * programs] = part.per


def _prepare(q5, lengths, *, kp: decode_triton._KernelParams, programs: int, interpret: bool):
  """(the table [64 + 4B + 2N + 1] int32, the packed query [B, K, 64, D]): _prepare_kernel."""
  b, tq, kh, g, d = q5.shape
  size = table_size(b, programs)
  return pl.pallas_call(
      functools.partial(_prepare_kernel, p=kp, programs=programs),
      grid=(b * kh,),
      in_specs=[pl.BlockSpec(lengths.shape, lambda i: (0,)),
                pl.BlockSpec((None, tq, None, g, d), lambda i: (i // kh, 0, i % kh, 0, 0))],
      out_specs=[pl.BlockSpec((size,), lambda i: (0,)),
                 pl.BlockSpec((None, None, ROWS, d), lambda i: (i // kh, i % kh, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct((size,), jnp.int32),
                 jax.ShapeDtypeStruct((b, kh, ROWS, d), q5.dtype)],
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="pallas_flash_decode_prepare",
  )(lengths, q5)


def attend(q, key_cache, value_cache, lengths, page_table, *, params: DecodeParams,
           config: MosaicDecodeConfig, kv_descale=None):
  """Split-KV decode attention; the contract is in pallas_flash.decode.call. `config` is
  resolved (config_for): the Mosaic kernel writes float32 partials over N balanced runs
  (params.programs; B without runs), the Triton merge kernel combines them into the final
  layout."""
  assert kv_descale is None, "unsupported_reason refuses FP8 caches"
  b, tq, h, d = q.shape
  kh = key_cache.shape[2]
  g = h // kh
  rows = tq * g
  bk, stages = config.block_kv, config.num_stages
  paged = params.page_size is not None
  capacity, num_pages, max_pages = cache_layout(key_cache, page_table, params)
  programs = params.programs or b
  params = dataclasses.replace(params, programs=programs)  # the merge's partition too
  slots = b + programs - 1
  prows = _partial_rows(rows)
  merge_kp = decode_triton._KernelParams(
      params=params, batch=b, num_kv_heads=kh, head_dim=d, block_m=prows, block_kv=bk,
      capacity=capacity, num_pages=num_pages, max_pages=max_pages, approx_tanh=False)
  kp = _KernelParams(params=params, dtype=jnp.dtype(q.dtype), head_dim=d, block_kv=bk,
                     stages=stages, batch=b, programs=programs, num_pages=num_pages,
                     max_pages=max_pages, interpret=config.interpret)
  q5 = q.reshape(b, tq, kh, g, d)  # a free view
  table, packed = _prepare(q5, lengths, kp=dataclasses.replace(merge_kp, block_m=ROWS),
                           programs=programs, interpret=config.interpret)
  tiled = common.smem_transforms(q.dtype, d)
  scratch = [
      plgpu.SMEM((ROWS, d), q.dtype, transforms=tiled),
      plgpu.SMEM((stages, bk, d), q.dtype, transforms=tiled),
      plgpu.SMEM((stages, bk, d), q.dtype, transforms=tiled),
      plgpu.SMEM((ROWS, bk), q.dtype, transforms=tiled) if config.interpret else None,
      plgpu.SMEM((ROWS, O_COLS), jnp.float32, transforms=common.smem_transforms(jnp.float32)),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.Barrier(),  # the query tile
      # Per slot: its K and V tile landed (one arrival per TMA copy), the consumer released it.
      plgpu.Barrier(num_arrivals=kp.copies, num_barriers=stages),
      plgpu.Barrier(num_arrivals=kp.copies, num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
  ]
  inputs = (table, packed, key_cache, value_cache) + ((page_table,) if paged else ())
  o, lse = plgpu.kernel(
      functools.partial(_decode_kernel, p=kp),
      out_type=(jax.ShapeDtypeStruct((kh, slots, prows, d), jnp.float32),
                jax.ShapeDtypeStruct((kh, slots, prows), jnp.float32)),
      scratch_types=scratch,
      grid=(kh, programs), grid_names=("k", "i"), num_threads=2, thread_name="wg",
      compiler_params=common.compiler_params(),
      interpret=common.interpret_params(config.interpret),
      kernel_name="pallas_flash_decode_mosaic",
  )(*inputs)
  out, lse = decode_triton.merge_partials(q5, lengths, o, lse, kp=merge_kp,
                                          interpret=config.interpret)
  return out.reshape(b, tq, h, d), lse.reshape(b, h, tq)


__all__ = ["CONFIG_TYPE", "attend", "config_for", "tiles", "unsupported_reason"]
