"""FlashAttention-2 forward as a Triton-lowered Pallas kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_flash.params import MASK_VALUE, AttentionParams
from pallas_flash.triton import common
from pallas_flash.triton.common import KernelParams
from pallas_flash.triton.config import TritonConfig


def _fwd_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref, *, p: KernelParams):
  """One query block against all the key blocks it may see.

  Refs after BlockSpec slicing: q_ref/o_ref [block_q, Dp]; k_ref/v_ref [S_pad, Dp];
  qs_ref [block_q] and ks_ref [S_pad] int32 segment ids (None without segments); lse_ref [block_q].
  Grid: (num_q_blocks, B, H), query blocks reversed under causal masking so the heaviest start
  first.
  """
  qi = _reversed(pl.program_id(0), p)
  q = q_ref[...]
  q_pos = qi * p.block_q + lax.broadcasted_iota(jnp.int32, (p.block_q,), 0)
  q_seg = qs_ref[...] if p.has_segments else None

  def step(j, carry, *, masked: bool):
    m_prev, l_prev, acc = carry
    kv_slice = pl.ds(pl.multiple_of(j * p.block_kv, p.block_kv), p.block_kv)
    k = k_ref[kv_slice, :]
    # Scores in log2 units: exp(x * scale) == exp2(x * scale * log2 e) (FA2 uses exp2 too).
    s = common.dot(q, k, trans_b=True) * p.scale_log2  # [block_q, block_kv]
    if masked:
      kv_pos = j * p.block_kv + lax.broadcasted_iota(jnp.int32, (p.block_kv,), 0)
      mask = common.block_mask(q_pos, kv_pos, q_seg,
                               ks_ref[kv_slice] if p.has_segments else None, p)
      s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp2(m_prev - m_next)  # FA2 Alg. 1: rescale what was summed under the old max
    probs = jnp.exp2(s - m_next[:, None])
    if masked:
      # A row with no visible key yet has m_next == MASK_VALUE, where exp2 gives 1, not 0.
      probs = jnp.where(mask, probs, 0.0)
    l_next = alpha * l_prev + probs.sum(axis=1)
    v = v_ref[kv_slice, :]
    acc = alpha[:, None] * acc + common.dot(probs.astype(v.dtype), v)
    return m_next, l_next, acc

  d_pad = q_ref.shape[-1]
  carry = (jnp.full((p.block_q,), MASK_VALUE, jnp.float32),
           jnp.zeros((p.block_q,), jnp.float32),
           jnp.zeros((p.block_q, d_pad), jnp.float32))
  n_unmasked = common.unmasked_kv_limit(qi, p)
  n_visible = common.causal_kv_limit(qi, p)
  carry = lax.fori_loop(0, n_unmasked, functools.partial(step, masked=False), carry)
  m, l, acc = lax.fori_loop(n_unmasked, n_visible, functools.partial(step, masked=True), carry)

  empty = l == 0.0  # no visible key: output 0 and lse -inf
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc * (1.0 / l_safe)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * common.LN2)


def forward(q, k, v, q_seg, kv_seg, *, params: AttentionParams, config: TritonConfig | None,
            interpret: bool):
  """Pallas-Triton FlashAttention forward; the contract is in pallas_flash.params."""
  config = common.resolve_config(q, params, config)
  b, t, h, d = q.shape
  s_len, kh = k.shape[1], k.shape[2]
  bq, bk = common.fit_block(config.block_q, t), common.fit_block(config.block_kv, s_len)
  q, k, v, q_seg, kv_seg = common.pad_inputs(q, k, v, q_seg, kv_seg, q_multiple=bq,
                                             kv_multiple=bk)
  t_pad, s_pad, d_pad = q.shape[1], k.shape[1], q.shape[3]
  p = KernelParams(scale=params.scale, is_causal=params.is_causal,
                   has_segments=params.has_segments, kv_len=s_len, block_q=bq, block_kv=bk,
                   num_kv_blocks=s_pad // bk, num_q_blocks=t_pad // bq, group_size=h // kh)

  def q_map(i, bi, hi):
    return bi, _reversed(i, p), hi, 0

  def kv_map(i, bi, hi):
    return bi, 0, hi // p.group_size, 0

  def lse_map(i, bi, hi):
    return bi, hi, _reversed(i, p)

  in_specs = [
      pl.BlockSpec((None, bq, None, d_pad), q_map),
      pl.BlockSpec((None, s_pad, None, d_pad), kv_map),
      pl.BlockSpec((None, s_pad, None, d_pad), kv_map),
      None if q_seg is None else pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, _reversed(i, p))),
      None if kv_seg is None else pl.BlockSpec((None, s_pad), lambda i, bi, hi: (bi, 0)),
  ]
  out_specs = [pl.BlockSpec((None, bq, None, d_pad), q_map),
               pl.BlockSpec((None, None, bq), lse_map)]
  o, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, p=p),
      grid=(p.num_q_blocks, b, h),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=[jax.ShapeDtypeStruct((b, t_pad, h, d_pad), q.dtype),
                 jax.ShapeDtypeStruct((b, h, t_pad), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      name="pallas_flash_fwd",
  )(q, k, v, q_seg, kv_seg)
  return o[:, :t, :, :d], lse[:, :, :t]


def _reversed(i, p: KernelParams):
  """Causal query blocks run in reverse: the heaviest (last) blocks start first."""
  return p.num_q_blocks - 1 - i if p.is_causal else i

