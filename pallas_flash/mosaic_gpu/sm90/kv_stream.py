"""Pieces of the kernels that own key rows and stream the queries: the split dK/dV kernel, the
fused backward and the head-dim-256 dK/dV kernel.

A consumer warpgroup owns block_kv key rows (K, V resident in SMEM) and streams, per (q block,
query head) step, Q, dO, lse and delta through `streams`: four (gmem ref, smem ring, ready,
free) tuples in that order. Products are formed transposed (Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ), so that
the register operand of dV += Pᵀ·dO and dK += dSᵀ·Q has the warpgroup's key rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_flash.mosaic_gpu.sm90 import common
from pallas_flash.mosaic_gpu.sm90 import dense as sm90_dense

# Steps per warpgroup that a profiled kernel (MosaicDebug.profile_dir) records: its event
# buffer lives in shared memory, which the fused kernel nearly fills.
PROFILE_STEPS = 32
# Barriers and alignment padding on top of the buffers a kernel counts (Mosaic measured
# 288-736 B in the fused kernel; the dK/dV kernel's 1024).
SMEM_SLACK_BYTES = 1024


def first_q_block(k0, kp: common.KernelParams):
  """The first query block that sees key k0 (causal: the block holding query k0; else 0)."""
  if not kp.causal:
    return 0
  return jnp.minimum(kp.t_pad // kp.block_q, lax.div(k0, kp.block_q))

def first_unmasked_step(k0, cta_first, kp: common.KernelParams):
  """Causal: the first step (counted from q block cta_first, G query heads per block) whose
  q block sees every key of k0 .. k0 + block_kv - 1."""
  bq = kp.block_q
  full = jnp.minimum(kp.t_pad // bq, lax.div(k0 + kp.block_kv - 1 + bq - 1, bq))
  return jnp.maximum(full - cta_first, 0) * kp.group

def load_kv_tiles(k_ref, v_ref, k_smem, v_smem, kv_ready, wg, rows):
  """TMA-loads WG `wg`'s K and V tiles (k/v_ref[rows]) and waits for both."""
  plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, kv_ready.at[wg, 0])
  plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, kv_ready.at[wg, 1])
  plgpu.barrier_wait(kv_ready.at[wg, 0])
  plgpu.barrier_wait(kv_ready.at[wg, 1])

def wait_streams(streams, slot):
  """Waits until every stream has filled `slot`; returns that slot's Q and dO tiles."""
  with jax.named_scope("wait_q"):
    for _, _, ready, _ in streams:
      plgpu.barrier_wait(ready.at[slot])
  return streams[0][1].at[slot], streams[1][1].at[slot]

def skip_step(t, carry, *, streams, stages: int):
  """A step whose q block sees none of this WG's keys: keeps the rings' barriers in phase."""
  slot = lax.rem(t, stages)
  for _, _, ready, free in streams:
    plgpu.barrier_wait(ready.at[slot])
    plgpu.barrier_arrive(free.at[slot])
  return carry

def transposed_grad_tiles(k_smem, v_smem, q_smem, do_smem, streams, slot, k0, mask_block, kp,
                          ids=None, early_probs=False, bias=None, drop=None, visible=None,
                          dense=None):
  """Pᵀ and dSᵀ [block_kv, block_q] float32 of one step; releases its lse and delta slots.

  Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (SMEM operands), Pᵀ = exp2(Sᵀ·c − lse2), dSᵀ = Pᵀ∘(dPᵀ − delta).
  mask_block: None when every key of the tile is visible to the step's queries, else a
  function giving the step's q block (called only then); invisible entries of Pᵀ become 0.
  ids: (key ids [block_kv] ROW, query ids [block_q] COL) of a segmented call (with mask_block).
  early_probs: wait for Sᵀ alone and form Pᵀ while dPᵀ runs (the fused kernel's order).
  bias: None, or the step's ALiBi on a raw Sᵀ tile (`alibi_steps`).
  drop: None, or the step's dropout key vectors (`dropout_steps`): the Pᵀ returned (dV's
  operand) is then the kept probabilities' (unscaled: dV is scaled once at the end) and dSᵀ
  takes the kept, scaled dPᵀ (`grad_scores_t`).
  visible: a block mask's element mask of the step (a function giving the [block_kv, block_q]
  bool tile) used instead of common.tile_mask where mask_block is given.
  dense: None, or (the step's dense tiles, with_dense: (bias, tiles) -> the bias with them)
  for the dK/dV kernel's dense bias / mask (the tiles' loads issued under the matmuls).
  """
  bq, bkv = kp.block_q, kp.block_kv

  def scores(s_ref, dp_ref):
    plgpu.wgmma(s_ref, k_smem, q_smem.T)
    plgpu.wgmma(dp_ref, v_smem, do_smem.T)
    if not early_probs:
      loaded = None if dense is None else sm90_dense.issue(dense[0])
      return s_ref[...], dp_ref[...], loaded
    # Sᵀ alone is waited for; Pᵀ's exp2s run while dPᵀ is on the tensor cores. delta is
    # loaded only after dPᵀ's wait, so that its registers are not live through the exp2s.
    p_t, slope = probs_t(plgpu.wgmma_accumulator_load(s_ref, wait_n=1),
                          step_stat(streams, slot, 2), k0, mask_block, kp, ids, bias, visible)
    keep = dropout_keep_t(drop, p_t.shape, kp)
    return (dropped(p_t, keep),
            grad_scores_t(p_t, slope, dp_ref[...], step_stat(streams, slot, 3), keep, kp))

  assert not (early_probs and dense), "common.early_probs excludes dense tiles"
  with jax.named_scope("scores"):
    out = pl.run_scoped(scores, plgpu.ACC((bkv, bq), jnp.float32),
                        plgpu.ACC((bkv, bq), jnp.float32))
  if early_probs:
    return out  # already Pᵀ and dSᵀ
  s_t, dp_t, loaded = out
  if dense is not None:
    bias = dense[1](bias, sm90_dense.issued(dense[0], loaded))
  with jax.named_scope("softmax"):
    lse, delta = step_stats(streams, slot)
    p_t, slope = probs_t(s_t, lse, k0, mask_block, kp, ids, bias, visible)
    keep = dropout_keep_t(drop, p_t.shape, kp)
    ds_t = grad_scores_t(p_t, slope, dp_t, delta, keep, kp)
  return dropped(p_t, keep), ds_t

def step_stats(streams, slot):
  """The lse (log2 units) and delta column vectors [block_q] of ring slot `slot`, whose
  buffers are released right after the load."""
  (_, lse_scratch, _, lse_free), (_, delta_scratch, _, delta_free) = streams[2:4]
  lse = plgpu.load(lse_scratch.at[slot], layout=common.COL)
  delta = plgpu.load(delta_scratch.at[slot], layout=common.COL)
  plgpu.barrier_arrive(lse_free.at[slot])
  plgpu.barrier_arrive(delta_free.at[slot])
  return lse, delta

def step_stat(streams, slot, which: int):
  """One row statistic [block_q] COL of ring slot `slot`: lse (which 2) or delta (3), its
  buffer released right after the load (the fused_overlap step loads delta late).
  `step_stats` is not built on it: it loads both before releasing either, the order the
  split kernels ran on the H200."""
  _, scratch, _, free = streams[which]
  x = plgpu.load(scratch.at[slot], layout=common.COL)
  plgpu.barrier_arrive(free.at[slot])
  return x

def capped_scores_t(s_t, bias, kp: common.KernelParams):
  """(the scores a raw Sᵀ tile gives after the soft cap and the step's bias, the cap's slope,
  exp2's factor on those scores): soft_cap(Sᵀ) + bias, or with kp.bias_in_cap
  ("bias_then_cap") soft_cap(Sᵀ + bias), a dense mask after the cap (bias's `cap`). bias:
  alibi_steps' or the dK/dV kernel's, or None. Where nothing follows the cap the cap's factor
  is left to exp2's (common.cap_fold; always so with kp.bias_in_cap)."""
  folded, c = common.cap_fold(kp, biased=bias is not None)  # ALiBi and / or dense tiles
  if not kp.bias_in_cap:
    s_t, slope = common.soft_cap_with_slope(s_t, kp, folded=folded)
    return (s_t if bias is None else bias(s_t)), slope, c
  cap = common.cap_after_bias(kp)
  return (*(cap(s_t) if bias is None else bias(s_t, cap=cap)), c)


def probs_t(s_t, lse, k0, mask_block, kp: common.KernelParams, ids=None, bias=None,
            visible=None):
  """(Pᵀ, slope): Pᵀ = exp2((soft_cap(Sᵀ) + bias)·c − lse2) (with kp.bias_in_cap
  soft_cap(Sᵀ + bias), a dense mask after the cap) [block_kv, block_q] with the
  entries the mask hides set to 0 (mask_block: see transposed_grad_tiles; bias: ALiBi's
  `alibi_steps`, or None), and the soft cap's slope (common.soft_cap_with_slope; None without
  a cap) for `grad_scores_t` (ALiBi adds a constant: no slope). visible: see
  transposed_grad_tiles."""
  s_t, slope, c = capped_scores_t(s_t, bias, kp)
  p_t = jnp.exp2(s_t * c - lax.broadcast_in_dim(lse, s_t.shape, [1]))
  if mask_block is not None:
    if visible is not None:
      visible = visible()
    else:
      visible = common.tile_mask(k0, mask_block() * kp.block_q, (kp.block_kv, kp.block_q), kp,
                                 transposed=True, ids=ids)
    p_t = jnp.where(visible, p_t, 0.0)
  return p_t, slope

def alibi_steps(slopes, k0, index, kp: common.KernelParams):
  """bias_at(t): the ALiBi of step t on a raw Sᵀ tile (keys k0.. by the step's queries), for
  a kernel whose step t streams (q block, query head) = index(t); None without slopes (the
  raw_alibi_slopes [H] GMEM ref). Call it at the top of a step: it loads the head's slope
  there (once per CTA when a kv head has one query head), ahead of the step's waits."""
  if slopes is None:
    return lambda t: None
  cta_slope = slopes[index(0)[1]] if kp.group == 1 else None

  def bias_at(t):
    block, head = index(t)
    slope = cta_slope if kp.group == 1 else slopes[head]

    def bias(s_t, cap=None):  # cap: as dense.add's, applied after ALiBi
      s_t = common.alibi(s_t, row0=k0, col0=block * kp.block_q, slope=slope)
      return s_t if cap is None else cap(s_t)

    return bias

  return bias_at

def dropout_steps(keys, b, k0, index, kp: common.KernelParams):
  """drop_at(t): the dropout key vectors of step t's transposed tile (keys k0.. of batch b by
  the step's queries): (the keys' [block_kv] ROW, loaded once, the queries' [block_q] COL),
  for a kernel whose step t streams (q block, query head) = index(t); None without dropout
  (keys: the common.DropoutKeys GMEM refs). Call it at the top of a step, so the queries' keys
  load ahead of the step's waits."""
  if keys is None:
    return lambda t: None
  cols = common.dropout_col_keys(keys, k0, kp.block_kv, layout=common.ROW)

  def drop_at(t):
    block, head = index(t)
    return cols, common.dropout_row_keys(keys, b, head, block * kp.block_q, kp.block_q,
                                         layout=common.COL)

  return drop_at

def dropout_keep_t(drop, shape, kp: common.KernelParams):
  """The keep mask [block_kv, block_q] of a transposed tile from `dropout_steps`' vectors, or
  None (no dropout)."""
  if drop is None:
    return None
  return common.dropout_keep(*drop, shape, kp)

def dropped(p_t, keep):
  """Pᵀ with the entries dropout drops set to 0 (keep None: unchanged)."""
  return p_t if keep is None else jnp.where(keep, p_t, 0.0)

def grad_scores_t(p_t, slope, dp_t, delta, keep=None, kp: common.KernelParams | None = None):
  """dSᵀ = Pᵀ∘(dPᵀ − delta) [block_kv, block_q], times the soft cap's slope where there is one
  (the raw scores' gradient); delta [block_q] COL. keep: dropout's mask (`dropout_keep_t`) or
  None: dPᵀ is then the kept entries' times 1 / (1 - rate), 0 elsewhere (Pᵀ undropped)."""
  if keep is not None:
    dp_t = jnp.where(keep, dp_t * kp.inv_keep, 0.0)
  if slope is not None:
    p_t = p_t * slope
  return p_t * (dp_t - lax.broadcast_in_dim(delta, p_t.shape, [1]))

def store_dk_dv(dk, dv, k_smem, v_smem, dk_ref, dv_ref, rows, kp: common.KernelParams):
  """Writes dK·scale and dV [block_kv, D] through the K and V tiles (no longer read), then
  waits until every SMEM-to-GMEM copy this thread issued, these included, has read its shared
  memory: the kernel ends here, and its writes to GMEM complete before the kernel does
  (CUTLASS's epilogues wait the same way), so the SM is free for the next CTA sooner."""
  k_smem[...] = (dk * kp.scale).astype(kp.dtype)
  v_smem[...] = dv.astype(kp.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rows], commit_group=False)
  plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rows], commit_group=False)
  plgpu.commit_smem_to_gmem_group()
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)

def produce_query_streams(cta_steps, stages, streams, index, b, bq, kp: common.KernelParams,
                          extra_rows=()):
  """The producer of the dK/dV-style kernels: the Q and dO rows and the lse and delta entries
  of step t's (q block, query head) = index(t). lse and delta are KernelParams.stats_view's
  [1, B·H, Tp], entry (b, h) at row b·H + h. extra_rows: rows(t) of each stream past the
  fourth (the dK/dV kernel's dense.StreamedBias)."""
  def q_rows(t):
    i, h = index(t)
    return b, pl.ds(i * bq, bq), h

  def stat_rows(t):
    i, h = index(t)
    return 0, b * streams[0][0].shape[2] + h, pl.ds(i * bq, bq)  # H: Q's heads

  common.produce(cta_steps, stages, tuple((*stream, rows) for stream, rows in
                                    zip(streams, (q_rows, q_rows, stat_rows, stat_rows,
                                                  *extra_rows), strict=True)))

def kv_stream_smem(kp: common.KernelParams, d: int) -> list:
  """Shared memory of a kernel that owns K/V tiles and streams Q/dO (dK/dV, fused backward):
  K and V [2 WGs, block_kv, D], the Q and dO rings [stages, block_q, D] and the lse / delta rows
  of each slot [stages, block_q]."""
  bq, bkv, stages = kp.block_q, kp.block_kv, kp.stages
  tiles = common.smem_transforms(kp.dtype, kp.d)
  return [plgpu.SMEM((2, bkv, d), kp.dtype, transforms=tiles),
          plgpu.SMEM((2, bkv, d), kp.dtype, transforms=tiles),
          plgpu.SMEM((stages, bq, d), kp.dtype, transforms=tiles),
          plgpu.SMEM((stages, bq, d), kp.dtype, transforms=tiles),
          plgpu.SMEM((stages, bq), jnp.float32),
          plgpu.SMEM((stages, bq), jnp.float32)]

def kv_stream_smem_bytes(d: int, block_q: int, block_kv: int, stages: int,
                         itemsize: int = 2) -> int:
  """kv_stream_smem's bytes: K/V of both WGs, the Q/dO rings and their lse/delta rows; the
  callers add SMEM_SLACK_BYTES (with it 133120 at head dim 128, block_q = block_kv = 64 and 2
  stages: the compiled dK/dV kernel's)."""
  kv = 2 * 2 * block_kv * d * itemsize
  ring = stages * (2 * block_q * d * itemsize + 2 * block_q * 4)
  return kv + ring


def kv_stream_barriers(kp: common.KernelParams) -> list:
  """Barriers of kv_stream_smem: the K/V loads [2 WGs, 2], then ready and free (both consumer
  WGs arrive) rings of Q, dO, lse and delta."""
  ring = [plgpu.Barrier(num_barriers=kp.stages) for _ in range(4)]
  free = [plgpu.Barrier(num_arrivals=2, num_barriers=kp.stages) for _ in range(4)]
  return [plgpu.Barrier(num_barriers=(2, 2)), *ring, *free]

def profile_steps(kp: common.KernelParams) -> int:
  """The most loop steps a warpgroup of a kernel that streams Q/dO runs (dK/dV, fused)."""
  return kp.t_pad // kp.block_q * kp.group
