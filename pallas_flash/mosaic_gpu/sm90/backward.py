"""The Hopper backward: the split kernels (dQ, then dK/dV), the fused kernel, or at head dims
192 and 256 hd256.py's pair, chosen by the config; operands padded, segment ids and windows
turned into the kernels' block limits.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax.numpy as jnp

from pallas_flash import _tiling, merge
from pallas_flash.call import AttentionParams, FeatureArrays
from pallas_flash.mosaic_gpu.config import SMEM_LIMIT_BYTES, MosaicConfig
from pallas_flash.mosaic_gpu.sm90 import block_mask, common, dkdv, fused, hd256
from pallas_flash.mosaic_gpu.sm90 import dense as sm90_dense
from pallas_flash.mosaic_gpu.sm90.dq import LOG2E, dq_call, dq_smem_bytes


def padded_lengths(t: int, s: int, config: MosaicConfig) -> tuple[int, int]:
  """(T, S) padded for the split backward: one length serves both kernels, a multiple of both
  CTA heights and both tiles."""
  q_mult = math.lcm(2 * config.block_q_dq, config.block_q_dkv)
  kv_mult = math.lcm(2 * config.block_kv_dkv, config.block_kv_dq)
  return _tiling.round_up(t, q_mult), _tiling.round_up(s, kv_mult)


def split_kernel_params(q, k, params: AttentionParams, config: MosaicConfig, *, t_pad: int,
                        s_pad: int):
  """(dQ kernel's, dK/dV kernel's) KernelParams for q [B, T, H, D], k [B, S, K, D] (arrays or
  jax.ShapeDtypeStruct), their tiles covering t_pad / s_pad rows."""
  make = functools.partial(common.KernelParams.make, q, k, params=params, t_pad=t_pad,
                           s_pad=s_pad, kv_len=k.shape[1], config=config)
  return (make(block_q=config.block_q_dq, block_kv=config.block_kv_dq,
               stages=min(config.bwd_stages, s_pad // config.block_kv_dq)),
          make(block_q=config.block_q_dkv, block_kv=config.block_kv_dkv,
               stages=min(config.bwd_stages, t_pad // config.block_q_dkv)))


def backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, *, params: AttentionParams,
             config: MosaicConfig, arrays: FeatureArrays | None = None):
  """See pallas_flash.call for the contract (of `arrays` only the ALiBi slopes and the sinks
  are read, as in forward; every kernel that forms P adds ALiBi, none needs more for dS). This
  backend sets BACKWARD_COMPUTES_DELTA: lse is the forward's (natural log, -inf on fully masked
  rows) and delta only the correction -dlse [B, H, T] float32, or None when lse has no
  cotangent. With params.has_sinks o and lse are the sinks' softmax's, which the kernels need
  nothing more for, and dsinks (merge.sinks_grad) follows dq, dk, dv: it reduces the full
  delta that the dQ kernel returns, or that XLA computed for the paths that take it from XLA.
  Segment ids: the split kernels load only the blocks that may share an id with their tile and
  compare ids on those not wholly inside the tile's one document; a local window runs the same
  path, its band's blocks as the limits (common.segment_inputs). A dense bias and mask are
  loaded by the split kernels (hd256.py's above head dim 128), and dbias (dS, from the dQ
  kernel) follows dk and dv. A block mask runs the split kernels (hd256.py's) over its
  tables at their tiles (block_mask.inputs). The fused kernel takes none of them, nor
  ALiBi: it falls back to the split with a warning."""
  d = q.shape[3]
  assert v.shape[3] == d or d > 128, "a value head dim of its own: the kernels of D > 128 only"
  slopes = common.raw_alibi_slopes(arrays, params)
  full_delta = None  # rowsum(dO∘O) - dlse, where the split kernels return it
  if d > 128:  # 192 or 256
    grads = hd256.backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, params=params,
                           config=config, slopes=slopes, arrays=arrays)
  elif config.fused_backward and (reason := _fused_reason(q, params, config)) is None:
    lse_inf, full_delta = common.xla_row_stats(o, lse, do, delta)
    grads = fused.backward(q, k, v, lse_inf, do, full_delta, params=params, config=config)
  else:
    if config.fused_backward:
      warnings.warn(f"fused_backward=True, using the split backward instead: {reason}",
                    stacklevel=2)
    *grads, full_delta = _split_backward(q, k, v, q_seg, kv_seg, o, lse, do, delta,
                                         params=params, config=config, slopes=slopes,
                                         arrays=arrays)
  if not params.has_sinks:
    return tuple(grads)
  if full_delta is None:  # XLA's, as the head-dim-256 path computes it (CSE'd)
    _, full_delta = common.xla_row_stats(o, lse, do, delta)
  return (*grads, merge.sinks_grad(arrays.sinks, lse, full_delta))


def _fused_reason(q, params: AttentionParams, config: MosaicConfig) -> str | None:
  """Why the fused backward kernel cannot run a call that config.fused_backward asks it for."""
  reason = fused.unsupported_reason(q, config)
  if reason is None and common.segment_path(params):
    reason = ("segment ids, lengths and local windows are streamed and compared in the "
              "split kernels only")
  if reason is None and params.has_alibi:
    reason = "ALiBi is added in the split kernels only"
  if reason is None and (params.has_bias or params.has_mask):
    reason = "a dense bias or mask is loaded in the split kernels only"
  if reason is None and params.dropout_rate:
    reason = "dropout's mask is formed in the split kernels only"
  if reason is None and params.block_mask_blocks is not None:
    reason = "block masks are streamed in the split kernels only"
  return reason


def _split_backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, *, params: AttentionParams,
                    config: MosaicConfig, slopes=(), arrays: FeatureArrays | None = None):
  """The dQ kernel, then the dK/dV kernel (backward's contract; slopes: () or ALiBi's
  (common.raw_alibi_slopes [H],); of `arrays` the dense bias and mask, the dropout seed and
  the block mask are
  read) -> (dq, dk, dv[, dbias], delta [B, H, T] = rowsum(dO∘O) - dlse), dbias with
  params.returns_dbias (summed over the bias's broadcast axes), delta as the dQ kernel or XLA
  computed it (unused but for the sinks' gradient)."""
  t, s = q.shape[1], k.shape[1]
  t_pad, s_pad = padded_lengths(t, s, config)
  kp_dq, kp_dkdv = split_kernel_params(q, k, params, config, t_pad=t_pad, s_pad=s_pad)
  bm = None if arrays is None else arrays.block_mask
  kp_dq, kp_dkdv, dq_blks, dkdv_blks = block_mask.backward_inputs(
      bm, kp_dq, kp_dkdv, dq_tiles=(2 * config.block_q_dq, config.block_kv_dq),
      dkdv_tiles=(config.block_q_dkv, 2 * config.block_kv_dkv), t_pad=t_pad, s_pad=s_pad)
  t_in = common.operand_rows(t, t_pad, config.interpret, kp_dkdv.stages * kp_dkdv.block_q)
  s_in = common.operand_rows(s, s_pad, config.interpret, kp_dq.stages * kp_dq.block_kv)
  qp, dop, op = (_tiling.pad_axis(x, 1, t_in) for x in (q, do, o))
  kpad, vpad = _tiling.pad_axis(k, 1, s_in), _tiling.pad_axis(v, 1, s_in)
  dq_segs = dkdv_segs = ()
  if common.segment_path(params):
    dq_segs, dkdv_segs = common.segment_inputs(
        *common.path_segment_ids(q, k, q_seg, kv_seg, params), t_pad, s_pad,
        dq_tiles=(2 * config.block_q_dq, config.block_kv_dq),
        dkdv_tiles=(config.block_q_dkv, 2 * config.block_kv_dkv), params=params)
  dense_in, dense_dkdv = sm90_dense.backward_inputs(arrays, params, t_pad, s_pad)
  dbias = ()
  with_o = dq_smem_bytes(kp_dq, in_kernel=True, correction=delta is not None) <= SMEM_LIMIT_BYTES
  kp_dq = sm90_dense.o_tile_stages(kp_dq, arrays, with_o=with_o)
  kp_dq, visible = sm90_dense.dbias_form(
      kp_dq, params, arrays, q_seg, kv_seg, batch=q.shape[0], heads=q.shape[2], t=t, s=s,
      block_mask=bm)
  keys = common.dropout_keys(arrays, params, batch=q.shape[0], heads=q.shape[2], t_pad=t_pad,
                             s_pad=s_pad)
  # Padded rows get lse = +inf (P = 0) and, with O and dO zero there, delta = 0.
  if with_o:
    # The dQ kernel computes lse2 and delta from O and dO (FA2's preprocessing) and hands them
    # to the dK/dV kernel, so no XLA op runs before the kernels.
    lse = _tiling.pad_axis(lse, 2, t_pad, jnp.inf)
    if delta is not None:
      delta = _tiling.pad_axis(delta, 2, t_pad)
    dq, lse2, delta, *dbias = dq_call(qp, kpad, vpad, dop, op, lse, delta, kp=kp_dq,
                                      segs=dq_segs, slopes=slopes, dense=dense_in, keys=keys,
                                      blks=dq_blks)
  else:  # the dQ kernel's O tile does not fit beside this config's tiles: XLA's pass
    lse, delta = common.xla_row_stats(o, lse, do, delta)
    # lse in log2 units so that P = exp2(S·c − lse2).
    lse2 = _tiling.pad_axis(lse * LOG2E, 2, t_pad, jnp.inf)
    delta = _tiling.pad_axis(delta, 2, t_pad)
    out = dq_call(qp, kpad, vpad, dop, None, lse2, delta, kp=kp_dq, segs=dq_segs,
                  slopes=slopes, dense=dense_in, keys=keys, blks=dq_blks)
    dq, *dbias = out if kp_dq.dbias else (out,)
  dk, dv = dkdv.dkdv_call(qp, kpad, vpad, dop, lse2, delta, kp=kp_dkdv, segs=dkdv_segs,
                          slopes=slopes, dense=dense_dkdv, keys=keys, blks=dkdv_blks)
  dbias = tuple(sm90_dense.reduce_dbias(x, arrays.bias.shape, t, s, bm, visible,
                                        zeroed=kp_dq.dbias_batch_sum) for x in dbias)
  return dq[:, :t], dk[:, :s], dv[:, :s], *dbias, delta[:, :, :t]
