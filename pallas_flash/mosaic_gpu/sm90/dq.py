"""The dQ kernel of the split backward (and of the head-dim-256 backward).

A CTA has 2 consumer warpgroups of `block_q` query rows each (Q, dO, lse and delta resident)
and a TMA producer warpgroup streaming K and V: per key block, S = Q·Kᵀ and dP = dO·Vᵀ (SMEM
operands), P = exp2(S·c − lse·log2e), dS = P∘(dP − delta), dQ += dS·K (dS from registers).
With O given, the kernel also computes FA2's preprocessing itself (delta = rowsum(O∘dO), lse
in log2 units) and stores both for the dK/dV kernel, so fwd+bwd runs no XLA op besides the
kernels; without it both come from XLA.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_flash.mosaic_gpu.sm90 import block_mask, common
from pallas_flash.mosaic_gpu.sm90 import dense as sm90_dense

LOG2E = math.log2(math.e)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, o_ref, lse_ref, delta_ref, dq_ref, lse2_out_ref,
                   delta_out_ref, dbias_ref, q_scratch, do_scratch, o_scratch, lse_scratch,
                   delta_scratch, k_scratch, v_scratch, ds_scratch, row_ready, k_ready, v_ready,
                   k_free, v_free, bias_ready,
                   *, kp: common.KernelParams, seg: common.SegmentRefs | None = None,
                   slopes=None, keys: common.DropoutKeys | None = None, dense=None,
                   blk: block_mask.Refs | None = None):
  """q_ref [B, Tp, H, D], do_ref [B, Tp, H, Dv], k_ref [B, Sp, K, D], v_ref [B, Sp, K, Dv],
  lse/delta_ref [B, H, Tp] (Dv = kp.dv: D but with MosaicConfig.native_value_head_dim; dP =
  dO·Vᵀ contracts over Dv, every other product over D or the keys).

  Two forms (absent refs are None). Statistics from XLA (o_ref, lse2_out_ref, delta_out_ref
  None): lse_ref in log2 units, delta_ref the full delta. Statistics in the kernel: o_ref
  [B, Tp, H, D], lse_ref natural log (-inf on fully masked rows), delta_ref the correction
  -dlse or None; the kernel computes lse2 and delta = rowsum(O∘dO) + correction and stores them
  to lse2_out/delta_out_ref [B, H, Tp] for the dK/dV kernel (o_ref [B, Tp, H, Dv]).
  Grid (H, Tp / (2·block_q), B) named (h, qt, b); dq_ref [B, Tp, H, D];
  q_scratch [2, block_q, D], do/o_scratch [2, block_q, Dv], lse/delta_scratch [2, block_q],
  k_scratch [stages, block_kv, D], v_scratch [v stages, block_kv, Dv], ds_scratch [2, block_q,
  block_kv] (interpret only); bias_ready [2] (one per WG) with kp.o_tile_stages, else None.
  seg: segment ids, the forward's way (the CTA streams only the key blocks its tile may share
  an id with). slopes: ALiBi's common.raw_alibi_slopes [H] (GMEM), or None. keys: dropout's
  row and column keys (common.dropout_keys), or None: dP is masked and scaled,
  dS = P∘(dP_kept / (1 - rate) − delta).
  dense: the dense bias and mask (dense.DenseRefs), or None; with kp.dbias, dbias_ref [B, H, Tp,
  Sp] (dense.dbias_dtype) gets dS (before the soft cap's slope: the bias is added after the
  cap) of every score tile, through the O tile with kp.o_tile_stages, zeros on
  the key blocks a warpgroup does not stream (kp.dbias_zero_tiles); with kp.dbias_batch_sum
  dbias_ref is [1, H, Tp, Sp], zeroed, and each tile is added to it; else dbias_ref is None.
  blk: a block mask's key-block table per q tile and mask function (block_mask.Refs), the
  forward's way; q tiles last one first (dbias is written on the table's blocks only).
  """
  bq, bkv, stages, v_stages = kp.block_q, kp.block_kv, kp.stages, kp.dq_v_stages
  wg = lax.axis_index("wg")
  b = lax.axis_index("b")
  qt, h = lax.axis_index("qt"), lax.axis_index("h")
  if kp.causal or blk is not None:
    qt = kp.t_pad // (2 * bq) - 1 - qt  # heaviest tiles first, as in the forward
  cta_q0, cta_steps, kv0, full = common.cta_kv_range(kp, seg, b, qt)
  sparse = None
  if blk is not None:  # may be 0 steps: dQ = 0
    sparse = block_mask.sparse(blk, kp.block_mask, b, qt)
    cta_steps = sparse.steps

  def key_block(j):
    return kv0 + j if sparse is None else sparse.block(j)

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
      lse2 = plgpu.load(lse_smem, layout=common.ROW)
      delta = plgpu.load(delta_smem, layout=common.ROW)
    else:
      lse2, delta = _row_stats(lse_smem, delta_smem if delta_ref is not None else None,
                                  o_scratch.at[wg], do_smem)
      # Both vectors go back through the SMEM they came from (each row is read and written by
      # the warp that owns it) and are stored once for the dK/dV kernel; the epilogue's
      # wait_smem_to_gmem covers these copies' reads.
      lse_smem[...] = lse2
      delta_smem[...] = delta
      plgpu.commit_smem()

      plgpu.copy_smem_to_gmem(lse_smem, lse2_out_ref.at[stats], commit_group=False)
      plgpu.copy_smem_to_gmem(delta_smem, delta_out_ref.at[stats], commit_group=False)
      plgpu.commit_smem_to_gmem_group()
    steps = kp.kv_steps(q0 + bq)
    alibi_slope = None if slopes is None else slopes[h]  # one scalar load per CTA
    folded, c = common.cap_fold(kp, biased=slopes is not None or dense is not None)
    drop_rows = None if keys is None else common.dropout_row_keys(keys, b, h, q0, bq)
    ids = None
    if sparse is not None:
      steps = cta_steps
    if seg is not None:
      steps = jnp.clip(steps - kv0, 1, cta_steps)
      if kp.segment_ids:
        ids = common.row_and_col_ids(seg, b, q0, bq, bkv)

    early = common.early_probs(kp, dense=dense, sparse=sparse)
    # The O tile stages the bias in and dS out (dense.o_tile_stages decided it before the call).
    o_tile = o_scratch.at[wg] if kp.o_tile_stages else None
    assert o_tile is None or (o_tile.shape == (bq, bkv) and o_tile.dtype == dense.bias.dtype)
    staging = None if dbias_ref is None else o_tile
    staged = None if o_tile is None else sm90_dense.StagedBias(o_tile, bias_ready.at[wg])
    dbias_b = 0 if kp.dbias_batch_sum else b  # the batch's CTAs add into one entry

    def step(j, dq, *, masked: bool):
      slot = lax.rem(j, stages)
      vslot = slot if v_stages == stages else lax.rem(j, v_stages)
      if staged is not None:  # the step's bias tile, TMA'd under the waits and S = Q·Kᵀ
        sm90_dense.fill_staged(dense, staged, b, h, q0, key_block(j) * bkv)
      # The dense tiles, loaded where they are added to S (dense.load).
      tiles = sm90_dense.load(dense, b, h, q0, key_block(j) * bkv, (bq, bkv), staged=staged)
      drop_cols = None  # loaded ahead of the waits
      if keys is not None:
        drop_cols = common.dropout_col_keys(keys, key_block(j) * bkv, bkv)
      plgpu.barrier_wait(k_ready.at[slot])
      if v_stages == stages:
        plgpu.barrier_wait(v_ready.at[vslot])

      def probs(s):
        """(P, the soft cap's slope) of the raw score tile s [block_q, block_kv]."""
        if not kp.bias_in_cap:
          s, slope = common.soft_cap_with_slope(s, kp, folded=folded)
        if alibi_slope is not None:  # a constant per score: dS is unchanged
          s = common.alibi(s, q0, key_block(j) * bkv, alibi_slope)
        if kp.bias_in_cap:  # "bias_then_cap": the slope is d cap / d(s + biases)
          s, slope = sm90_dense.add(s, tiles, kp.scale, cap=common.cap_after_bias(kp))
        else:
          s = sm90_dense.add(s, tiles, kp.scale)
        p = jnp.exp2(s * c - lax.broadcast_in_dim(lse2, s.shape, [0]))
        if masked and sparse is not None:
          p = jnp.where(sparse.mask(q0, key_block(j) * bkv, (bq, bkv), kp.kv_len, kp.kv_tail),
                        p, 0.0)
        elif masked:
          col0 = (kv0 + j) * bkv
          mask = common.tile_mask(q0, col0, (bq, bkv), kp, ids=ids and ids(col0))
          p = jnp.where(mask, p, 0.0)
        return p, slope

      def scores(s_ref, dp_ref):
        plgpu.wgmma(s_ref, q_smem, k_scratch.at[slot].T)
        if v_stages != stages:  # a shallower V ring: its load gets until Sᵀ is issued
          plgpu.barrier_wait(v_ready.at[vslot])
        plgpu.wgmma(dp_ref, do_smem, v_scratch.at[vslot].T)
        # Under both matmuls (early_probs excludes dense tiles); a bias and a mask loaded here
        # spilled (deviceless: 33 / 31 spill loads / stores in the loop at 4x4096x32x128).
        loaded = None if all(kp.dense) else sm90_dense.issue(tiles)
        if not early:
          return s_ref[...], dp_ref[...], loaded
        return probs(plgpu.wgmma_accumulator_load(s_ref, wait_n=1)), dp_ref[...], loaded

      s_or_p, dp, loaded = pl.run_scoped(scores, plgpu.ACC((bq, bkv), jnp.float32),
                                         plgpu.ACC((bq, bkv), jnp.float32))
      tiles = sm90_dense.issued(tiles, loaded)
      plgpu.barrier_arrive(v_free.at[vslot])
      p, slope = s_or_p if early else probs(s_or_p)
      if drop_cols is not None:  # the forward's mask: dropped entries took no part in O
        dp = jnp.where(common.dropout_keep(drop_rows, drop_cols, dp.shape, kp),
                       dp * kp.inv_keep, 0.0)
      if dbias_ref is not None:  # dbias = dS of the scores the bias is added to
        ds = p * (dp - lax.broadcast_in_dim(delta, p.shape, [0]))
        if slope is not None and kp.bias_in_cap:  # inside the cap: the raw scores' dS
          ds = ds * slope
        sm90_dense.dbias_tile(dbias_ref, ds, dbias_b, h, q0, key_block(j) * bkv, staging,
                              add=kp.dbias_batch_sum, interpret=kp.interpret)
        if slope is not None and not kp.bias_in_cap:  # after it: the slope comes after
          ds = ds * slope
      else:
        if slope is not None:  # P feeds only dS here: the cap's slope dies at once
          p = p * slope
        ds = p * (dp - lax.broadcast_in_dim(delta, p.shape, [0]))
      dq = common.accumulate(dq, ds.astype(kp.dtype), common.at(ds_scratch, wg),
                             k_scratch.at[slot], kp)
      plgpu.barrier_arrive(k_free.at[slot])
      return dq

    def idle_step(j, carry):
      for ready_, free_, n in ((k_ready, k_free, stages), (v_ready, v_free, v_stages)):
        slot = lax.rem(j, n)
        plgpu.barrier_wait(ready_.at[slot])
        plgpu.barrier_arrive(free_.at[slot])
      return carry

    dq = plgpu.layout_cast(jnp.zeros((bq, kp.d), jnp.float32), plgpu.Layout.WGMMA)
    # full: None without segment ids.
    dq = common.kv_loop(step, dq, q0, steps, kp, kv0=kv0, full=full, sparse=sparse)
    if sparse is None and (kp.causal or seg is not None):
      lax.fori_loop(steps, cta_steps, idle_step, None)
    # No key of the other blocks is visible: dbias is 0 there (zeroed by XLA instead with a
    # block table, where it runs an op on dbias anyway, or before a batch sum: dense.dbias_form).
    if dbias_ref is not None and sparse is None and kp.dbias_zero_tiles:
      sm90_dense.zero_dbias_blocks(dbias_ref, b, h, q0, bq, bkv, 0, kv0)
      sm90_dense.zero_dbias_blocks(dbias_ref, b, h, q0, bq, bkv, kv0 + steps, kp.num_kv_blocks)

    q_smem[...] = (dq * kp.scale).astype(kp.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the kernel's end (see store_dk_dv)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(kp.producer_registers, action="decrease")
    kvh = lax.div(h, kp.group)
    rows = lambda j: (b, pl.ds(key_block(j) * bkv, bkv), kvh)  # noqa: E731
    common.produce(cta_steps, (stages, v_stages), ((k_ref, k_scratch, k_ready, k_free, rows),
                                             (v_ref, v_scratch, v_ready, v_free, rows)))


def _row_stats(lse_smem, correction_smem, o_smem, do_smem):
  """lse2 and delta [block_q] (ROW layout) of a WG's rows, FA2's backward preprocessing.

  lse2 = lse·log2(e) with -inf (a fully masked row) mapped to +inf, so that exp2(S·c − lse2)
  is 0 there without a select; delta = rowsum(O∘dO) in float32 (a fixed order: each thread's
  columns, then the shuffles across the row's 4 threads), plus the correction -dlse when
  correction_smem is given.
  """
  lse = plgpu.load(lse_smem, layout=common.ROW)
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse) * LOG2E
  o = plgpu.load(o_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  do = plgpu.load(do_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  delta = jnp.sum(o * do, axis=1)
  if correction_smem is not None:
    delta = delta + plgpu.load(correction_smem, layout=common.ROW)
  return lse2, delta


def _with_absent_refs(kernel, present, *refs, **kwargs):
  """Calls kernel with None for each ref whose entry in `present` (the kernel's inputs, then
  outputs) is False, the given refs elsewhere; scratch refs follow unchanged. Bind kernel and
  present with functools.partial to get a body for plgpu.kernel."""
  given = iter(refs)
  return kernel(*(next(given) if p else None for p in present), *given, **kwargs)


def dq_smem_bytes(kp: common.KernelParams, *, in_kernel: bool, correction: bool) -> int:
  """Shared memory of one dQ CTA (dq_call's scratch): Q [2 WGs, block_q, D], dO (and O with the
  statistics in the kernel) [2 WGs, block_q, Dv], lse and delta [2, block_q] float32, the K
  [.., D] and V [.., Dv] rings, the barriers and 1 KiB that Mosaic adds (the estimate equals
  its 231,552 B with and 198,784 B without the O tile at head_dim 128, block_q 64, block_kv
  128, 2 stages)."""
  itemsize = jnp.dtype(kp.dtype).itemsize
  cols = kp.d + (2 if in_kernel else 1) * kp.dv  # Q, dO[, O]
  rows = 2 * kp.block_q * cols * itemsize + 2 * 2 * kp.block_q * 4
  slots = kp.stages + kp.dq_v_stages
  ring = kp.block_kv * (kp.stages * kp.d + kp.dq_v_stages * kp.dv) * itemsize
  barriers = 8 * (2 * (3 + (correction or not in_kernel) + in_kernel) + 2 * slots)
  return rows + ring + barriers + 1024


def dq_call(q, k, v, do, o, lse, delta, *, kp: common.KernelParams, segs=(), slopes=(),
            keys=(), dense=(), blks=()):
  """dQ [B, T, H, D], or (dQ, lse2, delta) when o is given: see _dq_kernel's two forms (o
  None: lse in log2 units and the full delta; else natural-log lse and delta the correction
  or None). q [B, T, H, D], do, o [B, T, H, Dv], k [B, S, K, D], v [B, S, K, Dv] (Dv = kp.dv)
  padded as common.operand_rows says;
  lse, delta and the lse2 and delta it returns [B, H, Tp]. segs: () or (q_seg [B, Tp], kv_seg
  [B, Sp], kv limits per q tile) int32. slopes: () or (common.raw_alibi_slopes [H],). keys: ()
  or dropout's (row keys [B, H, Tp], column keys [Sp]) (common.dropout_keys). dense: () or
  the first of dense.backward_inputs: the bias and / or the mask's bits (kp.dense says which);
  with kp.dbias the result ends with dbias [B, H, Tp, Sp] in dense.dbias_dtype (dS of every
  score; [1, H, Tp, Sp], the batch's sum, with kp.dbias_batch_sum). blks: () or a block
  mask's operands (block_mask.inputs by q tile), inputs after q .. delta."""
  bsz, _, h, d = q.shape
  t_pad = kp.t_pad
  bq, bkv, stages = kp.block_q, kp.block_kv, kp.stages
  tiles = common.smem_transforms(kp.dtype, kp.d)
  in_kernel = o is not None
  assert in_kernel or not kp.o_tile_stages, "the O tile exists where the kernel loads O"
  inputs = (q, k, v, do, o, lse, delta)
  row_tile = plgpu.SMEM((2, bq, d), kp.dtype, transforms=tiles)
  value_row_tile = plgpu.SMEM((2, bq, kp.dv), kp.dtype, transforms=tiles)
  scratch = [
      row_tile,
      value_row_tile,
      value_row_tile if in_kernel else None,
      plgpu.SMEM((2, bq), jnp.float32),
      plgpu.SMEM((2, bq), jnp.float32),
      plgpu.SMEM((stages, bkv, d), kp.dtype, transforms=tiles),
      plgpu.SMEM((kp.dq_v_stages, bkv, kp.dv), kp.dtype, transforms=tiles),
      plgpu.SMEM((2, bq, bkv), kp.dtype, transforms=tiles) if kp.interpret else None,
      # One per row load of a WG: Q, dO, lse, then delta and O where given.
      plgpu.Barrier(num_barriers=(2, 3 + (delta is not None) + in_kernel)),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=kp.dq_v_stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=kp.dq_v_stages),
      plgpu.Barrier(num_barriers=2) if kp.o_tile_stages else None,  # the staged bias's
  ]
  dq = jax.ShapeDtypeStruct(q.shape, q.dtype)
  row_stats = jax.ShapeDtypeStruct((bsz, h, t_pad), jnp.float32)
  out_type = [dq, row_stats, row_stats] if in_kernel else [dq]
  present = [x is not None for x in inputs] + [True, in_kernel, in_kernel, kp.dbias]
  if kp.dbias:
    out_type.append(jax.ShapeDtypeStruct((1 if kp.dbias_batch_sum else bsz, h, t_pad, kp.s_pad),
                                         sm90_dense.dbias_dtype(dense[0].dtype)))
  num_inputs = sum(present) - len(out_type)

  def make_body(blk=None):
    kernel = functools.partial(_with_absent_refs, functools.partial(_dq_kernel, kp=kp, blk=blk),
                               present)
    return common.with_segment_refs(kernel, num_inputs, bool(segs), alibi=bool(slopes),
                                    dropout=bool(keys), dense=kp.dense)

  body = block_mask.with_block_refs(make_body, num_inputs, len(blks)) if blks else make_body()
  launch = functools.partial(
      plgpu.kernel, common.named(body, "flash_dq"),
      scratch_types=scratch,
      # The batch fastest: a tile's batch entries run side by side (dbias_batch_sum's adds).
      **common.launch_grid(t_pad // (2 * bq), h, bsz, ("qt", "h", "b"), heads_fastest=False),
      num_threads=3, thread_name="wg",
      compiler_params=common.compiler_params(),
      interpret=common.interpret_params(kp.interpret))
  operands = (*(x for x in inputs if x is not None), *blks, *segs, *slopes, *keys, *dense)
  if kp.dbias_batch_sum:
    out = common.launch_on_zeroed_last(launch, operands, out_type)
  else:
    out = launch(out_type=tuple(out_type))(*operands)
  return tuple(out) if in_kernel or kp.dbias else out[0]
