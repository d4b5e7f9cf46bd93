"""The FP8 (float8_e4m3fn) forward for Hopper: both matmuls as FP8 wgmma, fp32 accumulation.

The CTA is the bf16 forward's (forward.py's grid kernel): 2 consumer warpgroups of `block_q`
query rows and a TMA producer warpgroup streaming K and Vᵀ tiles through a `num_stages`-slot
ring, the consumers alternating on the tensor cores (ping-pong), each running the plain kv
loop (`_kv_loop`). Per key block (256 keys up to head dim 128, 128 at 256: DEFAULT_BLOCK_KV):

  S = Q·Kᵀ                   FP8 wgmma (Q, K in shared memory), fp32 accumulator
  s·c                        c = q_descale · k_descale · softmax_scale · log2(e) (per head)
  P = 2⁸ · exp2(s·c − m)     online softmax in fp32; P rounded to e4m3 (satfinite)
  O += P·V                   FP8 wgmma, P from registers, Vᵀ tile from shared memory
  epilogue                   O = acc · v_descale / l, stored as out_dtype; lse

The soft cap applies to the dequantized logit, in c's units (`_capped_logits`); windows and
segment ids / sequence lengths take forward.py's segment-id path (`forward.segment_inputs`:
per CTA tile the key blocks it may see, masks only on those not wholly visible), with masks
built from row and column vectors (`_segment_path_mask`).

P's factor 2⁸ (P_SCALE_LOG2) is exact, keeps P's largest value (1 → 256) below e4m3's 448 and
moves its underflow from 2⁻¹⁰ to 2⁻¹⁸. The row sums l add the same scaled fp32 values, so the
factor cancels in acc / l and is subtracted from the lse.

FP8 wgmma takes both operands K-major: for P·V the contraction runs over keys, so V arrives
transposed, Vᵀ [B, K, D, S] with keys contiguous, made by one XLA transpose of V before the
kernel (one extra pass over V, counted in the benchmark's time). P is a register operand in
Mosaic's 8-bit A layout (WGMMA_8BIT), which assigns each thread 4 consecutive keys of every 16,
where the accumulator layout of S gave it keys {2t, 2t+1, 2t+8, 2t+9}: the kernel relabels the
registers instead of moving data (`p_operand`), and the same XLA pass permutes the keys of Vᵀ
within each group of 16 to match (`permute_keys`), so the contraction is unchanged. In the
Mosaic interpreter P is staged through shared memory in key order and Vᵀ is not permuted.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from pallas_flash import _tiling
from pallas_flash.call import MASK_VALUE, AttentionParams
from pallas_flash.mosaic_gpu.config import SMEM_LIMIT_BYTES, MosaicConfig
from pallas_flash.mosaic_gpu.sm90 import common
from pallas_flash.mosaic_gpu.sm90 import forward as sm90_forward

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
LN2 = math.log(2.0)
LOG2E = math.log2(math.e)
# P is rounded to e4m3 as 2**P_SCALE_LOG2 · P (see the module docstring).
P_SCALE_LOG2 = 8
# Keys per group of the Vᵀ permutation that matches P's register relabelling.
KEY_GROUP = 16
BLOCK_Q = 64  # rows per consumer warpgroup (wgmma's M)
# Key tiles without a config, per head dim: 256 up to 128; 128 at 256, where a 2-slot ring of
# 256-key K and Vᵀ tiles alone (256 KiB) exceeds shared memory (`fits`).
DEFAULT_BLOCK_KV = {64: 256, 128: 256, 256: 128}


def smem_transforms(minor: int):
  """Tiling + swizzle of an 8-bit [rows, minor] shared-memory tile: 128-byte swizzle, or
  64-byte for 64-element rows (head dim 64; wgmma's K group is then 64)."""
  swizzle = 128 if minor >= 128 else 64
  return (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))


def permute_keys(vt):
  """vt [..., S] (S % 16 == 0) with the keys of each group of 16 reordered to the order in
  which `p_operand` presents P: position 4t + 2h + i takes key 8h + 2t + i (t < 4, h, i < 2)."""
  *lead, s = vt.shape
  x = vt.reshape(*lead, s // KEY_GROUP, 2, 4, 2)  # (h, t, i)
  return jnp.swapaxes(x, -3, -2).reshape(*lead, s)  # (t, h, i)


def p_operand(p, kp: common.KernelParams):
  """P [block_q, block_kv] float32 (WGMMA layout) rounded to e4m3 as the A operand of P·V.

  On the GPU, the e4m3 registers are regrouped into the WGMMA_8BIT layout without moving data:
  the thread's two 2-key registers of each 16 keys (keys 2t, 2t+1 and 2t+8, 2t+9) become one
  4-key register, read by wgmma as keys 4t..4t+3; Vᵀ is permuted to match (`permute_keys`).
  In the interpreter, the plain e4m3 array (staged through shared memory in key order)."""
  if kp.interpret:
    return p.astype(E4M3)
  shape = p.shape

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct(shape, E4M3, layout=plgpu.Layout.WGMMA_8BIT))
  def relabel(ctx, p32):
    del ctx
    p8 = p32.astype(ir.Float8E4M3FNType.get())
    regs = p8.registers  # [.., key groups of 8, ..] of 2-element vectors
    out_shape = mgpu.WGMMA_LAYOUT_8BIT.registers_shape(shape)
    out = np.empty(out_shape, dtype=object)
    for idx in np.ndindex(out_shape):
      lo = regs[(idx[0], 2 * idx[1], *idx[2:])]
      hi = regs[(idx[0], 2 * idx[1] + 1, *idx[2:])]
      out[idx] = mgpu_utils.vector_concat([lo, hi])
    return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT_8BIT,
                                _is_signed=None)

  return relabel(p)


def _kv_loop(q_smem, k_scratch, vt_scratch, p_smem, bars: common.KvBarriers, *, q0, steps, c,
             kp: common.KernelParams, kv0=0, seg_ids=None, full=None):
  """One consumer WG's kv loop (forward.py's plain loop with FP8 operands) -> (acc, m, l).

  q_smem [block_q, D], k_scratch [stages, block_kv, D], vt_scratch [stages, D, block_kv]
  (e4m3), p_smem [block_q, block_kv] e4m3 (interpret mode only); c: the head's score factor
  (descales · softmax scale · log2 e). m is in c-scaled log2 units, l sums 2⁸-scaled P.
  The segment-id path (segment ids, sequence lengths, a local window), as forward.py's plain
  loop takes it: step j is key block kv0 + j, seg_ids(col0) gives the (row, column) ids of the
  block at key col0, `full` the run of blocks that need no mask (common.unmasked_run)."""
  bq, bkv, stages = kp.block_q, kp.block_kv, kp.stages
  sched_sync = functools.partial(common.sync, bars.sched)

  def step(j, carry, *, masked: bool):
    acc, m, l = carry
    slot = lax.rem(j, stages)

    def qk(s_ref):
      with jax.named_scope("issue"):
        plgpu.wgmma(s_ref, q_smem, k_scratch.at[slot].T)
      with jax.named_scope("handoff"):
        sched_sync()
      with jax.named_scope("wait_s"):
        return s_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
    plgpu.barrier_arrive(bars.k_free.at[slot])
    with jax.named_scope("softmax"):
      s, factor = _capped_logits(s, c, kp)  # before the mask: a hidden score must stay -inf
      if masked and not kp.segments:
        s = jnp.where(common.visible(q0, j * bkv, (bq, bkv), kp), s, -jnp.inf)
      elif masked:
        col0 = (kv0 + j) * bkv
        ids = None if seg_ids is None else seg_ids(col0)
        s = jnp.where(_segment_path_mask(q0, col0, (bq, bkv), kp, ids), s, -jnp.inf)
      p, m_new, l, alpha = common.online_softmax(s, m, l, factor,
                                                   log2_scale=P_SCALE_LOG2)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      p8 = p_operand(p, kp)
      acc, l, m_new, p8 = lax.optimization_barrier((acc, l, m_new, p8))
    v_op = vt_scratch.at[slot].T  # [block_kv, D], keys contiguous (K-major)
    acc = common.pv_step(acc, p8, v_op, p_smem, bars, j=j, steps=steps, slot=slot,
                         ring_slot=lambda i: lax.rem(i, stages), kp=kp)
    return acc, m_new, l

  carry = (plgpu.layout_cast(jnp.zeros((bq, kp.d), jnp.float32), plgpu.Layout.WGMMA),
           plgpu.layout_cast(jnp.full((bq,), MASK_VALUE, jnp.float32), common.ROW),
           plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), common.ROW))
  return common.kv_loop(step, carry, q0, steps, kp, kv0=kv0, full=full)


def _segment_path_mask(row0, col0, shape, kp: common.KernelParams, ids):
  """[rows, cols] bool of the segment-id path's masked blocks: common.tile_mask's causal /
  window band, key tail and (ids: (row ids ROW, column ids COL) or None) equal ids, built from
  a row and a column vector broadcast to the tile (key − query once per score). With
  common.tile_mask's two full-tile iotas the kernel spilled (ptxas, scripts/mosaic_ptxas.py
  --deviceless, 1x4096x16 causal with a window or segment ids: 276-412 B at head dim 256,
  828-1116 B with 256-key tiles at 128, up to 232 spill loads in the wgmma loops); built
  from vectors, nothing in the loops at head dims 64, 128 and 256. Each vector is built only
  where a term uses it: with an unused iota Mosaic's layout inference finds no solution."""
  lo, hi = kp.window if kp.window is not None else (None, None)
  lo = None if lo is None else -lo
  if kp.causal:
    hi = 0 if hi is None else min(hi, 0)
  keys = functools.cache(lambda: lax.broadcast_in_dim(
      plgpu.broadcasted_iota(jnp.int32, shape[1:], 0, layout=common.COL) + col0, shape, [1]))
  terms = []
  if lo is not None or hi is not None:
    rows = plgpu.broadcasted_iota(jnp.int32, shape[:1], 0, layout=common.ROW) + row0
    offset = keys() - lax.broadcast_in_dim(rows, shape, [0])  # key - query
    terms += [offset >= lo] if lo is not None else []
    terms += [offset <= hi] if hi is not None else []
  if kp.kv_tail and not (kp.causal and kp.q_len <= kp.kv_len):  # as in common.visible
    terms.append(keys() < kp.kv_len)
  if ids is not None:
    row_ids, col_ids = ids
    terms.append(lax.broadcast_in_dim(row_ids, shape, [0])
                 == lax.broadcast_in_dim(col_ids, shape, [1]))
  if not terms:  # nothing hidden (a masked block of the segment-id path always has a term)
    terms.append(keys() >= 0)
  return functools.reduce(lambda a, b: a & b, terms)


def _capped_logits(s, c, kp: common.KernelParams):
  """(scores, factor) of a raw FP8 score tile s = q̂·k̂ᵀ [block_q, block_kv] f32 whose product
  scores·factor is the logit in log2 units: (s, c) without a soft cap; with logits_soft_cap
  cap, the capped logit cap·tanh(x / cap) of the real scaled logit x = scale · q descale ·
  k descale · s = s·c / log2(e), already in log2 units (factor None):
  cap·log2(e) · tanh(s · c / (cap·log2(e))). c is the head's factor (descales folded in), so
  the cap sees the dequantized logit as the reference semantics' does (sm90/common.soft_cap
  is this with c = scale·log2(e), in raw-score units)."""
  if kp.softcap is None:
    return s, c
  cap = kp.softcap * LOG2E
  return jnp.tanh(s * (c * (1.0 / cap))) * cap, None


def _kernel(q_ref, k_ref, vt_ref, scales_ref, o_ref, lse_ref, q_scratch, k_scratch,
            vt_scratch, o_scratch, lse_scratch, p_scratch, q_ready, k_ready, v_ready, k_free,
            v_free, sched, *, kp: common.KernelParams, heads: int, batch: int,
            seg: common.SegmentRefs | None = None):
  """q_ref [B, Tp, H, D], k_ref [B, Sp, K, D], vt_ref [B, K, D, Sp] (e4m3, GMEM), scales_ref
  [2·B·H] float32 (c per (b, h), then the v descale per (b, h)), o_ref [B, Tp, H, D]
  out_dtype, lse_ref [B, H, Tp]. Grid (H, q tiles, B): forward.py's launch order. seg: as in
  forward.py's grid kernel (segment ids, lengths, a window): the CTA streams only the key
  blocks of its tile's limits, at least one, and masks those outside their full run."""
  bq, bkv, stages = kp.block_q, kp.block_kv, kp.stages
  wg = lax.axis_index("wg")
  b, h, qt = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("qt")
  if kp.causal:
    qt = kp.num_q_tiles - 1 - qt  # heaviest tiles first
  cta_q0, cta_steps, kv0, full = common.cta_kv_range(kp, seg, b, qt)
  sched_sync = functools.partial(common.sync, sched)

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(kp.compute_registers, action="increase")
    q_smem = q_scratch.at[wg]
    q0 = cta_q0 + wg * bq
    steps = kp.kv_steps(q0 + bq)
    segment_path = {}
    if seg is not None:
      steps = jnp.clip(steps - kv0, 1, cta_steps)
      # A window alone compares no ids (its zero ids are one document).
      segment_path = dict(kv0=kv0, full=full, seg_ids=common.row_and_col_ids(
          seg, b, q0, bq, bkv) if kp.segment_ids else None)
    c = scales_ref[b * heads + h]
    v_descale = scales_ref[(batch + b) * heads + h]
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], q_smem, q_ready.at[wg])
    plgpu.barrier_wait(q_ready.at[wg])
    plgpu.barrier_wait(k_ready.at[0])

    bars = common.KvBarriers(k_ready, v_ready, k_free, v_free, sched)
    pl.when(wg == 1)(sched_sync)
    acc, m, l = _kv_loop(q_smem, k_scratch, vt_scratch,
                         p_scratch.at[wg] if kp.interpret else None,
                         bars, q0=q0,
                         steps=steps, c=c, kp=kp, **segment_path)
    if kp.causal or seg is not None:
      lax.fori_loop(steps, cta_steps,
                    functools.partial(common.idle_kv_step, bars=bars, stages=stages), None)
    pl.when(wg == 0)(sched_sync)

    with jax.named_scope("epilogue"):
      o_smem, lse_smem = o_scratch.at[wg], lse_scratch.at[wg]
      empty = l == 0.0
      inv_l = v_descale / jnp.where(empty, 1.0, l)
      o_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(o_smem.dtype)
      lse_smem[...] = jnp.where(
          empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l)) - P_SCALE_LOG2) * LN2)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, pl.ds(q0, bq), h], commit_group=False)
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q0, bq)], commit_group=False)
      plgpu.commit_smem_to_gmem_group()
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(kp.producer_registers, action="decrease")
    kvh = lax.div(h, kp.group)

    def load(j, slot):
      keys = pl.ds((j if seg is None else kv0 + j) * bkv, bkv)
      plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kvh], k_scratch.at[slot], k_ready.at[slot])
      plgpu.copy_gmem_to_smem(vt_ref.at[b, kvh, :, keys], vt_scratch.at[slot],
                              v_ready.at[slot])

    for i in range(stages):
      pl.when(i < cta_steps)(functools.partial(load, i, i))

    @pl.loop(stages, cta_steps)
    def _(j):
      slot = lax.rem(j, stages)
      keys = pl.ds((j if seg is None else kv0 + j) * bkv, bkv)
      with jax.named_scope("wait_free"):
        plgpu.barrier_wait(k_free.at[slot])
      plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kvh], k_scratch.at[slot], k_ready.at[slot])
      with jax.named_scope("wait_free"):
        plgpu.barrier_wait(v_free.at[slot])
      plgpu.copy_gmem_to_smem(vt_ref.at[b, kvh, :, keys], vt_scratch.at[slot],
                              v_ready.at[slot])

    common.observe_last_releases((k_free, v_free), cta_steps, stages)


def smem_bytes(d: int, block_kv: int, stages: int, out_dtype) -> int:
  """Shared memory of one FP8 forward CTA: Q, the K/Vᵀ ring (1 byte per entry), the out_dtype
  output staging and lse of both consumer warpgroups, ~1 KiB of barriers and alignment."""
  out = jnp.dtype(out_dtype).itemsize
  return (2 * BLOCK_Q * d + 2 * stages * block_kv * d + 2 * BLOCK_Q * d * out
          + 2 * BLOCK_Q * 4 + 1024)


def block_kv(d: int, config: MosaicConfig | None) -> int:
  """The key tile at head dim d: config.fp8_block_kv where set, else DEFAULT_BLOCK_KV[d]."""
  if config is not None and config.fp8_block_kv:
    return config.fp8_block_kv
  return DEFAULT_BLOCK_KV[d]


def stages(config: MosaicConfig | None) -> int:
  return 2 if config is None else config.num_stages


def forward(q, k, v, c, v_descale, q_seg=None, kv_seg=None, *, params: AttentionParams,
            out_dtype, config: MosaicConfig | None):
  """FP8 attention forward: q [B, T, H, D], k/v [B, S, K, D] float8_e4m3fn; c [B, H] float32
  (q descale · k descale · softmax scale · log2 e), v_descale [B, H] float32 (of each query
  head's kv head); q_seg [B, T] / kv_seg [B, S] int32 segment ids (sequence lengths folded
  in, pallas_flash.validation) or None. params: the call's causal flag, softmax scale and the
  features the kernel takes (logits_soft_cap, local_window). Returns (o [B, T, H, D]
  out_dtype, lse [B, H, T] float32, natural log)."""
  causal, scale = params.is_causal, params.scale
  bsz, t, h, d = q.shape
  s, kvh = k.shape[1], k.shape[2]
  interpret = config is not None and config.interpret
  bkv = block_kv(d, config)
  t_pad = _tiling.round_up(t, 2 * BLOCK_Q)
  s_pad = _tiling.round_up(s, bkv)
  num_stages = min(stages(config), s_pad // bkv)
  if causal and num_stages < 2 and s_pad > bkv:
    raise ValueError("MosaicConfig.num_stages=1 deadlocks the causal mosaic forward when there "
                     "is more than one key block; use num_stages >= 2")
  base = config if config is not None else MosaicConfig()
  kp = common.KernelParams(
      dtype=E4M3, d=d, group=h // kvh, block_q=BLOCK_Q, block_kv=bkv, stages=num_stages,
      num_q_tiles=t_pad // (2 * BLOCK_Q), num_kv_blocks=s_pad // bkv, t_pad=t_pad,
      s_pad=s_pad, kv_len=s, q_len=t, causal=causal, scale=scale, heads_fastest=False,
      compute_registers=base.compute_registers, producer_registers=base.producer_registers,
      interpret=interpret, profile_dir=base.debug.profile_dir,
      segments=common.segment_path(params), segment_ids=params.has_segments,
      softcap=params.logits_soft_cap, window=params.local_window)
  segs = sm90_forward.segment_inputs(q, k, q_seg, kv_seg, params=params, kp=kp)
  qp = _tiling.pad_axis(q, 1, common.operand_rows(t, t_pad, interpret, 0))
  kpad = _tiling.pad_axis(k, 1, common.operand_rows(s, s_pad, interpret, num_stages * bkv))
  # Vᵀ [B, K, D, Sp]: one XLA pass that pads, transposes and (GPU) permutes the keys.
  vt = jnp.transpose(_tiling.pad_axis(v, 1, s_pad), (0, 2, 3, 1))
  if not interpret:
    vt = permute_keys(vt)
  scales = jnp.concatenate([c.reshape(-1), v_descale.reshape(-1)]).astype(jnp.float32)
  out_dtype = jnp.dtype(out_dtype)
  scratch = [
      plgpu.SMEM((2, BLOCK_Q, d), E4M3, transforms=smem_transforms(d)),
      plgpu.SMEM((num_stages, bkv, d), E4M3, transforms=smem_transforms(d)),
      plgpu.SMEM((num_stages, d, bkv), E4M3, transforms=smem_transforms(bkv)),
      plgpu.SMEM((2, BLOCK_Q, d), out_dtype, transforms=common.smem_transforms(out_dtype)),
      plgpu.SMEM((2, BLOCK_Q), jnp.float32),
      plgpu.SMEM((2, BLOCK_Q, bkv), E4M3, transforms=smem_transforms(bkv))
      if interpret else None,
      plgpu.Barrier(num_barriers=2),
      plgpu.Barrier(num_barriers=num_stages),
      plgpu.Barrier(num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=2),
  ]
  launch = common.launch_grid(kp.num_q_tiles, h, bsz, ("qt", "h", "b"), heads_fastest=False)
  body = functools.partial(_kernel, kp=kp, heads=h, batch=bsz)
  if segs:
    body = common.with_segment_refs(body, 4, True)
  o, lse = plgpu.kernel(
      common.named(body, "flash_fp8_fwd"),
      out_type=(jax.ShapeDtypeStruct(qp.shape, out_dtype),
                jax.ShapeDtypeStruct((bsz, h, t_pad), jnp.float32)),
      scratch_types=scratch,
      grid=launch["grid"], grid_names=launch["grid_names"], num_threads=3, thread_name="wg",
      compiler_params=common.compiler_params(kp, min(kp.num_kv_blocks, 32)),
      interpret=common.interpret_params(interpret),
  )(qp, kpad, vt, scales, *segs)
  return o[:, :t], lse[:, :, :t]


def fits(d: int, out_dtype, config: MosaicConfig | None) -> bool:
  return smem_bytes(d, block_kv(d, config), stages(config), out_dtype) <= SMEM_LIMIT_BYTES


__all__ = ["forward", "fits", "permute_keys", "p_operand", "smem_bytes"]
