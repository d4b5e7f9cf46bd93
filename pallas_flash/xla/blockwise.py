"""FlashAttention's blocked algorithm written with lax loops, for any XLA platform.

Same order as the kernels (FA2): a query block owns its output and streams key/value blocks with
a running max `m`, sum `l` and unnormalised accumulator; the backward recomputes scores block by
block (a dQ pass with query blocks outer, a dK/dV pass with key/value blocks outer). Nothing of
size T x S is ever live, so memory is linear in sequence length (a dense bias or mask and its
gradient are T x S by nature). Blocks outside the causal / local-window band are skipped through
dynamic loop bounds (`_tiling.block_runs`); with a block mask, the loops run over the active
blocks of its tables instead (united over the batch, since one loop serves every batch element).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash import _tiling, dropout, masks
from pallas_flash.call import MASK_VALUE, AttentionParams, CallInfo, FeatureArrays

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


SUPPORTED_FEATURES = frozenset({"local_window_size", "logits_soft_cap", "alibi_slopes", "dropout",
                                "bias", "mask", "block_mask"})


def default_config(call: CallInfo) -> XlaConfig:
  del call
  return XlaConfig()


def unsupported_reason(call: CallInfo, config: XlaConfig | None = None) -> str | None:
  return block_mask_reason(call, config)


def block_mask_reason(call: CallInfo, config) -> str | None:
  """A block mask fixes the blocks of the kernels that take one: a config asking for others
  cannot run it (the Triton kernels share this rule)."""
  blocks = call.params.block_mask_blocks
  if blocks is not None and config is not None and (config.block_q, config.block_kv) != blocks:
    return (f"config blocks ({config.block_q}, {config.block_kv}) differ from the block_mask's "
            f"{blocks}; build the BlockMask with the config's blocks or pass no config")
  return None


def _blocks(x: jax.Array, block: int) -> jax.Array:
  """[B, N, ...] -> [N // block, B, block, ...] for lax.map over blocks."""
  b, n = x.shape[:2]
  return jnp.moveaxis(x.reshape(b, n // block, block, *x.shape[2:]), 1, 0)


def _unblocks(x: jax.Array) -> jax.Array:
  """Inverse of _blocks."""
  nb, b, block = x.shape[:3]
  return jnp.moveaxis(x, 0, 1).reshape(b, nb * block, *x.shape[3:])


@dataclasses.dataclass(frozen=True)
class _Ctx:
  """One call, padded to whole blocks: what scores and masks of a block pair need."""

  params: AttentionParams
  kv_len: int
  bq: int
  bk: int
  num_heads: int
  kv_seg: jax.Array | None  # [B, S_pad]
  dense: dict  # "bias" / "mask": [B|1, K|1, G|1, T_pad, S_pad]
  slopes: jax.Array | None  # [K, G] float32
  head_keys: jax.Array | None  # [B, K, G] int32 dropout keys
  # Segment limits (_tiling.segment_block_limits), hulls over the batch: [nq, 2] and [nk, 2].
  kv_limits: jax.Array | None
  q_limits: jax.Array | None
  # Block mask: its function (leaves padded to whole blocks) and the tables of blocks active for
  # any batch element: kv_table [nq, nk] / kv_count [nq] and q_table [nk, nq] / q_count [nk].
  mask_fn: masks.MaskFn | None = None
  kv_table: jax.Array | None = None
  kv_count: jax.Array | None = None
  q_table: jax.Array | None = None
  q_count: jax.Array | None = None

  def tile(self, name: str, i, j):
    x = lax.dynamic_slice_in_dim(self.dense[name], i * self.bq, self.bq, axis=3)
    return lax.dynamic_slice_in_dim(x, j * self.bk, self.bk, axis=4)

  def logits(self, q_blk, k_blk, qs_blk, i, j):
    """Scores of block pair (i, j), [B, K, G, bq, bk] float32 (natural units), the soft cap's
    tanh (for the backward) or None, and the visibility mask or None."""
    p = self.params
    q_pos, kv_pos = i * self.bq + jnp.arange(self.bq), j * self.bk + jnp.arange(self.bk)
    s = jnp.einsum("bqkgd,bskd->bkgqs", q_blk, k_blk, precision=_HI,
                   preferred_element_type=jnp.float32) * p.scale
    t = None
    if p.logits_soft_cap is not None and not p.bias_in_cap:
      t = jnp.tanh(s / p.logits_soft_cap)
      s = p.logits_soft_cap * t
    if p.has_alibi:
      dist = jnp.abs(q_pos[:, None] - kv_pos[None, :]).astype(jnp.float32)
      s = s - self.slopes[None, :, :, None, None] * dist
    if p.has_bias:
      s = s + self.tile("bias", i, j).astype(jnp.float32)
    if p.bias_in_cap:
      t = jnp.tanh(s / p.logits_soft_cap)
      s = p.logits_soft_cap * t
    mask = _tiling.band_mask(q_pos, kv_pos, p.band)
    if self.kv_len % self.bk:
      tail = (kv_pos < self.kv_len)[None, :]
      mask = tail if mask is None else mask & tail
    if mask is not None:
      mask = mask[None, None, None]
    if p.has_segments:
      ks_blk = lax.dynamic_slice_in_dim(self.kv_seg, j * self.bk, self.bk, axis=1)
      seg = (qs_blk[:, :, None] == ks_blk[:, None, :])[:, None, None]
      mask = seg if mask is None else mask & seg
    if p.has_mask:
      dense = self.tile("mask", i, j)
      mask = dense if mask is None else mask & dense
    if self.mask_fn is not None:
      fn = masks.tiles(self.mask_fn, i * self.bq, self.bq, j * self.bk, self.bk)
      fn_mask = masks.evaluate(fn, q_pos, kv_pos)[:, None, None]  # [B|1, 1, 1, bq, bk]
      mask = fn_mask if mask is None else mask & fn_mask
    return s, t, mask

  def keep(self, i, j):
    """Dropout keep mask of block pair (i, j), [B, K, G, bq, bk] bool."""
    rows = dropout.row_keys(self.head_keys[..., None], i * self.bq + jnp.arange(self.bq))
    cols = j * self.bk + jnp.arange(self.bk)
    return dropout.keep(rows[..., None], cols, dropout.threshold(self.params.dropout_rate))

  def kv_loop(self, i, nk, body, init):
    """lax.fori_loop of body(j, carry) over the key blocks query block i may see."""
    if self.kv_table is None:
      return lax.fori_loop(*self.kv_runs(i, nk), body, init)
    return lax.fori_loop(0, self.kv_count[i], lambda n, c: body(self.kv_table[i, n], c), init)

  def q_loop(self, j, nq, body, init):
    """lax.fori_loop of body(i, carry) over the query blocks that may see key block j."""
    if self.q_table is None:
      return lax.fori_loop(*self.q_runs(j, nq), body, init)
    return lax.fori_loop(0, self.q_count[j], lambda n, c: body(self.q_table[j, n], c), init)

  def kv_runs(self, i, nk):
    limits = None if self.kv_limits is None else (self.kv_limits[i, 0], self.kv_limits[i, 1])
    first, _, _, last = _tiling.block_runs(i, owner_block=self.bq, other_block=self.bk,
                                         num_other=nk, band=self.params.band, element_mask=True,
                                         other_len=None, limits=limits)
    return first, last

  def q_runs(self, j, nq):
    limits = None if self.q_limits is None else (self.q_limits[j, 0], self.q_limits[j, 1])
    first, _, _, last = _tiling.block_runs(j, owner_block=self.bk, other_block=self.bq,
                                         num_other=nq, band=_tiling.mirrored(self.params.band),
                                         element_mask=True, other_len=None, limits=limits)
    return first, last


def _prepare(q, k, v, q_seg, kv_seg, arrays: FeatureArrays, params: AttentionParams,
             config: XlaConfig):
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = h // kh
  bm = arrays.block_mask
  bq, bk = ((bm.block_q, bm.block_kv) if bm is not None
            else (min(config.block_q, t), min(config.block_kv, s)))
  t_pad, s_pad = _tiling.round_up(t, bq), _tiling.round_up(s, bk)
  q = _tiling.pad_axis(q, 1, t_pad).reshape(b, t_pad, kh, g, d)
  k, v = _tiling.pad_axis(k, 1, s_pad), _tiling.pad_axis(v, 1, s_pad)
  q_seg, kv_seg = _tiling.pad_segments(q_seg, kv_seg, t_pad, s_pad)
  dense = {}
  for name in ("bias", "mask"):
    x = getattr(arrays, name)
    if x is not None:  # [B|1, H|1, T, S] -> [B|1, K|1, G|1, T_pad, S_pad]
      x = _tiling.pad_axis(_tiling.pad_axis(x, 2, t_pad), 3, s_pad)
      dense[name] = x.reshape(x.shape[0], *((kh, g) if x.shape[1] == h else (1, 1)),
                              t_pad, s_pad)
  slopes = None if arrays.alibi_slopes is None else arrays.alibi_slopes.reshape(kh, g)
  head_keys = None
  if params.dropout_rate > 0.0:
    heads = jnp.arange(h, dtype=jnp.int32).reshape(1, kh, g)
    batch = jnp.arange(b, dtype=jnp.int32)[:, None, None]
    head_keys = dropout.head_key(arrays.dropout_seed[0], arrays.dropout_seed[1], batch, heads)
  limits = [None, None]
  if q_seg is not None:  # one loop serves the whole batch: take the hull over it
    limits = [jnp.stack([x[..., 0].min(0), x[..., 1].max(0)], -1)
              for x in _tiling.segment_block_limits(q_seg, kv_seg, block_q=bq, block_kv=bk)]
  sparse = {}
  if bm is not None:
    active = (bm.block_state != masks.SKIPPED).any(0)  # [nq, nk], over the batch
    state = jnp.where(active, masks.PARTIAL, masks.SKIPPED)[None]
    (kv_table,), (kv_count,), _ = masks.block_tables(state)
    (q_table,), (q_count,), _ = masks.block_tables(jnp.swapaxes(state, 1, 2))
    sparse = dict(mask_fn=masks.pad_leaves(bm.mask_fn, t_pad, s_pad), kv_table=kv_table,
                  kv_count=kv_count, q_table=q_table, q_count=q_count)
  ctx = _Ctx(params=params, kv_len=s, bq=bq, bk=bk, num_heads=h, kv_seg=kv_seg, dense=dense,
             slopes=slopes, head_keys=head_keys, kv_limits=limits[0], q_limits=limits[1],
             **sparse)
  return q, k, v, q_seg, ctx


def forward(q, k, v, q_seg, kv_seg, *, params: AttentionParams, config: XlaConfig,
            arrays: FeatureArrays | None = None):
  """See pallas_flash.call for the contract."""
  b, t, h, _ = q.shape
  dv = v.shape[3]  # the value head dim, which may differ from the query/key one
  q, k, v, q_seg, ctx = _prepare(q, k, v, q_seg, kv_seg, arrays or FeatureArrays(), params,
                                 config)
  bq, bk = ctx.bq, ctx.bk
  nk = k.shape[1] // bk
  kh, g = q.shape[2], q.shape[3]

  def q_block(args):
    i, q_blk, qs_blk = args  # q_blk [B, bq, K, G, D]

    def kv_step(j, carry):
      m, l, acc = carry
      k_blk = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1)
      v_blk = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1)
      sc, _, mask = ctx.logits(q_blk, k_blk, qs_blk, i, j)  # [B, K, G, bq, bk]
      if mask is not None:
        sc = jnp.where(mask, sc, MASK_VALUE)
      m_new = jnp.maximum(m, sc.max(-1))
      alpha = jnp.exp(m - m_new)  # FA2 Alg. 1 rescaling of the running sum and accumulator
      p = jnp.exp(sc - m_new[..., None])
      if mask is not None:
        p = jnp.where(mask, p, 0.0)  # rows with no visible key so far must keep l == 0
      l = alpha * l + p.sum(-1)
      if params.dropout_rate > 0.0:  # l sums every probability; only kept ones reach V
        p = jnp.where(ctx.keep(i, j), p, 0.0)
      pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v_blk, precision=_HI,
                      preferred_element_type=jnp.float32)
      return m_new, l, alpha[..., None] * acc + pv

    init = (jnp.full((b, kh, g, bq), MASK_VALUE, jnp.float32),
            jnp.zeros((b, kh, g, bq), jnp.float32),
            jnp.zeros((b, kh, g, bq, dv), jnp.float32))
    m, l, acc = ctx.kv_loop(i, nk, kv_step, init)
    l_safe = jnp.where(l == 0.0, 1.0, l)
    o = acc / (l_safe * (1.0 - params.dropout_rate))[..., None]  # [B, K, G, bq, D]
    lse = jnp.where(l == 0.0, -jnp.inf, m + jnp.log(l_safe))
    return jnp.einsum("bkgqd->bqkgd", o).astype(q.dtype), lse.reshape(b, h, bq)

  nq = q.shape[1] // bq
  qs_blocks = None if q_seg is None else _blocks(q_seg, bq)
  o, lse = lax.map(q_block, (jnp.arange(nq), _blocks(q, bq), qs_blocks))
  o = _unblocks(o).reshape(b, -1, h, dv)[:, :t]
  lse = jnp.moveaxis(lse, 0, 2).reshape(b, h, -1)[:, :, :t]
  return o, lse


def backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, *, params: AttentionParams,
             config: XlaConfig, arrays: FeatureArrays | None = None):
  """See pallas_flash.call for the contract."""
  del o
  arrays = arrays or FeatureArrays()
  b, t, h, d = q.shape
  s_len = k.shape[1]
  q, k, v, q_seg, ctx = _prepare(q, k, v, q_seg, kv_seg, arrays, params, config)
  bq, bk = ctx.bq, ctx.bk
  kh, g = q.shape[2], q.shape[3]
  t_pad, s_pad = q.shape[1], k.shape[1]
  do = _tiling.pad_axis(do, 1, t_pad).reshape(*q.shape[:4], v.shape[3])
  # Padded rows get lse = +inf so that their probabilities are exactly 0.
  lse = _tiling.pad_axis(lse, 2, t_pad, jnp.inf).reshape(b, kh, g, t_pad)
  delta = _tiling.pad_axis(delta, 2, t_pad).reshape(b, kh, g, t_pad)
  nq, nk = t_pad // bq, s_pad // bk
  grads = functools.partial(_block_grads, ctx=ctx)
  bias_shape = ctx.dense["bias"].shape[:3] if params.returns_dbias else None

  def dq_block(args):
    i, q_blk, do_blk, qs_blk = args
    lse_blk = lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
    delta_blk = lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)

    def kv_step(j, carry):
      dq, dbias = carry
      k_blk = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1)
      v_blk = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1)
      _, ds, ds_bias = grads(q_blk, k_blk, v_blk, do_blk, lse_blk, delta_blk, qs_blk, i, j)
      if dbias is not None:  # summed over the axes the bias broadcasts along
        axes = tuple(a for a, n in enumerate(bias_shape) if n == 1 and ds.shape[a] != 1)
        dbias = lax.dynamic_update_slice_in_dim(dbias, ds_bias.sum(axes, keepdims=True),
                                                j * bk, axis=4)
      dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(k.dtype), k_blk, precision=_HI,
                           preferred_element_type=jnp.float32)
      return dq, dbias

    dbias = (jnp.zeros((*bias_shape, bq, s_pad), jnp.float32) if params.returns_dbias
             else None)
    dq, dbias = ctx.kv_loop(i, nk, kv_step, (jnp.zeros(q_blk.shape, jnp.float32), dbias))
    return dq * params.scale, dbias

  def dkv_block(args):
    j, k_blk, v_blk = args

    def q_step(i, carry):
      dk, dv = carry
      q_blk = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=1)
      do_blk = lax.dynamic_slice_in_dim(do, i * bq, bq, axis=1)
      lse_blk = lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
      delta_blk = lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
      qs_blk = None if q_seg is None else lax.dynamic_slice_in_dim(q_seg, i * bq, bq, axis=1)
      p, ds, _ = grads(q_blk, k_blk, v_blk, do_blk, lse_blk, delta_blk, qs_blk, i, j)
      # Summing over g reduces GQA gradients inside the einsum: no repeated K/V is formed.
      dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do.dtype), do_blk, precision=_HI,
                           preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(q.dtype), q_blk, precision=_HI,
                           preferred_element_type=jnp.float32)
      return dk, dv

    dk, dv = ctx.q_loop(j, nq, q_step, (jnp.zeros(k_blk.shape, jnp.float32),
                                        jnp.zeros(v_blk.shape, jnp.float32)))
    return dk * params.scale, dv

  qs_blocks = None if q_seg is None else _blocks(q_seg, bq)
  dq, dbias = lax.map(dq_block, (jnp.arange(nq), _blocks(q, bq), _blocks(do, bq), qs_blocks))
  dk, dv = lax.map(dkv_block, (jnp.arange(nk), _blocks(k, bk), _blocks(v, bk)))
  dq = _unblocks(dq).reshape(b, t_pad, h, d)[:, :t]
  dk, dv = _unblocks(dk)[:, :s_len], _unblocks(dv)[:, :s_len]
  out = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
  if not params.returns_dbias:
    return out
  # [nq, B|1, K|1, G|1, bq, S_pad] -> [B|1, H|1, T, S]
  dbias = jnp.moveaxis(dbias, 0, 3).reshape(bias_shape[0], -1, t_pad, s_pad)
  return (*out, dbias[:, :, :t, :s_len])


def _block_grads(q_blk, k_blk, v_blk, do_blk, lse_blk, delta_blk, qs_blk, i, j, *, ctx: _Ctx):
  """Of one block pair, each [B, K, G, bq, bk]: the probabilities that multiplied V (dropped and
  rescaled), the gradient of the pre-soft-cap scores, and that of the bias (dbias)."""
  params = ctx.params
  sc, t, mask = ctx.logits(q_blk, k_blk, qs_blk, i, j)
  p = jnp.exp(sc - lse_blk[..., None])
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  dp = jnp.einsum("bqkgd,bskd->bkgqs", do_blk, v_blk, precision=_HI,
                  preferred_element_type=jnp.float32)
  p_v = p
  if params.dropout_rate > 0.0:
    keep, inv = ctx.keep(i, j), 1.0 / (1.0 - params.dropout_rate)
    dp = jnp.where(keep, dp * inv, 0.0)
    p_v = jnp.where(keep, p * inv, 0.0)
  ds = p * (dp - delta_blk[..., None])
  ds_capped = ds
  if t is not None:  # d/ds of c·tanh(s/c) = 1 - tanh²
    ds = ds * (1.0 - t * t)
  # A bias added after the cap gets the capped logits' gradient, one inside it the scores'.
  return p_v, ds, ds if params.bias_in_cap else ds_capped
