"""FlashAttention-2 forward as a Triton-lowered Pallas kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_flash import dropout
from pallas_flash.call import MASK_VALUE, AttentionParams, FeatureArrays
from pallas_flash.triton import common
from pallas_flash.triton.common import KernelParams
from pallas_flash.triton.config import TritonConfig


def _fwd_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, bias_ref, mask_ref, slopes_ref, rk_ref,
                ck_ref, limits_ref, table_ref, counts_ref, fn_refs, o_ref, lse_ref, *,
                p: KernelParams):
  """One query block against the key blocks it may see.

  Refs after BlockSpec slicing: q_ref [block_q, Dp]; k_ref [S_pad, Dp]; v_ref [S_pad, Dvp];
  o_ref [block_q, Dvp] (Dvp: the value head dim padded, Dp unless it differs);
  qs_ref [block_q] and ks_ref [S_pad] int32 segment ids; bias_ref [block_q, S_pad] (any float);
  mask_ref [block_q, S_pad] int8; slopes_ref [H_pad] float32; dropout keys rk_ref [block_q] and
  ck_ref [S_pad] int32; limits_ref [4] int32 (key blocks sharing a segment id, then those in the
  same document throughout); lse_ref [block_q]; with a block mask,
  table_ref [nk] (active key blocks, partial first), counts_ref [2] (active, partial) and
  fn_refs the mask function's leaves ([T_pad], [S_pad] or [B_pad]). Refs of unused features
  are None.
  Grid: (num_q_blocks, B, H), query blocks reversed under causal masking so the heaviest start
  first.
  """
  qi = _reversed(pl.program_id(0), p)
  b, h = pl.program_id(1), pl.program_id(2)
  q = q_ref[...]
  q_pos = qi * p.block_q + lax.broadcasted_iota(jnp.int32, (p.block_q,), 0)
  q_seg = qs_ref[...] if p.has_segments else None
  slope = slopes_ref[h] if p.has_alibi else None
  row_keys = rk_ref[...] if p.dropout_rate else None

  def step(j, carry, *, masked: bool):
    m_prev, l_prev, acc = carry
    kv_slice = pl.ds(pl.multiple_of(j * p.block_kv, p.block_kv), p.block_kv)
    kv_pos = j * p.block_kv + lax.broadcasted_iota(jnp.int32, (p.block_kv,), 0)
    k = k_ref[kv_slice, :]
    # Scores in log2 units: exp(x * scale) == exp2(x * scale * log2 e) (FA2 uses exp2 too).
    s, _ = common.logits(common.dot(q, k, trans_b=True), q_pos, kv_pos, slope,
                         bias_ref[:, kv_slice] if p.has_bias else None, p)  # [block_q, block_kv]
    if masked:
      mask = common.block_mask(q_pos, kv_pos, q_seg, ks_ref[kv_slice] if p.has_segments else None,
                               p, mask_ref[:, kv_slice] if p.has_mask else None,
                               fn=(fn_refs, b, qi * p.block_q, j * p.block_kv))
    if p.fixed_max:  # bounded soft-capped scores: the max stays 0, nothing to rescale
      m_next, alpha = m_prev, None
      probs = jnp.exp2(s)
      if masked:
        probs = jnp.where(mask, probs, 0.0)
    else:
      if masked:
        s = jnp.where(mask, s, MASK_VALUE)
      m_next = jnp.maximum(m_prev, s.max(axis=1))
      alpha = jnp.exp2(m_prev - m_next)  # FA2 Alg. 1: rescale what was summed under the old max
      probs = jnp.exp2(s - m_next[:, None])
      if masked:
        # A row with no visible key yet has m_next == MASK_VALUE, where exp2 gives 1, not 0.
        probs = jnp.where(mask, probs, 0.0)
    l_next = l_prev + probs.sum(axis=1) if alpha is None else alpha * l_prev + probs.sum(axis=1)
    if p.dropout_rate:  # l sums every probability (the softmax); only kept ones reach V
      keep = dropout.keep_keys(row_keys[:, None], ck_ref[kv_slice][None, :], p.dropout_threshold)
      probs = jnp.where(keep, probs, 0.0)
    v = v_ref[kv_slice, :]
    if alpha is not None:
      acc = alpha[:, None] * acc
    acc = acc + common.dot(probs.astype(v.dtype), v)
    return m_next, l_next, acc

  dv_pad = v_ref.shape[-1]
  carry = (jnp.full((p.block_q,), 0.0 if p.fixed_max else MASK_VALUE, jnp.float32),
           jnp.zeros((p.block_q,), jnp.float32),
           jnp.zeros((p.block_q, dv_pad), jnp.float32))
  if p.block_sparse:
    m, l, acc = common.sparse_loop(table_ref, counts_ref, step, carry)
  else:
    first, full_lo, full_hi, last = common.kv_runs(qi, p, limits_ref)
    carry = lax.fori_loop(first, full_lo, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
    m, l, acc = lax.fori_loop(full_hi, last, functools.partial(step, masked=True), carry)

  empty = l == 0.0  # no visible key: output 0 and lse -inf
  l_safe = jnp.where(empty, 1.0, l)
  # Dropout's 1 / (1 - rate) rescaling folds into the final normalisation.
  o_ref[...] = (acc * (1.0 / (l_safe * (1.0 - p.dropout_rate)))[:, None]).astype(o_ref.dtype)
  if p.precise_lse:  # m·ln2 + log2(l)·ln2: no rounding of the sum at |m| (common.probabilities)
    lse = m * common.LN2 + jnp.log2(l_safe) * common.LN2
  else:
    lse = (m + jnp.log2(l_safe)) * common.LN2
  lse_ref[...] = jnp.where(empty, -jnp.inf, lse)


def forward(q, k, v, q_seg, kv_seg, *, params: AttentionParams, config: TritonConfig,
            interpret: bool, arrays: FeatureArrays | None = None):
  """Pallas-Triton FlashAttention forward; the contract is in pallas_flash.call."""
  b, t, h, _ = q.shape
  s_len, kh, dv_len = k.shape[1], k.shape[2], v.shape[3]
  bm = arrays.block_mask if arrays is not None else None
  bq, bk = ((bm.block_q, bm.block_kv) if bm is not None else
            (common.fit_block(config.block_q, t), common.fit_block(config.block_kv, s_len)))
  q, k, v, q_seg, kv_seg = common.pad_inputs(q, k, v, q_seg, kv_seg, q_multiple=bq,
                                             kv_multiple=bk)
  t_pad, s_pad, d_pad, dv_pad = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
  bias, mask, slopes, row_keys, col_keys = common.pad_arrays(arrays, batch=b, heads=h,
                                                             t_pad=t_pad, s_pad=s_pad)
  kv_limits, _ = common.segment_limits(q_seg, kv_seg, block_q=bq, block_kv=bk)
  p = KernelParams.create(params, dtype=q.dtype, interpret=interpret, kv_len=s_len, block_q=bq,
                          block_kv=bk, num_kv_blocks=s_pad // bk, num_q_blocks=t_pad // bq,
                          group_size=h // kh, **common.sparse_params(bm))
  sparse_args, sparse_specs = common.sparse_inputs(bm, p, t_pad=t_pad, s_pad=s_pad, by_q=True)

  def q_map(i, bi, hi):
    return bi, _reversed(i, p), hi, 0

  def kv_map(i, bi, hi):
    return bi, 0, hi // p.group_size, 0

  def lse_map(i, bi, hi):
    return bi, hi, _reversed(i, p)

  in_specs = [
      pl.BlockSpec((None, bq, None, d_pad), q_map),
      pl.BlockSpec((None, s_pad, None, d_pad), kv_map),
      pl.BlockSpec((None, s_pad, None, dv_pad), kv_map),
      None if q_seg is None else pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, _reversed(i, p))),
      None if kv_seg is None else pl.BlockSpec((None, s_pad), lambda i, bi, hi: (bi, 0)),
      dense_spec(bias, p), dense_spec(mask, p), whole_spec(slopes),
      None if row_keys is None else pl.BlockSpec((None, None, bq),
                                                 lambda i, bi, hi: (bi, hi, _reversed(i, p))),
      whole_spec(col_keys),
      None if kv_limits is None else pl.BlockSpec((None, None, 4),
                                                  lambda i, bi, hi: (bi, _reversed(i, p), 0)),
      *sparse_specs,
  ]
  out_specs = [pl.BlockSpec((None, bq, None, dv_pad), q_map),
               pl.BlockSpec((None, None, bq), lse_map)]
  o, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, p=p),
      grid=(p.num_q_blocks, b, h),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=[jax.ShapeDtypeStruct((b, t_pad, h, dv_pad), q.dtype),
                 jax.ShapeDtypeStruct((b, h, t_pad), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      name="pallas_flash_fwd",
  )(q, k, v, q_seg, kv_seg, bias, mask, slopes, row_keys, col_keys, kv_limits, *sparse_args)
  return o[:, :t, :, :dv_len], lse[:, :, :t]


def dense_spec(x, p: KernelParams):
  """Rows of a dense [B|1, H|1, T_pad, S_pad] bias or mask for one (query block, batch, head),
  on the grid (num_q_blocks, B, H); broadcast axes always read index 0."""
  if x is None:
    return None

  def dense_map(i, bi, hi):
    return (bi if x.shape[0] > 1 else 0, hi if x.shape[1] > 1 else 0, _reversed(i, p), 0)

  return pl.BlockSpec((None, None, p.block_q, x.shape[3]), dense_map)


def whole_spec(x):
  """A 1-D array (ALiBi slopes, dropout column keys) read whole by every program."""
  return None if x is None else pl.BlockSpec(x.shape, lambda *_: (0,))


def _reversed(i, p: KernelParams):
  """Causal query blocks run in reverse: the heaviest (last) blocks start first."""
  return p.num_q_blocks - 1 - i if p.is_causal else i
