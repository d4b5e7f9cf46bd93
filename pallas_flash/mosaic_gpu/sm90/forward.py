"""FlashAttention-3 style forward for Hopper as a Pallas Mosaic GPU kernel.

One CTA = 3 warpgroups. WG 2 is the producer: it TMA-loads K/V tiles into a `num_stages`-slot
shared-memory ring ("ready" mbarriers, refilled once both consumers arrived on "free"). WGs 0 and
1 each own `block_q` query rows and run S = Q·Kᵀ and O += P·V on the tensor cores (wgmma), with
the online softmax (FA2 Alg. 1) in registers between them. A two-party "schedule" barrier makes
the consumers alternate: one WG's softmax runs while the other WG's matmuls occupy the tensor
cores (FA3 §3.1 ping-pong).

With MosaicConfig.fwd_intra_wg_overlap each consumer also pipelines its own two matmuls (FA3
§3.2): S_{j+1} = Q·K_{j+1}ᵀ is issued together with O += P_j·V_j, and the softmax of S_{j+1} runs
while P_j·V_j is still on the tensor cores (`_overlapped_kv_loop`).

Causal: blocks above the diagonal are never loaded, only the blocks that cross the diagonal are
masked, and q tiles are launched heaviest first (reversed), so the last wave holds short tiles.

With MosaicConfig.fwd_persistent (non-causal, or a window alone) one CTA per SM loops over
the tiles instead (`_fwd_persistent_kernel`): the same warpgroups and kv loops, with the K/V
ring running on across tiles and Q double-buffered, so a tile's loads overlap the previous
tile's end.

With MosaicConfig.fwd_split_tail (non-causal grid kernel) the tiles of the last, partly filled
wave run as several CTAs each, every one streaming a share of the key blocks (split_tail.py);
their float32 partial (o, lse) are merged by `combine_tail`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_flash import _tiling
from pallas_flash.call import MASK_VALUE, AttentionParams, FeatureArrays
from pallas_flash.mosaic_gpu.config import SMEM_LIMIT_BYTES, MosaicConfig
from pallas_flash.mosaic_gpu.sm90 import block_mask, common, split_tail
from pallas_flash.mosaic_gpu.sm90 import dense as sm90_dense

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Steps per warpgroup that a profiled forward (MosaicConfig.profile_dir) records.
PROFILE_STEPS = 32


class _SplitRefs(NamedTuple):
  """A split-tail kernel's extra operands: o_part [parts total, 2, block_q, Dv] and lse_part
  [parts total, 2, block_q] float32 (GMEM), o32_scratch [2, block_q, Dv] float32 (SMEM)."""

  split: split_tail.TailSplit
  o_part: Any
  lse_part: Any
  o32_scratch: Any


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, q_scratch, k_scratch, v_scratch,
                lse_scratch, p_scratch, o_scratch, q_ready, k_ready, v_ready, k_free, v_free,
                sched, bias_tiles=None, bias_ready=None, *,
                kp: common.KernelParams, seg: common.SegmentRefs | None = None,
                tail: _SplitRefs | None = None, slopes=None, sinks=None,
                keys: common.DropoutKeys | None = None, dense=None,
                blk: block_mask.Refs | None = None):
  """q_ref [B, Tp, H, D], k_ref [B, Sp, K, D], v_ref [B, Sp, K, Dv] (GMEM), o_ref [B, Tp, H, Dv],
  lse_ref [B, H, Tp] (Dv = kp.dv: D but with MosaicConfig.native_value_head_dim).

  Grid (H, q tiles, B), or (q tiles, H, B) with kp.heads_fastest; q_scratch [2, block_q, D],
  k_scratch [stages, block_kv, D], v_scratch [stages, block_kv, Dv], lse_scratch [2, block_q],
  p_scratch [2, block_q, block_kv] (interpret mode only), o_scratch [2, block_q, Dv] (O's staging
  where Dv differs from D, else None: O leaves through the Q buffer). seg: segment ids of the rows
  (q) and keys, and per q tile the hull of key blocks that may share an id
  (_tiling.segment_block_limits): the CTA streams only those blocks, at least one, and compares ids
  on each except the run of blocks that lie wholly inside the tile's one document. tail (non-causal,
  no seg): a one-dimensional grid of tail.split.ctas CTAs in the same launch order, see
  split_tail.TailSplit. slopes: ALiBi's common.raw_alibi_slopes [H] (GMEM), or None. sinks: the
  attention sinks' sink_logits [H] (GMEM), added to each row's softmax by `_store_tile` (a split
  tail's parts leave them to combine_tail), or None. keys: dropout's row and column keys
  (common.dropout_keys), or None. dense: the dense bias and mask (dense.DenseRefs), or None. blk:
  the block mask's table of key blocks per q tile and its mask function's leaves (block_mask.Refs):
  the CTA streams the tile's listed blocks, at least one, and evaluates the function on the partial
  ones (listed first); q tiles are launched last one first, as causal ones. bias_tiles,
  bias_ready: a dense 16-bit bias's shared-memory ring (dense.BiasRing; `fwd_call`), or None:
  its tiles then come from GMEM.
  """
  bq, bkv, stages = kp.block_q, kp.block_kv, kp.stages
  wg = lax.axis_index("wg")
  is_part = part_row = None
  if tail is None:
    b, h, qt = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("qt")
  else:
    is_part, part_row, (b, h, qt) = tail.split.this_cta()
  if kp.causal or blk is not None:
    qt = kp.num_q_tiles - 1 - qt  # heaviest tiles first
  cta_q0, cta_steps, kv0, full = common.cta_kv_range(kp, seg, b, qt)
  if tail is not None:
    kv0, kv_end = tail.split.bounds(is_part, part_row, kp.num_kv_blocks)
    cta_steps = kv_end - kv0
  sparse = None
  if blk is not None:
    sparse = block_mask.sparse(blk, kp.block_mask, b, qt, min_steps=1)
    cta_steps = sparse.steps

  sched_sync = functools.partial(common.sync, sched)

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(kp.compute_registers, action="increase")
    q_smem, lse_smem = q_scratch.at[wg], lse_scratch.at[wg]
    q0 = cta_q0 + wg * bq
    steps = kp.kv_steps(q0 + bq)
    seg_ids = None
    if seg is not None:
      steps = jnp.clip(steps - kv0, 1, cta_steps)
      # A window alone compares no ids (its zero ids are one document), as in the backward's
      # windowed kernels (KernelParams.segment_ids).
      if kp.segment_ids:
        seg_ids = common.row_and_col_ids(seg, b, q0, bq, bkv)
    if tail is not None or sparse is not None:
      steps = cta_steps
    slope = None if slopes is None else slopes[h]  # one scalar load per CTA
    sink = None if sinks is None else sinks[h]
    row_term = None
    if slope is not None and common.alibi_drops_rows(kp):
      row_term = common.alibi_row_term(bq, slope, kp.c)
    drop = _dropout_rows(keys, b, h, q0, kp)
    with jax.named_scope("prologue"):
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], q_smem, q_ready.at[wg])
      plgpu.barrier_wait(q_ready.at[wg])
      plgpu.barrier_wait(k_ready.at[0])  # steps >= 1 always

    bars = common.KvBarriers(k_ready, v_ready, k_free, v_free, sched)
    pl.when(wg == 1)(sched_sync)
    loop = _overlapped_kv_loop if kp.intra_wg_overlap else _plain_kv_loop
    if seg is not None:
      loop = functools.partial(_plain_kv_loop, kv0=kv0, seg_ids=seg_ids, full=full)
    elif tail is not None:
      loop = functools.partial(loop, kv0=kv0)
    if sparse is not None:
      loop = functools.partial(loop, sparse=sparse)
    ring = None if bias_tiles is None else sm90_dense.BiasRing(bias_tiles, bias_ready, wg)
    if dense is not None:
      loop = functools.partial(loop, dense=functools.partial(sm90_dense.load, dense, b, h,
                                                             ring=ring))
    carry = loop(q_smem, k_scratch, v_scratch, p_scratch.at[wg] if kp.interpret else None,
                 bars, q0=q0, steps=steps, kp=kp,
                 slope=slope, **drop)
    if kp.causal or seg is not None:
      lax.fori_loop(steps, cta_steps,
                    functools.partial(common.idle_kv_step, bars=bars, stages=stages,
                                      ring=ring), None)
    pl.when(wg == 0)(sched_sync)

    with jax.named_scope("epilogue"):
      o_smem = q_smem if o_scratch is None else o_scratch.at[wg]
      store = functools.partial(_store_tile, *carry, o_smem, lse_smem,
                                o_ref.at[b, pl.ds(q0, bq), h], lse_ref.at[b, h, pl.ds(q0, bq)],
                                kp, sink=sink, row_term=row_term)
      if tail is None:
        store()
      else:
        pl.when(~is_part)(store)
        pl.when(is_part)(functools.partial(
            _store_tile, *carry, tail.o32_scratch.at[wg], lse_smem,
            tail.o_part.at[part_row, wg], tail.lse_part.at[part_row, wg], kp,
            row_term=row_term))
      # The kernel's end: only the copies' reads of shared memory need to finish here.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(kp.producer_registers, action="decrease")
    kvh = lax.div(h, kp.group)

    def kv_block(j):
      return sparse.block(j) if sparse is not None else _kv_block(j, kv0, cta_steps, kp)

    def fill_bias(j, slot):  # freed with V (read under the score matmul, before K is freed)
      if bias_tiles is not None:
        sm90_dense.fill_ring(dense, sm90_dense.BiasRing(bias_tiles, bias_ready), b, h,
                             cta_q0, kv_block(j) * bkv, slot, (bq, bkv))

    def load(j, slot):
      rows = (b, pl.ds(kv_block(j) * bkv, bkv), kvh)
      plgpu.copy_gmem_to_smem(k_ref.at[rows], k_scratch.at[slot], k_ready.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[rows], v_scratch.at[slot], v_ready.at[slot])
      fill_bias(j, slot)

    for i in range(stages):
      pl.when(i < cta_steps)(functools.partial(load, i, i))

    @pl.loop(stages, cta_steps)
    def _(j):
      slot = lax.rem(j, stages)
      rows = (b, pl.ds(kv_block(j) * bkv, bkv), kvh)
      with jax.named_scope("wait_free"):
        plgpu.barrier_wait(k_free.at[slot])
      plgpu.copy_gmem_to_smem(k_ref.at[rows], k_scratch.at[slot], k_ready.at[slot])
      with jax.named_scope("wait_free"):
        plgpu.barrier_wait(v_free.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[rows], v_scratch.at[slot], v_ready.at[slot])
      fill_bias(j, slot)

    common.observe_last_releases((k_free, v_free), cta_steps, stages)


def _store_tile(acc, m, l, o_smem, lse_smem, o_dst, lse_dst, kp: common.KernelParams, *,
                sink=None, row_term=None):
  """Normalises one WG's tile and starts its TMA stores: O = acc / l [block_q, Dv] through
  o_smem (the WG's Q buffer, free once its last Q·Kᵀ retired, or where Dv differs from D its
  own [block_q, Dv] buffer; a split tail's part: a float32 buffer), lse (natural log) through
  lse_smem. The caller waits for the stores.

  sink: the head's attention-sink logit in log2 units (sink_logits), or None. It joins each
  row's softmax as one more score with a zero value: m' = max(m, sink), and with
  alpha = exp2(m - m') the row sum becomes l' = l·alpha + exp2(sink - m') and O = acc·alpha / l'
  (FA2's rescaling of one more, value-free, key block). Taking the max keeps exp2 finite on a
  row that saw no key (l = 0, m = MASK_VALUE, set so for a fixed row max, which leaves m at
  common.fixed_row_max's M): alpha = 0, l' = 1, O = 0 and lse = sink.

  row_term: ALiBi's row term [block_q] that the kv loop left out of m (common.alibi_row_term),
  or None; added to m first, so that lse and the sink see the true row max."""
  if row_term is not None:
    m = m + row_term
  if sink is not None:
    m = jnp.where(l == 0.0, MASK_VALUE, m)  # the running max's m already there
    m_all = jnp.maximum(m, sink)
    alpha = jnp.exp2(m - m_all)
    l = l * alpha + jnp.exp2(sink - m_all)
    m = m_all
  empty = l == 0.0  # only with segment ids (or a sink of -inf): no visible key at all
  inv_l = 1.0 / jnp.where(empty, 1.0, l)
  if sink is not None:
    inv_l = inv_l * alpha
  if kp.dropout:  # the kept probabilities' 1 / (1 - rate), folded into the normalisation
    inv_l = inv_l * kp.inv_keep
  o_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(o_smem.dtype)
  lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_dst, commit_group=False)
  plgpu.copy_smem_to_gmem(lse_smem, lse_dst, commit_group=False)
  plgpu.commit_smem_to_gmem_group()


def _fwd_persistent_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, q_scratch, k_scratch, v_scratch,
                           lse_scratch, p_scratch, o_scratch, q_ready, k_ready, v_ready, k_free,
                           v_free, sched, q_free, *, kp: common.KernelParams, ctas: int, heads: int,
                           batch: int, seg: common.SegmentRefs | None = None, slopes=None,
                           sinks=None, keys=None):
  """The non-causal forward as a persistent kernel: `ctas` CTAs (one per SM) loop over the
  (q tile, head, batch) tiles, CTA c taking tiles c, c + ctas, ...

  Same warpgroups, ring and kv loops as `_fwd_kernel`, but the ring runs on across tiles, so
  the producer loads the next tile's first K/V blocks while the consumers finish a tile, and Q
  is double-buffered by tile parity: the producer loads tile i+1's Q during tile i (as soon
  as tile i-1 released its buffer), so a tile starts without waiting for a load. What a CTA
  launch paid per tile (Q and first K/V latency, launch, drain) is paid once per CTA.

  q_scratch [2 (tile parity), 2 (WG), block_q, D]; q_ready [4] indexed parity·2 + WG (TMA
  arrivals); q_free [2] (2 arrivals: both WGs stored that parity's tile and the TMA has read
  its O out of the buffer). o_scratch [2, block_q, Dv] or None, as in `_fwd_kernel` (a WG's
  store is read out before its next tile). seg: a window's band (no segment ids), as in
  `_fwd_kernel`: each tile streams its band's blocks, so tiles differ in steps and the ring's
  step of a tile's first block is the sum of the steps before it. Other operands (slopes,
  sinks and keys too) as in `_fwd_kernel`.
  """
  bq, bkv, stages = kp.block_q, kp.block_kv, kp.stages
  nqt = kp.num_q_tiles
  cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
  tiles = lax.div(nqt * heads * batch - cta + ctas - 1, ctas)  # >= 1: ctas <= tile count

  def coords(i):
    """(b, h, q tile) of this CTA's i-th tile, in the launch order of `_fwd_kernel`."""
    t = cta + i * ctas
    if kp.heads_fastest:
      h, r = lax.rem(t, heads), lax.div(t, heads)
      return lax.div(r, nqt), h, lax.rem(r, nqt)
    qt, r = lax.rem(t, nqt), lax.div(t, nqt)
    return lax.div(r, heads), lax.rem(r, heads), qt

  sched_sync = functools.partial(common.sync, sched)

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(kp.compute_registers, action="increase")
    loop = _overlapped_kv_loop if kp.intra_wg_overlap else _plain_kv_loop
    bars = common.KvBarriers(k_ready, v_ready, k_free, v_free, sched)

    def _tile(i, base):
      b, h, qt = coords(i)
      parity = lax.rem(i, 2)
      q_smem = q_scratch.at[parity, wg]
      q0 = qt * (2 * bq) + wg * bq
      steps = cta_steps = kp.num_kv_blocks  # non-causal: every tile sees every key block
      band = {}
      if seg is not None:  # a window alone: its band's blocks, no ids compared
        _, cta_steps, kv0, full = common.cta_kv_range(kp, seg, b, qt)
        steps = jnp.clip(kp.kv_steps(q0 + bq) - kv0, 1, cta_steps)
        band = dict(kv0=kv0, full=full)
      # The ring's step of the tile's first block (formed where used, as the gate recorded).
      first = (lambda: i * cta_steps) if base is None else (lambda: base)
      with jax.named_scope("prologue"):
        plgpu.barrier_wait(q_ready.at[parity * 2 + wg])
        plgpu.barrier_wait(k_ready.at[lax.rem(first(), stages)])
      pl.when(wg == 1)(sched_sync)
      slope = None if slopes is None else slopes[h]
      row_term = None  # a causal window's ALiBi leaves its row term to the store (alibi)
      if slope is not None and common.alibi_drops_rows(kp):
        row_term = common.alibi_row_term(bq, slope, kp.c)
      carry = loop(q_smem, k_scratch, v_scratch, p_scratch.at[wg] if kp.interpret else None,
                   bars, q0=q0, steps=steps, kp=kp, base=first(), slope=slope,
                   **band, **_dropout_rows(keys, b, h, q0, kp))
      if seg is not None:
        lax.fori_loop(base + steps, base + cta_steps,
                      functools.partial(common.idle_kv_step, bars=bars, stages=stages), None)
      pl.when(wg == 0)(sched_sync)
      with jax.named_scope("epilogue"):
        _store_tile(*carry, q_smem if o_scratch is None else o_scratch.at[wg],
                    lse_scratch.at[wg], o_ref.at[b, pl.ds(q0, bq), h],
                    lse_ref.at[b, h, pl.ds(q0, bq)], kp,
                    sink=None if sinks is None else sinks[h], row_term=row_term)
        # The buffer takes tile i+2's Q next; lse_scratch is rewritten by the next tile.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      plgpu.barrier_arrive(q_free.at[parity])
      return None if base is None else base + cta_steps

    _tile_loop(tiles, kp, seg, _tile)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the kernel's end

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(kp.producer_registers, action="decrease")

    def load_q(i):
      b, h, qt = coords(i)
      parity = lax.rem(i, 2)
      for w in range(2):
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(qt * (2 * bq) + w * bq, bq), h],
                                q_scratch.at[parity, w], q_ready.at[parity * 2 + w])

    load_q(0)

    def _tile(i, base):
      b, h, qt = coords(i)
      steps, kv0 = kp.num_kv_blocks, 0
      if seg is not None:
        _, steps, kv0, _ = common.cta_kv_range(kp, seg, b, qt)
      kvh = lax.div(h, kp.group)

      @pl.loop(0, steps)
      def _step(j):
        g = (i * steps if base is None else base) + j  # the ring's step
        slot = lax.rem(g, stages)
        rows = (b, pl.ds(_kv_block(j, kv0, steps, kp) * bkv, bkv), kvh)
        with jax.named_scope("wait_free"):
          pl.when(g >= stages)(lambda: plgpu.barrier_wait(k_free.at[slot]))
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_scratch.at[slot], k_ready.at[slot])
        with jax.named_scope("wait_free"):
          pl.when(g >= stages)(lambda: plgpu.barrier_wait(v_free.at[slot]))
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_scratch.at[slot], v_ready.at[slot])

        # Tile i+1's Q, once the ring holds tile i's first blocks: issuing those needed tile
        # i-1's last blocks consumed, so tile i-1's release of the buffer is close.
        first_blocks = min(steps, stages) if seg is None else jnp.minimum(steps, stages)
        @pl.when((j == first_blocks - 1) & (i + 1 < tiles))
        def _():
          pl.when(i >= 1)(lambda: plgpu.barrier_wait(q_free.at[lax.rem(i + 1, 2)]))
          load_q(i + 1)

      return None if base is None else base + steps

    total = _tile_loop(tiles, kp, seg, _tile)
    common.observe_last_releases((k_free, v_free), total, stages)
    common.observe_last_releases((q_free,), tiles, 2)


def _tile_loop(tiles, kp: common.KernelParams, seg, body):
  """Runs body(i, base) -> base + tile i's steps over a persistent CTA's `tiles` tiles, base
  being the ring's step of tile i's first key block, and returns the ring's steps in all:
  without seg every tile streams every key block (base None, i.e. i · kp.num_kv_blocks, a
  loop without a carry), with a window's band the running sum of the tiles' steps."""
  if seg is None:  # body(i, None): the body forms i · kp.num_kv_blocks where it needs it
    pl.loop(0, tiles)(lambda i: body(i, None))
    return tiles * kp.num_kv_blocks
  return lax.fori_loop(0, tiles, body, jnp.int32(0))


def _ring(base):
  """slot(j): the K/V ring slot of a tile's kv step j when the tile's first step is the
  ring's step `base` (None: 0, the non-persistent kernel)."""
  def slot(j, stages):
    if base is None:
      return 0 if isinstance(j, int) and j == 0 else lax.rem(j, stages)
    return lax.rem(base + j, stages)

  return slot


def _last_block_first(kp: common.KernelParams) -> bool:
  """Whether the overlapped loop streams a CTA's key blocks last one first, because that block
  is the only one its warpgroups mask: non-causal calls whose last key block is partial, and
  causal calls whose key tile covers both warpgroups' rows (block_kv = 2·block_q: every block
  before the diagonal one is wholly visible to the CTA's rows, and the diagonal block, or the
  key tail where the range stops at S, is the last of both warpgroups' equal ranges). No
  segment ids (they take the plain loop). The last block then is the loop's first, whose
  softmax runs before the loop and is masked anyway, and no loop step masks.
  Non-causal, masking every step instead (a peeled masked last step makes ptxas serialise the
  wgmmas, C7512) cost 10 % at 1x5000x16x128 (H200: 508 against 565 TFLOP/s);
  causal calls ran the diagonal block as a masked step after the unmasked loop."""
  if not kp.intra_wg_overlap or kp.segments or kp.block_mask is not None:
    return False
  if kp.causal:
    return kp.block_kv == 2 * kp.block_q
  return kp.kv_tail


def _kv_block(j, kv0, steps, kp: common.KernelParams):
  """The key block of a CTA's kv step j (its steps stream blocks [kv0, kv0 + steps)): kv0 + j,
  or with `_last_block_first` the last block at step 0 and kv0 + j - 1 after it. The rotated
  index is computed at run time even from Python ints, so that the producer's first loads
  have no static offset past the operand's rows (common.operand_rows). A loop's traced j takes
  a select: a remainder's integer-division chain kept ALiBi's work of the step behind it, where
  with the select ptxas overlaps it with P·V (ALiBi's causal forward 1.06x on the H200,
  docs/mosaic.md "Instruction order")."""
  if not _last_block_first(kp):
    return kv0 + j
  if not isinstance(j, int):
    return kv0 + jnp.where(j == 0, jnp.int32(steps) - 1, j - 1)
  return kv0 + lax.rem(jnp.int32(j) + steps - 1, jnp.int32(steps))


def _plain_kv_loop(q_smem, k_scratch, v_scratch, p_smem, bars: common.KvBarriers, *, q0,
                   steps, kp: common.KernelParams, base=None, kv0=0, seg_ids=None, full=None,
                   slope=None, drop_keys=None, drop_rows=None, dense=None,
                   sparse: block_mask.Sparse | None = None):
  """One consumer WG's kv loop, S_j then O += P_j·V_j per step -> (acc, m, l).

  q_smem [block_q, D], k_scratch [stages, block_kv, D], v_scratch [stages, block_kv, Dv], p_smem
  [block_q, block_kv] (interpret mode only); acc is [block_q, Dv]. The caller has waited for K_0;
  `base`: see `_ring`. Step j is key block kv0 + j; seg_ids(col0) gives the (row, column) segment
  ids of the block starting at key col0, and `full` the run of key blocks that share the rows' one
  id (common.unmasked_run). slope: the head's ALiBi slope in raw-score units (common.alibi), or
  None. drop_keys, drop_rows: dropout's key refs and the rows' keys [block_q] ROW (`_dropout_rows`),
  or None: P·V takes the kept probabilities, l sums them all. dense: the dense bias and mask tiles'
  loader (dense.load bound to the CTA's batch and head), or None. sparse: a block mask's view of the
  CTA's table (step j is key block sparse.block(j), its first sparse.masked steps evaluate the mask
  function), or None.
  """
  bq, bkv, stages = kp.block_q, kp.block_kv, kp.stages
  ring = _ring(base)

  sched_sync = functools.partial(common.sync, bars.sched)
  folded, c = common.cap_fold(kp, biased=slope is not None or dense is not None)
  fixed = common.fixed_row_max(kp, folded, c)

  def key_block(j):
    return kv0 + j if sparse is None else sparse.block(j)

  def step(j, carry, *, masked: bool):
    acc, m, l = carry
    slot = ring(j, stages)
    # The dense tiles, loaded where they are added to S (dense.load).
    dense_tiles = None if dense is None else dense(q0, key_block(j) * bkv, (bq, bkv),
                                                   slot=slot)
    drop_cols = None  # loaded ahead of the scores' wait
    if drop_keys is not None:
      drop_cols = common.dropout_col_keys(drop_keys, key_block(j) * bkv, bkv)

    def qk(s_ref):
      with jax.named_scope("issue"):
        plgpu.wgmma(s_ref, q_smem, k_scratch.at[slot].T)
      loaded = sm90_dense.issue(dense_tiles)  # under the matmul
      with jax.named_scope("handoff"):
        sched_sync()  # hand the tensor cores to the other WG while S is computed
      with jax.named_scope("wait_s"):
        return s_ref[...], loaded

    s, loaded = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
    dense_tiles = sm90_dense.issued(dense_tiles, loaded)
    plgpu.barrier_arrive(bars.k_free.at[slot])
    with jax.named_scope("softmax"):
      if not kp.bias_in_cap:  # before the mask: a hidden score must stay -inf
        s = common.soft_cap(s, kp, folded=folded)
      if slope is not None:  # on every block, masked or not
        s = common.alibi(s, q0, key_block(j) * bkv, slope,
                         drop_rows=common.alibi_drops_rows(kp))
      if kp.bias_in_cap:  # logits_soft_cap_order="bias_then_cap": the biases inside the cap
        s, _ = sm90_dense.add(s, dense_tiles, kp.scale, cap=common.cap_after_bias(kp))
      elif dense_tiles is not None:  # on every block too: the mask is data
        s = sm90_dense.add(s, dense_tiles, kp.scale)
      if masked and sparse is not None:
        s = jnp.where(sparse.mask(q0, key_block(j) * bkv, (bq, bkv), kp.kv_len, kp.kv_tail), s,
                      -jnp.inf)
      elif masked:
        col0 = (kv0 + j) * bkv
        ids = None if seg_ids is None else seg_ids(col0)
        s = jnp.where(common.tile_mask(q0, col0, (bq, bkv), kp, ids=ids), s, -jnp.inf)
      # exp2 with softmax_scale·log2(e) folded in: m is kept in scaled log2 units, so each
      # probability is one FFMA plus one ex2. -inf scores give p = 0 without a select since
      # m starts at the finite MASK_VALUE (or the fixed row max).
      if fixed is not None:  # m stays fixed_row_max's M: no max, no rescale
        p, m_new, l, _ = common.online_softmax(s, m, l, c, fixed_max=fixed)
      else:
        m_new = jnp.maximum(m, s.max(axis=1) * c)
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        l = l * alpha + p.sum(axis=1)
      if drop_cols is not None:
        p = jnp.where(common.dropout_keep(drop_rows, drop_cols, p.shape, kp), p, 0.0)
      p16 = p.astype(kp.dtype)
      # Pin the softmax before the barrier so that it overlaps the other WG's matmuls.
      acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
    acc = common.pv_step(acc, p16, v_scratch.at[slot], p_smem, bars, j=j, steps=steps,
                         slot=slot, ring_slot=lambda i: ring(i, stages), kp=kp)
    return acc, m_new, l

  carry = (plgpu.layout_cast(jnp.zeros((bq, kp.dv), jnp.float32), plgpu.Layout.WGMMA),
           _initial_max(bq, fixed),
           plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), common.ROW))
  return common.kv_loop(step, carry, q0, steps, kp, kv0=kv0, full=full, sparse=sparse)


def _initial_max(rows: int, fixed: float | None):
  """A kv loop's initial row max m [rows] ROW: the finite MASK_VALUE, or the fixed row max
  (common.fixed_row_max) that it keeps throughout."""
  return plgpu.layout_cast(jnp.full((rows,), MASK_VALUE if fixed is None else fixed,
                                    jnp.float32), common.ROW)


def _q_operand(q_smem, kp: common.KernelParams):
  """The overlapped loop's Q operand of S = Q·Kᵀ: the SMEM tile, or with kp.q_registers its
  [block_q, D] register copy (the WGMMA layout of a register A operand), loaded once per tile.

  Not in the plain loop: there ptxas (CUDA 13.0) gives P's registers to Q's copy while the loop
  still needs it (SASS: P packed into the registers the next step's S = Q·Kᵀ reads; the H200
  returned wrong outputs at 16x1024x16x128), where in the overlapped loop, whose P·V is in flight
  beside S = Q·Kᵀ, it keeps them apart (scripts/mosaic_ptxas.py reports such writes)."""
  if kp.q_registers and not kp.interpret:
    return plgpu.load(q_smem, layout=plgpu.Layout.WGMMA)
  return q_smem


def _overlapped_kv_loop(q_smem, k_scratch, v_scratch, p_smem, bars: common.KvBarriers, *, q0,
                        steps, kp: common.KernelParams, base=None, kv0=0, slope=None,
                        drop_keys=None, drop_rows=None, dense=None,
                        sparse: block_mask.Sparse | None = None):
  """One consumer WG's kv loop with FA3's intra-warpgroup 2-stage pipeline -> (acc, m, l).

  q_smem [block_q, D], k_scratch [stages, block_kv, D], v_scratch [stages, block_kv, Dv], p_smem
  [block_q, block_kv] (interpret mode only). S_0 is computed before the loop; step j issues S_{j+1}
  = Q·K_{j+1}ᵀ and then O += P_j·V_j, waits for S_{j+1} alone (`wgmma_accumulator_load(wait_n=1)`)
  and runs its softmax while P_j·V_j is still in flight; O is rescaled once that has retired. The
  last P·V follows the loop. Each matmul pair sits between the same two schedule-barrier rounds per
  block as in the plain loop, so the two WGs still alternate (ping-pong) and the idle steps of a
  causal CTA are unchanged. `base`: see `_ring`; step j is key block `_kv_block(j, ...)`; slope,
  drop_keys, drop_rows, dense, sparse: as in `_plain_kv_loop` (S_{j+1}'s dense tiles are loaded in
  its softmax; with a block mask block 0 is masked, the others as their table says).
  """
  bq, bkv, stages = kp.block_q, kp.block_kv, kp.stages
  ring = _ring(base)

  sched_sync = functools.partial(common.sync, bars.sched)
  q_op = _q_operand(q_smem, kp)

  def key_block(j):
    return _kv_block(j, kv0, steps, kp) if sparse is None else sparse.block(j)

  def dense_tiles(j):
    if dense is None:
      return None
    return dense(q0, key_block(j) * bkv, (bq, bkv), slot=ring(j, stages))

  def drop_cols(j, early: bool = False):
    """The dropout keys of step j's key block, or None. `early` (a load ahead of the step's
    waits, off the softmax's path): in the grid kernel only; in the persistent one ptxas
    spilled with the vector live across the step (12 / 5 spill loads / stores in its loops at
    1x4096x16x128, none when loaded in the softmax; deviceless, CUDA 13.0)."""
    if drop_keys is None or (early and base is not None):
      return None
    return common.dropout_col_keys(drop_keys, key_block(j) * bkv, bkv)

  folded, c = common.cap_fold(kp, biased=slope is not None or dense is not None)
  fixed = common.fixed_row_max(kp, folded, c)

  def softmax(s, j, masked, m, l, tiles=None, cols=None):
    if not kp.bias_in_cap:  # before the mask: a hidden score must stay -inf
      s = common.soft_cap(s, kp, folded=folded)
    if masked or slope is not None or tiles is not None:
      col0 = key_block(j) * bkv
      s = common.alibi(s, q0, col0, slope,  # on every block, masked or not
                       drop_rows=common.alibi_drops_rows(kp))
    if kp.bias_in_cap:  # logits_soft_cap_order="bias_then_cap": the biases inside the cap
      s, _ = sm90_dense.add(s, tiles, kp.scale, cap=common.cap_after_bias(kp))
    else:
      s = sm90_dense.add(s, tiles, kp.scale)
    if masked and sparse is not None:
      s = jnp.where(sparse.mask(q0, col0, (bq, bkv), kp.kv_len, kp.kv_tail), s, -jnp.inf)
    elif masked:
      s = jnp.where(common.visible(q0, col0, (bq, bkv), kp), s, -jnp.inf)
    p, m, l, alpha = common.online_softmax(s, m, l, c, fixed_max=fixed)  # alpha None: fixed
    if drop_keys is not None:  # after l: l sums every probability, P·V takes the kept ones
      cols = drop_cols(j) if cols is None else cols
      p = jnp.where(common.dropout_keep(drop_rows, cols, p.shape, kp), p, 0.0)
    return p, m, l, alpha

  def qk(s_ref):  # K_0 is ready: the caller waited for it
    plgpu.wgmma(s_ref, q_op, k_scratch.at[ring(0, stages)].T)
    sched_sync()
    return s_ref[...]

  tiles = dense_tiles(0)
  s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
  plgpu.barrier_arrive(bars.k_free.at[ring(0, stages)])
  # Block 0 is masked whenever any block can be: exact where it is not needed, and one tile.
  cols0 = drop_cols(0, early=True)
  p, m, l, _ = softmax(
      s, 0, kp.needs_mask or sparse is not None, _initial_max(bq, fixed),
      plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), common.ROW), tiles, cols0)
  acc = plgpu.layout_cast(jnp.zeros((bq, kp.dv), jnp.float32), plgpu.Layout.WGMMA)
  carry = lax.optimization_barrier((acc, p.astype(kp.dtype), m, l))

  def step(j, carry, *, masked: bool):
    acc, p16, m, l = carry  # acc is scaled to m; p16 = P_j is not in it yet
    slot, nxt = ring(j, stages), ring(j + 1, stages)
    cols = drop_cols(j + 1, early=True)
    with jax.named_scope("wait_kv"):
      plgpu.barrier_arrive(bars.sched)
      plgpu.barrier_wait(bars.k_ready.at[nxt])
      plgpu.barrier_wait(bars.v_ready.at[slot])
      plgpu.barrier_wait(bars.sched)

    def scores_and_softmax(s_ref, issue_pv):
      tiles = dense_tiles(j + 1)
      with jax.named_scope("issue"):
        plgpu.wgmma(s_ref, q_op, k_scratch.at[nxt].T)  # S_{j+1}
        issue_pv()  # P_j·V_j, queued behind it
      tiles = sm90_dense.issued(tiles, sm90_dense.issue(tiles))  # under both
      with jax.named_scope("handoff"):
        sched_sync()  # hand the tensor cores to the other WG
      with jax.named_scope("wait_s"):
        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # P_j·V_j keeps running
      plgpu.barrier_arrive(bars.k_free.at[nxt])
      with jax.named_scope("softmax"):
        return softmax(s, j + 1, masked, m, l, tiles, cols)

    if kp.interpret:  # P staged through SMEM, P_j·V_j into its own accumulator
      p_smem[...] = p16
      plgpu.commit_smem()

      def scoped(s_ref, pv_ref):
        out = scores_and_softmax(
            s_ref, lambda: plgpu.wgmma(pv_ref, p_smem, v_scratch.at[slot]))
        return out, pv_ref[...]

      (p, m, l, alpha), pv = pl.run_scoped(scoped, plgpu.ACC((bq, bkv), jnp.float32),
                                           plgpu.ACC((bq, kp.dv), jnp.float32))
      acc = acc + pv
    else:
      def state(refs):
        # The softmax results leave through plain refs: run_state returns only its state, and
        # exiting it waits for every wgmma (here P_j·V_j, after the softmax has been issued).
        s_ref, o_ref, p_ref, m_ref, l_ref, alpha_ref = refs
        out = scores_and_softmax(
            s_ref, lambda: plgpu.wgmma(o_ref, p16, v_scratch.at[slot]))  # RS wgmma
        p_ref[...], m_ref[...], l_ref[...] = out[:3]
        if alpha_ref is not None:
          alpha_ref[...] = out[3]

      s0 = plgpu.layout_cast(jnp.zeros((bq, bkv), jnp.float32), plgpu.Layout.WGMMA)
      _, acc, p, m, l, alpha = pl.run_state(state)(
          (plgpu.ACC.init(s0), plgpu.ACC.init(acc), s0, m, l, None if fixed is not None else m))
      # P_{j+1} is written in kp.dtype only now that P_j·V_j has retired: P's registers are the
      # loop-carried operand of that wgmma, and redefining them while it is in flight makes
      # ptxas serialise every wgmma of the kernel (C7513; FA3 converts after wait<0> too).
      p = lax.optimization_barrier(p)
    plgpu.barrier_arrive(bars.v_free.at[slot])
    with jax.named_scope("rescale"):
      p16 = p.astype(kp.dtype)
      if alpha is not None:  # None: the fixed row max (fixed_row_max), nothing to rescale
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      # Pin the softmax and the rescale before the next barrier round (see the plain loop).
      return lax.optimization_barrier((acc, p16, m, l))

  if sparse is not None:
    # Loop step j forms block j + 1's softmax: the table's partial blocks, then the full ones.
    split = jnp.maximum(sparse.masked - 1, 0)
    carry = lax.fori_loop(0, split, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(split, steps - 1, functools.partial(step, masked=False), carry)
  elif kp.needs_mask and not _last_block_first(kp):
    # Causal with other tiles: the blocks from the diagonal's first on are masked. (A
    # non-causal key tail is streamed first, `_last_block_first`: a masked last step after an
    # unmasked loop made ptxas serialise every wgmma of the kernel, C7512, and masking every
    # step cost 10 %.)
    split = 0
    if kp.causal:
      split = jnp.maximum(common.first_masked_block(q0, kv0 + steps, kp) - kv0 - 1, 0)
    carry = lax.fori_loop(0, split, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(split, steps - 1, functools.partial(step, masked=True), carry)
  else:
    carry = lax.fori_loop(0, steps - 1, functools.partial(step, masked=False), carry)

  acc, p16, m, l = carry
  last = ring(steps - 1, stages)
  plgpu.barrier_arrive(bars.sched)
  plgpu.barrier_wait(bars.v_ready.at[last])
  plgpu.barrier_wait(bars.sched)
  acc = common.accumulate(acc, p16, p_smem, v_scratch.at[last], kp)
  plgpu.barrier_arrive(bars.v_free.at[last])
  return acc, m, l


def _registers(config: MosaicConfig) -> tuple[int, int]:
  """(consumer, producer) setmaxnreg of the forward. The intra-WG overlap keeps two steps' S,
  P and O live, so it takes FA3's 240 / 24 split unless the config sets its own."""
  regs = (config.compute_registers, config.producer_registers)
  defaults = {f.name: f.default for f in dataclasses.fields(MosaicConfig)}
  if config.fwd_intra_wg_overlap and regs == (defaults["compute_registers"],
                                              defaults["producer_registers"]):
    return 240, 24
  return regs


def fwd_call(q, k, v, *, kp: common.KernelParams, persistent_ctas: int = 0, segs=(),
             split: split_tail.TailSplit | None = None, slopes=(), sinks=(), keys=(),
             dense=(), blks=()):
  """Runs the kernel on q [B, T, H, D], k [B, S, K, D], v [B, S, K, Dv] -> (o [B, T, H, Dv], lse [B,
  H, Tp]) (Dv = kp.dv), T and S padded as common.operand_rows says (up to kp.t_pad and kp.s_pad, or
  less: TMA reads rows past the end as zeros and drops stores past it); lse always has kp.t_pad
  rows.

  persistent_ctas > 0 (non-causal, no segments): `_fwd_persistent_kernel` on that many CTAs.
  segs: () or the padded (q_seg [B, Tp], kv_seg [B, Sp], kv_limits [B, q tiles, 4]) int32.
  split (non-causal, no segments, not persistent): the split tail; the result is then
  (o, lse, o_part, lse_part) with the tail tiles of o and lse unwritten (`combine_tail`).
  slopes: () or ALiBi's (common.raw_alibi_slopes [H],), an input after q, k, v and segs;
  sinks: () or (sink_logits [H],), the attention sinks, an input after those; keys: () or
  dropout's (row keys [B, H, Tp], column keys [Sp]) (common.dropout_keys), after those; dense:
  () or dense.inputs' bias and / or mask (kp.dense says which), the last inputs (grid kernel
  only). blks: () or the block mask's operands (block_mask.inputs; grid kernel, no segs),
  inputs right after q, k, v."""
  bsz, _, h, d = q.shape
  dv = kp.dv
  t_pad = kp.t_pad
  bq, bkv, stages = kp.block_q, kp.block_kv, kp.stages
  tiles = common.smem_transforms(kp.dtype, kp.d)
  persistent = persistent_ctas > 0
  scratch = [
      plgpu.SMEM(((2,) if persistent else ()) + (2, bq, d), kp.dtype, transforms=tiles),
      plgpu.SMEM((stages, bkv, d), kp.dtype, transforms=tiles),
      plgpu.SMEM((stages, bkv, dv), kp.dtype, transforms=tiles),
      plgpu.SMEM((2, bq), jnp.float32),
      plgpu.SMEM((2, bq, bkv), kp.dtype, transforms=tiles) if kp.interpret else None,
      # O's staging where its columns are not Q's (MosaicConfig.native_value_head_dim).
      plgpu.SMEM((2, bq, dv), kp.dtype, transforms=tiles) if dv != d else None,
      plgpu.Barrier(num_barriers=4 if persistent else 2),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2),
  ]
  out_type = [jax.ShapeDtypeStruct((*q.shape[:3], dv), q.dtype),
              jax.ShapeDtypeStruct((bsz, h, t_pad), jnp.float32)]
  assert not ((split is not None or persistent) and dense), "dense inputs: grid kernel only"
  if split is not None:
    assert not (kp.causal or persistent or segs), "the split tail is for the non-causal grid"
    rows = (split.tiles - split.main) * split.parts
    out_type += [jax.ShapeDtypeStruct((rows, 2, bq, dv), jnp.float32),
                 jax.ShapeDtypeStruct((rows, 2, bq), jnp.float32)]
    scratch.append(plgpu.SMEM((2, bq, dv), jnp.float32,
                              transforms=common.smem_transforms(jnp.float32)))

    def body(q_ref, k_ref, v_ref, *refs):
      heads = common.head_refs(refs, bool(slopes), bool(sinks), bool(keys))
      n = len(slopes) + len(sinks) + len(keys)
      o_ref, lse_ref, o_part, lse_part, *scratch_refs, o32 = refs[n:]
      _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *scratch_refs, kp=kp,
                  tail=_SplitRefs(split, o_part, lse_part, o32), **heads)

    grid, names = (split.ctas,), ("t",)
    most_steps = kp.num_kv_blocks
  elif persistent:
    assert not kp.causal or segs, "the persistent forward: non-causal, or a window"
    scratch.append(plgpu.Barrier(num_arrivals=2, num_barriers=2))
    body = common.with_segment_refs(
        functools.partial(_fwd_persistent_kernel, kp=kp, ctas=persistent_ctas, heads=h,
                          batch=bsz), 3, bool(segs), alibi=bool(slopes), sinks=bool(sinks),
        dropout=bool(keys))
    grid, names = (persistent_ctas,), ("cta",)
    most_steps = kp.num_kv_blocks * -(-kp.num_q_tiles * h * bsz // persistent_ctas)
  else:
    scratch += bias_ring_scratch(dense, kp, d)

    def make_body(blk=None):
      return common.with_segment_refs(functools.partial(_fwd_kernel, kp=kp, blk=blk), 3,
                                      bool(segs), alibi=bool(slopes), sinks=bool(sinks),
                                      dropout=bool(keys), dense=kp.dense)

    body = block_mask.with_block_refs(make_body, 3, len(blks)) if blks else make_body()
    launch = common.launch_grid(kp.num_q_tiles, h, bsz, ("qt", "h", "b"),
                                 heads_fastest=kp.heads_fastest)
    grid, names = launch["grid"], launch["grid_names"]
    most_steps = kp.num_kv_blocks
  return plgpu.kernel(
      common.named(body, "flash_fwd"),
      out_type=tuple(out_type),
      scratch_types=scratch,
      grid=grid, grid_names=names, num_threads=3, thread_name="wg",
      # The profiler's event buffer lives in shared memory (~48 B per step-event slot over the
      # 3 WGs): sized for at most PROFILE_STEPS steps, later events are dropped by its bounds
      # check, so long or persistent kernels still fit.
      compiler_params=common.compiler_params(kp, min(most_steps, PROFILE_STEPS)),
      interpret=common.interpret_params(kp.interpret),
  )(q, k, v, *blks, *segs, *slopes, *sinks, *keys, *dense)


def bias_ring_scratch(dense: tuple, kp: common.KernelParams, d: int) -> list:
  """The grid forward's scratch for a BiasRing (dense.ring_scratch), where the call has a
  16-bit dense bias (dense: dense.inputs' arrays, the bias first where kp.dense[0]) and its
  tiles fit in shared memory beside the kernel's own; else [] (the tiles come from GMEM).
  Through the ring a warpgroup reads its bias tile from swizzled shared memory in a few
  conflict-free vector loads, where from GMEM each of its 4-byte loads spans 8 rows. A
  profiled kernel (kp.profile_dir) takes the GMEM loads: its event buffer takes the room."""
  if not sm90_dense.in_shared_memory(dense, kp):
    return []
  dtype, bq, bkv, stages = dense[0].dtype, kp.block_q, kp.block_kv, kp.stages
  need = (smem_bytes(d, bq, bkv, stages, jnp.dtype(kp.dtype).itemsize, dv=kp.dv)
          + sm90_dense.ring_bytes(dtype, stages, bq, bkv))
  if need > SMEM_LIMIT_BYTES:
    return []
  return sm90_dense.ring_scratch(dtype, stages, bq, bkv, common.smem_transforms(dtype))


def _dropout_rows(keys, b, h, q0, kp: common.KernelParams) -> dict:
  """The kv loops' dropout arguments for a WG's rows q0.. of (b, h): {} without dropout, else
  the key refs and the rows' keys [block_q] ROW, loaded once per tile."""
  if keys is None:
    return {}
  return dict(drop_keys=keys, drop_rows=common.dropout_row_keys(keys, b, h, q0, kp.block_q))


def sink_logits(arrays: FeatureArrays | None, params: AttentionParams) -> tuple:
  """() without attention sinks, else (sinks·log2(e),) [H] float32: each head's sink logit in
  the log2 units of the kernels' row max m (scores times c = scale·log2(e))."""
  if not params.has_sinks:
    return ()
  return (arrays.sinks.astype(jnp.float32) * LOG2E,)


def smem_bytes(d: int, block_q: int, block_kv: int, stages: int, itemsize: int = 2, *,
               persistent: bool = False, tail_staging: bool = False, dv: int = 0) -> int:
  """Shared memory of one forward CTA: Q (double-buffered when persistent), the K/V ring and
  lse, plus ~1 KiB of barriers and alignment (and the split tail's float32 o staging); dv:
  the value head dim where it differs from d (0: d), whose O has a staging buffer of its own."""
  dv = dv or d
  q = (2 if persistent else 1) * 2 * block_q * d * itemsize
  staging = 2 * block_q * dv * 4 if tail_staging else 0
  o = 2 * block_q * dv * itemsize if dv != d else 0
  return (q + stages * block_kv * (d + dv) * itemsize + o + 2 * block_q * 4 + 1024
          + staging)


def tail_split(q, config: MosaicConfig, params: AttentionParams, kv_blocks: int,
               persistent: bool, dv: int = 0) -> split_tail.TailSplit | None:
  """The split tail of a call with q [B, T, H, D] (dv: V's head dim, 0: D), or None where it
  does not apply (not config.fwd_split_tail, causal, segment ids, the persistent kernel, no room
  for the float32 staging tile, or no split that pays)."""
  b, t, h, d = q.shape
  if (not config.fwd_split_tail or params.is_causal or common.segment_path(params)
      or persistent or params.has_bias or params.has_mask
      or params.block_mask_blocks is not None
      or smem_bytes(d, config.block_q, config.block_kv, config.num_stages,
                    jnp.dtype(q.dtype).itemsize, tail_staging=True, dv=dv) > SMEM_LIMIT_BYTES):
    return None
  num_q_tiles = _tiling.round_up(t, 2 * config.block_q) // (2 * config.block_q)
  return split_tail.plan(num_q_tiles, h, b, kv_blocks, heads_fastest=config.heads_fastest,
                         config=config)


def combine_tail(o, lse, o_part, lse_part, split: split_tail.TailSplit, sinks=()):
  """o [B, T or Tp, H, D], lse [B, H, Tp] with the split tail's tiles merged in from its parts
  (rows past o's end dropped):
  o_part [tail tiles · parts, 2, block_q, D], lse_part [.., 2, block_q] float32, each part
  normalised over its own keys, so o = Σ exp(lse_p − lse) o_p with lse = logsumexp_p lse_p.
  sinks: () or (sink_logits [H],): the sink joins as one more part, lse_p = sink, o_p = 0 (the
  kernel added it to the other tiles)."""
  r, parts = split.tail_tiles, split.parts
  rows_per_tile = o_part.shape[1] * o_part.shape[2]
  o_part = o_part.reshape(r, parts, rows_per_tile, o_part.shape[-1])
  lse_part = lse_part.reshape(r, parts, rows_per_tile)
  if sinks:
    sink = sinks[0][split.tail_coords()[1]] * LN2  # [tail tiles], natural log
    sink = jnp.broadcast_to(sink[:, None, None], (r, 1, rows_per_tile))
    lse_part = jnp.concatenate([lse_part, sink], axis=1)
    o_part = jnp.concatenate([o_part, jnp.zeros((r, 1) + o_part.shape[2:], o_part.dtype)],
                             axis=1)
  m = lse_part.max(axis=1)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lse_part - m[:, None])
  total = w.sum(axis=1)
  o_tail = (w[..., None] * o_part).sum(axis=1) / jnp.where(total == 0, 1.0, total)[..., None]
  lse_tail = jnp.where(total == 0, -jnp.inf, m + jnp.log(total))
  o = split_tail.set_tiles(o, o_tail, split)
  b, h, qt = split.tail_coords()
  rows = qt[:, None] * rows_per_tile + np.arange(rows_per_tile)
  lse = lse.at[b[:, None], h[:, None], rows].set(lse_tail, unique_indices=True)
  return o, lse


def window_limits(seg_limits, params: AttentionParams, kp: common.KernelParams, batch: int):
  """[B, q tiles, 4] key-block limits of the local window's (and causal) band per CTA tile of
  2·block_q rows (common.band_limits), intersected with seg_limits, the segment ids' limits,
  or None."""
  return common.band_limits(seg_limits, params.band, tiles=kp.t_pad // (2 * kp.block_q),
                             tile_rows=2 * kp.block_q, block=kp.block_kv, length=kp.kv_len,
                             batch=batch)


def segment_inputs(q, k, q_seg, kv_seg, *, params: AttentionParams,
                   kp: common.KernelParams) -> tuple:
  """() without the segment-id path, else the grid kernel's padded (q_seg [B, Tp], kv_seg
  [B, Sp], kv_limits [B, q tiles, 4]) int32 for q [B, T, H, D], k [B, S, K, D]: the call's ids
  (one document's zeros for a window alone) and per CTA tile of 2·block_q rows the key blocks
  that may share an id (_tiling.segment_block_limits) cut to the window's band
  (`window_limits`). The FP8 forward takes the same inputs."""
  if not kp.segments:
    return ()
  q_seg, kv_seg = common.path_segment_ids(q, k, q_seg, kv_seg, params)
  q_seg, kv_seg = _tiling.pad_segments(q_seg, kv_seg, kp.t_pad, kp.s_pad)
  kv_limits = None
  if params.has_segments:
    kv_limits, _ = _tiling.segment_block_limits(q_seg, kv_seg, block_q=2 * kp.block_q,
                                              block_kv=kp.block_kv)
  if params.local_window is not None:
    kv_limits = window_limits(kv_limits, params, kp, q.shape[0])
  return q_seg, kv_seg, kv_limits


def persistent_ctas(q, config: MosaicConfig, params: AttentionParams, dv: int = 0) -> int:
  """CTAs of the persistent forward for q [B, T, H, D] (0: run the one-CTA-per-tile kernel;
  dv: V's head dim, 0: D).

  Persistent only where it applies: config.fwd_persistent, non-causal (causal tiles differ in
  length; that kernel balances them by its launch order) or a window alone (its band's tiles,
  causal or not, of nearly equal length), and Q's second buffer fits in shared memory (not at
  head_dim 256)."""
  b, t, h, d = q.shape
  if (not config.fwd_persistent or params.has_segments  # a window, if any, alone
      or (params.is_causal and params.local_window is None)
      or params.has_bias or params.has_mask  # the dense tiles: the grid kernel only
      or params.block_mask_blocks is not None):
    return 0
  if smem_bytes(d, config.block_q, config.block_kv, config.num_stages,
                jnp.dtype(q.dtype).itemsize, persistent=True, dv=dv) > SMEM_LIMIT_BYTES:
    return 0
  tiles = b * h * (_tiling.round_up(t, 2 * config.block_q) // (2 * config.block_q))
  return min(tiles, config.debug.persistent_ctas or common.sm_count())


def forward(q, k, v, q_seg, kv_seg, *, params: AttentionParams,
            config: MosaicConfig, arrays: FeatureArrays | None = None):
  """See pallas_flash.call for the contract; of `arrays` the ALiBi slopes, the sinks, the
  dropout seed and the dense bias and mask are read (the other features taken,
  logits_soft_cap and local_window_size, live in params); ALiBi runs in every form, added to
  each score tile (common.alibi), and the sinks too, added to each row's sum before O is
  normalised (`_store_tile`; a split tail's parts in combine_tail), and dropout, whose keep
  mask (common.dropout_keep) zeroes the probabilities P·V takes, not those the row sum l takes.
  The dense bias and mask run in the grid kernel (no persistent form, no split tail), each step
  loading its tiles (sm90/dense.py). With segment ids or a window the grid kernel runs its
  plain kv loop (no persistent form, no intra-warpgroup overlap); only the key blocks that may
  share an id with a q tile, or lie in its band, are loaded, and ids and bounds are compared on
  those that do not lie wholly inside them."""
  b, t, h, d = q.shape
  s = k.shape[1]
  t_pad = _tiling.round_up(t, 2 * config.block_q)
  s_pad = _tiling.round_up(s, config.block_kv)
  if params.is_causal and config.num_stages < 2 and s_pad > config.block_kv:
    # A warpgroup's causal idle step waits for V_j before its schedule-barrier rounds; with one
    # slot V_j loads only after the other WG frees V_{j-1}, which it does after such a round.
    raise ValueError("MosaicConfig.num_stages=1 deadlocks the causal mosaic forward when there "
                     "is more than one key block; use num_stages >= 2 (the tuned configs use 2)")
  kp = common.KernelParams.make(
      q, k, params=params, block_q=config.block_q, block_kv=config.block_kv,
      stages=min(config.num_stages, s_pad // config.block_kv), t_pad=t_pad, s_pad=s_pad,
      kv_len=s, config=config, value_head_dim=v.shape[3])
  bm = None if arrays is None else arrays.block_mask
  if bm is not None:
    kp = dataclasses.replace(kp, block_mask=block_mask.Info.of(bm))
  if config.fwd_intra_wg_overlap:
    compute, producer = _registers(config)
    kp = dataclasses.replace(kp, compute_registers=compute, producer_registers=producer,
                             intra_wg_overlap=not kp.segments)
  t_in = common.operand_rows(t, t_pad, config.interpret, 0)
  s_in = common.operand_rows(s, s_pad, config.interpret, kp.stages * kp.block_kv)
  qp = _tiling.pad_axis(q, 1, t_in)
  kpad, vpad = _tiling.pad_axis(k, 1, s_in), _tiling.pad_axis(v, 1, s_in)
  segs = segment_inputs(q, k, q_seg, kv_seg, params=params, kp=kp)
  ctas = persistent_ctas(q, config, params, kp.dv)
  split = tail_split(q, config, params, kp.num_kv_blocks, ctas > 0, kp.dv)
  sinks = sink_logits(arrays, params)
  keys = common.dropout_keys(arrays, params, batch=b, heads=h, t_pad=t_pad, s_pad=s_pad)
  blks = () if bm is None else block_mask.inputs(
      bm, q_tile=2 * kp.block_q, kv_tile=kp.block_kv, t_pad=t_pad, s_pad=s_pad, by_q=True)
  out = fwd_call(qp, kpad, vpad, kp=kp, persistent_ctas=ctas, segs=segs, split=split,
                 slopes=common.raw_alibi_slopes(arrays, params), sinks=sinks, keys=keys,
                 dense=sm90_dense.inputs(arrays, params, t_pad, s_pad), blks=blks)
  o, lse = out if split is None else combine_tail(*out, split, sinks)
  return o[:, :t], lse[:, :, :t]
