"""FlashAttention backward for Hopper as two Pallas Mosaic GPU kernels (dQ, then dK/dV).

Both kernels use the forward's layout: 2 consumer warpgroups with their own rows plus a TMA
producer warpgroup streaming the other operand through a shared-memory ring.

* `_bwd_dq_kernel`: a WG owns `block_q_dq` query rows (Q, dO, lse, delta resident) and streams
  K/V: S = Q·Kᵀ and dP = dO·Vᵀ (SMEM operands), P = exp2(S·c − lse·log2e), dS = P∘(dP − delta),
  dQ += dS·K (dS from registers). By default (`MosaicConfig.bwd_delta_in_kernel`) it also
  loads its O rows, computes FA2's preprocessing itself (delta = rowsum(O∘dO), lse in log2
  units) and stores both for the dK/dV kernel, which runs after it.
* `_bwd_dkdv_kernel`: a WG owns `block_kv_dkv` key rows (K, V resident) and streams Q/dO of every
  query head of its kv head (so GQA gradients are summed in registers, no repeated K/V):
  Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dV += Pᵀ·dO, dK += dSᵀ·Q (the transposed form keeps the register
  operand's rows = the WG's key rows).

S, P and dP are recomputed in both kernels (7 tile matmuls per tile pair instead of 5); see
docs/mosaic.md for the single-kernel plan. Summation order is fixed, so gradients are
bitwise reproducible run to run.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple
import warnings

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_flash import _tiling
from pallas_flash.mosaic_gpu import _common, split_tail
from pallas_flash.mosaic_gpu.config import SMEM_LIMIT_BYTES, MosaicConfig
from pallas_flash.call import AttentionParams, FeatureArrays

LOG2E = math.log2(math.e)


def _at(ref, i):
  """ref.at[i], or None for the staging buffers that exist only in interpret mode."""
  return None if ref is None else ref.at[i]


def _bwd_dq_kernel(q_ref, k_ref, v_ref, do_ref, o_ref, lse_ref, delta_ref, dq_ref, lse2_out_ref,
                   delta_out_ref, q_scratch, do_scratch, o_scratch, lse_scratch, delta_scratch,
                   k_scratch, v_scratch, ds_scratch, row_ready, k_ready, v_ready, k_free, v_free,
                   *, kp: _common.KernelParams, seg: _common.SegmentRefs | None = None,
                   tail: _PartRefs | None = None):
  """q/do_ref [B, Tp, H, D], k/v_ref [B, Sp, K, D], lse/delta_ref [B, H, Tp].

  Two forms (absent refs are None). Statistics from XLA (o_ref, lse2_out_ref, delta_out_ref
  None): lse_ref in log2 units, delta_ref the full delta. Statistics in the kernel: o_ref
  [B, Tp, H, D], lse_ref natural log (-inf on fully masked rows), delta_ref the correction
  -dlse or None; the kernel computes lse2 and delta = rowsum(O∘dO) + correction and stores them
  to lse2_out/delta_out_ref [B, H, Tp] for the dK/dV kernel.
  Grid over (Tp / (2·block_q), H, B) in _launch_order's order; dq_ref [B, Tp, H, D];
  q/do/o_scratch [2, block_q, D], lse/delta_scratch [2, block_q], k/v_scratch [stages,
  block_kv, D], ds_scratch [2, block_q, block_kv] (interpret only). seg: segment ids, the
  forward's way (the CTA streams only the key blocks its tile may share an id with). tail
  (non-causal, no seg): the split tail's one-dimensional grid; a part streams its share of
  the key blocks and writes dQ·scale in float32 to tail.parts[0][part row, wg].
  """
  bq, bkv, stages, v_stages = kp.block_q, kp.block_kv, kp.stages, kp.dq_v_stages
  wg = lax.axis_index("wg")
  is_part = part_row = None
  if tail is None:
    b = lax.axis_index("b")
    qt, h = _tile_and_head(("qt", "h"), q_ref.shape[2], kp)
  else:
    is_part, part_row, (b, h, qt) = tail.split.this_cta()
  if kp.causal and not kp.bwd_heads_fastest:
    qt = kp.t_pad // (2 * bq) - 1 - qt  # heaviest tiles first, as in the forward
  cta_q0 = qt * (2 * bq)

  cta_steps = kp.kv_steps(cta_q0 + 2 * bq)
  kv0, full = 0, None  # the CTA's first key block (steps count from it), its full run
  if seg is not None:
    kv0, cta_steps, full = _common.streamed_kv_range(seg, b, qt, cta_steps)
  if tail is not None:
    kv0, kv_end = tail.split.bounds(is_part, part_row, cta_steps)
    cta_steps = kv_end - kv0

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(kp.compute_registers, action="increase")
    q_smem, do_smem = q_scratch.at[wg], do_scratch.at[wg]
    lse_smem, delta_smem = lse_scratch.at[wg], delta_scratch.at[wg]
    q0 = cta_q0 + wg * bq
    rows = (b, pl.ds(q0, bq), h)
    stats = (b, h, pl.ds(q0, bq))
    loads = [(q_ref.at[rows], q_smem), (do_ref.at[rows], do_smem),
             (lse_ref.at[stats], lse_smem)]
    if delta_ref is not None:
      loads.append((delta_ref.at[stats], delta_smem))
    if o_ref is not None:
      loads.append((o_ref.at[rows], o_scratch.at[wg]))
    for i, (src, dst) in enumerate(loads):
      plgpu.copy_gmem_to_smem(src, dst, row_ready.at[wg, i])
    for i in range(len(loads)):
      plgpu.barrier_wait(row_ready.at[wg, i])
    if o_ref is None:
      lse2 = plgpu.load(lse_smem, layout=_common.ROW)
      delta = plgpu.load(delta_smem, layout=_common.ROW)
    else:
      lse2, delta = _dq_row_stats(lse_smem, delta_smem if delta_ref is not None else None,
                                  o_scratch.at[wg], do_smem)
      # Both vectors go back through the SMEM they came from (each row is read and written by
      # the warp that owns it) and are stored once for the dK/dV kernel; the epilogue's
      # wait_smem_to_gmem covers these copies' reads.
      lse_smem[...] = lse2
      delta_smem[...] = delta
      plgpu.commit_smem()

      def store_stats():
        plgpu.copy_smem_to_gmem(lse_smem, lse2_out_ref.at[stats], commit_group=False)
        plgpu.copy_smem_to_gmem(delta_smem, delta_out_ref.at[stats], commit_group=False)
        plgpu.commit_smem_to_gmem_group()

      if tail is None:
        store_stats()
      else:  # every part of a tile computes the same rows' statistics; its first stores them
        pl.when(lax.rem(part_row, tail.split.parts) == 0)(store_stats)
    steps = kp.kv_steps(q0 + bq)
    ids = None
    if seg is not None:
      steps = jnp.clip(steps - kv0, 1, cta_steps)
      if kp.segment_ids:
        ids = _common.row_and_col_ids(seg, b, q0, bq, bkv)
    if tail is not None:
      steps = cta_steps

    def step(j, dq, *, masked: bool):
      slot = lax.rem(j, stages)
      vslot = slot if v_stages == stages else lax.rem(j, v_stages)
      plgpu.barrier_wait(k_ready.at[slot])
      if v_stages == stages:
        plgpu.barrier_wait(v_ready.at[vslot])

      def scores(s_ref, dp_ref):
        plgpu.wgmma(s_ref, q_smem, k_scratch.at[slot].T)
        if v_stages != stages:  # a shallower V ring: its load gets until Sᵀ is issued
          plgpu.barrier_wait(v_ready.at[vslot])
        plgpu.wgmma(dp_ref, do_smem, v_scratch.at[vslot].T)
        return s_ref[...], dp_ref[...]

      s, dp = pl.run_scoped(scores, plgpu.ACC((bq, bkv), jnp.float32),
                            plgpu.ACC((bq, bkv), jnp.float32))
      plgpu.barrier_arrive(v_free.at[vslot])
      s, slope = _common.soft_cap_with_slope(s, kp)
      p = jnp.exp2(s * kp.c - lax.broadcast_in_dim(lse2, s.shape, [0]))
      if masked:
        col0 = (kv0 + j) * bkv
        mask = _common.tile_mask(q0, col0, (bq, bkv), kp, ids=ids and ids(col0))
        p = jnp.where(mask, p, 0.0)
      if slope is not None:  # P feeds only dS here: the cap's slope dies at once
        p = p * slope
      ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [0]))
      dq = _common.accumulate(dq, ds.astype(kp.dtype), _at(ds_scratch, wg), k_scratch.at[slot], kp)
      plgpu.barrier_arrive(k_free.at[slot])
      return dq

    def idle_step(j, carry):
      for ready_, free_, n in ((k_ready, k_free, stages), (v_ready, v_free, v_stages)):
        slot = lax.rem(j, n)
        plgpu.barrier_wait(ready_.at[slot])
        plgpu.barrier_arrive(free_.at[slot])
      return carry

    dq = plgpu.layout_cast(jnp.zeros((bq, kp.d), jnp.float32), plgpu.Layout.WGMMA)
    u0, u1 = _common.unmasked_run(q0, steps, kp, kv0=kv0, full=full)
    if seg is not None:
      dq = lax.fori_loop(0, u0, functools.partial(step, masked=True), dq)
    dq = lax.fori_loop(u0, u1, functools.partial(step, masked=False), dq)
    if kp.needs_mask:
      dq = lax.fori_loop(u1, steps, functools.partial(step, masked=True), dq)
    if kp.causal or seg is not None:
      lax.fori_loop(steps, cta_steps, idle_step, None)

    def store_dq():
      q_smem[...] = (dq * kp.scale).astype(kp.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])

    if tail is None:
      store_dq()
    else:
      pl.when(~is_part)(store_dq)
      pl.when(is_part)(lambda: _store_part(tail.parts[0].at[part_row, wg], dq * kp.scale))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the kernel's end (see _store_dk_dv)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(kp.producer_registers, action="decrease")
    kvh = lax.div(h, kp.group)
    rows = lambda j: (b, pl.ds((kv0 + j) * bkv, bkv), kvh)  # noqa: E731
    _produce(cta_steps, (stages, v_stages), ((k_ref, k_scratch, k_ready, k_free, rows),
                                             (v_ref, v_scratch, v_ready, v_free, rows)))


class _PartRefs(NamedTuple):
  """A split-tail kernel's partial outputs (GMEM, float32): dQ's [rows, 2, block_q, D], or
  dK's and dV's [rows, 2, block_kv, D], one row per tail CTA (split_tail.TailSplit)."""

  split: split_tail.TailSplit
  parts: tuple


def _store_part(dst, acc):
  """Stores a warpgroup's float32 accumulator [rows, D] straight from registers to its
  partial's GMEM rows: no shared memory is left for a float32 staging tile (the dQ kernel
  uses 231,552 of 232,448 B), and a part stores once."""
  dst[...] = acc


def _dq_row_stats(lse_smem, correction_smem, o_smem, do_smem):
  """lse2 and delta [block_q] (ROW layout) of a WG's rows, FA2's backward preprocessing.

  lse2 = lse·log2(e) with -inf (a fully masked row) mapped to +inf, so that exp2(S·c − lse2)
  is 0 there without a select; delta = rowsum(O∘dO) in float32 (a fixed order: each thread's
  columns, then the shuffles across the row's 4 threads), plus the correction -dlse when
  correction_smem is given.
  """
  lse = plgpu.load(lse_smem, layout=_common.ROW)
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse) * LOG2E
  o = plgpu.load(o_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  do = plgpu.load(do_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  delta = jnp.sum(o * do, axis=1)
  if correction_smem is not None:
    delta = delta + plgpu.load(correction_smem, layout=_common.ROW)
  return lse2, delta


def _produce(num_steps, stages, streams):
  """Producer loop: TMA step j of every (gmem, smem ring, ready, free, index) stream into slot
  j % stages, where index(j) gives the gmem slice (stages: one depth for all streams, or a
  tuple of one per stream).

  A slot is refilled once its free barrier completed; the last releases are observed as well,
  since every waiter of an mbarrier must see each of its phases.
  """
  if not isinstance(stages, int):
    if len(set(stages)) > 1:
      return _produce_rings(num_steps, stages, streams)
    stages = stages[0]

  def load(j, slot):
    for src, dst, ready, _, index in streams:
      plgpu.copy_gmem_to_smem(src.at[index(j)], dst.at[slot], ready.at[slot])

  for i in range(stages):
    pl.when(i < num_steps)(functools.partial(load, i, i))

  @pl.loop(stages, num_steps)
  def _(j):
    slot = lax.rem(j, stages)
    for src, dst, ready, free, index in streams:
      with jax.named_scope("wait_free"):
        plgpu.barrier_wait(free.at[slot])
      plgpu.copy_gmem_to_smem(src.at[index(j)], dst.at[slot], ready.at[slot])

  _common.observe_last_releases([free for _, _, _, free, _ in streams], num_steps, stages)


def _produce_rings(num_steps, depths, streams):
  """_produce with a ring depth per stream: step j of a stream of depth n waits for the
  release of step j - n (from j = n on), in stream order, so a shallow ring's wait holds back
  the deeper rings' next loads only once they are a step ahead."""
  @pl.loop(0, num_steps)
  def _(j):
    for n, (src, dst, ready, free, index) in zip(depths, streams):
      slot = lax.rem(j, n)
      pl.when(j >= n)(lambda: plgpu.barrier_wait(free.at[slot]))
      plgpu.copy_gmem_to_smem(src.at[index(j)], dst.at[slot], ready.at[slot])

  for n, stream in zip(depths, streams):
    _common.observe_last_releases([stream[3]], num_steps, n)


def _bwd_dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_scratch,
                     v_scratch, q_scratch, do_scratch, lse_scratch, delta_scratch, st_scratch,
                     kv_ready, q_ready, do_ready, lse_ready, delta_ready, q_free, do_free,
                     lse_free, delta_free, sched, *, kp: _common.KernelParams,
                     seg: _common.SegmentRefs | None = None, tail: _PartRefs | None = None):
  """q/do_ref [B, Tp, H, D], k/v_ref [B, Sp, K, D], lse (log2 units)/delta_ref [B, H, Tp].

  Grid over (Sp / (2·block_kv), K, B) in _launch_order's order; dk/dv_ref [B, Sp, K, D]
  float32-accumulated, stored in dtype; k/v_scratch [2, block_kv, D], q/do_scratch [stages,
  block_q, D], lse/delta_scratch [stages, block_q], st_scratch [2, block_kv, block_q]
  (interpret only), sched: the two-WG schedule barrier of kp.dkdv_pingpong (else None).
  Steps run over (q block i, query head g) with g minor, starting at the first q block that
  sees the CTA's keys.

  Ping-pong: per step a WG issues Sᵀ, dPᵀ, syncs (handing the tensor cores to the other WG),
  forms Pᵀ, dSᵀ, syncs again and issues dV, dK; WG 1 starts and WG 0 ends with one extra sync,
  so WG 0's elementwise work runs while WG 1's matmuls do and vice versa (the forward's
  schedule). Skipped steps sync twice, keeping the rounds paired.

  seg: segment ids of the key rows and of the queries, and per kv tile the hull of q blocks
  that may share an id with it: the CTA streams only those, and compares ids on each except
  the q blocks wholly inside the tile's one document.

  tail (non-causal, no seg): the split tail's one-dimensional grid; a part
  streams its share of the tile's steps and writes dK·scale and dV in float32 to
  tail.parts[0 / 1][part row, wg]. The parts divide the steps evenly (tail_splits), so that
  the main CTAs and the parts each run a loop of static length (see the end of _consumer):
  with one loop over a dynamic step count ptxas kept 11 words in local memory at 240
  registers, stored and reloaded every step; now 1 (deviceless SASS, 1x16384x16x128).
  """
  bq, bkv, stages, g_size = kp.block_q, kp.block_kv, kp.stages, kp.group
  wg = lax.axis_index("wg")
  is_part = part_row = None
  if tail is None:
    b = lax.axis_index("b")
    kt, kvh = _tile_and_head(("kt", "kvh"), k_ref.shape[2], kp)
  else:
    is_part, part_row, (b, kvh, kt) = tail.split.this_cta()
  cta_k0 = kt * (2 * bkv)
  cta_first = _first_q_block(cta_k0, kp)
  cta_last = kp.t_pad // bq
  if seg is not None:
    first, last, full_first, full_last = _common.segment_limits(seg.limits, b, kt)
    cta_first, cta_last = jnp.maximum(cta_first, first), jnp.minimum(cta_last, last)
    cta_last = jnp.maximum(cta_last, cta_first)  # no q block: zero steps, dK = dV = 0
  cta_steps = (cta_last - cta_first) * g_size
  step0 = 0  # a tail part's first step
  if tail is not None:
    tile_steps = cta_steps
    part_steps = _even_share(cta_steps, tail.split.parts)
    step0 = lax.rem(part_row, tail.split.parts) * part_steps
    cta_steps = jnp.where(is_part, part_steps, cta_steps)

  def index(step):
    step = step + step0
    i = cta_first + lax.div(step, g_size)
    return i, kvh * g_size + lax.rem(step, g_size)

  streams = ((q_ref, q_scratch, q_ready, q_free), (do_ref, do_scratch, do_ready, do_free),
             (lse_ref, lse_scratch, lse_ready, lse_free),
             (delta_ref, delta_scratch, delta_ready, delta_free))

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(kp.compute_registers, action="increase")
    k_smem, v_smem = k_scratch.at[wg], v_scratch.at[wg]
    k0 = cta_k0 + wg * bkv
    rows = (b, pl.ds(k0, bkv), kvh)
    _load_kv_tiles(k_ref, v_ref, k_smem, v_smem, kv_ready, wg, rows)

    st_smem = _at(st_scratch, wg)  # interpret mode only

    pingpong = functools.partial(_common.sync, sched) if kp.dkdv_pingpong else None
    ids = None
    if seg is not None and kp.segment_ids:
      ids_at = _common.row_and_col_ids(seg, b, k0, bkv, bq)
      ids = lambda t: ids_at(index(t)[0] * bq)  # noqa: E731

    def step(t, carry, *, masked: bool):
      dk, dv = carry
      slot = lax.rem(t, stages)
      q_smem, do_smem = _wait_streams(streams, slot)
      if kp.dkdv_schedule == "overlap" and not (kp.interpret or pingpong or masked):
        # Unmasked steps only: the mask's iotas on top of the overlap's live registers spill
        # inside the loop (deviceless SASS); masked steps run "batched".
        return _overlapped_dk_dv_step(
            dk, dv, (k_smem, v_smem, q_smem, do_smem), streams, slot, k0, None,
            (do_free.at[slot], q_free.at[slot]), kp)
      p_t, ds_t = _transposed_grad_tiles(k_smem, v_smem, q_smem, do_smem, streams, slot, k0,
                                         (lambda: index(t)[0]) if masked else None, kp,
                                         handoff=pingpong, ids=ids and ids(t))
      if pingpong:
        # Pin Pᵀ and dSᵀ before the barrier, so their elementwise work is not sunk past it.
        p_t, ds_t = lax.optimization_barrier((p_t, ds_t))
        pingpong()
      return _dk_dv_updates(dk, dv, p_t, ds_t, q_smem, do_smem, st_smem,
                            (do_free.at[slot], q_free.at[slot]), kp)

    def skip_step(t, carry):
      _skip_step(t, carry, streams=streams, stages=stages)
      if pingpong:
        pingpong()
        pingpong()
      return carry

    zeros = plgpu.layout_cast(jnp.zeros((bkv, kp.d), jnp.float32), plgpu.Layout.WGMMA)
    carry = (zeros, zeros)
    # Causal: q blocks before `first` do not see these keys, blocks in [first, full) cross the
    # diagonal and are masked, blocks from `full` on see every key of the tile.
    first = (_first_q_block(k0, kp) - cta_first) * g_size
    if seg is not None:  # cta_first may lie past this WG's first q block
      first = jnp.clip(first, 0, cta_steps)
    if pingpong:
      pl.when(wg == 1)(pingpong)
    lax.fori_loop(0, first, skip_step, None)
    if seg is not None:
      # Ids are compared except on the q blocks wholly inside the tile's one document, and
      # (causal) past the diagonal.
      lo = (full_first - cta_first) * g_size
      if kp.causal:
        lo = jnp.maximum(lo, _first_unmasked_step(k0, cta_first, kp))
      lo = jnp.clip(lo, first, cta_steps)
      hi = jnp.clip((full_last - cta_first) * g_size, lo, cta_steps)
      carry = lax.fori_loop(first, lo, functools.partial(step, masked=True), carry)
      carry = lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
      carry = lax.fori_loop(hi, cta_steps, functools.partial(step, masked=True), carry)
      first = cta_steps
    elif kp.causal:
      full = _first_unmasked_step(k0, cta_first, kp)
      carry = lax.fori_loop(first, full, functools.partial(step, masked=True), carry)
      first = full

    def last_steps(end):
      dk, dv = lax.fori_loop(first, end, functools.partial(step, masked=False), carry)
      if pingpong:
        pl.when(wg == 0)(pingpong)
      return dk, dv

    if tail is None:
      dk, dv = last_steps(cta_steps)
      _store_dk_dv(dk, dv, k_smem, v_smem, dk_ref, dv_ref, rows, kp)
    else:
      # Non-causal (first = 0): the main CTAs and the parts each loop a static step count,
      # in the two branches of a cond (nothing of one branch is live in the other's loop),
      # and each rederives its outputs' coordinates from the CTA index after its loop rather
      # than holding those above through it (ptxas kept them in local memory, reloaded
      # every step; the unsplit kernel rereads its grid indices).
      def main():
        dk, dv = last_steps(tile_steps)
        b_, kvh_, kt_ = tail.split.coords(lax.axis_index("t"))
        rows_ = (b_, pl.ds(kt_ * (2 * bkv) + wg * bkv, bkv), kvh_)
        _store_dk_dv(dk, dv, k_smem, v_smem, dk_ref, dv_ref, rows_, kp)

      def part():
        dk, dv = last_steps(part_steps)
        row = lax.axis_index("t") - tail.split.main
        _store_part(tail.parts[0].at[row, wg], dk * kp.scale)
        _store_part(tail.parts[1].at[row, wg], dv)

      lax.cond(is_part, part, main)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(kp.producer_registers, action="decrease")
    _produce_query_streams(cta_steps, stages, streams, index, b, bq, kp)


# Pieces of the dK/dV kernel that the fused backward (backward_fused.py) shares. A WG owns
# block_kv key rows (K, V resident in SMEM) and streams, per (q block, query head) step, Q, dO,
# lse and delta through `streams`: four (gmem ref, smem ring, ready, free) tuples in that order.


def _even_share(steps: int, parts: int) -> int:
  """Steps per part when `parts` CTAs share a tile's static `steps` (tail_splits lets the
  dK/dV kernel split only where they divide)."""
  if not isinstance(steps, int) or steps % parts:
    raise ValueError(f"a split dK/dV tile needs a static step count that its {parts} parts "
                     f"divide, got {steps}")
  return steps // parts


def _first_q_block(k0, kp: _common.KernelParams):
  """The first query block that sees key k0 (causal: the block holding query k0; else 0)."""
  if not kp.causal:
    return 0
  return jnp.minimum(kp.t_pad // kp.block_q, lax.div(k0, kp.block_q))


def _first_unmasked_step(k0, cta_first, kp: _common.KernelParams):
  """Causal: the first step (counted from q block cta_first, G query heads per block) whose
  q block sees every key of k0 .. k0 + block_kv - 1."""
  bq = kp.block_q
  full = jnp.minimum(kp.t_pad // bq, lax.div(k0 + kp.block_kv - 1 + bq - 1, bq))
  return jnp.maximum(full - cta_first, 0) * kp.group


def _load_kv_tiles(k_ref, v_ref, k_smem, v_smem, kv_ready, wg, rows):
  """TMA-loads WG `wg`'s K and V tiles (k/v_ref[rows]) and waits for both."""
  plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, kv_ready.at[wg, 0])
  plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, kv_ready.at[wg, 1])
  plgpu.barrier_wait(kv_ready.at[wg, 0])
  plgpu.barrier_wait(kv_ready.at[wg, 1])


def _wait_streams(streams, slot):
  """Waits until every stream has filled `slot`; returns that slot's Q and dO tiles."""
  with jax.named_scope("wait_q"):
    for _, _, ready, _ in streams:
      plgpu.barrier_wait(ready.at[slot])
  return streams[0][1].at[slot], streams[1][1].at[slot]


def _skip_step(t, carry, *, streams, stages: int):
  """A step whose q block sees none of this WG's keys: keeps the rings' barriers in phase."""
  slot = lax.rem(t, stages)
  for _, _, ready, free in streams:
    plgpu.barrier_wait(ready.at[slot])
    plgpu.barrier_arrive(free.at[slot])
  return carry


def _transposed_grad_tiles(k_smem, v_smem, q_smem, do_smem, streams, slot, k0, mask_block, kp,
                           handoff=None, ids=None, early_probs=False):
  """Pᵀ and dSᵀ [block_kv, block_q] float32 of one step; releases its lse and delta slots.

  Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (SMEM operands), Pᵀ = exp2(Sᵀ·c − lse2), dSᵀ = Pᵀ∘(dPᵀ − delta).
  mask_block: None when every key of the tile is visible to the step's queries, else a
  function giving the step's q block (called only then); invisible entries of Pᵀ become 0.
  handoff: called once both matmuls are issued (the ping-pong's schedule sync), or None.
  ids: (key ids [block_kv] ROW, query ids [block_q] COL) of a segmented call (with mask_block).
  early_probs: wait for Sᵀ alone and form Pᵀ while dPᵀ runs (MosaicConfig.fused_early_probs).
  """
  bq, bkv = kp.block_q, kp.block_kv

  def scores(s_ref, dp_ref):
    plgpu.wgmma(s_ref, k_smem, q_smem.T)
    plgpu.wgmma(dp_ref, v_smem, do_smem.T)
    if handoff is not None:
      handoff()
    if not early_probs:
      return s_ref[...], dp_ref[...]
    # Sᵀ alone is waited for; Pᵀ's exp2s run while dPᵀ is on the tensor cores. delta is
    # loaded only after dPᵀ's wait, so that its registers are not live through the exp2s.
    p_t, slope = _probs_t(plgpu.wgmma_accumulator_load(s_ref, wait_n=1),
                          _step_stat(streams, slot, 2), k0, mask_block, kp, ids)
    return p_t, grad_scores_t(p_t, slope, dp_ref[...], _step_stat(streams, slot, 3))

  with jax.named_scope("scores"):
    s_t, dp_t = pl.run_scoped(scores, plgpu.ACC((bkv, bq), jnp.float32),
                              plgpu.ACC((bkv, bq), jnp.float32))
  if early_probs:
    return s_t, dp_t  # already Pᵀ and dSᵀ
  with jax.named_scope("softmax"):
    lse, delta = _step_stats(streams, slot)
    p_t, slope = _probs_t(s_t, lse, k0, mask_block, kp, ids)
    ds_t = grad_scores_t(p_t, slope, dp_t, delta)
  return p_t, ds_t


def _step_stats(streams, slot):
  """The lse (log2 units) and delta column vectors [block_q] of ring slot `slot`, whose
  buffers are released right after the load."""
  (_, lse_scratch, _, lse_free), (_, delta_scratch, _, delta_free) = streams[2:]
  lse = plgpu.load(lse_scratch.at[slot], layout=_common.COL)
  delta = plgpu.load(delta_scratch.at[slot], layout=_common.COL)
  plgpu.barrier_arrive(lse_free.at[slot])
  plgpu.barrier_arrive(delta_free.at[slot])
  return lse, delta


def _step_stat(streams, slot, which: int):
  """One row statistic [block_q] COL of ring slot `slot`: lse (which 2) or delta (3), its
  buffer released right after the load (the fused_overlap step loads delta late).
  `_step_stats` is not built on it: it loads both before releasing either, the order the
  split kernels ran on the H200."""
  _, scratch, _, free = streams[which]
  x = plgpu.load(scratch.at[slot], layout=_common.COL)
  plgpu.barrier_arrive(free.at[slot])
  return x


def _probs_t(s_t, lse, k0, mask_block, kp: _common.KernelParams, ids=None):
  """(Pᵀ, slope): Pᵀ = exp2(soft_cap(Sᵀ)·c − lse2) [block_kv, block_q] with the entries the
  mask hides set to 0 (mask_block: see _transposed_grad_tiles), and the soft cap's slope
  (_common.soft_cap_with_slope; None without a cap) for `grad_scores_t`."""
  s_t, slope = _common.soft_cap_with_slope(s_t, kp)
  p_t = jnp.exp2(s_t * kp.c - lax.broadcast_in_dim(lse, s_t.shape, [1]))
  if mask_block is not None:
    visible = _common.tile_mask(k0, mask_block() * kp.block_q, (kp.block_kv, kp.block_q), kp,
                                transposed=True, ids=ids)
    p_t = jnp.where(visible, p_t, 0.0)
  return p_t, slope


def grad_scores_t(p_t, slope, dp_t, delta):
  """dSᵀ = Pᵀ∘(dPᵀ − delta) [block_kv, block_q], times the soft cap's slope where there is one
  (the raw scores' gradient); delta [block_q] COL."""
  if slope is not None:
    p_t = p_t * slope
  return p_t * (dp_t - lax.broadcast_in_dim(delta, p_t.shape, [1]))


def _dk_dv_updates(dk, dv, p_t, ds_t, q_smem, do_smem, st_smem, frees, kp):
  """dV += Pᵀ·dO and dK += dSᵀ·Q (p_t, ds_t [block_kv, block_q] f32, converted to kp.dtype
  register operands), each waited for in turn, or with kp.dkdv_schedule "batched" issued back
  to back with one wait.

  frees = (dO's, Q's) free barriers of the step, each arrived on once the matmul reading that
  tile has retired.
  """
  do_free, q_free = frees
  if kp.interpret or kp.dkdv_schedule == "serial":  # "overlap" runs its masked steps batched
    dv = _common.accumulate(dv, p_t.astype(kp.dtype), st_smem, do_smem, kp)
    plgpu.barrier_arrive(do_free)
    dk = _common.accumulate(dk, ds_t.astype(kp.dtype), st_smem, q_smem, kp)
    plgpu.barrier_arrive(q_free)
    return dk, dv

  p16, ds16 = p_t.astype(kp.dtype), ds_t.astype(kp.dtype)

  def mm(refs):
    dv_ref, dk_ref = refs
    plgpu.wgmma(dv_ref, p16, do_smem)
    plgpu.wgmma(dk_ref, ds16, q_smem)
    plgpu.wgmma_wait(1)
    plgpu.barrier_arrive(do_free)

  with jax.named_scope("grad_mm"):
    dv, dk = pl.run_state(mm)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
  plgpu.barrier_arrive(q_free)
  return dk, dv


def _overlapped_dk_dv_step(dk, dv, tiles, streams, slot, k0, mask_block, frees,
                           kp: _common.KernelParams):
  """One dK/dV step with dkdv_schedule "overlap": the elementwise work runs under matmuls.

  tiles: the WG's K, V and the step's Q, dO SMEM tiles; mask_block, frees: as in
  `_transposed_grad_tiles` and `_dk_dv_updates`. wgmma groups retire in issue order:

    issue Sᵀ, dPᵀ | wait 1: Sᵀ -> Pᵀ (dPᵀ running) | issue dV += Pᵀ·dO |
    wait 1: dPᵀ -> dSᵀ (dV running) | scope exit waits dV -> release dO |
    issue dK += dSᵀ·Q, wait -> release Q.

  Same products in the same order as "serial", so the same bits. Pᵀ stays float32 for dSᵀ
  while its 16-bit copy is dV's register operand (a new value, not a redefinition of an
  in-flight operand's registers: no C7513).
  """
  k_smem, v_smem, q_smem, do_smem = tiles
  do_free, q_free = frees
  if kp.dkdv_fold_stats and mask_block is None and kp.softcap is None:
    return _folded_dk_dv_step(dk, dv, tiles, streams, slot, frees, kp)
  acc_t = plgpu.ACC((kp.block_kv, kp.block_q), jnp.float32)

  def body(refs):
    dv_ref, dk_ref = refs

    def scores(s_ref, dp_ref):
      plgpu.wgmma(s_ref, k_smem, q_smem.T)
      plgpu.wgmma(dp_ref, v_smem, do_smem.T)
      lse, delta = _step_stats(streams, slot)
      p_t, slope = _probs_t(plgpu.wgmma_accumulator_load(s_ref, wait_n=1), lse, k0,
                            mask_block, kp)
      plgpu.wgmma(dv_ref, p_t.astype(kp.dtype), do_smem)
      dp_t = plgpu.wgmma_accumulator_load(dp_ref, wait_n=1)
      return grad_scores_t(p_t, slope, dp_t, delta)

    ds_t = pl.run_scoped(scores, acc_t, acc_t)
    plgpu.wgmma_wait(0)  # dV (also covered by the scope's exit): dO is free
    plgpu.barrier_arrive(do_free)
    plgpu.wgmma(dk_ref, ds_t.astype(kp.dtype), q_smem)

  with jax.named_scope("overlap_step"):
    dv, dk = pl.run_state(body)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
  plgpu.barrier_arrive(q_free)
  return dk, dv


def _folded_dk_dv_step(dk, dv, tiles, streams, slot, frees, kp: _common.KernelParams):
  """An unmasked "overlap" step with MosaicConfig.dkdv_fold_stats: the same order of issues
  and waits, with Sᵀ starting from -lse2/c and dPᵀ from -delta, so that lse and delta are
  spent before the matmuls are issued."""
  k_smem, v_smem, q_smem, do_smem = tiles
  do_free, q_free = frees
  shape = (kp.block_kv, kp.block_q)
  lse, delta = _step_stats(streams, slot)
  s0 = lax.broadcast_in_dim(lse * (-1.0 / kp.c), shape, [1])
  dp0 = lax.broadcast_in_dim(-delta, shape, [1])

  def body(refs):
    dv_ref, dk_ref, s_ref, dp_ref = refs
    plgpu.wgmma(s_ref, k_smem, q_smem.T)
    plgpu.wgmma(dp_ref, v_smem, do_smem.T)
    p_t = jnp.exp2(plgpu.wgmma_accumulator_load(s_ref, wait_n=1) * kp.c)
    plgpu.wgmma(dv_ref, p_t.astype(kp.dtype), do_smem)
    ds_t = p_t * plgpu.wgmma_accumulator_load(dp_ref, wait_n=1)
    plgpu.wgmma_wait(0)  # dV: dO is free
    plgpu.barrier_arrive(do_free)
    plgpu.wgmma(dk_ref, ds_t.astype(kp.dtype), q_smem)

  with jax.named_scope("folded_step"):
    dv, dk, _, _ = pl.run_state(body)((plgpu.ACC.init(dv), plgpu.ACC.init(dk),
                                       plgpu.ACC.init(s0), plgpu.ACC.init(dp0)))
  plgpu.barrier_arrive(q_free)
  return dk, dv


def _store_dk_dv(dk, dv, k_smem, v_smem, dk_ref, dv_ref, rows, kp: _common.KernelParams):
  """Writes dK·scale and dV [block_kv, D] through the K and V tiles (no longer read), then
  waits until every SMEM-to-GMEM copy this thread issued, these included, has read its shared
  memory: the kernel ends here, and its writes to GMEM complete before the kernel does
  (CUTLASS's epilogues wait the same way), so the SM is free for the next CTA sooner."""
  k_smem[...] = (dk * kp.scale).astype(kp.dtype)
  v_smem[...] = dv.astype(kp.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rows], commit_group=False)
  plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rows], commit_group=False)
  plgpu.commit_smem_to_gmem_group()
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _produce_query_streams(cta_steps, stages, streams, index, b, bq, kp: _common.KernelParams):
  """The producer of the dK/dV-style kernels: the Q and dO rows and the lse and delta entries
  of step t's (q block, query head) = index(t). kp.flat_stats: lse and delta are
  kp.stats_view's [1, B·H, Tp], entry (b, h) at row b·H + h."""
  def q_rows(t):
    i, h = index(t)
    return b, pl.ds(i * bq, bq), h

  def stat_rows(t):
    i, h = index(t)
    if kp.flat_stats:  # H is the query heads of Q, streams[0]'s ref
      return 0, b * streams[0][0].shape[2] + h, pl.ds(i * bq, bq)
    return b, h, pl.ds(i * bq, bq)

  _produce(cta_steps, stages, tuple((*stream, rows) for stream, rows in
                                    zip(streams, (q_rows, q_rows, stat_rows, stat_rows))))


def _with_absent_refs(kernel, present, *refs, **kwargs):
  """Calls kernel with None for each ref whose entry in `present` (the kernel's inputs, then
  outputs) is False, the given refs elsewhere; scratch refs follow unchanged. Bind kernel and
  present with functools.partial to get a body for plgpu.kernel."""
  given = iter(refs)
  return kernel(*(next(given) if p else None for p in present), *given, **kwargs)


def dq_smem_bytes(kp: _common.KernelParams, *, in_kernel: bool, correction: bool) -> int:
  """Shared memory of one dQ CTA (_dq_call's scratch): Q, dO (and O with the statistics in the
  kernel) [2 WGs, block_q, D], lse and delta [2, block_q] float32, the K and V rings, the
  barriers and 1 KiB that Mosaic adds (the estimate equals its 231,552 B with and 198,784 B
  without the O tile at head_dim 128, block_q 64, block_kv 128, 2 stages)."""
  itemsize = jnp.dtype(kp.dtype).itemsize
  rows = (3 if in_kernel else 2) * 2 * kp.block_q * kp.d * itemsize + 2 * 2 * kp.block_q * 4
  slots = kp.stages + kp.dq_v_stages
  ring = slots * kp.block_kv * kp.d * itemsize
  barriers = 8 * (2 * (3 + (correction or not in_kernel) + in_kernel) + 2 * slots)
  return rows + ring + barriers + 1024


def _dq_call(q, k, v, do, o, lse, delta, *, kp: _common.KernelParams, segs=(),
             split: split_tail.TailSplit | None = None):
  """dQ [B, T, H, D], or (dQ, lse2, delta) when o is given: see _bwd_dq_kernel's two forms
  (o None: lse in log2 units and the full delta; else natural-log lse and delta the correction
  or None). q, do, o [B, T, H, D] and k, v [B, S, K, D] padded as _common.operand_rows says;
  lse, delta and the lse2 and delta it returns [B, H, Tp]. segs: () or (q_seg [B, Tp], kv_seg
  [B, Sp], kv limits per q tile) int32. split (no segs): the split tail; dQ then comes back
  with the tail tiles summed in from their parts."""
  bsz, _, h, d = q.shape
  t_pad = kp.t_pad
  bq, bkv, stages = kp.block_q, kp.block_kv, kp.stages
  tiles = _common.smem_transforms(kp.dtype)
  in_kernel = o is not None
  inputs = (q, k, v, do, o, lse, delta)
  row_tile = plgpu.SMEM((2, bq, d), kp.dtype, transforms=tiles)
  scratch = [
      row_tile,
      row_tile,
      row_tile if in_kernel else None,
      plgpu.SMEM((2, bq), jnp.float32),
      plgpu.SMEM((2, bq), jnp.float32),
      plgpu.SMEM((stages, bkv, d), kp.dtype, transforms=tiles),
      plgpu.SMEM((kp.dq_v_stages, bkv, d), kp.dtype, transforms=tiles),
      plgpu.SMEM((2, bq, bkv), kp.dtype, transforms=tiles) if kp.interpret else None,
      # One per row load of a WG: Q, dO, lse, then delta and O where given.
      plgpu.Barrier(num_barriers=(2, 3 + (delta is not None) + in_kernel)),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=kp.dq_v_stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=kp.dq_v_stages),
  ]
  dq = jax.ShapeDtypeStruct(q.shape, q.dtype)
  row_stats = jax.ShapeDtypeStruct((bsz, h, t_pad), jnp.float32)
  out_type = [dq, row_stats, row_stats] if in_kernel else [dq]
  present = [x is not None for x in inputs] + [True, in_kernel, in_kernel]
  kernel = functools.partial(_with_absent_refs, functools.partial(_bwd_dq_kernel, kp=kp), present)
  body = _common.with_segment_refs(kernel, sum(present) - len(out_type), bool(segs))
  launch = _launch_order(t_pad // (2 * bq), h, bsz, ("qt", "h", "b"), kp)
  if split is not None:
    body, launch = _split_body(kernel, split, sum(present), 1), _split_launch(split)
    out_type.append(jax.ShapeDtypeStruct((split.tail_tiles * split.parts, 2, bq, d),
                                         jnp.float32))
  out = plgpu.kernel(
      body,
      out_type=tuple(out_type),
      scratch_types=scratch,
      **launch,
      num_threads=3, thread_name="wg",
      compiler_params=_common.compiler_params(),
      interpret=_common.interpret_params(kp.interpret),
  )(*(x for x in inputs if x is not None), *segs)
  if split is not None:
    *out, dq_part = out
    out[0] = split_tail.sum_parts(out[0], dq_part, split)
  return tuple(out) if in_kernel else out[0]


def _split_body(kernel, split: split_tail.TailSplit, refs: int, parts: int):
  """A plgpu.kernel body calling `kernel` under a split tail: the first `refs` refs (inputs
  and outputs) as given, the next `parts` (the partial outputs) as tail=_PartRefs, then the
  scratch."""
  def body(*all_refs):
    return kernel(*all_refs[:refs], *all_refs[refs + parts:],
                  tail=_PartRefs(split, all_refs[refs:refs + parts]))
  return body


def _split_launch(split: split_tail.TailSplit) -> dict:
  return dict(grid=(split.ctas,), grid_names=("t",))


def kv_stream_smem(kp: _common.KernelParams, d: int) -> list:
  """Shared memory of a kernel that owns K/V tiles and streams Q/dO (dK/dV, fused backward):
  K and V [2 WGs, block_kv, D], the Q and dO rings [stages, block_q, D] and the lse / delta rows
  of each slot [stages, block_q]."""
  bq, bkv, stages = kp.block_q, kp.block_kv, kp.stages
  tiles = _common.smem_transforms(kp.dtype)
  return [plgpu.SMEM((2, bkv, d), kp.dtype, transforms=tiles),
          plgpu.SMEM((2, bkv, d), kp.dtype, transforms=tiles),
          plgpu.SMEM((stages, bq, d), kp.dtype, transforms=tiles),
          plgpu.SMEM((stages, bq, d), kp.dtype, transforms=tiles),
          plgpu.SMEM((stages, bq), jnp.float32),
          plgpu.SMEM((stages, bq), jnp.float32)]


def kv_stream_barriers(kp: _common.KernelParams) -> list:
  """Barriers of kv_stream_smem: the K/V loads [2 WGs, 2], then ready and free (both consumer
  WGs arrive) rings of Q, dO, lse and delta."""
  ring = [plgpu.Barrier(num_barriers=kp.stages) for _ in range(4)]
  free = [plgpu.Barrier(num_arrivals=2, num_barriers=kp.stages) for _ in range(4)]
  return [plgpu.Barrier(num_barriers=(2, 2)), *ring, *free]


def _dkdv_call(q, k, v, do, lse2, delta, *, kp: _common.KernelParams, segs=(),
               split: split_tail.TailSplit | None = None):
  """(dK, dV) [B, S, K, D] for q, do [B, T, H, D] and k, v [B, S, K, D], T and S padded as
  _common.operand_rows says; lse2, delta [B, H, Tp] (kp.stats_view). segs: () or (kv_seg
  [B, Sp], q_seg [B, Tp], q limits per kv tile) int32. split (no segs): the split tail, its
  tiles summed in from their parts."""
  bsz, _, kh, d = k.shape
  s_pad = kp.s_pad
  bq, bkv = kp.block_q, kp.block_kv
  tiles = _common.smem_transforms(kp.dtype)
  scratch = [
      *kv_stream_smem(kp, d),
      plgpu.SMEM((2, bkv, bq), kp.dtype, transforms=tiles) if kp.interpret else None,
      *kv_stream_barriers(kp),
      plgpu.Barrier(num_arrivals=2) if kp.dkdv_pingpong else None,
  ]
  kv_out = jax.ShapeDtypeStruct(k.shape, k.dtype)
  out_type = [kv_out, kv_out]
  kernel = functools.partial(_bwd_dkdv_kernel, kp=kp)
  body = _common.with_segment_refs(kernel, 6, bool(segs))
  launch = _launch_order(s_pad // (2 * bkv), kh, bsz, ("kt", "kvh", "b"), kp)
  if split is not None:
    body, launch = _split_body(kernel, split, 8, 2), _split_launch(split)
    out_type += [jax.ShapeDtypeStruct((split.tail_tiles * split.parts, 2, bkv, d),
                                      jnp.float32)] * 2
  out = plgpu.kernel(
      body,
      out_type=tuple(out_type),
      scratch_types=scratch,
      **launch,
      num_threads=3, thread_name="wg",
      # Profiled (kp.profile_dir) for at most PROFILE_STEPS steps, as the forward; the dQ
      # kernel never is, so that a backward's trace holds one kernel's events.
      compiler_params=_common.compiler_params(kp, min(profile_steps(kp), PROFILE_STEPS)),
      interpret=_common.interpret_params(kp.interpret),
  )(q, k, v, do, kp.stats_view(lse2), kp.stats_view(delta), *segs)
  if split is None:
    return out
  dk, dv, dk_part, dv_part = out
  return split_tail.sum_parts(dk, dk_part, split), split_tail.sum_parts(dv, dv_part, split)


# Steps per warpgroup that a profiled kernel (MosaicConfig.profile_dir) records: its event
# buffer lives in shared memory, which the fused kernel nearly fills.
PROFILE_STEPS = 32


def profile_steps(kp: _common.KernelParams) -> int:
  """The most loop steps a warpgroup of a kernel that streams Q/dO runs (dK/dV, fused)."""
  return kp.t_pad // kp.block_q * kp.group


def _launch_order(tiles, heads, bsz, names, kp: _common.KernelParams) -> dict:
  """The backward kernels' grid and grid_names (_common.launch_grid with the backward's
  order: kp.bwd_heads_fastest, kp.bwd_head_group)."""
  return _common.launch_grid(tiles, heads, bsz, names, heads_fastest=kp.bwd_heads_fastest,
                             head_group=kp.bwd_head_group)


def _tile_and_head(names, heads: int, kp: _common.KernelParams):
  """(tile, head) of this CTA under the grid of _launch_order(tiles, heads, .., names, kp)."""
  return _common.tile_and_head(names, heads, heads_fastest=kp.bwd_heads_fastest,
                               head_group=kp.bwd_head_group)


def _xla_row_stats(o, lse, do, correction):
  """The API's preprocessing, for the paths that do not compute it in a kernel: lse with +inf
  on fully masked rows and delta = rowsum(dO∘O) + correction [B, H, T] float32."""
  delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32))
  if correction is not None:
    delta = delta + correction
  return jnp.where(lse == -jnp.inf, jnp.inf, lse), delta


def split_kernel_params(q, k, params: AttentionParams, config: MosaicConfig, *, t_pad: int,
                        s_pad: int):
  """(dQ kernel's, dK/dV kernel's) KernelParams for q [B, T, H, D], k [B, S, K, D] (arrays or
  jax.ShapeDtypeStruct), their tiles covering t_pad / s_pad rows."""
  make = functools.partial(_common.KernelParams.make, q, k, params=params, t_pad=t_pad,
                           s_pad=s_pad, kv_len=k.shape[1], config=config)
  return (make(block_q=config.block_q_dq, block_kv=config.block_kv_dq,
               stages=min(config.bwd_stages, s_pad // config.block_kv_dq)),
          make(block_q=config.block_q_dkv, block_kv=config.block_kv_dkv,
               stages=min(config.bwd_stages, t_pad // config.block_q_dkv)))


def step_cost(products: int, rows: int, cols: int) -> float:
  """A kernel step of `products` tile matmuls of rows x cols (x D) in forward key-block steps
  (2 products of 128 x 128), split_tail's cost unit: the dQ kernel's step (3 products of
  128 query rows x 128 keys) is 1.5, the dK/dV kernel's (4 of 128 keys x 64 queries) 1.0."""
  return products * rows * cols / (2 * 128 * 128)


def tail_splits(kp_dq, kp_dkdv, batch: int, heads: int, kv_heads: int,
                params: AttentionParams, config: MosaicConfig):
  """(dQ kernel's, dK/dV kernel's) split tail (MosaicConfig.bwd_split_tail), each None where
  it does not apply (causal, segment ids, a head group's launch order) or no split pays."""
  kernels = config.bwd_split_tail.split(",")
  if params.is_causal or _common.segment_path(params):
    return None, None

  def plan(name, kp, tiles, heads, steps, cost, merged, even=False):
    if name not in kernels or _common._head_group(heads, kp.bwd_heads_fastest,
                                                   kp.bwd_head_group):
      return None  # TailSplit.coords decodes the plain orders only
    return split_tail.plan(tiles, heads, batch, steps, heads_fastest=kp.bwd_heads_fastest,
                           config=config, step_cost=cost,
                           merge_cost=merged * split_tail.MERGE_OVERHEAD_BLOCKS, even=even)

  dq = plan("dq", kp_dq, kp_dq.t_pad // (2 * kp_dq.block_q), heads, kp_dq.num_kv_blocks,
            step_cost(3, 2 * kp_dq.block_q, kp_dq.block_kv), 1)
  dkdv = plan("dkdv", kp_dkdv, kp_dkdv.s_pad // (2 * kp_dkdv.block_kv), kv_heads,
              kp_dkdv.t_pad // kp_dkdv.block_q * kp_dkdv.group,
              step_cost(4, 2 * kp_dkdv.block_kv, kp_dkdv.block_q), 2, even=True)
  return dq, dkdv


def padded_lengths(t: int, s: int, config: MosaicConfig) -> tuple[int, int]:
  """(T, S) padded for the split backward: one length serves both kernels, a multiple of both
  CTA heights and both tiles."""
  q_mult = math.lcm(2 * config.block_q_dq, config.block_q_dkv)
  kv_mult = math.lcm(2 * config.block_kv_dkv, config.block_kv_dq)
  return _tiling.round_up(t, q_mult), _tiling.round_up(s, kv_mult)


def planned_tail_splits(q, k, params: AttentionParams, config: MosaicConfig):
  """The (dQ, dK/dV) split tails the split backward runs for q [B, T, H, D], k [B, S, K, D]
  (arrays or jax.ShapeDtypeStruct)."""
  (b, t, h, _), (s, kh) = q.shape, k.shape[1:3]
  t_pad, s_pad = padded_lengths(t, s, config)
  kps = split_kernel_params(q, k, params, config, t_pad=t_pad, s_pad=s_pad)
  return tail_splits(*kps, b, h, kh, params, config)


def segment_inputs(q_seg, kv_seg, t_pad: int, s_pad: int, *, dq_tiles: tuple[int, int],
                   dkdv_tiles: tuple[int, int], params: AttentionParams):
  """(dQ kernel's, dK/dV kernel's) segment inputs: the ids q_seg [B, T] / kv_seg [B, S] (zeros,
  one document, for a window alone) padded to t_pad / s_pad, and the hull of blocks each CTA
  tile may share an id with (_tiling.segment_block_limits), cut to the local window's band
  (_common.band_limits).

  dq_tiles: (query rows per dQ CTA, keys per step); dkdv_tiles: (query rows per step, keys per
  dK/dV CTA)."""
  (batch, t), s = q_seg.shape, kv_seg.shape[1]
  q_seg, kv_seg = _tiling.pad_segments(q_seg, kv_seg, t_pad, s_pad)
  kv_limits = q_limits = None
  if params.has_segments:
    kv_limits, _ = _tiling.segment_block_limits(q_seg, kv_seg, block_q=dq_tiles[0],
                                              block_kv=dq_tiles[1])
    _, q_limits = _tiling.segment_block_limits(q_seg, kv_seg, block_q=dkdv_tiles[0],
                                             block_kv=dkdv_tiles[1])
  if params.local_window is not None:
    kv_limits = _common.band_limits(
        kv_limits, params.band, tiles=t_pad // dq_tiles[0], tile_rows=dq_tiles[0],
        block=dq_tiles[1], length=s, batch=batch)
    q_limits = _common.band_limits(
        q_limits, _tiling.mirrored(params.band), tiles=s_pad // dkdv_tiles[1],
        tile_rows=dkdv_tiles[1], block=dkdv_tiles[0], length=t, batch=batch)
  return (q_seg, kv_seg, kv_limits), (kv_seg, q_seg, q_limits)


def _triton_backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, *,
                     params: AttentionParams, config: MosaicConfig):
  """The Triton backward kernels (Pallas' Triton lowering, on any GPU this backend runs on; in
  its interpreter when the Mosaic kernels are interpreted), same contract, deterministic, for
  the calls the Mosaic backward kernels do not take:
  - head_dim 256 with wide_backward="triton" (0.57-0.61x cuDNN fwd+bwd on the H200 at
    4x4096x8x256, against backward_wide's 1.05-1.09x), or with a soft cap: backward_wide's dS
    warpgroup gets Pᵀ through shared memory, never Sᵀ, so it has no cap slope;
  - a local window with window_backward="triton" (the Mosaic kernels' windowed backward is
    the default; see MosaicConfig).
  """
  from pallas_flash import triton as triton_backend
  lse, delta = _xla_row_stats(o, lse, do, delta)
  triton_config = triton_backend.call_config(q.shape[3], q.dtype, params)
  return triton_backend.backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, params=params,
                                 config=triton_config, interpret=config.interpret)


def backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, *, params: AttentionParams,
             config: MosaicConfig, arrays: FeatureArrays | None = None):
  """See pallas_flash.call for the contract (`arrays` unused, as in forward). This backend
  sets BACKWARD_COMPUTES_DELTA: lse is the forward's (natural log, -inf on fully masked rows)
  and delta only the correction -dlse [B, H, T] float32, or None when lse has no cotangent.
  Segment ids: the split kernels load only the blocks that may share an id with their tile and
  compare ids on those not wholly inside the tile's one document; a local window (unless
  window_backward="triton") runs the same path, its band's blocks as the limits
  (segment_inputs). The fused kernel takes neither: it falls back to the split with a
  warning."""
  d = q.shape[3]
  wide_mosaic = config.wide_backward == "mosaic" and params.logits_soft_cap is None
  window_triton = params.local_window is not None and config.window_backward == "triton"
  if window_triton or (d > 128 and not wide_mosaic):
    return _triton_backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, params=params,
                            config=config)
  if d > 128:  # 256, the one wider head dim the backend takes
    from pallas_flash.mosaic_gpu import backward_wide
    return backward_wide.backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, params=params,
                                  config=config)
  if config.fused_backward:
    from pallas_flash.mosaic_gpu import backward_fused
    reason = backward_fused.unsupported_reason(q, config)
    if reason is None and _common.segment_path(params):
      reason = ("segment ids, lengths and local windows are streamed and compared in the "
                "split kernels only")
    if reason is None:
      lse, delta = _xla_row_stats(o, lse, do, delta)
      return backward_fused.backward(q, k, v, lse, do, delta, params=params, config=config)
    warnings.warn(f"fused_backward=True, using the split backward instead: {reason}",
                  stacklevel=2)
  t, s = q.shape[1], k.shape[1]
  t_pad, s_pad = padded_lengths(t, s, config)
  kp_dq, kp_dkdv = split_kernel_params(q, k, params, config, t_pad=t_pad, s_pad=s_pad)
  t_in = _common.operand_rows(t, t_pad, config.interpret, kp_dkdv.stages * kp_dkdv.block_q)
  s_in = _common.operand_rows(s, s_pad, config.interpret, kp_dq.stages * kp_dq.block_kv)
  qp, dop, op = (_tiling.pad_axis(x, 1, t_in) for x in (q, do, o))
  kpad, vpad = _tiling.pad_axis(k, 1, s_in), _tiling.pad_axis(v, 1, s_in)
  dq_split, dkdv_split = tail_splits(kp_dq, kp_dkdv, q.shape[0], q.shape[2], k.shape[2],
                                     params, config)
  dq_segs = dkdv_segs = ()
  if _common.segment_path(params):
    dq_segs, dkdv_segs = segment_inputs(
        *_common.path_segment_ids(q, k, q_seg, kv_seg, params), t_pad, s_pad,
        dq_tiles=(2 * config.block_q_dq, config.block_kv_dq),
        dkdv_tiles=(config.block_q_dkv, 2 * config.block_kv_dkv), params=params)
  in_kernel = config.bwd_delta_in_kernel
  if in_kernel and dq_smem_bytes(kp_dq, in_kernel=True, correction=delta is not None) > \
      SMEM_LIMIT_BYTES:
    warnings.warn("bwd_delta_in_kernel=True, computing delta in XLA instead: the dQ kernel's "
                  "O tile does not fit in shared memory with this config", stacklevel=2)
    in_kernel = False
  # Padded rows get lse = +inf (P = 0) and, with O and dO zero there, delta = 0.
  if in_kernel:
    # The dQ kernel computes lse2 and delta from O and dO (FA2's preprocessing) and hands them
    # to the dK/dV kernel, so no XLA op runs before the kernels.
    lse = _tiling.pad_axis(lse, 2, t_pad, jnp.inf)
    if delta is not None:
      delta = _tiling.pad_axis(delta, 2, t_pad)
    dq, lse2, delta = _dq_call(qp, kpad, vpad, dop, op, lse, delta, kp=kp_dq, segs=dq_segs,
                               split=dq_split)
  else:
    lse, delta = _xla_row_stats(o, lse, do, delta)
    # lse in log2 units so that P = exp2(S·c − lse2).
    lse2 = _tiling.pad_axis(lse * LOG2E, 2, t_pad, jnp.inf)
    delta = _tiling.pad_axis(delta, 2, t_pad)
    dq = _dq_call(qp, kpad, vpad, dop, None, lse2, delta, kp=kp_dq, segs=dq_segs,
                  split=dq_split)
  dk, dv = _dkdv_call(qp, kpad, vpad, dop, lse2, delta, kp=kp_dkdv, segs=dkdv_segs,
                      split=dkdv_split)
  return dq[:, :t], dk[:, :s], dv[:, :s]
