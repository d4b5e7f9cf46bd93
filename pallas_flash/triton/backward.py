"""FlashAttention-2 backward as two Triton-lowered Pallas kernels (dK/dV, then dQ).

delta = rowsum(dO * O) comes precomputed from the API. Both kernels recompute probabilities
from the saved log-sum-exp. The dK/dV kernel works in the transposed frame (Sᵀ = K·Qᵀ) so that
every matmul has the kernel's key block as its M dimension, and loops over the query heads of
its key/value head's group itself: GQA gradients are summed in registers, with no repeated K/V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_flash import _blocking
from pallas_flash.params import AttentionParams
from pallas_flash.triton import common
from pallas_flash.triton.common import KernelParams
from pallas_flash.triton.config import TritonConfig


def _iota(n: int, start):
  return start + lax.broadcasted_iota(jnp.int32, (n,), 0)


def _bwd_dkdv_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, do_ref, lse_ref, delta_ref,
                     dk_ref, dv_ref, *, p: KernelParams):
  """dK, dV of one key block, summed over every query head of its group and every query block.

  Refs: q_ref/do_ref [T_pad, G, Dp]; k_ref/v_ref/dk_ref/dv_ref [block_kv, Dp];
  lse_ref/delta_ref [G, T_pad] (lse +inf on empty rows); qs_ref [T_pad], ks_ref [block_kv].
  Grid: (num_kv_blocks, B, K).
  """
  j = pl.program_id(0)
  k, v = k_ref[...], v_ref[...]
  kv_pos = _iota(p.block_kv, j * p.block_kv)
  kv_seg = ks_ref[...] if p.has_segments else None

  def q_step(i, carry, *, g, masked: bool):
    dk, dv = carry
    q_slice = pl.ds(pl.multiple_of(i * p.block_q, p.block_q), p.block_q)
    q, do = q_ref[q_slice, g, :], do_ref[q_slice, g, :]
    lse2 = lse_ref[g, q_slice] * common.LOG2E
    s_t = common.dot(k, q, trans_b=True) * p.scale_log2  # [block_kv, block_q]
    p_t = jnp.exp2(s_t - lse2[None, :])
    if masked:
      mask = common.block_mask(_iota(p.block_q, i * p.block_q), kv_pos,
                               qs_ref[q_slice] if p.has_segments else None, kv_seg, p)
      p_t = jnp.where(mask.T, p_t, 0.0)
    dv = dv + common.dot(p_t.astype(do.dtype), do)
    dp_t = common.dot(v, do, trans_b=True)  # [block_kv, block_q]
    ds_t = p_t * (dp_t - delta_ref[g, q_slice][None, :])
    dk = dk + common.dot(ds_t.astype(q.dtype), q)
    return dk, dv

  first, first_unmasked = _q_ranges(j, p)

  def head_step(g, carry):
    carry = lax.fori_loop(first, first_unmasked, functools.partial(q_step, g=g, masked=True),
                          carry)
    return lax.fori_loop(first_unmasked, p.num_q_blocks,
                         functools.partial(q_step, g=g, masked=not _unmasked_ok(p)), carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, p.group_size, head_step, (zeros, zeros))
  dk_ref[...] = (dk * p.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _unmasked_ok(p: KernelParams) -> bool:
  return not p.has_segments and not p.kv_tail


def _q_ranges(j, p: KernelParams):
  """Query blocks [first, num_q_blocks) see key block j; those before first_unmasked need masks.

  Under causal masking, query blocks above the diagonal are skipped and those crossing it are
  masked; everything else is masked only for segments or a padded key tail (`_unmasked_ok`).
  """
  if not p.is_causal:
    return 0, 0
  first = lax.div(j * p.block_kv, p.block_q)
  # Query block i is wholly below the diagonal iff its first row i * bq >= the block's last key.
  last_key = (j + 1) * p.block_kv - 1
  first_unmasked = jnp.minimum(p.num_q_blocks, lax.div(last_key + p.block_q - 1, p.block_q))
  return first, first_unmasked


def _bwd_dq_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
                   p: KernelParams):
  """dQ of one query block against all key blocks it sees.

  Refs: q_ref/do_ref/dq_ref [block_q, Dp]; k_ref/v_ref [S_pad, Dp]; lse_ref/delta_ref [block_q];
  qs_ref [block_q], ks_ref [S_pad]. Grid: (num_q_blocks, B, H), reversed under causal masking.
  """
  qi = p.num_q_blocks - 1 - pl.program_id(0) if p.is_causal else pl.program_id(0)
  q, do = q_ref[...], do_ref[...]
  lse2 = lse_ref[...] * common.LOG2E
  delta = delta_ref[...]
  q_pos = _iota(p.block_q, qi * p.block_q)
  q_seg = qs_ref[...] if p.has_segments else None

  def kv_step(j, dq, *, masked: bool):
    kv_slice = pl.ds(pl.multiple_of(j * p.block_kv, p.block_kv), p.block_kv)
    k, v = k_ref[kv_slice, :], v_ref[kv_slice, :]
    s = common.dot(q, k, trans_b=True) * p.scale_log2  # [block_q, block_kv]
    probs = jnp.exp2(s - lse2[:, None])
    if masked:
      mask = common.block_mask(q_pos, _iota(p.block_kv, j * p.block_kv), q_seg,
                               ks_ref[kv_slice] if p.has_segments else None, p)
      probs = jnp.where(mask, probs, 0.0)
    dp = common.dot(do, v, trans_b=True)
    ds = probs * (dp - delta[:, None])
    return dq + common.dot(ds.astype(k.dtype), k)

  n_unmasked = common.unmasked_kv_limit(qi, p)
  dq = lax.fori_loop(0, n_unmasked, functools.partial(kv_step, masked=False),
                     jnp.zeros(q.shape, jnp.float32))
  dq = lax.fori_loop(n_unmasked, common.causal_kv_limit(qi, p),
                     functools.partial(kv_step, masked=True), dq)
  dq_ref[...] = (dq * p.scale).astype(dq_ref.dtype)


def backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, *, params: AttentionParams,
             config: TritonConfig | None, interpret: bool):
  """Pallas-Triton FlashAttention backward; the contract is in pallas_flash.params."""
  del o
  config = common.resolve_config(q, params, config)
  b, t, h, d = q.shape
  s_len, kh = k.shape[1], k.shape[2]
  blocks = dict(
      q_dkv=common.fit_block(config.block_q_dkv, t), kv_dkv=common.fit_block(config.block_kv_dkv, s_len),
      q_dq=common.fit_block(config.block_q_dq, t), kv_dq=common.fit_block(config.block_kv_dq, s_len))
  q_mult, kv_mult = max(blocks["q_dkv"], blocks["q_dq"]), max(blocks["kv_dkv"], blocks["kv_dq"])
  q, k, v, q_seg, kv_seg = common.pad_inputs(q, k, v, q_seg, kv_seg, q_multiple=q_mult,
                                             kv_multiple=kv_mult)
  t_pad, s_pad, d_pad = q.shape[1], k.shape[1], q.shape[3]
  do = _blocking.pad_axis(_blocking.pad_axis(do, 1, t_pad), 3, d_pad)
  lse = _blocking.pad_axis(lse, 2, t_pad, jnp.inf)  # padded rows: probabilities exactly 0
  delta = _blocking.pad_axis(delta, 2, t_pad)
  base = dict(scale=params.scale, is_causal=params.is_causal, has_segments=params.has_segments,
              kv_len=s_len, group_size=h // kh)
  compiler_params = pltriton.CompilerParams(num_warps=config.num_warps_bwd,
                                            num_stages=config.num_stages_bwd)
  args = (q, k, v, q_seg, kv_seg, do, lse, delta)

  p = KernelParams(block_q=blocks["q_dkv"], block_kv=blocks["kv_dkv"],
                   num_q_blocks=t_pad // blocks["q_dkv"], num_kv_blocks=s_pad // blocks["kv_dkv"],
                   **base)
  dk, dv = pl.pallas_call(
      functools.partial(_bwd_dkdv_kernel, p=p),
      grid=(p.num_kv_blocks, b, kh),
      in_specs=_dkdv_in_specs(p, t_pad, d_pad, q_seg is not None),
      out_specs=[pl.BlockSpec((None, p.block_kv, None, d_pad), lambda j, bi, ki: (bi, j, ki, 0))] * 2,
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=compiler_params,
      interpret=interpret,
      name="pallas_flash_bwd_dkdv",
  )(*args)

  p = KernelParams(block_q=blocks["q_dq"], block_kv=blocks["kv_dq"],
                   num_q_blocks=t_pad // blocks["q_dq"], num_kv_blocks=s_pad // blocks["kv_dq"],
                   **base)
  dq = pl.pallas_call(
      functools.partial(_bwd_dq_kernel, p=p),
      grid=(p.num_q_blocks, b, h),
      in_specs=_dq_in_specs(p, s_pad, d_pad, q_seg is not None),
      out_specs=pl.BlockSpec((None, p.block_q, None, d_pad), _dq_q_map(p)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=compiler_params,
      interpret=interpret,
      name="pallas_flash_bwd_dq",
  )(*args)
  return dq[:, :t, :, :d], dk[:, :s_len, :, :d], dv[:, :s_len, :, :d]


def _dkdv_in_specs(p: KernelParams, t_pad: int, d_pad: int, segments: bool):
  g = p.group_size

  def group_map(j, bi, ki):  # the G query heads of key/value head ki
    return bi, 0, ki, 0

  def kv_map(j, bi, ki):
    return bi, j, ki, 0

  def stats_map(j, bi, ki):
    return bi, ki, 0

  q_spec = pl.BlockSpec((None, t_pad, g, d_pad), group_map)
  kv_spec = pl.BlockSpec((None, p.block_kv, None, d_pad), kv_map)
  stats_spec = pl.BlockSpec((None, g, t_pad), stats_map)
  return [q_spec, kv_spec, kv_spec,
          pl.BlockSpec((None, t_pad), lambda j, bi, ki: (bi, 0)) if segments else None,
          pl.BlockSpec((None, p.block_kv), lambda j, bi, ki: (bi, j)) if segments else None,
          q_spec, stats_spec, stats_spec]


def _dq_q_map(p: KernelParams):
  def q_map(i, bi, hi):
    return bi, (p.num_q_blocks - 1 - i) if p.is_causal else i, hi, 0
  return q_map


def _dq_in_specs(p: KernelParams, s_pad: int, d_pad: int, segments: bool):
  q_map = _dq_q_map(p)

  def kv_map(i, bi, hi):
    return bi, 0, hi // p.group_size, 0

  def stats_map(i, bi, hi):
    return bi, hi, q_map(i, bi, hi)[1]

  q_spec = pl.BlockSpec((None, p.block_q, None, d_pad), q_map)
  kv_spec = pl.BlockSpec((None, s_pad, None, d_pad), kv_map)
  stats_spec = pl.BlockSpec((None, None, p.block_q), stats_map)
  return [q_spec, kv_spec, kv_spec,
          pl.BlockSpec((None, p.block_q), lambda i, bi, hi: (bi, q_map(i, bi, hi)[1]))
          if segments else None,
          pl.BlockSpec((None, s_pad), lambda i, bi, hi: (bi, 0)) if segments else None,
          q_spec, stats_spec, stats_spec]
