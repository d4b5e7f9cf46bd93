"""FlashAttention-2 backward as two Triton-lowered Pallas kernels (dK/dV, then dQ).

delta = rowsum(dO * O) comes precomputed from the API. Both kernels recompute probabilities
(and the dropout mask, from its hash) from the saved log-sum-exp. The dK/dV kernel works in the
transposed frame (Sᵀ = K·Qᵀ) so that every matmul has the kernel's key block as its M dimension,
and loops over the query heads of its key/value head's group itself: GQA gradients are summed in
registers, with no repeated K/V. The dQ kernel also writes the logits gradient when there is a
dense bias (dbias, summed over the bias's broadcast axes by XLA afterwards).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_flash import _tiling, dropout
from pallas_flash.call import AttentionParams, FeatureArrays
from pallas_flash.triton import common
from pallas_flash.triton.common import KernelParams
from pallas_flash.triton.config import TritonConfig
from pallas_flash.triton.forward import whole_spec


def _iota(n: int, start):
  return start + lax.broadcasted_iota(jnp.int32, (n,), 0)


def _bwd_dkdv_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, do_ref, lse_ref, delta_ref, bias_ref,
                     mask_ref, slopes_ref, rk_ref, ck_ref, limits_ref, table_ref, counts_ref,
                     fn_refs, dk_ref, dv_ref, *, p: KernelParams):
  """dK, dV of one key block, summed over every query head of its group and every query block.

  Refs: q_ref [T_pad, G, Dp], do_ref [T_pad, G, Dvp]; k_ref/dk_ref [block_kv, Dp], v_ref/dv_ref
  [block_kv, Dvp] (Dvp: the value head dim padded);
  lse_ref/delta_ref [G, T_pad] (lse +inf on empty rows); qs_ref [T_pad], ks_ref [block_kv];
  bias_ref/mask_ref [G, T_pad, block_kv] (or [T_pad, block_kv] when shared by the heads);
  slopes_ref [H_pad]; dropout keys rk_ref [G, T_pad], ck_ref [S_pad]; limits_ref [4] (query
  blocks sharing a segment id); with a block mask, table_ref [nq] / counts_ref [2] (its query
  blocks of this key block) and fn_refs.
  Grid: (num_kv_blocks, B, K).
  """
  j, b, kh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  kv_pos = _iota(p.block_kv, j * p.block_kv)
  kv_seg = ks_ref[...] if p.has_segments else None
  col_keys = ck_ref[pl.ds(j * p.block_kv, p.block_kv)] if p.dropout_rate else None
  inv_keep = 1.0 / (1.0 - p.dropout_rate)

  def dense_t(ref, g, q_slice):  # the [block_kv, block_q] tile of a dense bias / mask
    return (ref[g, q_slice, :] if p.bias_per_head else ref[q_slice, :]).T

  def q_step(i, carry, *, g, masked: bool):
    dk, dv = carry
    q_slice = pl.ds(pl.multiple_of(i * p.block_q, p.block_q), p.block_q)
    q_pos = _iota(p.block_q, i * p.block_q)
    q, do = q_ref[q_slice, g, :], do_ref[q_slice, g, :]
    lse = lse_ref[g, q_slice]
    lse2 = lse * common.LOG2E
    head = kh * p.group_size + g
    slope = slopes_ref[head] if p.has_alibi else None
    bias_t = dense_t(bias_ref, g, q_slice) if p.has_bias else None
    p_t, tanh_t = common.probabilities(common.dot(k, q, trans_b=True), lse, lse2, kv_pos,
                                       q_pos, slope, bias_t, p, lse_on_rows=False)
    # p_t: [block_kv, block_q]
    if masked:
      mask = common.block_mask(q_pos, kv_pos, qs_ref[q_slice] if p.has_segments else None,
                               kv_seg, p, dense_t(mask_ref, g, q_slice).T if p.has_mask else None,
                               fn=(fn_refs, b, i * p.block_q, j * p.block_kv))
      p_t = jnp.where(mask.T, p_t, 0.0)
    if tanh_t is not None and not p.dropout_rate:
      # Soft cap alone: the plain path's order (dP, dV, then dS through c·tanh(s / c)'s
      # derivative) measured 7 % faster on the H200 than dV first with tanh' folded into P
      # (2.97 vs 3.18 ms at causal 8K, docs/perf.md), despite one more live tile.
      dp_t = common.dot(v, do, trans_b=True)
      dv = dv + common.dot(p_t.astype(do.dtype), do)
      ds_t = p_t * (1.0 - tanh_t * tanh_t) * (dp_t - delta_ref[g, q_slice][None, :])
    elif tanh_t is None and not p.dropout_rate:  # the plain path, as measured in docs/perf.md
      dp_t = common.dot(v, do, trans_b=True)  # [block_kv, block_q]
      dv = dv + common.dot(p_t.astype(do.dtype), do)
      ds_t = p_t * (dp_t - delta_ref[g, q_slice][None, :])
    else:
      delta = delta_ref[g, q_slice][None, :]
      # Dropout (with or without the soft cap): dV's matmul first, so that fewer
      # [block_kv, block_q] tiles are live at once next to the keep mask.
      keep_t = None
      p_v = p_t
      if p.dropout_rate:  # the forward's mask, regenerated; 1 / (1 - rate) is applied to dV last
        keep_t = dropout.keep_keys(rk_ref[g, q_slice][None, :], col_keys[:, None],
                                   p.dropout_threshold)
        p_v = jnp.where(keep_t, p_t, 0.0)
      dv = dv + common.dot(p_v.astype(do.dtype), do)
      if tanh_t is not None:  # through c·tanh(s / c), folded into P so that tanh dies here
        p_t = p_t * (1.0 - tanh_t * tanh_t)
      dp_t = common.dot(v, do, trans_b=True)
      if keep_t is None:
        ds_t = p_t * (dp_t - delta)
      else:
        ds_t = p_t * jnp.where(keep_t, dp_t * inv_keep - delta, -delta)
    dk = dk + common.dot(ds_t.astype(q.dtype), q)
    return dk, dv

  first, full_lo, full_hi, last = common.q_runs(j, p, limits_ref)

  def head_step(g, carry):
    if p.block_sparse:
      return common.sparse_loop(table_ref, counts_ref, functools.partial(q_step, g=g), carry)
    carry = lax.fori_loop(first, full_lo, functools.partial(q_step, g=g, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(q_step, g=g, masked=False), carry)
    return lax.fori_loop(full_hi, last, functools.partial(q_step, g=g, masked=True), carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  zeros_v = zeros if v.shape == k.shape else jnp.zeros(v.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, p.group_size, head_step, (zeros, zeros_v))
  dk_ref[...] = (dk * p.scale).astype(dk_ref.dtype)
  dv_ref[...] = (dv * inv_keep if p.dropout_rate else dv).astype(dv_ref.dtype)


def _bwd_dq_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, do_ref, lse_ref, delta_ref, bias_ref,
                   mask_ref, slopes_ref, rk_ref, ck_ref, limits_ref, table_ref, counts_ref,
                   fn_refs, dq_ref, dbias_ref, *, p: KernelParams):
  """dQ of one query block against all key blocks it sees (and its rows of dbias).

  Refs: q_ref/dq_ref [block_q, Dp], do_ref [block_q, Dvp]; k_ref [S_pad, Dp], v_ref [S_pad, Dvp];
  lse_ref/delta_ref [block_q];
  qs_ref [block_q], ks_ref [S_pad]; bias_ref/mask_ref/dbias_ref [block_q, S_pad];
  slopes_ref [H_pad]; dropout keys rk_ref [block_q], ck_ref [S_pad]; limits_ref [4] (key blocks
  sharing a segment id); with a block mask, table_ref [nk] / counts_ref [2] (as in the forward)
  and fn_refs.
  Grid: (num_q_blocks, B, H), reversed under causal masking.
  """
  qi = p.num_q_blocks - 1 - pl.program_id(0) if p.is_causal else pl.program_id(0)
  b, h = pl.program_id(1), pl.program_id(2)
  q, do = q_ref[...], do_ref[...]
  lse = lse_ref[...]
  lse2 = lse * common.LOG2E
  delta = delta_ref[...]
  q_pos = _iota(p.block_q, qi * p.block_q)
  q_seg = qs_ref[...] if p.has_segments else None
  slope = slopes_ref[h] if p.has_alibi else None
  row_keys = rk_ref[...] if p.dropout_rate else None

  def kv_step(j, dq, *, masked: bool):
    kv_slice = pl.ds(pl.multiple_of(j * p.block_kv, p.block_kv), p.block_kv)
    kv_pos = _iota(p.block_kv, j * p.block_kv)
    k, v = k_ref[kv_slice, :], v_ref[kv_slice, :]
    probs, tanh = common.probabilities(  # [block_q, block_kv]
        common.dot(q, k, trans_b=True), lse, lse2, q_pos, kv_pos, slope,
        bias_ref[:, kv_slice] if p.has_bias else None, p, lse_on_rows=True)
    if masked:
      mask = common.block_mask(q_pos, kv_pos, q_seg, ks_ref[kv_slice] if p.has_segments else None,
                               p, mask_ref[:, kv_slice] if p.has_mask else None,
                               fn=(fn_refs, b, qi * p.block_q, j * p.block_kv))
      probs = jnp.where(mask, probs, 0.0)
    # Fold c·tanh's derivative into P (tanh dies here) unless a bias added after the cap needs
    # dS before it.
    if tanh is not None and (dbias_ref is None or p.bias_in_cap):
      probs = probs * (1.0 - tanh * tanh)
      tanh = None
    dp = common.dot(do, v, trans_b=True)
    if p.dropout_rate:
      keep = dropout.keep_keys(row_keys[:, None], ck_ref[kv_slice][None, :], p.dropout_threshold)
      ds = probs * jnp.where(keep, dp * (1.0 / (1.0 - p.dropout_rate)) - delta[:, None],
                             -delta[:, None])
    else:
      ds = probs * (dp - delta[:, None])
    # dbias: dS before tanh's derivative for a bias after the cap, after it for one inside.
    if dbias_ref is not None:
      dbias_ref[:, kv_slice] = ds
    if tanh is not None:
      ds = ds * (1.0 - tanh * tanh)
    return dq + common.dot(ds.astype(k.dtype), k)

  def zero_step(j, _):  # skipped blocks have a zero dbias, which must still be written
    dbias_ref[:, pl.ds(pl.multiple_of(j * p.block_kv, p.block_kv), p.block_kv)] = jnp.zeros(
        (p.block_q, p.block_kv), jnp.float32)
    return _

  dq = jnp.zeros(q.shape, jnp.float32)
  if p.block_sparse:
    if dbias_ref is not None:  # the active blocks are not a range: zero the row, then write
      lax.fori_loop(0, p.num_kv_blocks, zero_step, 0)
    dq = common.sparse_loop(table_ref, counts_ref, kv_step, dq)
  else:
    first, full_lo, full_hi, last = common.kv_runs(qi, p, limits_ref)
    dq = lax.fori_loop(first, full_lo, functools.partial(kv_step, masked=True), dq)
    dq = lax.fori_loop(full_lo, full_hi, functools.partial(kv_step, masked=False), dq)
    dq = lax.fori_loop(full_hi, last, functools.partial(kv_step, masked=True), dq)
    if dbias_ref is not None:
      lax.fori_loop(0, first, zero_step, 0)
      lax.fori_loop(last, p.num_kv_blocks, zero_step, 0)
  dq_ref[...] = (dq * p.scale).astype(dq_ref.dtype)


def backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, *, params: AttentionParams,
             config: TritonConfig, interpret: bool, arrays: FeatureArrays | None = None):
  """Pallas-Triton FlashAttention backward; the contract is in pallas_flash.call."""
  del o
  b, t, h, d = q.shape
  s_len, kh, dv_len = k.shape[1], k.shape[2], v.shape[3]
  bm = arrays.block_mask if arrays is not None else None
  if bm is not None:  # the block mask's tables fix every kernel's blocks
    blocks = dict(q_dkv=bm.block_q, kv_dkv=bm.block_kv, q_dq=bm.block_q, kv_dq=bm.block_kv)
  else:
    blocks = dict(
        q_dkv=common.fit_block(config.block_q_dkv, t),
        kv_dkv=common.fit_block(config.block_kv_dkv, s_len),
        q_dq=common.fit_block(config.block_q_dq, t),
        kv_dq=common.fit_block(config.block_kv_dq, s_len))
  q_mult, kv_mult = max(blocks["q_dkv"], blocks["q_dq"]), max(blocks["kv_dkv"], blocks["kv_dq"])
  q, k, v, q_seg, kv_seg = common.pad_inputs(q, k, v, q_seg, kv_seg, q_multiple=q_mult,
                                             kv_multiple=kv_mult)
  t_pad, s_pad, d_pad, dv_pad = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
  do = _tiling.pad_axis(_tiling.pad_axis(do, 1, t_pad), 3, dv_pad)
  lse = _tiling.pad_axis(lse, 2, t_pad, jnp.inf)  # padded rows: probabilities exactly 0
  delta = _tiling.pad_axis(delta, 2, t_pad)
  bias, mask, slopes, row_keys, col_keys = common.pad_arrays(arrays, batch=b, heads=h,
                                                             t_pad=t_pad, s_pad=s_pad)
  dense = bias if bias is not None else mask
  base = dict(dtype=q.dtype, interpret=interpret, kv_len=s_len, group_size=h // kh,
              bias_per_batch=dense is not None and dense.shape[0] > 1,
              bias_per_head=dense is not None and dense.shape[1] > 1, **common.sparse_params(bm))
  compiler_params = pltriton.CompilerParams(num_warps=config.num_warps_bwd,
                                            num_stages=config.num_stages_bwd)
  args = (q, k, v, q_seg, kv_seg, do, lse, delta, bias, mask, slopes, row_keys, col_keys)
  _, q_limits = common.segment_limits(q_seg, kv_seg, block_q=blocks["q_dkv"],
                                      block_kv=blocks["kv_dkv"])
  kv_limits, _ = common.segment_limits(q_seg, kv_seg, block_q=blocks["q_dq"],
                                       block_kv=blocks["kv_dq"])

  p = KernelParams.create(params, block_q=blocks["q_dkv"], block_kv=blocks["kv_dkv"],
                          num_q_blocks=t_pad // blocks["q_dkv"],
                          num_kv_blocks=s_pad // blocks["kv_dkv"], **base)
  sparse_args, sparse_specs = common.sparse_inputs(bm, p, t_pad=t_pad, s_pad=s_pad, by_q=False)
  dk, dv = pl.pallas_call(
      functools.partial(_bwd_dkdv_kernel, p=p),
      grid=(p.num_kv_blocks, b, kh),
      in_specs=[*_dkdv_in_specs(p, t_pad, (d_pad, dv_pad), args, q_limits), *sparse_specs],
      out_specs=[pl.BlockSpec((None, p.block_kv, None, width), lambda j, bi, ki: (bi, j, ki, 0))
                 for width in (d_pad, dv_pad)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=compiler_params,
      interpret=interpret,
      name="pallas_flash_bwd_dkdv",
  )(*args, q_limits, *sparse_args)

  p = KernelParams.create(params, block_q=blocks["q_dq"], block_kv=blocks["kv_dq"],
                          num_q_blocks=t_pad // blocks["q_dq"],
                          num_kv_blocks=s_pad // blocks["kv_dq"], **base)
  sparse_args, sparse_specs = common.sparse_inputs(bm, p, t_pad=t_pad, s_pad=s_pad, by_q=True)
  q_map = _dq_q_map(p)
  out_specs = [pl.BlockSpec((None, p.block_q, None, d_pad), q_map)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if params.returns_dbias:  # [B, H, T_pad, S_pad] float32: one writer per row block, reduced
    out_specs.append(pl.BlockSpec((None, None, p.block_q, s_pad),
                                  lambda i, bi, hi: (bi, hi, q_map(i, bi, hi)[1], 0)))
    out_shape.append(jax.ShapeDtypeStruct((b, h, t_pad, s_pad), jnp.float32))
  dq, *dbias = pl.pallas_call(
      functools.partial(_bwd_dq_kernel if params.returns_dbias else _no_dbias(_bwd_dq_kernel),
                        p=p),
      grid=(p.num_q_blocks, b, h),
      in_specs=[*_dq_in_specs(p, s_pad, (d_pad, dv_pad), args, kv_limits), *sparse_specs],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=compiler_params,
      interpret=interpret,
      name="pallas_flash_bwd_dq",
  )(*args, kv_limits, *sparse_args)
  grads = (dq[:, :t, :, :d], dk[:, :s_len, :, :d], dv[:, :s_len, :, :dv_len])
  if not params.returns_dbias:
    return grads
  shape = arrays.bias.shape
  axes = tuple(a for a in (0, 1) if shape[a] == 1 and dbias[0].shape[a] != 1)
  return (*grads, dbias[0].sum(axes, keepdims=True)[:, :, :t, :s_len])


def _no_dbias(kernel):
  def without_dbias(*refs, p):
    return kernel(*refs, None, p=p)
  return without_dbias


def _dkdv_in_specs(p: KernelParams, t_pad: int, widths: tuple[int, int], args, limits):
  """widths: the padded q/k and v head dims."""
  g = p.group_size
  d_pad, dv_pad = widths
  segments, bias, mask, slopes, row_keys, col_keys = args[3] is not None, *args[8:]

  def group_map(j, bi, ki):  # the G query heads of key/value head ki
    return bi, 0, ki, 0

  def kv_map(j, bi, ki):
    return bi, j, ki, 0

  def stats_map(j, bi, ki):
    return bi, ki, 0

  def dense_spec(x):
    if x is None:
      return None

    def dense_map(j, bi, ki):
      return bi if p.bias_per_batch else 0, ki if p.bias_per_head else 0, 0, j

    return pl.BlockSpec((None, g if p.bias_per_head else None, t_pad, p.block_kv), dense_map)

  q_spec = pl.BlockSpec((None, t_pad, g, d_pad), group_map)
  do_spec = pl.BlockSpec((None, t_pad, g, dv_pad), group_map)
  k_spec = pl.BlockSpec((None, p.block_kv, None, d_pad), kv_map)
  v_spec = pl.BlockSpec((None, p.block_kv, None, dv_pad), kv_map)
  stats_spec = pl.BlockSpec((None, g, t_pad), stats_map)
  return [q_spec, k_spec, v_spec,
          pl.BlockSpec((None, t_pad), lambda j, bi, ki: (bi, 0)) if segments else None,
          pl.BlockSpec((None, p.block_kv), lambda j, bi, ki: (bi, j)) if segments else None,
          do_spec, stats_spec, stats_spec, dense_spec(bias), dense_spec(mask), whole_spec(slopes),
          None if row_keys is None else stats_spec, whole_spec(col_keys),
          None if limits is None else pl.BlockSpec((None, None, 4), lambda j, bi, ki: (bi, j, 0))]


def _dq_q_map(p: KernelParams):
  def q_map(i, bi, hi):
    return bi, (p.num_q_blocks - 1 - i) if p.is_causal else i, hi, 0
  return q_map


def _dq_in_specs(p: KernelParams, s_pad: int, widths: tuple[int, int], args, limits):
  """widths: the padded q/k and v head dims."""
  q_map = _dq_q_map(p)
  d_pad, dv_pad = widths
  segments, bias, mask, slopes, row_keys, col_keys = args[3] is not None, *args[8:]

  def kv_map(i, bi, hi):
    return bi, 0, hi // p.group_size, 0

  def stats_map(i, bi, hi):
    return bi, hi, q_map(i, bi, hi)[1]

  def dense_spec(x):
    if x is None:
      return None

    def dense_map(i, bi, hi):
      return (bi if p.bias_per_batch else 0, hi if p.bias_per_head else 0, q_map(i, bi, hi)[1], 0)

    return pl.BlockSpec((None, None, p.block_q, s_pad), dense_map)

  q_spec = pl.BlockSpec((None, p.block_q, None, d_pad), q_map)
  do_spec = pl.BlockSpec((None, p.block_q, None, dv_pad), q_map)
  k_spec = pl.BlockSpec((None, s_pad, None, d_pad), kv_map)
  v_spec = pl.BlockSpec((None, s_pad, None, dv_pad), kv_map)
  stats_spec = pl.BlockSpec((None, None, p.block_q), stats_map)
  return [q_spec, k_spec, v_spec,
          pl.BlockSpec((None, p.block_q), lambda i, bi, hi: (bi, q_map(i, bi, hi)[1]))
          if segments else None,
          pl.BlockSpec((None, s_pad), lambda i, bi, hi: (bi, 0)) if segments else None,
          do_spec, stats_spec, stats_spec, dense_spec(bias), dense_spec(mask), whole_spec(slopes),
          None if row_keys is None else stats_spec, whole_spec(col_keys),
          None if limits is None else pl.BlockSpec((None, None, 4),
                                                   lambda i, bi, hi: (bi, q_map(i, bi, hi)[1], 0))]
