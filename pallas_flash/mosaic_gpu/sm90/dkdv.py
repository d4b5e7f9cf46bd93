"""The dK/dV kernel of the split backward (head dims up to 128).

A CTA has 2 consumer warpgroups of `block_kv` key rows each (K, V resident) and a TMA producer
streaming Q, dO, lse and delta of every (q block, query head of the kv head) pair, so GQA
gradients are summed in registers with no repeated K/V: Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ,
dV += Pᵀ·dO, dK += dSᵀ·Q (kv_stream.py). Summation order is fixed: gradients are bitwise
reproducible run to run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_flash.mosaic_gpu.config import SMEM_LIMIT_BYTES
from pallas_flash.mosaic_gpu.sm90 import block_mask, common, kv_stream
from pallas_flash.mosaic_gpu.sm90 import dense as sm90_dense


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_scratch,
                 v_scratch, q_scratch, do_scratch, lse_scratch, delta_scratch, st_scratch,
                 kv_ready, q_ready, do_ready, lse_ready, delta_ready, q_free, do_free,
                 lse_free, delta_free, bias_tiles=None, bias_ready=None, bias_free=None, *,
                 kp: common.KernelParams,
                 seg: common.SegmentRefs | None = None, slopes=None,
                 keys: common.DropoutKeys | None = None, dense=None,
                 blk: block_mask.Refs | None = None):
  """q/do_ref [B, Tp, H, D], k/v_ref [B, Sp, K, D], lse (log2 units)/delta_ref [1, B·H, Tp].

  Grid (K, Sp / (2·block_kv), B) named (kvh, kt, b); dk/dv_ref [B, Sp, K, D]
  float32-accumulated, stored in dtype; k/v_scratch [2, block_kv, D], q/do_scratch [stages,
  block_q, D], lse/delta_scratch [stages, block_q], st_scratch [2, block_kv, block_q]
  (interpret only). Steps run over (q block i, query head g) with g minor, starting at the
  first q block that sees the CTA's keys.

  seg: segment ids of the key rows and of the queries, and per kv tile the hull of q blocks
  that may share an id with it: the CTA streams only those, and compares ids on each except
  the q blocks wholly inside the tile's one document. slopes: ALiBi's
  common.raw_alibi_slopes [H] (GMEM), or None. keys: dropout's row and column keys
  (common.dropout_keys), or None: dV takes the kept Pᵀ (scaled by 1 / (1 - rate) once, at
  the end), dSᵀ the kept, scaled dPᵀ. dense: the dense bias and mask (dense.DenseRefs), or
  None: each step loads its transposed tiles (a 16-bit bias's from bias_tiles [stages,
  block_q, 2·block_kv], streamed beside Q with the ready / free barriers bias_ready /
  bias_free, where dkdv_call gives them: dense.StreamedBias). blk: a block mask's q-block
  table per kv tile and mask function (block_mask.Refs): the CTA streams the listed q blocks
  (each for every query head of the group), evaluating the function on the partial ones
  (listed first).
  """
  bq, bkv, stages, g_size = kp.block_q, kp.block_kv, kp.stages, kp.group
  wg = lax.axis_index("wg")
  b = lax.axis_index("b")
  kt, kvh = lax.axis_index("kt"), lax.axis_index("kvh")
  cta_k0 = kt * (2 * bkv)
  cta_first = kv_stream.first_q_block(cta_k0, kp)
  cta_last = kp.t_pad // bq
  if seg is not None:
    first, last, full_first, full_last = common.segment_limits(seg.limits, b, kt)
    cta_first, cta_last = jnp.maximum(cta_first, first), jnp.minimum(cta_last, last)
    cta_last = jnp.maximum(cta_last, cta_first)  # no q block: zero steps, dK = dV = 0
  cta_steps = (cta_last - cta_first) * g_size
  sparse = None
  if blk is not None:
    sparse = block_mask.sparse(blk, kp.block_mask, b, kt)
    cta_steps = sparse.steps * g_size

  def index(step):
    """(q block, query head) of CTA step `step`."""
    if sparse is not None:
      return sparse.block(lax.div(step, g_size)), kvh * g_size + lax.rem(step, g_size)
    i = cta_first + lax.div(step, g_size)
    return i, kvh * g_size + lax.rem(step, g_size)

  streams = ((q_ref, q_scratch, q_ready, q_free), (do_ref, do_scratch, do_ready, do_free),
             (lse_ref, lse_scratch, lse_ready, lse_free),
             (delta_ref, delta_scratch, delta_ready, delta_free))
  if bias_tiles is not None:  # the bias's tiles: a fifth stream
    streams += ((dense.bias, bias_tiles, bias_ready, bias_free),)

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(kp.compute_registers, action="increase")
    k_smem, v_smem = k_scratch.at[wg], v_scratch.at[wg]
    k0 = cta_k0 + wg * bkv
    rows = (b, pl.ds(k0, bkv), kvh)
    kv_stream.load_kv_tiles(k_ref, v_ref, k_smem, v_smem, kv_ready, wg, rows)

    st_smem = common.at(st_scratch, wg)  # interpret mode only

    ids = None
    if seg is not None and kp.segment_ids:
      ids_at = common.row_and_col_ids(seg, b, k0, bkv, bq)
      ids = lambda t: ids_at(index(t)[0] * bq)  # noqa: E731

    alibi_at = kv_stream.alibi_steps(slopes, k0, index, kp)
    drop_at = kv_stream.dropout_steps(keys, b, k0, index, kp)

    def step(t, carry, *, masked: bool):
      dk, dv = carry
      slot = lax.rem(t, stages)
      bias = alibi_at(t)  # the slope's load runs ahead of the waits
      tiles = None
      if dense is not None:  # the dense tiles (dense.load), added to Sᵀ with the bias
        streamed = (None if bias_tiles is None
                    else sm90_dense.StreamedBias(bias_tiles, bias_free, wg))
        tiles = (sm90_dense.load(dense, b, index(t)[1], k0, index(t)[0] * bq, (bkv, bq),
                                 transposed=True, slot=slot, streamed=streamed),
                 functools.partial(with_dense, kp=kp))
      drop = drop_at(t)  # as do the queries' dropout keys
      q_smem, do_smem = kv_stream.wait_streams(streams, slot)
      if kp.dkdv_overlap and not (kp.interpret or masked or kp.alibi or kp.dropout
                                  or dense is not None):
        # Unmasked steps only: the mask's iotas on top of the overlap's live registers spill
        # inside the loop (deviceless SASS); masked steps issue dV and dK back to back. ALiBi's
        # position vectors take the masked steps' form too (not yet checked with ptxas), and
        # dropout's keep mask (the overlap step with it: 24 / 20 spill loads / stores in the
        # loop at 1x4096x16x128 non-causal, this form 1 / 0; deviceless ptxas, CUDA 13.0).
        return _overlapped_step(
            dk, dv, (k_smem, v_smem, q_smem, do_smem), streams, slot, k0,
            (do_free.at[slot], q_free.at[slot]), kp)
      visible = None
      if sparse is not None:
        visible = lambda: sparse.mask(k0, index(t)[0] * bq, (bkv, bq), kp.kv_len,  # noqa: E731
                                      kp.kv_tail, transposed=True)
      p_t, ds_t = kv_stream.transposed_grad_tiles(
          k_smem, v_smem, q_smem, do_smem, streams, slot, k0,
          (lambda: index(t)[0]) if masked else None, kp, ids=ids and ids(t), bias=bias,
          drop=drop, visible=visible, dense=tiles,
          early_probs=common.early_probs(kp, dense=dense, sparse=sparse))
      return _dk_dv_updates(dk, dv, p_t, ds_t, q_smem, do_smem, st_smem,
                            (do_free.at[slot], q_free.at[slot]), kp)

    def skip_step(t, carry):
      return kv_stream.skip_step(t, carry, streams=streams, stages=stages)

    zeros = plgpu.layout_cast(jnp.zeros((bkv, kp.d), jnp.float32), plgpu.Layout.WGMMA)
    carry = (zeros, zeros)
    # Causal: q blocks before `first` do not see these keys, blocks in [first, full) cross the
    # diagonal and are masked, blocks from `full` on see every key of the tile.
    first = (kv_stream.first_q_block(k0, kp) - cta_first) * g_size
    if seg is not None:  # cta_first may lie past this WG's first q block
      first = jnp.clip(first, 0, cta_steps)
    if sparse is not None:  # the partial q blocks, then the full ones
      first = 0
    lax.fori_loop(0, first, skip_step, None)
    if sparse is not None:
      carry = lax.fori_loop(0, sparse.masked * g_size, functools.partial(step, masked=True),
                            carry)
      first = sparse.masked * g_size
    elif seg is not None:
      # Ids are compared except on the q blocks wholly inside the tile's one document, and
      # (causal) past the diagonal.
      lo = (full_first - cta_first) * g_size
      if kp.causal:
        lo = jnp.maximum(lo, kv_stream.first_unmasked_step(k0, cta_first, kp))
      lo = jnp.clip(lo, first, cta_steps)
      hi = jnp.clip((full_last - cta_first) * g_size, lo, cta_steps)
      carry = lax.fori_loop(first, lo, functools.partial(step, masked=True), carry)
      carry = lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
      carry = lax.fori_loop(hi, cta_steps, functools.partial(step, masked=True), carry)
      first = cta_steps
    elif kp.causal:
      full = kv_stream.first_unmasked_step(k0, cta_first, kp)
      carry = lax.fori_loop(first, full, functools.partial(step, masked=True), carry)
      first = full
    dk, dv = lax.fori_loop(first, cta_steps, functools.partial(step, masked=False), carry)
    if kp.dropout:  # the kept probabilities' 1 / (1 - rate), once
      dv = dv * kp.inv_keep
    kv_stream.store_dk_dv(dk, dv, k_smem, v_smem, dk_ref, dv_ref, rows, kp)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(kp.producer_registers, action="decrease")
    extra = () if bias_tiles is None else (
        sm90_dense.stream_rows(dense.bias, b, bq, bkv, cta_k0, index),)
    kv_stream.produce_query_streams(cta_steps, stages, streams, index, b, bq, kp, extra)


def with_dense(alibi, tiles, kp: common.KernelParams):
  """The step's bias on a raw Sᵀ tile: ALiBi's (`alibi`, or None), then the dense tiles
  (dense.add, whose `cap` the bias takes too); hd256.py's "P" role takes it too."""
  return lambda s_t, cap=None: sm90_dense.add(s_t if alibi is None else alibi(s_t), tiles,
                                              kp.scale, cap=cap)


def _dk_dv_updates(dk, dv, p_t, ds_t, q_smem, do_smem, st_smem, frees, kp):
  """dV += Pᵀ·dO and dK += dSᵀ·Q (p_t, ds_t [block_kv, block_q] f32, converted to kp.dtype
  register operands), each waited for in turn, or with kp.dkdv_overlap (its masked steps)
  issued back to back with one wait.

  frees = (dO's, Q's) free barriers of the step, each arrived on once the matmul reading that
  tile has retired.
  """
  do_free, q_free = frees
  if kp.interpret or not kp.dkdv_overlap:
    dv = common.accumulate(dv, p_t.astype(kp.dtype), st_smem, do_smem, kp)
    plgpu.barrier_arrive(do_free)
    dk = common.accumulate(dk, ds_t.astype(kp.dtype), st_smem, q_smem, kp)
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


def _overlapped_step(dk, dv, tiles, streams, slot, k0, frees, kp: common.KernelParams):
  """One unmasked dK/dV step with kp.dkdv_overlap: the elementwise work runs under matmuls.

  tiles: the WG's K, V and the step's Q, dO SMEM tiles; frees: as in `_dk_dv_updates`. wgmma
  groups retire in issue order:

    issue Sᵀ, dPᵀ | wait 1: Sᵀ -> Pᵀ (dPᵀ running) | issue dV += Pᵀ·dO |
    wait 1: dPᵀ -> dSᵀ (dV running) | scope exit waits dV -> release dO |
    issue dK += dSᵀ·Q, wait -> release Q.

  Same products in the same order as the serial form, so the same bits. Pᵀ stays float32 for dSᵀ
  while its 16-bit copy is dV's register operand (a new value, not a redefinition of an
  in-flight operand's registers: no C7513).
  """
  k_smem, v_smem, q_smem, do_smem = tiles
  do_free, q_free = frees
  acc_t = plgpu.ACC((kp.block_kv, kp.block_q), jnp.float32)

  def body(refs):
    dv_ref, dk_ref = refs

    def scores(s_ref, dp_ref):
      plgpu.wgmma(s_ref, k_smem, q_smem.T)
      plgpu.wgmma(dp_ref, v_smem, do_smem.T)
      lse, delta = kv_stream.step_stats(streams, slot)
      p_t, slope = kv_stream.probs_t(plgpu.wgmma_accumulator_load(s_ref, wait_n=1), lse, k0,
                                     None, kp)
      plgpu.wgmma(dv_ref, p_t.astype(kp.dtype), do_smem)
      dp_t = plgpu.wgmma_accumulator_load(dp_ref, wait_n=1)
      return kv_stream.grad_scores_t(p_t, slope, dp_t, delta)

    ds_t = pl.run_scoped(scores, acc_t, acc_t)
    plgpu.wgmma_wait(0)  # dV (also covered by the scope's exit): dO is free
    plgpu.barrier_arrive(do_free)
    plgpu.wgmma(dk_ref, ds_t.astype(kp.dtype), q_smem)

  with jax.named_scope("overlap_step"):
    dv, dk = pl.run_state(body)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
  plgpu.barrier_arrive(q_free)
  return dk, dv


def bias_stream_scratch(dense: tuple, kp: common.KernelParams, d: int) -> list:
  """The dK/dV kernel's scratch for a dense.StreamedBias, where the call has a 16-bit dense
  bias (dense: the second of dense.backward_inputs, the bias first where kp.dense[0]), its
  tiles fit beside the kernel's own and the kernel is not profiled (its event buffer takes
  the room); else [] (each step loads its tile from GMEM: 4-byte loads along the keys, then
  a register transpose). At head dim 128 and the default tiles: 165888 bytes of shared
  memory with the stream, 133120 without (deviceless, 4x4096x32x128)."""
  if not sm90_dense.in_shared_memory(dense, kp):
    return []
  own = kv_stream.kv_stream_smem_bytes(d, kp.block_q, kp.block_kv, kp.stages,
                                       jnp.dtype(kp.dtype).itemsize)
  tiles = sm90_dense.ring_bytes(dense[0].dtype, kp.stages, kp.block_q, kp.block_kv)
  if own + tiles + kv_stream.SMEM_SLACK_BYTES > SMEM_LIMIT_BYTES:
    return []
  return sm90_dense.stream_scratch(dense[0].dtype, kp.stages, kp.block_q, kp.block_kv)


def dkdv_call(q, k, v, do, lse2, delta, *, kp: common.KernelParams, segs=(), slopes=(),
              keys=(), dense=(), blks=()):
  """(dK, dV) [B, S, K, D] for q, do [B, T, H, D] and k, v [B, S, K, D], T and S padded as
  common.operand_rows says; lse2, delta [B, H, Tp]. segs: () or (kv_seg [B, Sp], q_seg
  [B, Tp], q limits per kv tile) int32. slopes: () or (common.raw_alibi_slopes [H],). keys:
  () or dropout's (row keys [B, H, Tp], column keys [Sp]) (common.dropout_keys). dense: () or
  the second of dense.backward_inputs: the bias and / or maskᵀ's bits (kp.dense says which).
  blks: () or a block mask's operands (block_mask.inputs by kv tile), inputs after the six
  others."""
  bsz, _, kh, d = k.shape
  s_pad = kp.s_pad
  bq, bkv = kp.block_q, kp.block_kv
  tiles = common.smem_transforms(kp.dtype, kp.d)
  scratch = [
      *kv_stream.kv_stream_smem(kp, d),
      plgpu.SMEM((2, bkv, bq), kp.dtype, transforms=tiles) if kp.interpret else None,
      *kv_stream.kv_stream_barriers(kp),
      *bias_stream_scratch(dense, kp, d),
  ]
  kv_out = jax.ShapeDtypeStruct(k.shape, k.dtype)

  def make_body(blk=None):
    return common.with_segment_refs(functools.partial(_dkdv_kernel, kp=kp, blk=blk), 6,
                                    bool(segs), alibi=bool(slopes), dropout=bool(keys),
                                    dense=kp.dense)

  return plgpu.kernel(
      common.named(block_mask.with_block_refs(make_body, 6, len(blks)) if blks
                   else make_body(), "flash_dkdv"),
      out_type=(kv_out, kv_out),
      scratch_types=scratch,
      **common.launch_grid(s_pad // (2 * bkv), kh, bsz, ("kt", "kvh", "b"), heads_fastest=False),
      num_threads=3, thread_name="wg",
      # Profiled (kp.profile_dir) for at most PROFILE_STEPS steps, as the forward; the dQ
      # kernel never is, so that a backward's trace holds one kernel's events.
      compiler_params=common.compiler_params(
          kp, min(kv_stream.profile_steps(kp), kv_stream.PROFILE_STEPS)),
      interpret=common.interpret_params(kp.interpret),
  )(q, k, v, do, kp.stats_view(lse2), kp.stats_view(delta), *blks, *segs, *slopes, *keys,
    *dense)
