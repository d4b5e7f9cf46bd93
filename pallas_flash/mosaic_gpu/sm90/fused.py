"""FlashAttention-3 style backward for Hopper: one Pallas Mosaic GPU kernel per KV tile.

A CTA has 2 consumer warpgroups, each owning `block_kv_fused` key rows (K, V resident in SMEM,
dK and dV accumulated in registers), and a TMA producer warpgroup streaming Q, dO, lse and delta
of every (q block, query head of the kv head) pair. Per step a consumer does 5 tile matmuls
instead of the split backward's 7:

  Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ                      (SMEM operands)
  Pᵀ = exp2(Sᵀ·c − lse·log2e), dSᵀ = Pᵀ∘(dPᵀ − delta)
  dV += Pᵀ·dO                                 (Pᵀ from registers)
  dK += dSᵀ·Q,  dQ_part = dS·K                (dSᵀ written once to SMEM; dQ reads its transposed
                                               view, since register operands cannot be transposed)

The two warpgroups share one dQ_part over the CTA's 2·block_kv keys, each computing half of
D's columns from both warpgroups' dSᵀ (FA3's split: half the reduce-add traffic, a [block_q,
D/2] accumulator). A step issues the previous step's dQ_part behind its own dV and dK, waiting
for the other warpgroup's dSᵀ of that step only in between, so the two need not meet every
step. dQ_part (float32) goes through SMEM and is TMA reduce-added (`reduction_op="add"`) into a
float32 dQ buffer in HBM; XLA then applies softmax_scale and casts. The float32 atomics make
dQ's summation order, and so its last bits, vary run to run; the split backward is the bitwise
reproducible one.

In interpret mode (the interpreter has no TMA reductions, register-operand wgmma or `run_state`
accumulators), each warpgroup of each CTA read-modify-writes its own slice of a [2·(Sp /
(2·block_kv)), ...] dQ buffer (no two read-modify-writes touch the same bytes, as the atomic
reduce-adds may: the interpreter's race detector takes CTAs to run concurrently), Pᵀ is
staged through SMEM and the accumulations are scoped products added in registers.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_flash import _tiling
from pallas_flash.call import AttentionParams
from pallas_flash.mosaic_gpu.config import SMEM_LIMIT_BYTES, MosaicConfig
from pallas_flash.mosaic_gpu.sm90 import common
from pallas_flash.mosaic_gpu.sm90.kv_stream import (PROFILE_STEPS, SMEM_SLACK_BYTES,
                                                    first_q_block,
                                                    first_unmasked_step, kv_stream_barriers,
                                                    kv_stream_smem, kv_stream_smem_bytes,
                                                    load_kv_tiles,
                                                    produce_query_streams, profile_steps,
                                                    store_dk_dv, transposed_grad_tiles,
                                                    wait_streams)

LOG2E = math.log2(math.e)
# dSᵀ buffers per warpgroup: a warpgroup rewrites slot t % 4 at step t + 4, after its step
# t + 3 saw the other warpgroup hand over step t + 2's dSᵀ, i.e. finish step t + 1 and with it
# its dQ_part of step t, the slot's last reader.
DS_SLOTS = 4


def smem_bytes(d: int, block_q: int, block_kv: int, stages: int, itemsize: int = 2) -> int:
  """Shared memory of one CTA: K/V of both WGs, the Q/dO/lse/delta ring, the dSᵀ slots and
  each WG's float32 half of dQ_part."""
  ds = DS_SLOTS * 2 * block_kv * block_q * itemsize
  dq = 2 * block_q * (d // 2) * 4
  return (kv_stream_smem_bytes(d, block_q, block_kv, stages, itemsize) + ds + dq
          + SMEM_SLACK_BYTES)


def unsupported_reason(q, config: MosaicConfig) -> str | None:
  """Why the fused kernel cannot run q [B, T, H, D] with `config`, or None when it can."""
  d = q.shape[3]
  if d != 128:
    return (f"head_dim {d}: the fused backward is built for 128 (each warpgroup takes D/2 "
            "columns of dQ_part, a multiple of the 64-element swizzle width; dK, dV and "
            "dQ_part of wider heads need more than a warpgroup's registers)")
  need = smem_bytes(d, config.block_q_fused, config.block_kv_fused, config.fused_stages,
                    jnp.dtype(q.dtype).itemsize)
  if need > SMEM_LIMIT_BYTES:
    return (f"needs about {need} B of shared memory (head_dim {d}, block_q_fused "
            f"{config.block_q_fused}, block_kv_fused {config.block_kv_fused}, fused_stages "
            f"{config.fused_stages}) > {SMEM_LIMIT_BYTES} B")
  return None


def _dq_part(out, terms):
  """out[...] = the sum of the a @ b products in terms (SMEM operands), one accumulator."""
  def mm(acc_ref):
    for a, b in terms:
      plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]  # waits for every wgmma in flight

  out[...] = pl.run_scoped(mm, plgpu.ACC(out.shape, jnp.float32))


def _gradient_matmuls(dv, dk, p_t, ds_smem, q_smem, do_smem, dq_smem, dq_terms, p_staging,
                      release_do, release_q, wait_dq_operands, kp: common.KernelParams):
  """dV += Pᵀ·dO and dK += dSᵀ·Q, then dq_smem = Σ a @ b over dq_terms (the previous step's
  dQ_part), issued back to back in one accumulator scope.

  dv/dk [block_kv, D] f32, p_t [block_kv, block_q] (dtype, registers), ds_smem [block_kv,
  block_q] (dSᵀ), q/do_smem [block_q, D], dq_smem [block_q, D/2] f32. wait_dq_operands: called
  after dV and dK are issued, before dQ_part's operands are read (the other WG's dSᵀ).
  """
  if kp.interpret:
    dv = common.accumulate(dv, p_t, p_staging, do_smem, kp)
    release_do()
    dk = dk + common.smem_matmul(ds_smem, q_smem, dk.shape)
    release_q()
    wait_dq_operands()
    _dq_part(dq_smem, dq_terms)
    return dv, dk

  def mm(refs):
    dv_ref, dk_ref, dq_ref = refs
    # Issued back to back so the tensor cores never wait on this warpgroup between them; the
    # stream buffers are released as soon as the matmul reading them has retired.
    plgpu.wgmma(dv_ref, p_t, do_smem)
    plgpu.wgmma(dk_ref, ds_smem, q_smem)
    wait_dq_operands()
    for a, b in dq_terms:
      plgpu.wgmma(dq_ref, a, b)
    plgpu.wgmma_wait(len(dq_terms) + 1)
    release_do()
    plgpu.wgmma_wait(len(dq_terms))
    release_q()

  zeros = plgpu.layout_cast(jnp.zeros(dq_smem.shape, jnp.float32), plgpu.Layout.WGMMA)
  dv, dk, dq = pl.run_state(mm)((plgpu.ACC.init(dv), plgpu.ACC.init(dk), plgpu.ACC.init(zeros)))
  dq_smem[...] = dq
  return dv, dk


def _reduce_dq(dq_smem, dq_acc_ref, dst, wg, dq_loaded, kp: common.KernelParams):
  """Adds dq_smem [block_q, D/2] f32 (a dQ_part just written) into dq_acc_ref[dst]; in
  interpret mode into dq_acc_ref[wg, *dst] (wg: one slice per warpgroup of each CTA)."""
  if kp.interpret:
    # dQ_part is read before the fence, so that the TMA load overwriting it is ordered after
    # the read (a generic-proxy read, then an async-proxy write of the same bytes).
    dst = dq_acc_ref.at[(wg, *dst)]
    part = dq_smem[...]
    plgpu.commit_smem()
    plgpu.copy_gmem_to_smem(dst, dq_smem, dq_loaded)
    plgpu.barrier_wait(dq_loaded)
    dq_smem[...] = dq_smem[...] + part
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dq_smem, dst)
    plgpu.wait_smem_to_gmem(0)
    return
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(dq_smem, dq_acc_ref.at[dst], reduction_op="add")


def _bwd_fused_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_acc_ref, dk_ref, dv_ref,
                      k_scratch, v_scratch, q_scratch, do_scratch, lse_scratch, delta_scratch,
                      ds_scratch, dq_scratch, p_scratch, kv_ready, q_ready, do_ready, lse_ready,
                      delta_ready, q_free, do_free, lse_free, delta_free, dq_loaded, unused,
                      kv_done, ds_handoff, *, kp: common.KernelParams):
  """q/do_ref [B, Tp, H, D], k/v_ref [B, Sp, K, D], lse (log2 units)/delta_ref [1, B·H, Tp].

  Grid (K, Sp / (2·block_kv), B) named (kvh, kt, b). dq_acc_ref [B, Tp, H, D] f32 (a zeroed buffer
  the kernel adds into, with a leading [2·(Sp / (2·block_kv))] in interpret mode, one slice per WG
  of each kt); dk/dv_ref [B, Sp, K, D]. k/v_scratch [2, block_kv, D], q/do_scratch [stages, block_q,
  D], lse/delta_scratch [stages, block_q], ds_scratch [4, 2, block_kv, block_q] (dSᵀ of step t in
  slot t % 4), dq_scratch [2, block_q, D/2] f32, p_scratch [2, block_kv, block_q] (interpret only).
  ds_handoff [2 WGs, 4]: WG w arrives at [w, t % 4] once its dSᵀ of step t is stored. Steps run over
  (q block i, query head g) with g minor, starting at the first q block that sees the CTA's keys;
  both WGs run every CTA step (the other WG needs each dSᵀ), the ones before a WG's first visible q
  block masked to zero.
  """
  del unused  # a two-party barrier no step waits on; see fused_call
  bq, bkv, stages, g_size = kp.block_q, kp.block_kv, kp.stages, kp.group
  nq = kp.t_pad // bq
  b = lax.axis_index("b")
  wg = lax.axis_index("wg")
  kt, kvh = lax.axis_index("kt"), lax.axis_index("kvh")
  cta_k0 = kt * (2 * bkv)
  cta_first = first_q_block(cta_k0, kp)
  cta_steps = (nq - cta_first) * g_size

  def index(step):
    """(q block, query head) of CTA step `step`."""
    return cta_first + lax.div(step, g_size), kvh * g_size + lax.rem(step, g_size)

  streams = ((q_ref, q_scratch, q_ready, q_free), (do_ref, do_scratch, do_ready, do_free),
             (lse_ref, lse_scratch, lse_ready, lse_free),
             (delta_ref, delta_scratch, delta_ready, delta_free))

  def _consumer(wg):
    plgpu.set_max_registers(kp.compute_registers, action="increase")
    k_smem, v_smem, dq_smem = k_scratch.at[wg], v_scratch.at[wg], dq_scratch.at[wg]
    k0 = cta_k0 + wg * bkv
    rows = (b, pl.ds(k0, bkv), kvh)
    load_kv_tiles(k_ref, v_ref, k_smem, v_smem, kv_ready, wg, rows)

    def dq_terms(ds):
      """This WG's columns of D and its dQ_part's (a, b) products from both WGs' dSᵀ tiles
      ds [2, block_kv, block_q] and K tiles."""
      cols = pl.ds(wg * (kp.d // 2), kp.d // 2)
      # Traced WG indices only: a literal index captured by run_state's body becomes one of
      # its outputs, which the Mosaic lowering rejects.
      return [(ds.at[w].T, k_scratch.at[w, :, cols]) for w in (wg, 1 - wg)], cols

    def wait_dq_staging():
      """Waits until the previous reduce-add has finished reading dq_smem; a step of matmuls
      has run since it was issued, so this rarely waits. (The interpreter's is synchronous.)"""
      if not kp.interpret:
        with jax.named_scope("wait_reduce"):
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def reduce_dq(i, h, cols):
      """Reduce-adds dq_smem into the rows of q block i, head h, columns cols."""
      _reduce_dq(dq_smem, dq_acc_ref, (b, pl.ds(i * bq, bq), h, cols),
                 2 * kt + wg if kp.interpret else wg,
                 common.at(dq_loaded, wg), kp)

    def last_dq(t):
      """dQ_part of step t, after the loop: both WGs' dSᵀ of it times their K, this WG's half
      of D's columns, reduce-added into its q rows."""
      ds_slot = lax.rem(t, DS_SLOTS)
      with jax.named_scope("sync_ds"):
        plgpu.barrier_wait(ds_handoff.at[1 - wg, ds_slot])
      i, h = index(t)
      terms, cols = dq_terms(ds_scratch.at[ds_slot])
      wait_dq_staging()
      with jax.named_scope("dq_mm"):
        _dq_part(dq_smem, terms)
      with jax.named_scope("reduce_dq"):
        reduce_dq(i, h, cols)

    def step(t, carry, *, masked: bool):
      """Step t: this WG's Pᵀ and dSᵀ (dSᵀ stored in slot t % 4 and handed to the other WG),
      then dV, dK and the previous step's dQ_part in one accumulator scope, the wait for the
      other WG's dSᵀ of step t - 1 between them (step 0's dQ_part reads the slot the
      pre-arrival released and is not reduced)."""
      dk, dv = carry
      slot = lax.rem(t, stages)
      i, _ = index(t)
      q_smem, do_smem = wait_streams(streams, slot)
      p_t, ds_t = transposed_grad_tiles(k_smem, v_smem, q_smem, do_smem, streams, slot, k0,
                                         (lambda: i) if masked else None, kp,
                                         early_probs=True)
      ds_slot = lax.rem(t, DS_SLOTS)
      ds_smem = ds_scratch.at[ds_slot, wg]
      with jax.named_scope("ds_store"):
        ds_smem[...] = ds_t.astype(kp.dtype)
        plgpu.commit_smem()
      plgpu.barrier_arrive(ds_handoff.at[wg, ds_slot])
      prev_slot = lax.rem(t + (DS_SLOTS - 1), DS_SLOTS)
      p16 = p_t.astype(kp.dtype)
      prev_i, prev_h = index(jnp.maximum(t - 1, 0))
      terms, cols = dq_terms(ds_scratch.at[prev_slot])
      wait_dq_staging()
      with jax.named_scope("grad_mm"):
        dv, dk = _gradient_matmuls(
            dv, dk, p16, ds_smem, q_smem, do_smem, dq_smem, terms, common.at(p_scratch, wg),
            lambda: plgpu.barrier_arrive(do_free.at[slot]),
            lambda: plgpu.barrier_arrive(q_free.at[slot]),
            lambda: plgpu.barrier_wait(ds_handoff.at[1 - wg, prev_slot]), kp)
      with jax.named_scope("reduce_dq"):
        pl.when(t > 0)(lambda: reduce_dq(prev_i, prev_h, cols))
      return dk, dv

    zeros = plgpu.layout_cast(jnp.zeros((bkv, kp.d), jnp.float32), plgpu.Layout.WGMMA)
    carry = (zeros, zeros)
    # Causal: q blocks before `full` cross this WG's diagonal (or precede it) and are masked,
    # blocks from `full` on see every key of the tile.
    first = jnp.zeros((), jnp.int32)
    full = first
    if kp.causal:
      full = first_unmasked_step(k0, cta_first, kp)
    if kp.kv_tail:
      # Padded keys are zero, so their dQ_part terms vanish, unless exp2(0 − lse2) overflows
      # (rows whose scores are all far below 0): the tile holding the tail masks every step.
      full = jnp.where(k0 + bkv > kp.kv_len, cta_steps, full)
    # Step 0's dQ_part waits for the other WG's "step -1", slot 3.
    pl.when(cta_steps > 0)(lambda: plgpu.barrier_arrive(ds_handoff.at[wg, DS_SLOTS - 1]))
    if not (kp.causal or kp.kv_tail):
      # WG w runs its first (w + 1)·G steps in a loop of their own, then the rest: same steps,
      # but ptxas keeps the main loop free of spill reloads (docs/mosaic.md).
      lead = jnp.minimum(first + (wg + 1) * g_size, cta_steps)
      carry = lax.fori_loop(first, lead, functools.partial(step, masked=False), carry)
      first = lead
    if kp.needs_mask:
      carry = lax.fori_loop(first, full, functools.partial(step, masked=True), carry)
      first = full
    dk, dv = lax.fori_loop(first, cta_steps, functools.partial(step, masked=False), carry)
    pl.when(cta_steps > 0)(lambda: last_dq(cta_steps - 1))
    # The other WG's last dQ matmul reads this WG's K tile, about to be overwritten.
    common.sync(kv_done)
    # Also the last dQ reduction.
    store_dk_dv(dk, dv, k_smem, v_smem, dk_ref, dv_ref, rows, kp)

  # One consumer body per warpgroup, its index a constant in each (its shared-memory addresses
  # and key offsets too): the main loops then spill nothing (docs/mosaic.md). `wg * 0 + w`, not
  # `w`: a literal ref index closed over by run_state's body becomes one of its outputs, which
  # the lowering rejects; MLIR folds this one to the constant.
  for w in range(2):
    pl.when(wg == w)(functools.partial(_consumer, wg * 0 + w))

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(kp.producer_registers, action="decrease")
    produce_query_streams(cta_steps, stages, streams, index, b, bq, kp)


def fused_call(q, k, v, do, lse2, delta, *, kp: common.KernelParams):
  """q/do [B, T', H, D], k/v [B, S', K, D] (T', S' padded as common.operand_rows says, the
  tiles covering kp.t_pad / kp.s_pad rows), lse2/delta [B, H, Tp] -> (dq_acc [B, T', H, D] f32
  unscaled, dk [B, S', K, D] scaled, dv [B, S', K, D]).

  On the GPU the kernel is compiled without Pallas' barriers around shared-memory stores
  (ignored when interpreting, whose dQ read-modify-write needs them). No thread reads shared
  memory that a thread wrote; the stores' hazards are ordered by: dSᵀ (read by wgmma only):
  its slot's last readers, the wgmmas of two steps before, retired before this WG's wait and
  before the other WG's arrival on the step between; commit_smem's fence and barrier publish
  it. The dQ_part staging (read by TMA only): the wait for the last reduction's reads ends in a
  warpgroup barrier (Mosaic's await_async_copy); _reduce_dq's commit_smem publishes it. The
  dK / dV tiles at the end: written after the last matmuls that read them (both WGs': the
  kv_done sync), published by commit_smem."""
  bsz, _, kh, d = k.shape
  bq, bkv = kp.block_q, kp.block_kv
  tiles = common.smem_transforms(kp.dtype)
  scratch = [
      *kv_stream_smem(kp, d),
      plgpu.SMEM((DS_SLOTS, 2, bkv, bq), kp.dtype, transforms=tiles),
      plgpu.SMEM((2, bq, d // 2), jnp.float32, transforms=common.smem_transforms(jnp.float32)),
      plgpu.SMEM((2, bkv, bq), kp.dtype, transforms=tiles) if kp.interpret else None,
      *kv_stream_barriers(kp),
      plgpu.Barrier(num_barriers=2) if kp.interpret else None,
      # Unused: it stays allocated so that the compiled kernel is the one measured on the
      # H200 (removing it shifts the shared-memory layout; not measured).
      plgpu.Barrier(num_arrivals=2),
      plgpu.Barrier(num_arrivals=2),
      plgpu.Barrier(num_barriers=(2, DS_SLOTS)),
  ]
  # The kernel only adds: the zeros come from XLA (a memset) and reach the kernel as a mutable
  # input, aliased to the result. Their scalar passes through an optimization barrier with dO:
  # constant zeros have no operands, and XLA fused the memsets of a whole model's backward
  # into one at its start, all the buffers live at once (12 layers at 2x16384x8x128: +1.4 GiB).
  zero, _ = lax.optimization_barrier((jnp.zeros((), jnp.float32), do))
  slices = (2 * (kp.s_pad // (2 * bkv)),) if kp.interpret else ()
  dq_acc = jax.new_ref(jnp.broadcast_to(zero, slices + q.shape))
  kv_out = jax.ShapeDtypeStruct(k.shape, k.dtype)
  dk, dv = plgpu.kernel(
      functools.partial(_bwd_fused_kernel, kp=kp),
      out_type=(kv_out, kv_out),
      scratch_types=scratch,
      **common.launch_grid(kp.s_pad // (2 * bkv), kh, bsz, ("kt", "kvh", "b"),
                            heads_fastest=False),
      num_threads=3, thread_name="wg",
      compiler_params=common.compiler_params(kp, min(profile_steps(kp), PROFILE_STEPS),
                                              auto_barriers=kp.interpret),
      interpret=common.interpret_params(kp.interpret),
  )(q, k, v, do, kp.stats_view(lse2), kp.stats_view(delta), dq_acc)
  dq = jax.freeze(dq_acc)
  if kp.interpret:
    dq = dq.sum(0)
  return dq, dk, dv


def backward(q, k, v, lse, do, delta, *, params: AttentionParams, config: MosaicConfig):
  """q/do [B, T, H, D], k/v [B, S, K, D], lse/delta [B, H, T] -> (dq, dk, dv) in q.dtype.

  lse is +inf on fully masked rows (see pallas_flash.call); callers check
  `unsupported_reason` first.
  """
  t, s = q.shape[1], k.shape[1]
  bq, bkv = config.block_q_fused, config.block_kv_fused
  t_pad, s_pad = _tiling.round_up(t, bq), _tiling.round_up(s, 2 * bkv)
  kp = common.KernelParams.make(
      q, k, params=params, block_q=bq, block_kv=bkv,
      stages=min(config.fused_stages, t_pad // bq), t_pad=t_pad, s_pad=s_pad, kv_len=s,
      config=config, q_tile_rows=bq)
  # Operands padded only to TMA's 8-row tile (the split backward's rule): the producer's first
  # `stages` q blocks load at static offsets, the K/V tiles at dynamic ones.
  t_in = common.operand_rows(t, t_pad, config.interpret, kp.stages * bq)
  s_in = common.operand_rows(s, s_pad, config.interpret, 0)
  qp, dop = _tiling.pad_axis(q, 1, t_in), _tiling.pad_axis(do, 1, t_in)
  kpad, vpad = _tiling.pad_axis(k, 1, s_in), _tiling.pad_axis(v, 1, s_in)
  # lse in log2 units so that P = exp2(S·c − lse2); padded rows get +inf (P = 0, so their dS,
  # dQ_part rows and contributions to dK/dV are 0).
  lse2 = _tiling.pad_axis(lse * LOG2E, 2, t_pad, jnp.inf)
  delta = _tiling.pad_axis(delta, 2, t_pad)
  dq_acc, dk, dv = fused_call(qp, kpad, vpad, dop, lse2, delta, kp=kp)
  dq = (dq_acc[:, :t] * params.scale).astype(q.dtype)
  return dq, dk[:, :s], dv[:, :s]
