"""The Mosaic backward at head dim 256, and 192 (the same kernels, at a D of 192).

At D = 256 a warpgroup cannot hold both float32 dK and dV of a 64-row key tile (256 registers
per thread), so the dK/dV kernel splits the work by role instead of by keys: both consumer
warpgroups of a CTA own the same 64 keys. The "P" warpgroup holds dV, computes
Sᵀ = K·Qᵀ, Pᵀ = exp2(Sᵀ·c − lse2) and dV += Pᵀ·dO, and hands its 16-bit Pᵀ to the "dS"
warpgroup through a two-slot shared-memory buffer; the "dS" warpgroup holds dK, computes
dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ − δ) and dK += dSᵀ·Q. Each product is computed once (4 per tile
pair, as the head-dim-128 kernel's), each warpgroup holds one 128-register accumulator, the "P"
warpgroup needs only K and the "dS" warpgroup only V. dSᵀ uses the 16-bit Pᵀ (the split kernel
at D <= 128 uses float32 Pᵀ), which adds one 16-bit rounding to dSᵀ before its own. With a soft
cap the "P" warpgroup hands over Pᵀ times the cap's slope 1 − tanh² instead (the raw scores'
dSᵀ is the capped ones' times it), so the "dS" warpgroup still needs no Sᵀ.

The dQ kernel is dq.py's, with two K slots and one V slot (see DQ_K_STAGES) and the row
statistics from XLA. Segment ids (and lengths, folded into them): as in the split kernels, a
CTA streams only the blocks that may share an id with its tile; here every step of a
segmented call compares ids (the "P" role masks Pᵀ, which the "dS" role then uses). A local
window streams as one document whose limits are the band's (common.segment_inputs). A dense
bias and mask (their transposed tiles) and a block mask (its table's q blocks, the partial ones
masked) enter at the "P" role, which forms Pᵀ; the dS role needs nothing more.

Measured on the H200 at 4x4096x8x256 (fwd+bwd, same run as cuDNN): 431 / 395 TFLOP/s
non-causal / causal, 1.05x / 1.09x cuDNN, where Triton's backward kernels gave 0.57-0.59x.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_flash import _tiling
from pallas_flash.call import AttentionParams, FeatureArrays
from pallas_flash.mosaic_gpu.config import MosaicConfig
from pallas_flash.mosaic_gpu.sm90 import block_mask, common, dkdv, kv_stream
from pallas_flash.mosaic_gpu.sm90 import dense as sm90_dense
from pallas_flash.mosaic_gpu.sm90.dq import LOG2E, dq_call

# Key rows of a dK/dV CTA (both warpgroups) and query rows per step; key rows per dQ step
# and the dQ kernel's K and V ring depths: at D = 256 its Q and dO tiles (2 warpgroups x 64
# rows) take 128 KiB, so two 64-key K slots and one V slot (32 KiB each) fit beside them
# (231,536 of 232,448 B) and two of each do not (32-key tiles would, but a wgmma's
# contraction over keys needs multiples of 64 with 128-byte swizzled K rows). K is read by
# the step's first and last products, V only by dPᵀ: with two K slots the next K loads during
# a whole step, the next V from dPᵀ on; with one of each (the first form) the next K's load
# waited for the step's last product, and the dQ kernel ran at 371 TFLOP/s against the dK/dV
# kernel's 601 (4x4096x8x256).
BLOCK_KV, BLOCK_Q, BLOCK_KV_DQ, DQ_K_STAGES, DQ_V_STAGES = 64, 64, 64, 2, 1


def _dkdv_roles_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_smem,
                       v_smem, q_scratch, do_scratch, lse_scratch, delta_scratch, p_scratch,
                       st_scratch, kv_ready, q_ready, do_ready, lse_ready, delta_ready, q_free,
                       do_free, lse_free, delta_free, p_ready, p_free, *,
                       kp: common.KernelParams, seg: common.SegmentRefs | None = None,
                       slopes=None, keys: common.DropoutKeys | None = None, dense=None,
                       blk: block_mask.Refs | None = None):
  """q_ref [B, Tp, H, D], do_ref [B, Tp, H, Dv], k_ref [B, Sp, K, D], v_ref [B, Sp, K, Dv], lse
  (log2 units)/delta_ref [B, H, Tp] (Dv = kp.dv: D but with MosaicConfig.native_value_head_dim).

  Grid over (Sp / block_kv, K, B) in the backward's launch order; dk_ref [B, Sp, K, D], dv_ref
  [B, Sp, K, Dv]. k_smem [block_kv, D], v_smem [block_kv, Dv], q_scratch [stages, block_q, D],
  do_scratch [stages, block_q, Dv], lse/delta_scratch [stages, block_q], p_scratch
  [2, block_kv, block_q] (Pᵀ, with a soft cap times its slope, from WG 0 to WG 1, slot t % 2 at
  step t; p_ready / p_free [2] hand each slot over and back), st_scratch [block_kv, block_q]
  (dSᵀ staging, interpret only). Steps run over (q block, query head) with the head minor, from
  the first q block that sees the keys. seg: the keys' and queries' segment ids and per kv tile
  the hull of q blocks that may share an id with it (the split dK/dV kernel's); the CTA streams
  only those and masks every step. slopes: ALiBi's common.raw_alibi_slopes [H] (GMEM) or None;
  only the "P" role, which forms Pᵀ, adds it (dSᵀ needs no change: ALiBi is a constant per
  score). keys: dropout's row and
  column keys (common.dropout_keys) or None: both roles form the keep mask, the "P" role for
  dV += (kept Pᵀ)·dO (scaled by 1 / (1 - rate) at the end), the "dS" role for the kept, scaled
  dPᵀ; the Pᵀ handed over is the undropped one, which dSᵀ takes.

  Each role stores its accumulator through a tile of its shape that no role reads any more:
  with Dv = D, dV through K (only the "P" role reads K) and dK through V (only the "dS" role
  reads V); with Dv < D the other way round, dV [block_kv, Dv] through V and dK [block_kv, D]
  through K, each tile then being the other role's: the "P" role's last waits on p_free come
  after the "dS" role's last read of V (its dPᵀ retires before it takes the step's Pᵀ), and
  that role's last p_ready wait after the "P" role's last read of K (its Sᵀ retires before it
  hands Pᵀ over). Both roles wait for both tiles' loads first, for a CTA of no steps.
  dense: the dense bias and maskᵀ (dense.DenseRefs) or None; the "P" role adds their tiles.
  blk: a block mask's q-block table per kv tile (block_mask.Refs): the steps run over the
  table's q blocks, the "P" role evaluating the mask function on its partial ones.
  """
  bq, bkv, stages, g_size = kp.block_q, kp.block_kv, kp.stages, kp.group
  wg = lax.axis_index("wg")
  b = lax.axis_index("b")
  kt, kvh = lax.axis_index("kt"), lax.axis_index("kvh")
  k0 = kt * bkv
  cta_first, cta_last = kv_stream.first_q_block(k0, kp), kp.t_pad // bq
  ids = None
  if seg is not None:
    first, last, _, _ = common.segment_limits(seg.limits, b, kt)
    cta_first, cta_last = jnp.maximum(cta_first, first), jnp.minimum(cta_last, last)
    cta_last = jnp.maximum(cta_last, cta_first)  # no q block: zero steps, dK = dV = 0
    if kp.segment_ids:
      ids_at = common.row_and_col_ids(seg, b, k0, bkv, bq)
      ids = lambda t: ids_at(index(t)[0] * bq)  # noqa: E731  (index: below)
  cta_steps = (cta_last - cta_first) * g_size
  sparse = None
  if blk is not None:
    sparse = block_mask.sparse(blk, kp.block_mask, b, kt)
    cta_steps = sparse.steps * g_size
  rows = (b, pl.ds(k0, bkv), kvh)

  def index(step):
    if sparse is not None:
      return sparse.block(lax.div(step, g_size)), kvh * g_size + lax.rem(step, g_size)
    return cta_first + lax.div(step, g_size), kvh * g_size + lax.rem(step, g_size)

  streams = ((q_ref, q_scratch, q_ready, q_free), (do_ref, do_scratch, do_ready, do_free),
             (lse_ref, lse_scratch, lse_ready, lse_free),
             (delta_ref, delta_scratch, delta_ready, delta_free))

  def release(slot, names):
    for stream in names:
      plgpu.barrier_arrive(stream[3].at[slot])

  swapped = kp.dv != kp.d  # each role stores through the other's tile (see above)

  @pl.when(wg == 0)
  def _p_role():
    plgpu.set_max_registers(kp.compute_registers, action="increase")
    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, kv_ready.at[0])
    plgpu.barrier_wait(kv_ready.at[0])
    alibi_at = kv_stream.alibi_steps(slopes, k0, index, kp)
    drop_at = kv_stream.dropout_steps(keys, b, k0, index, kp)

    def step(t, dv, *, masked: bool):
      slot, pslot = lax.rem(t, stages), lax.rem(t, 2)
      bias = alibi_at(t)  # the slope's load runs ahead of the waits
      if dense is not None:  # the transposed dense tiles, added to Sᵀ with ALiBi
        tiles = sm90_dense.load(dense, b, index(t)[1], k0, index(t)[0] * bq, (bkv, bq),
                                transposed=True)
        bias = dkdv.with_dense(bias, tiles, kp)
      drop = drop_at(t)  # as do the queries' dropout keys
      q_smem, do_smem = kv_stream.wait_streams(streams, slot)
      s_t = common.smem_matmul(k_smem, q_smem.T, (bkv, bq))
      s_t, slope, c = kv_stream.capped_scores_t(s_t, bias, kp)
      lse = plgpu.load(lse_scratch.at[slot], layout=common.COL)
      release(slot, streams[2:])  # lse read; delta is the other role's
      p_t = jnp.exp2(s_t * c - lax.broadcast_in_dim(lse, s_t.shape, [1]))
      if sparse is not None:  # the table's partial blocks first; full ones keep every score
        visible = sparse.mask(k0, index(t)[0] * bq, (bkv, bq), kp.kv_len, kp.kv_tail,
                              transposed=True)
        p_t = jnp.where(visible | (t >= sparse.masked * g_size), p_t, 0.0)
      elif masked:
        visible = common.tile_mask(k0, index(t)[0] * bq, (bkv, bq), kp, transposed=True,
                                    ids=ids and ids(t))
        p_t = jnp.where(visible, p_t, 0.0)
      p16 = p_t.astype(kp.dtype)
      # What the dS role takes: Pᵀ, times the soft cap's slope where there is one (the raw
      # scores' dSᵀ = Pᵀ∘slope∘(dPᵀ − δ)), so that role never needs Sᵀ.
      handed = p16 if slope is None else (p_t * slope).astype(kp.dtype)
      p_smem = p_scratch.at[pslot]
      # The slot's previous Pᵀ (two steps ago) must have been read by the dS role, which
      # released both slots once before its first step.
      plgpu.barrier_wait(p_free.at[pslot])
      kept = lambda: kv_stream.dropped(  # noqa: E731  dV's operand with dropout: the kept Pᵀ
          p_t, kv_stream.dropout_keep_t(drop, p_t.shape, kp)).astype(kp.dtype)
      # Interpret: dV's operand through the slot first where it is not the handed-over tile.
      if kp.interpret and (drop is not None or slope is not None):
        p_smem[...] = p16 if drop is None else kept()
        plgpu.commit_smem()
        dv = dv + common.smem_matmul(p_smem, do_smem, dv.shape)
      p_smem[...] = handed
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready.at[pslot])
      if kp.interpret and drop is None and slope is None:  # SMEM operands: Pᵀ is there
        dv = dv + common.smem_matmul(p_smem, do_smem, dv.shape)
      elif not kp.interpret:  # the kept Pᵀ formed once the handed-over one is stored
        dv = common.accumulate(dv, p16 if drop is None else kept(), None, do_smem, kp)
      release(slot, streams[:2])
      return dv

    dv = plgpu.layout_cast(jnp.zeros((bkv, kp.dv), jnp.float32), plgpu.Layout.WGMMA)
    # Causal: the CTA's first q block holds key k0 (no step is skipped) and every step is
    # masked: past the diagonal the mask is all true. One loop, not a masked and an unmasked
    # one: with two loops of dynamic bounds here the Mosaic GPU interpreter hung, before the
    # suite set common.INTERPRET_XLA_FLAG (the split-tail launches' cause; not retried); the
    # masks' compares are cheap beside the step's two 256-deep products.
    masked = kp.causal or seg is not None
    dv = lax.fori_loop(0, cta_steps, functools.partial(step, masked=masked), dv)

    for pslot in range(2):  # each slot's last release, not waited for above: every phase of
      plgpu.barrier_wait(p_free.at[pslot])  # an mbarrier must be observed

    if kp.dropout:  # the kept probabilities' 1 / (1 - rate), once
      dv = dv * kp.inv_keep
    # Only this role reads K; V, once the "dS" role's last p_free arrival is observed above.
    _store_through(dv, v_smem if swapped else k_smem, dv_ref.at[rows], kp)

  @pl.when(wg == 1)
  def _ds_role():
    plgpu.set_max_registers(kp.compute_registers, action="increase")
    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, kv_ready.at[1])
    if swapped:  # the "P" role may store dV through V after these arrivals: V has landed
      plgpu.barrier_wait(kv_ready.at[1])
    for pslot in range(2):  # both Pᵀ slots start free
      plgpu.barrier_arrive(p_free.at[pslot])
    if not swapped:
      plgpu.barrier_wait(kv_ready.at[1])
    drop_at = kv_stream.dropout_steps(keys, b, k0, index, kp)

    def step(t, dk):
      slot, pslot = lax.rem(t, stages), lax.rem(t, 2)
      drop = drop_at(t)  # the queries' dropout keys load ahead of the waits
      q_smem, do_smem = kv_stream.wait_streams(streams, slot)
      dp_t = common.smem_matmul(v_smem, do_smem.T, (bkv, bq))
      delta = plgpu.load(delta_scratch.at[slot], layout=common.COL)
      release(slot, streams[2:])
      plgpu.barrier_wait(p_ready.at[pslot])
      p_t = plgpu.load(p_scratch.at[pslot], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
      plgpu.barrier_arrive(p_free.at[pslot])
      if drop is not None:
        dp_t = jnp.where(kv_stream.dropout_keep_t(drop, dp_t.shape, kp), dp_t * kp.inv_keep,
                         0.0)
      ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1]))
      dk = common.accumulate(dk, ds_t.astype(kp.dtype), st_scratch, q_smem, kp)
      release(slot, streams[:2])
      return dk

    dk = plgpu.layout_cast(jnp.zeros((bkv, kp.d), jnp.float32), plgpu.Layout.WGMMA)
    dk = lax.fori_loop(0, cta_steps, step, dk)
    if swapped:  # K: read by the "P" role's Sᵀ only, the last before its last Pᵀ (waited for
      plgpu.barrier_wait(kv_ready.at[0])  # above); its load, for a CTA of no steps
    # Only this role reads V; K, see above.
    _store_through(dk * kp.scale, k_smem if swapped else v_smem, dk_ref.at[rows], kp)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(kp.producer_registers, action="decrease")
    kv_stream.produce_query_streams(cta_steps, stages, streams, index, b, bq, kp)


def _store_through(acc, smem, dst, kp: common.KernelParams):
  """Stores a float32 accumulator [block_kv, D] to GMEM `dst` in kp.dtype, staged through
  `smem` (a tile this warpgroup alone has finished reading), and waits for the copy to read
  it (the kernel ends after its stores; their writes complete before it does)."""
  smem[...] = acc.astype(kp.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, dst)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _dkdv_call(q, k, v, do, lse2, delta, *, kp: common.KernelParams, segs=(), slopes=(),
               keys=(), dense=(), blks=()):
  """(dK [B, S', K, D], dV [B, S', K, Dv]) of q [B, T', H, D], do [B, T', H, Dv], k [B, S', K, D], v
  [B, S', K, Dv] (Dv = kp.dv), T' and S' padded as common.operand_rows says (tiles cover kp.t_pad /
  kp.s_pad rows); lse2/delta [B, H, Tp] (kp.stats_view); segs: () or (kv_seg [B, Sp], q_seg [B, Tp],
  q limits per kv tile) int32; slopes: () or (common.raw_alibi_slopes [H],); keys: () or dropout's
  (row keys [B, H, Tp], column keys [Sp]); dense: () or the second of dense.backward_inputs (the
  bias and / or maskᵀ's bits; kp.dense says which), whose tiles the "P" role adds to Sᵀ; blks:
  () or a block mask's operands (block_mask.inputs by kv tile), inputs after the six others."""
  bsz, _, kh, d = k.shape
  s_pad = kp.s_pad
  bq, bkv, stages = kp.block_q, kp.block_kv, kp.stages
  tiles = common.smem_transforms(kp.dtype)
  ring = [plgpu.Barrier(num_barriers=stages) for _ in range(4)]
  free = [plgpu.Barrier(num_arrivals=2, num_barriers=stages) for _ in range(4)]
  scratch = [
      plgpu.SMEM((bkv, d), kp.dtype, transforms=tiles),
      plgpu.SMEM((bkv, kp.dv), kp.dtype, transforms=tiles),
      plgpu.SMEM((stages, bq, d), kp.dtype, transforms=tiles),
      plgpu.SMEM((stages, bq, kp.dv), kp.dtype, transforms=tiles),
      plgpu.SMEM((stages, bq), jnp.float32),
      plgpu.SMEM((stages, bq), jnp.float32),
      plgpu.SMEM((2, bkv, bq), kp.dtype, transforms=tiles),
      plgpu.SMEM((bkv, bq), kp.dtype, transforms=tiles) if kp.interpret else None,
      plgpu.Barrier(num_barriers=2),
      *ring, *free,
      plgpu.Barrier(num_barriers=2),
      plgpu.Barrier(num_barriers=2),
  ]
  dk_out, dv_out = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (k, v))

  def make_body(blk=None):
    return common.with_segment_refs(functools.partial(_dkdv_roles_kernel, kp=kp, blk=blk), 6,
                                    bool(segs), alibi=bool(slopes), dropout=bool(keys),
                                    dense=kp.dense)

  return plgpu.kernel(
      common.named(block_mask.with_block_refs(make_body, 6, len(blks)) if blks
                   else make_body(), "flash_dkdv_roles"),
      out_type=(dk_out, dv_out),
      scratch_types=scratch,
      **common.launch_grid(s_pad // bkv, kh, bsz, ("kt", "kvh", "b"), heads_fastest=False),
      num_threads=3, thread_name="wg",
      compiler_params=common.compiler_params(kp),
      interpret=common.interpret_params(kp.interpret),
  )(q, k, v, do, kp.stats_view(lse2), kp.stats_view(delta), *blks, *segs, *slopes, *keys,
    *dense)


def padded_lengths(t: int, s: int) -> tuple[int, int]:
  """(T, S) padded to these kernels' tiles (a dQ CTA takes 2 x BLOCK_Q rows)."""
  return _tiling.round_up(t, 2 * BLOCK_Q), _tiling.round_up(s, BLOCK_KV)


def kernel_params(q, k, params: AttentionParams, config: MosaicConfig, *, t_pad: int,
                  s_pad: int, value_head_dim: int = 0):
  """(dQ, dK/dV) KernelParams for q [B, T, H, D], k [B, S, K, D] (arrays or
  jax.ShapeDtypeStruct) and V's head dim (0: D), their tiles covering t_pad / s_pad rows
  (padded_lengths)."""
  # FA3's register split: a dQ warpgroup holds a 128-register accumulator beside S and dP.
  config = dataclasses.replace(config, compute_registers=240, producer_registers=24)
  make = functools.partial(common.KernelParams.make, q, k, params=params, t_pad=t_pad,
                           s_pad=s_pad, kv_len=k.shape[1], config=config,
                           value_head_dim=value_head_dim)
  kp_dq = dataclasses.replace(make(block_q=BLOCK_Q, block_kv=BLOCK_KV_DQ, stages=DQ_K_STAGES),
                              v_stages=DQ_V_STAGES)
  kp_dkdv = make(block_q=BLOCK_Q, block_kv=BLOCK_KV,
                 stages=min(config.bwd_stages, t_pad // BLOCK_Q))
  return kp_dq, kp_dkdv


def backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, *, params: AttentionParams,
             config: MosaicConfig, slopes=(), arrays: FeatureArrays | None = None):
  """q [B, T, H, D] (D = 192 or 256), k [B, S, K, D], v [B, S, K, Dv], o/do [B, T, H, Dv] (Dv: D, or
  with MosaicConfig.native_value_head_dim its own, a multiple of 64 below D), q/kv_seg [B, T] / [B,
  S] int32 or None, lse as the forward returned it, delta the correction -dlse or None
  (backward.py's contract), slopes () or ALiBi's (common.raw_alibi_slopes [H],), of `arrays` the
  dropout seed and the dense bias and mask are read -> (dq, dk, dv[, dbias]), dbias (dS from the
  dQ kernel) summed over the bias's broadcast axes."""
  t, s = q.shape[1], k.shape[1]
  t_pad, s_pad = padded_lengths(t, s)
  kp_dq, kp_dkdv = kernel_params(q, k, params, config, t_pad=t_pad, s_pad=s_pad,
                                 value_head_dim=v.shape[3])
  # As in the split backward: operands padded only to TMA's 8-row tile where the producers'
  # static first loads allow it; rows past the end read as zeros, stores past it are dropped.
  t_in = common.operand_rows(t, t_pad, config.interpret, kp_dkdv.stages * kp_dkdv.block_q)
  s_in = common.operand_rows(s, s_pad, config.interpret, kp_dq.stages * kp_dq.block_kv)
  qp, dop = _tiling.pad_axis(q, 1, t_in), _tiling.pad_axis(do, 1, t_in)
  kpad, vpad = _tiling.pad_axis(k, 1, s_in), _tiling.pad_axis(v, 1, s_in)
  lse, delta = common.xla_row_stats(o, lse, do, delta)
  # Padded rows: lse2 = +inf (P = 0), delta = 0.
  lse2 = _tiling.pad_axis(lse * LOG2E, 2, t_pad, jnp.inf)
  delta = _tiling.pad_axis(delta, 2, t_pad)
  dq_segs = dkdv_segs = ()
  if common.segment_path(params):
    dq_segs, dkdv_segs = common.segment_inputs(
        *common.path_segment_ids(q, k, q_seg, kv_seg, params), t_pad, s_pad,
        dq_tiles=(2 * BLOCK_Q, BLOCK_KV_DQ), dkdv_tiles=(BLOCK_Q, BLOCK_KV), params=params)
  keys = common.dropout_keys(arrays, params, batch=q.shape[0], heads=q.shape[2], t_pad=t_pad,
                            s_pad=s_pad)
  dense_dq, dense_dkdv = sm90_dense.backward_inputs(arrays, params, t_pad, s_pad)
  bm = None if arrays is None else arrays.block_mask
  kp_dq, kp_dkdv, dq_blks, dkdv_blks = block_mask.backward_inputs(
      bm, kp_dq, kp_dkdv, dq_tiles=(2 * BLOCK_Q, BLOCK_KV_DQ), dkdv_tiles=(BLOCK_Q, BLOCK_KV),
      t_pad=t_pad, s_pad=s_pad)
  kp_dq, visible = sm90_dense.dbias_form(
      kp_dq, params, arrays, q_seg, kv_seg, batch=q.shape[0], heads=q.shape[2], t=t, s=s,
      block_mask=bm)
  out = dq_call(qp, kpad, vpad, dop, None, lse2, delta, kp=kp_dq, segs=dq_segs, slopes=slopes,
                keys=keys, dense=dense_dq, blks=dq_blks)
  dq, *dbias = out if kp_dq.dbias else (out,)
  dk, dv = _dkdv_call(qp, kpad, vpad, dop, lse2, delta, kp=kp_dkdv, segs=dkdv_segs,
                      slopes=slopes, keys=keys, dense=dense_dkdv, blks=dkdv_blks)
  dbias = tuple(sm90_dense.reduce_dbias(x, arrays.bias.shape, t, s, bm, visible)
                for x in dbias)
  return dq[:, :t], dk[:, :s], dv[:, :s], *dbias
