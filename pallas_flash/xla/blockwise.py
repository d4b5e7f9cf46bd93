"""FlashAttention's blocked algorithm written with lax loops, for any XLA platform.

Same order as the kernels (FA2): a query block owns its output and streams key/value blocks with
a running max `m`, sum `l` and unnormalised accumulator; the backward recomputes scores block by
block (a dQ pass with query blocks outer, a dK/dV pass with key/value blocks outer). Nothing of
size T x S is ever live, so memory is linear in sequence length. Causal blocks above the diagonal
are skipped through dynamic loop bounds.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash import _blocking
from pallas_flash.params import MASK_VALUE, AttentionParams, CallInfo

_HI = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaConfig:
  """Block sizes of the blockwise XLA implementation (rows of q and of k/v per step)."""

  block_q: int = 256
  block_kv: int = 256

  def __post_init__(self):
    for name in ("block_q", "block_kv"):
      if getattr(self, name) < 1:
        raise ValueError(f"XlaConfig.{name} must be positive, got {getattr(self, name)}")


def unsupported_reason(call: CallInfo) -> str | None:
  del call
  return None


def _blocks(x: jax.Array, block: int) -> jax.Array:
  """[B, N, ...] -> [N // block, B, block, ...] for lax.map over blocks."""
  b, n = x.shape[:2]
  return jnp.moveaxis(x.reshape(b, n // block, block, *x.shape[2:]), 1, 0)


def _unblocks(x: jax.Array) -> jax.Array:
  """Inverse of _blocks."""
  nb, b, block = x.shape[:3]
  return jnp.moveaxis(x, 0, 1).reshape(b, nb * block, *x.shape[3:])


def _visible(q_seg, kv_seg, q_pos, kv_pos, *, params: AttentionParams, kv_len: int):
  """[B|1, 1, 1, bq, bk] bool mask of one block pair, or None when everything is visible."""
  mask = None
  if params.has_segments:
    mask = (q_seg[:, :, None] == kv_seg[:, None, :])[:, None, None]
  if params.is_causal:
    c = (q_pos[:, None] >= kv_pos[None, :])[None, None, None]
    mask = c if mask is None else mask & c
  if kv_pos.shape[0] and kv_len % kv_pos.shape[0]:
    tail = (kv_pos < kv_len)[None, None, None, None, :]
    mask = tail if mask is None else mask & tail
  return mask


def _scores(q_blk, k_blk, scale):
  """q_blk [B, bq, K, G, D], k_blk [B, bk, K, D] -> [B, K, G, bq, bk] float32."""
  s = jnp.einsum("bqkgd,bskd->bkgqs", q_blk, k_blk, precision=_HI,
                 preferred_element_type=jnp.float32)
  return s * scale


def _prepare(q, k, v, q_seg, kv_seg, config: XlaConfig):
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  bq, bk = min(config.block_q, t), min(config.block_kv, s)
  t_pad, s_pad = _blocking.round_up(t, bq), _blocking.round_up(s, bk)
  q = _blocking.pad_axis(q, 1, t_pad).reshape(b, t_pad, kh, h // kh, d)
  k, v = _blocking.pad_axis(k, 1, s_pad), _blocking.pad_axis(v, 1, s_pad)
  q_seg, kv_seg = _blocking.pad_segments(q_seg, kv_seg, t_pad, s_pad)
  return q, k, v, q_seg, kv_seg, bq, bk


def forward(q, k, v, q_seg, kv_seg, *, params: AttentionParams, config: XlaConfig | None = None):
  """See pallas_flash.params for the contract."""
  config = config or XlaConfig()
  b, t, h, d = q.shape
  s_len = k.shape[1]
  q, k, v, q_seg, kv_seg, bq, bk = _prepare(q, k, v, q_seg, kv_seg, config)
  nk = k.shape[1] // bk
  kh, g = q.shape[2], q.shape[3]

  def q_block(args):
    i, q_blk, qs_blk = args  # q_blk [B, bq, K, G, D]
    q_pos = i * bq + jnp.arange(bq)

    def kv_step(j, carry):
      m, l, acc = carry
      k_blk = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1)
      v_blk = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1)
      kv_pos = j * bk + jnp.arange(bk)
      ks_blk = None if kv_seg is None else lax.dynamic_slice_in_dim(kv_seg, j * bk, bk, axis=1)
      sc = _scores(q_blk, k_blk, params.scale)  # [B, K, G, bq, bk]
      mask = _visible(qs_blk, ks_blk, q_pos, kv_pos, params=params, kv_len=s_len)
      if mask is not None:
        sc = jnp.where(mask, sc, MASK_VALUE)
      m_new = jnp.maximum(m, sc.max(-1))
      alpha = jnp.exp(m - m_new)  # FA2 Alg. 1 rescaling of the running sum and accumulator
      p = jnp.exp(sc - m_new[..., None])
      if mask is not None:
        p = jnp.where(mask, p, 0.0)  # rows with no visible key so far must keep l == 0
      l = alpha * l + p.sum(-1)
      pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v_blk, precision=_HI,
                      preferred_element_type=jnp.float32)
      return m_new, l, alpha[..., None] * acc + pv

    init = (jnp.full((b, kh, g, bq), MASK_VALUE, jnp.float32),
            jnp.zeros((b, kh, g, bq), jnp.float32),
            jnp.zeros((b, kh, g, bq, d), jnp.float32))
    hi = _blocking.causal_kv_blocks(i, block_q=bq, block_kv=bk, num_kv_blocks=nk) \
        if params.is_causal else nk
    m, l, acc = lax.fori_loop(0, hi, kv_step, init)
    l_safe = jnp.where(l == 0.0, 1.0, l)
    o = acc / l_safe[..., None]  # [B, K, G, bq, D]
    lse = jnp.where(l == 0.0, -jnp.inf, m + jnp.log(l_safe))
    return jnp.einsum("bkgqd->bqkgd", o).astype(q.dtype), lse.reshape(b, h, bq)

  nq = q.shape[1] // bq
  qs_blocks = None if q_seg is None else _blocks(q_seg, bq)
  o, lse = lax.map(q_block, (jnp.arange(nq), _blocks(q, bq), qs_blocks))
  o = _unblocks(o).reshape(b, -1, h, d)[:, :t]
  lse = jnp.moveaxis(lse, 0, 2).reshape(b, h, -1)[:, :, :t]
  return o, lse


def backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, *, params: AttentionParams,
             config: XlaConfig | None = None):
  """See pallas_flash.params for the contract."""
  del o
  config = config or XlaConfig()
  b, t, h, d = q.shape
  s_len = k.shape[1]
  q, k, v, q_seg, kv_seg, bq, bk = _prepare(q, k, v, q_seg, kv_seg, config)
  kh, g = q.shape[2], q.shape[3]
  t_pad = q.shape[1]
  do = _blocking.pad_axis(do, 1, t_pad).reshape(q.shape)
  # Padded rows get lse = +inf so that their probabilities are exactly 0.
  lse = _blocking.pad_axis(lse, 2, t_pad, jnp.inf).reshape(b, kh, g, t_pad)
  delta = _blocking.pad_axis(delta, 2, t_pad).reshape(b, kh, g, t_pad)
  nq, nk = t_pad // bq, k.shape[1] // bk
  grads = functools.partial(_block_grads, params=params, kv_len=s_len, v_dtype=v.dtype)

  def dq_block(args):
    i, q_blk, do_blk, qs_blk = args
    lse_blk = lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
    delta_blk = lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)

    def kv_step(j, dq):
      k_blk = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1)
      v_blk = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1)
      ks_blk = None if kv_seg is None else lax.dynamic_slice_in_dim(kv_seg, j * bk, bk, axis=1)
      _, ds = grads(q_blk, k_blk, v_blk, do_blk, lse_blk, delta_blk, qs_blk, ks_blk, i, j, bq, bk)
      return dq + jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(k.dtype), k_blk, precision=_HI,
                             preferred_element_type=jnp.float32)

    hi = _blocking.causal_kv_blocks(i, block_q=bq, block_kv=bk, num_kv_blocks=nk) \
        if params.is_causal else nk
    dq = lax.fori_loop(0, hi, kv_step, jnp.zeros(q_blk.shape, jnp.float32))
    return dq * params.scale

  def dkv_block(args):
    j, k_blk, v_blk, ks_blk = args

    def q_step(i, carry):
      dk, dv = carry
      q_blk = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=1)
      do_blk = lax.dynamic_slice_in_dim(do, i * bq, bq, axis=1)
      lse_blk = lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
      delta_blk = lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
      qs_blk = None if q_seg is None else lax.dynamic_slice_in_dim(q_seg, i * bq, bq, axis=1)
      p, ds = grads(q_blk, k_blk, v_blk, do_blk, lse_blk, delta_blk, qs_blk, ks_blk, i, j, bq, bk)
      # Summing over g reduces GQA gradients inside the einsum: no repeated K/V is formed.
      dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do.dtype), do_blk, precision=_HI,
                           preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(q.dtype), q_blk, precision=_HI,
                           preferred_element_type=jnp.float32)
      return dk, dv

    lo = _blocking.causal_first_q_block(j, block_q=bq, block_kv=bk) if params.is_causal else 0
    zeros = jnp.zeros(k_blk.shape, jnp.float32)
    dk, dv = lax.fori_loop(lo, nq, q_step, (zeros, zeros))
    return dk * params.scale, dv

  qs_blocks = None if q_seg is None else _blocks(q_seg, bq)
  dq = lax.map(dq_block, (jnp.arange(nq), _blocks(q, bq), _blocks(do, bq), qs_blocks))
  ks_blocks = None if kv_seg is None else _blocks(kv_seg, bk)
  dk, dv = lax.map(dkv_block, (jnp.arange(nk), _blocks(k, bk), _blocks(v, bk), ks_blocks))
  dq = _unblocks(dq).reshape(b, t_pad, h, d)[:, :t]
  dk, dv = _unblocks(dk)[:, :s_len], _unblocks(dv)[:, :s_len]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _block_grads(q_blk, k_blk, v_blk, do_blk, lse_blk, delta_blk, qs_blk, ks_blk, i, j, bq, bk,
                 *, params: AttentionParams, kv_len: int, v_dtype):
  """Recomputed probabilities and score gradients of one block pair, [B, K, G, bq, bk] each."""
  del v_dtype
  sc = _scores(q_blk, k_blk, params.scale)
  p = jnp.exp(sc - lse_blk[..., None])
  mask = _visible(qs_blk, ks_blk, i * bq + jnp.arange(bq), j * bk + jnp.arange(bk),
                  params=params, kv_len=kv_len)
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  dp = jnp.einsum("bqkgd,bskd->bkgqs", do_blk, v_blk, precision=_HI,
                  preferred_element_type=jnp.float32)
  ds = p * (dp - delta_blk[..., None])
  return p, ds
