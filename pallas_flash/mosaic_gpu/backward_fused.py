"""FlashAttention-3 style backward for Hopper: one Pallas Mosaic GPU kernel per KV tile.

The kernel is `backward._bwd_dkdv_kernel` plus dQ. A CTA has 2 consumer warpgroups, each owning
`block_kv_fused` key rows (K, V resident in SMEM, dK and dV accumulated in registers), and a TMA
producer warpgroup streaming Q, dO, lse and delta of every (q block, query head of the kv head)
pair. Per step a consumer does 5 tile matmuls instead of the split backward's 7:

  Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ                      (SMEM operands)
  Pᵀ = exp2(Sᵀ·c − lse·log2e), dSᵀ = Pᵀ∘(dPᵀ − delta)
  dV += Pᵀ·dO                                 (Pᵀ from registers)
  dK += dSᵀ·Q,  dQ_part = dS·K                (dSᵀ written once to SMEM; dQ reads its transposed
                                               view, since register operands cannot be transposed)

dQ_part (float32) goes through SMEM and is TMA reduce-added (`reduction_op="add"`) into a
float32 dQ buffer in HBM; XLA then applies softmax_scale and casts. The float32 atomics make dQ's
summation order, and so its last bits, vary run to run; `backward.py`'s split path is the
bitwise reproducible one.

Options (MosaicConfig): `fused_dq_shared` lets the two consumer WGs share one dQ_part per step,
each computing half of D's columns from both dSᵀ tiles (FA3's split: half the reduce traffic,
smaller accumulators, one 2-WG barrier per step); `fused_dq_blocks` computes dQ_part in column
blocks (fewer live registers); `fused_stagger_q` rotates the q-block order per kv tile;
`fused_overlap` runs `_overlapped_step`: FA3's intra-warpgroup overlap (Pᵀ while dPᵀ runs, dV
while dSᵀ is computed, dQ_part stored while dK runs) and a double-buffered dQ staging buffer
where shared memory allows (`dq_slots`). `fused_defer_dq` (with `fused_dq_shared`) issues each
step's dQ_part one step late, so the two WGs wait only for each other's dSᵀ of the step before
and need not meet every step; `fused_defer_inline` issues it with dV and dK, `fused_offset`
starts WG 1 behind WG 0. `config.FUSED_DEFERRED` is the fastest measured form (opt-in: see
docs/perf.md, seventh session).

In interpret mode (the interpreter has no TMA reductions, register-operand wgmma or `run_state`
accumulators), each warpgroup read-modify-writes its own slice of a [2, ...] dQ buffer (grid
points run one after another there, so only the two warpgroups of a CTA could collide), Pᵀ is
staged through SMEM and the accumulations are scoped products added in registers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_flash import _tiling
from pallas_flash.mosaic_gpu import _common
from pallas_flash.mosaic_gpu.backward import (PROFILE_STEPS, _at, _dk_dv_updates,
                                              _first_q_block, _first_unmasked_step,
                                              _load_kv_tiles, _probs_t,
                                              _produce_query_streams, _skip_step,
                                              _step_stat, _store_dk_dv, _tile_and_head,
                                              _transposed_grad_tiles, _wait_streams,
                                              grad_scores_t,
                                              kv_stream_barriers, kv_stream_smem,
                                              profile_steps)
from pallas_flash.mosaic_gpu.config import SMEM_LIMIT_BYTES, MosaicConfig
from pallas_flash.call import AttentionParams

LOG2E = math.log2(math.e)
# Barriers and alignment padding on top of the buffers counted below (Mosaic measured 288-736 B).
_SMEM_SLACK_BYTES = 1024


def smem_bytes(d: int, block_q: int, block_kv: int, stages: int, itemsize: int = 2, *,
               dq_shared: bool = False, dq_slots: int = 1, defer_dq: bool = False) -> int:
  """Shared memory of one CTA: K/V of both WGs, the Q/dO/lse/delta ring, dSᵀ and dQ (f32,
  `dq_slots` buffers per WG)."""
  kv = 2 * 2 * block_kv * d * itemsize
  ring = stages * (2 * block_q * d * itemsize + 2 * block_q * 4)
  ds = ds_slots(dq_shared, defer_dq) * 2 * block_kv * block_q * itemsize
  dq = dq_slots * 2 * block_q * (d // 2 if dq_shared else d) * 4
  return kv + ring + ds + dq + _SMEM_SLACK_BYTES


def ds_slots(dq_shared: bool, defer_dq: bool) -> int:
  """dSᵀ buffers per WG: with a deferred dQ_part, a WG rewrites slot t % 4 at step t + 4, after
  its step t + 3 saw the other WG arrive at t + 2, i.e. finish step t + 1 and its dQ_part of
  step t, the slot's last reader; with a shared one, 2 (by step parity, see the kernel)."""
  return 4 if defer_dq else (2 if dq_shared else 1)


def dq_slots(d: int, config: MosaicConfig, itemsize: int = 2) -> int:
  """dQ_part staging buffers per WG: 2 (double-buffered) with fused_overlap where they fit
  in shared memory, else 1. A profiled kernel (config.profile_dir) counts the profiler's
  buffer too, so that the head_dim 128 form (231,424 B with 2 slots) is profiled with one."""
  if not config.fused_overlap:
    return 1
  two = smem_bytes(d, config.block_q_fused, config.block_kv_fused, config.fused_stages,
                   itemsize, dq_shared=config.fused_dq_shared, dq_slots=2)
  if config.profile_dir:
    two += _common.profiler_smem_bytes(PROFILE_STEPS)
  return 2 if two <= SMEM_LIMIT_BYTES else 1


def unsupported_reason(q, config: MosaicConfig) -> str | None:
  """Why the fused kernel cannot run q [B, T, H, D] with `config`, or None when it can."""
  d = q.shape[3]
  if d > 128:
    return (f"head_dim {d}: dK, dV and dQ_part of a 64-row tile need more than the 232 "
            "accumulator registers a warpgroup has")
  if d % (64 * config.fused_dq_blocks):
    return (f"fused_dq_blocks {config.fused_dq_blocks}: head_dim {d} does not split into "
            "column blocks of a multiple of 64 (the 128-byte swizzle width)")
  if config.fused_dq_shared and (d % 128 or config.fused_dq_blocks != 1):
    return (f"fused_dq_shared needs head_dim a multiple of 128 (got {d}; each WG takes D/2 "
            "columns, a multiple of the 64-element swizzle width) and fused_dq_blocks 1")
  if config.fused_defer_dq and (not config.fused_dq_shared or config.fused_overlap):
    return (f"fused_defer_dq needs fused_dq_shared and not fused_overlap (got "
            f"fused_dq_shared={config.fused_dq_shared}, fused_overlap={config.fused_overlap})")
  if config.fused_defer_inline and not config.fused_defer_dq:
    return "fused_defer_inline needs fused_defer_dq (it is a form of the deferred dQ_part)"
  if config.fused_offset and not config.fused_defer_dq:
    return "fused_offset needs fused_defer_dq (it offsets the warpgroups the deferral decouples)"
  if config.fused_overlap and config.fused_dq_blocks != 1:
    return (f"fused_overlap needs fused_dq_blocks 1 (got {config.fused_dq_blocks}): it issues "
            "dQ_part as one accumulator next to dK")
  need = smem_bytes(d, config.block_q_fused, config.block_kv_fused, config.fused_stages,
                    jnp.dtype(q.dtype).itemsize, dq_shared=config.fused_dq_shared,
                    dq_slots=dq_slots(d, config, jnp.dtype(q.dtype).itemsize),
                    defer_dq=config.fused_defer_dq)
  if need > SMEM_LIMIT_BYTES:
    return (f"needs about {need} B of shared memory (head_dim {d}, block_q_fused "
            f"{config.block_q_fused}, block_kv_fused {config.block_kv_fused}, fused_stages "
            f"{config.fused_stages}) > {SMEM_LIMIT_BYTES} B")
  return None


def _accumulate_smem(acc, a_smem, b_smem, kp: _common.KernelParams):
  """acc + a_smem @ b_smem with both operands in SMEM (interpretable form; the GPU path folds
  this into `_gradient_matmuls`)."""
  return acc + _common.smem_matmul(a_smem, b_smem, acc.shape)


def _dq_part(out, terms):
  """out[...] = the sum of the a @ b products in terms (SMEM operands), one accumulator."""
  def mm(acc_ref):
    for a, b in terms:
      plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]  # waits for every wgmma in flight

  out[...] = pl.run_scoped(mm, plgpu.ACC(out.shape, jnp.float32))


def _gradient_matmuls(dv, dk, p_t, ds_smem, q_smem, do_smem, dq_plan, p_staging, release_do,
                      release_q, kp: _common.KernelParams, before_dq=lambda: None,
                      reduce_dq=None):
  """dV += Pᵀ·dO and dK += dSᵀ·Q; dQ_part = dS·K is written to SMEM as `dq_plan` says.

  dv/dk [block_kv, D] f32, p_t [block_kv, block_q] (dtype, registers), ds_smem [block_kv,
  block_q] (dSᵀ), q/do_smem [block_q, D]. dq_plan: [(out, [(a, b), ...]), ...]: each out
  [block_q, cols] f32 SMEM receives the sum of its a @ b products, one accumulator at a time.
  before_dq: called after dV and dK are issued, before dQ_part's operands are read (the
  deferred dQ_part's wait for the other WG's dSᵀ).
  reduce_dq: None, or (one dq_plan entry) dQ_part is issued before dK instead of after it, and
  reduce_dq() (its reduce-add) is called as soon as it is in SMEM, while dK still runs
  (MosaicConfig.fused_dq_first); before_dq is then called after dV alone is issued.
  """
  if kp.interpret:
    dv = _common.accumulate(dv, p_t, p_staging, do_smem, kp)
    release_do()
    dk = _accumulate_smem(dk, ds_smem, q_smem, kp)
    release_q()
    before_dq()
    for out, terms in dq_plan:
      _dq_part(out, terms)
    if reduce_dq is not None:
      reduce_dq()
    return dv, dk

  if len(dq_plan) == 1:
    (out, terms), = dq_plan
    dq_first = reduce_dq is not None

    def mm(refs):
      dv_ref, dk_ref, dq_ref = refs
      # Issued back to back so the tensor cores never wait on this warpgroup between them; the
      # stream buffers are released as soon as the matmul reading them has retired.
      plgpu.wgmma(dv_ref, p_t, do_smem)
      if not dq_first:
        plgpu.wgmma(dk_ref, ds_smem, q_smem)
      before_dq()
      for a, b in terms:
        plgpu.wgmma(dq_ref, a, b)
      if dq_first:
        plgpu.wgmma(dk_ref, ds_smem, q_smem)
      plgpu.wgmma_wait(len(terms) + 1)
      release_do()
      if dq_first:
        # dQ_part's staging store, fence and reduce-add run while dK is on the tensor cores.
        out[...] = plgpu.wgmma_accumulator_load(dq_ref, wait_n=1)
        reduce_dq()
      else:
        plgpu.wgmma_wait(len(terms))
        release_q()

    zeros = plgpu.layout_cast(jnp.zeros(out.shape, jnp.float32), plgpu.Layout.WGMMA)
    dv, dk, dq = pl.run_state(mm)((plgpu.ACC.init(dv), plgpu.ACC.init(dk),
                                   plgpu.ACC.init(zeros)))
    if dq_first:
      release_q()  # dK retired at run_state's exit
    else:
      out[...] = dq
    return dv, dk

  def mm_blocked(refs):
    dv_ref, dk_ref = refs
    plgpu.wgmma(dv_ref, p_t, do_smem)
    plgpu.wgmma(dk_ref, ds_smem, q_smem)
    before_dq()
    for c, (out, terms) in enumerate(dq_plan):
      _dq_part(out, terms)
      if c == 0:  # dV and dK have retired too
        release_do()
        release_q()

  return pl.run_state(mm_blocked)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))


def _overlapped_step(dv, dk, tiles, stats, ds_smem, dq_terms, dq_shape, k0, mask_block, hooks,
                     p_staging, kp: _common.KernelParams):
  """One fused_overlap step: all five matmuls with FA3's intra-warpgroup overlap.

  tiles: this step's (k, v, q, do) SMEM tiles; stats: (lse2, delta) loaders of the step's
  column vectors, lse2 read while Sᵀ and dPᵀ run, delta only when dSᵀ is formed. dSᵀ is
  formed from the 16-bit Pᵀ that dV reads (as backward_wide's is), so the float32 Pᵀ dies at the
  conversion: with both, deviceless SASS at 240 registers (1x16384x16x128, fused_dq_shared)
  reloads 18 spilled words per step and stores 1, against 40 and 18 before (twenty-first
  session; not yet timed). wgmma groups retire in issue order, so a wait for "all but the
  newest n" retires exactly the older ones:

    issue Sᵀ, dPᵀ | wait 1: Sᵀ -> Pᵀ | issue dV += Pᵀ·dO | wait 1: dPᵀ -> dSᵀ -> SMEM
    issue dQ_part = dS·K (dq_terms), dK += dSᵀ·Q | wait 1: dV, dQ_part -> release dO,
    reduce_dq(dQ_part) while dK runs | wait 0 (run_state exit) -> release Q.

  hooks: (sync_ds, reduce_dq, release_do, release_q). Interpret mode keeps the order but its
  matmuls are synchronous (dV through p_staging, dK through SMEM operands).
  """
  k_smem, v_smem, q_smem, do_smem = tiles
  sync_ds, reduce_dq, release_do, release_q = hooks
  acc_t = plgpu.ACC((kp.block_kv, kp.block_q), jnp.float32)

  # The named scopes are scripts/mosaic_profile.py's regions (MosaicConfig.profile_dir); they
  # change nothing else (deviceless SASS identical with and without them).
  def grads(dv_mm, dk_mm):
    def scores(s_ref, dp_ref):
      lse_fn, delta_fn = stats
      with jax.named_scope("scores"):
        plgpu.wgmma(s_ref, k_smem, q_smem.T)
        plgpu.wgmma(dp_ref, v_smem, do_smem.T)
        s_t = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
      with jax.named_scope("softmax"):
        p_t, slope = _probs_t(s_t, lse_fn(), k0, mask_block, kp)
        p16 = p_t.astype(kp.dtype)
      with jax.named_scope("dv_issue"):
        dv_out = dv_mm(p16)
      with jax.named_scope("wait_dp"):
        dp_t = plgpu.wgmma_accumulator_load(dp_ref, wait_n=1)
      with jax.named_scope("ds"):
        return dv_out, grad_scores_t(p16.astype(jnp.float32), slope, dp_t, delta_fn())

    dv_out, ds_t = pl.run_scoped(scores, acc_t, acc_t)
    # dSᵀ in SMEM serves dK (as is) and dQ (its transposed view); wgmma reads it through the
    # async proxy, hence the fence.
    with jax.named_scope("ds_store"):
      ds_smem[...] = ds_t.astype(kp.dtype)
      plgpu.commit_smem()
    with jax.named_scope("sync_ds"):
      sync_ds()

    def dq_mm(dq_ref):
      with jax.named_scope("grad_mm"):
        for a, b in dq_terms:
          plgpu.wgmma(dq_ref, a, b)
        dk_out = dk_mm()
        dq = plgpu.wgmma_accumulator_load(dq_ref, wait_n=1)
      with jax.named_scope("reduce_dq"):
        release_do()
        reduce_dq(dq)
      return dk_out

    # A scoped accumulator, so dQ_part's zeros take registers only from here on.
    return dv_out, pl.run_scoped(dq_mm, plgpu.ACC(dq_shape, jnp.float32))

  if kp.interpret:
    dv, dk = grads(lambda p_t: _common.accumulate(dv, p_t, p_staging, do_smem, kp),
                   lambda: _accumulate_smem(dk, ds_smem, q_smem, kp))
  else:
    def body(refs):
      dv_ref, dk_ref = refs
      grads(lambda p_t: plgpu.wgmma(dv_ref, p_t, do_smem),
            lambda: plgpu.wgmma(dk_ref, ds_smem, q_smem))

    dv, dk = pl.run_state(body)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
  release_q()
  return dv, dk


def _reduce_dq(dq_smem, dq_acc_ref, dst, wg, dq_loaded, kp: _common.KernelParams):
  """Adds dq_smem [block_q, cols] f32 (a dQ_part just written) into dq_acc_ref[dst]."""
  plgpu.commit_smem()
  if kp.interpret:
    dst = dq_acc_ref.at[(wg, *dst)]
    part = dq_smem[...]
    plgpu.copy_gmem_to_smem(dst, dq_smem, dq_loaded)
    plgpu.barrier_wait(dq_loaded)
    dq_smem[...] = dq_smem[...] + part
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dq_smem, dst)
    plgpu.wait_smem_to_gmem(0)
    return
  plgpu.copy_smem_to_gmem(dq_smem, dq_acc_ref.at[dst], reduction_op="add")


def _bwd_fused_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_acc_ref, dk_ref, dv_ref,
                      k_scratch, v_scratch, q_scratch, do_scratch, lse_scratch, delta_scratch,
                      ds_scratch, dq_scratch, p_scratch, kv_ready, q_ready, do_ready, lse_ready,
                      delta_ready, q_free, do_free, lse_free, delta_free, dq_loaded, ds_ready,
                      kv_done, ds_handoff, start, *, kp: _common.KernelParams,
                      stagger_q: bool, dq_blocks: int, dq_shared: bool, overlap: bool = False,
                      dq_slots: int = 1, defer_dq: bool | str = False, offset: bool = False,
                      dq_head_major: bool = False, split_loop: bool = False,
                      early_probs: bool = False, dq_first: bool = False,
                      static_wg: bool = False, entry: int | None = None):
  """q/do_ref [B, Tp, H, D], k/v_ref [B, Sp, K, D], lse (log2 units)/delta_ref [B, H, Tp].

  entry: None, or the one batch entry this launch (grid batch 1) computes; its dk/dv_ref are
  then [1, Sp, K, D]. With kp.flat_stats lse/delta_ref are [1, B·H, Tp].

  Grid over (Sp / (2·block_kv), K, B) in launch_grid's order. dq_acc_ref [B, Tp, H, D] f32
  ([B, H, Tp, D] with dq_head_major; a zeroed buffer the kernel adds into, with a leading [2]
  in interpret mode, one slice per WG); dk/dv_ref [B, Sp, K, D]. k/v_scratch [2, block_kv,
  D], q/do_scratch [stages, block_q, D], lse/delta_scratch [stages, block_q], ds_scratch [2,
  block_kv, block_q] (dSᵀ; [2 (step parity), 2, ...] with dq_shared), dq_scratch [2, block_q,
  D or D/2 (dq_shared)] f32, p_scratch [2, block_kv, block_q] (interpret only). Steps run
  over (q block i, query head g) with g minor, starting at the first q block that sees the
  CTA's keys.

  dq_shared: the CTA's two WGs compute one dQ_part over all 2·block_kv keys, each WG the
  product for half of D's columns from both WGs' dSᵀ (FA3's split): half the reduce-add traffic
  and a [block_q, D/2] accumulator, for one 2-WG barrier per step.

  overlap: steps run `_overlapped_step`; dq_scratch is [dq_slots, 2, block_q, D or D/2] and
  step t stages its dQ_part in slot t % dq_slots.

  defer_dq (with dq_shared): step t stores its dSᵀ in ds_scratch [4, 2, block_kv, block_q] slot
  t % 4 and arrives on ds_handoff [2 WGs, 4] at [wg, t % 4], issues dV and dK (dSᵀ from
  registers), then waits for the other WG's dSᵀ of step t - 1 and computes that step's
  dQ_part; the last step's follows the loop. offset: WG 1 waits on `start` until WG 0 has
  formed its first Pᵀ and dSᵀ. defer_dq "inline": as `inline_step` says.

  split_loop (MosaicConfig.fused_split_loop; ignored causal or with a key tail): WG w runs
  its first (w + 1)·G steps in a loop of their own, then the rest.

  early_probs (MosaicConfig.fused_early_probs): a step forms Pᵀ while its dPᵀ runs.

  dq_first (MosaicConfig.fused_dq_first; defer_dq "inline" only): a step issues the previous
  step's dQ_part between dV and dK and reduce-adds it while dK runs. Step 0's dQ_part, of the
  zeroed dSᵀ slot 3, is reduce-added too (zeros, into step 0's rows), so that no branch sits
  among the matmuls.

  static_wg (MosaicConfig.fused_static_wg): the consumer body is traced once per warpgroup,
  its index a constant in each copy.
  """
  bq, bkv, stages, g_size = kp.block_q, kp.block_kv, kp.stages, kp.group
  nq = kp.t_pad // bq
  b = lax.axis_index("b") if entry is None else entry
  out_b = b if entry is None else 0
  wg = lax.axis_index("wg")
  kt, kvh = _tile_and_head(("kt", "kvh"), k_ref.shape[2], kp)
  assert not kp.bwd_head_group, "fused_call launches without head groups"
  cta_k0 = kt * (2 * bkv)
  cta_first = _first_q_block(cta_k0, kp)
  cta_steps = (nq - cta_first) * g_size

  def dq_rows(i, h, *cols):
    """dq_acc_ref's index of q block i of head h (and its columns `cols`)."""
    rows = pl.ds(i * bq, bq)
    return (b, h, rows, *cols) if dq_head_major else (b, rows, h, *cols)

  def index(step):
    i = lax.div(step, g_size)
    if stagger_q:
      # Non-causal: CTA kt starts at q block kt, so CTAs running together reduce into
      # different dQ rows instead of all hitting the same ones.
      i = lax.rem(i + kt, nq)
    return cta_first + i, kvh * g_size + lax.rem(step, g_size)

  streams = ((q_ref, q_scratch, q_ready, q_free), (do_ref, do_scratch, do_ready, do_free),
             (lse_ref, lse_scratch, lse_ready, lse_free),
             (delta_ref, delta_scratch, delta_ready, delta_free))

  def _consumer(wg):
    plgpu.set_max_registers(kp.compute_registers, action="increase")
    k_smem, v_smem, dq_smem = k_scratch.at[wg], v_scratch.at[wg], dq_scratch.at[wg]
    k0 = cta_k0 + wg * bkv
    rows = (b, pl.ds(k0, bkv), kvh)
    _load_kv_tiles(k_ref, v_ref, k_smem, v_smem, kv_ready, wg, rows)

    def shared_dq_terms(ds):
      """dq_shared: this WG's columns of D and its dQ_part's (a, b) products from both WGs'
      dSᵀ tiles ds [2, block_kv, block_q] and K tiles."""
      cols = pl.ds(wg * (kp.d // 2), kp.d // 2)
      # Traced WG indices only: a literal index captured by run_state's body becomes one of
      # its outputs, which the Mosaic lowering rejects.
      return [(ds.at[w].T, k_scratch.at[w, :, cols]) for w in (wg, 1 - wg)], cols

    def dq_plan(t, dq_smem=dq_smem):
      """Where this WG's dQ_part goes (see _gradient_matmuls) and its dq_acc_ref index."""
      i, h = index(t)
      q_rows = dq_rows(i, h)
      if dq_shared:
        terms, cols = shared_dq_terms(ds_scratch.at[lax.rem(t, 2)])
        return [(dq_smem, terms)], dq_rows(i, h, cols)
      ds = ds_scratch.at[wg]
      if dq_blocks == 1:
        return [(dq_smem, [(ds.T, k_smem)])], q_rows
      width = kp.d // dq_blocks
      blocks = [pl.ds(c * width, width) for c in range(dq_blocks)]
      return [(dq_smem.at[:, c], [(ds.T, k_smem.at[:, c])]) for c in blocks], q_rows

    def overlapped_step(t, carry, *, masked: bool):
      dk, dv = carry
      slot = lax.rem(t, stages)
      i, _ = index(t)
      q_smem, do_smem = _wait_streams(streams, slot)
      stats = (functools.partial(_step_stat, streams, slot, 2),
               functools.partial(_step_stat, streams, slot, 3))

      ds_smem = ds_scratch.at[lax.rem(t, 2), wg] if dq_shared else ds_scratch.at[wg]
      dq_smem = dq_scratch.at[lax.rem(t, dq_slots), wg]
      [(out, terms)], dst = dq_plan(t, dq_smem)

      def sync_ds():
        if dq_shared:  # as in `step`
          _common.sync(ds_ready)

      def reduce_dq(dq):
        if not kp.interpret:
          # The reduction that last read this slot was issued dq_slots steps ago; with 2 slots
          # the previous step's may still be reading the other one.
          plgpu.wait_smem_to_gmem(dq_slots - 1, wait_read_only=True)
        out[...] = dq
        _reduce_dq(out, dq_acc_ref, dst, wg, _at(dq_loaded, wg), kp)

      hooks = (sync_ds, reduce_dq, lambda: plgpu.barrier_arrive(do_free.at[slot]),
               lambda: plgpu.barrier_arrive(q_free.at[slot]))
      dv, dk = _overlapped_step(dv, dk, (k_smem, v_smem, q_smem, do_smem), stats, ds_smem,
                                terms, out.shape, k0, (lambda: i) if masked else None, hooks,
                                _at(p_scratch, wg), kp)
      return dk, dv

    def wait_dq_staging():
      """Waits until the previous step's reduce-add has finished reading dq_smem; a step of
      matmuls has run since it was issued, so this rarely waits. (The interpreter's reduction
      is synchronous.)"""
      if not kp.interpret:
        with jax.named_scope("wait_reduce"):
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def deferred_dq(t):
      """dQ_part of step t: both WGs' dSᵀ of it times their K, this WG's half of D's
      columns, reduce-added into its q rows."""
      ds_slot = lax.rem(t, 4)
      with jax.named_scope("sync_ds"):
        plgpu.barrier_wait(ds_handoff.at[1 - wg, ds_slot])
      i, h = index(t)
      terms, cols = shared_dq_terms(ds_scratch.at[ds_slot])
      wait_dq_staging()
      with jax.named_scope("dq_mm"):
        _dq_part(dq_smem, terms)
      with jax.named_scope("reduce_dq"):
        _reduce_dq(dq_smem, dq_acc_ref, dq_rows(i, h, cols), wg,
                   _at(dq_loaded, wg), kp)

    def deferred_tiles(t, *, masked: bool, release: bool):
      """A deferred step's first half: (ring slot, Q, dO, Pᵀ f32, dSᵀ in kp.dtype, dSᵀ's SMEM
      slot); this WG's dSᵀ is stored in slot t % 4 and handed to the other WG (release: WG 0
      releases WG 1 once it has Pᵀ and dSᵀ, the offset form's first step)."""
      slot = lax.rem(t, stages)
      i, _ = index(t)
      q_smem, do_smem = _wait_streams(streams, slot)
      p_t, ds_t = _transposed_grad_tiles(k_smem, v_smem, q_smem, do_smem, streams, slot, k0,
                                         (lambda: i) if masked else None, kp,
                                         early_probs=early_probs)
      if release:
        pl.when(wg == 0)(lambda: plgpu.barrier_arrive(start))
      ds_slot = lax.rem(t, 4)
      ds16, ds_smem = ds_t.astype(kp.dtype), ds_scratch.at[ds_slot, wg]
      with jax.named_scope("ds_store"):
        ds_smem[...] = ds16
        plgpu.commit_smem()
      plgpu.barrier_arrive(ds_handoff.at[wg, ds_slot])
      return slot, q_smem, do_smem, p_t, ds16, ds_smem

    def inline_step(t, carry, *, masked: bool, release: bool):
      """defer_dq "inline": dV, dK and the previous step's dQ_part in one accumulator scope,
      the wait for the other WG's dSᵀ between them (step 0's dQ_part reads the slot the
      pre-arrival released and is not reduced)."""
      dk, dv = carry
      slot, q_smem, do_smem, p_t, _, ds_smem = deferred_tiles(t, masked=masked,
                                                               release=release)
      prev_slot = lax.rem(t + 3, 4)
      p16 = p_t.astype(kp.dtype)
      prev_i, prev_h = index(jnp.maximum(t - 1, 0))
      terms, cols = shared_dq_terms(ds_scratch.at[prev_slot])
      wait_dq_staging()

      def reduce_prev():
        _reduce_dq(dq_smem, dq_acc_ref, dq_rows(prev_i, prev_h, cols), wg, _at(dq_loaded, wg),
                   kp)

      with jax.named_scope("grad_mm"):
        dv, dk = _gradient_matmuls(
            dv, dk, p16, ds_smem, q_smem, do_smem, [(dq_smem, terms)], _at(p_scratch, wg),
            lambda: plgpu.barrier_arrive(do_free.at[slot]),
            lambda: plgpu.barrier_arrive(q_free.at[slot]), kp,
            before_dq=lambda: plgpu.barrier_wait(ds_handoff.at[1 - wg, prev_slot]),
            reduce_dq=reduce_prev if dq_first else None)
      if not dq_first:
        with jax.named_scope("reduce_dq"):
          pl.when(t > 0)(reduce_prev)
      return dk, dv

    def deferred_step(t, carry, *, masked: bool, release: bool):
      dk, dv = carry
      slot, q_smem, do_smem, p_t, ds16, _ = deferred_tiles(t, masked=masked, release=release)
      dk, dv = _dk_dv_updates(dk, dv, p_t, ds16, q_smem, do_smem, _at(p_scratch, wg),
                              (do_free.at[slot], q_free.at[slot]), kp)
      pl.when(t > 0)(lambda: deferred_dq(t - 1))
      return dk, dv

    def step(t, carry, *, masked: bool, release: bool = False):
      if defer_dq == "inline":
        return inline_step(t, carry, masked=masked, release=release)
      if defer_dq:
        return deferred_step(t, carry, masked=masked, release=release)
      if overlap:
        return overlapped_step(t, carry, masked=masked)
      dk, dv = carry
      slot = lax.rem(t, stages)
      i, _ = index(t)
      q_smem, do_smem = _wait_streams(streams, slot)
      p_t, ds_t = _transposed_grad_tiles(k_smem, v_smem, q_smem, do_smem, streams, slot, k0,
                                         (lambda: i) if masked else None, kp,
                                         early_probs=early_probs)
      # dSᵀ in SMEM serves both dK (as is) and dQ (its transposed view); wgmma reads it through
      # the async proxy, hence the fence.
      ds_smem = ds_scratch.at[lax.rem(t, 2), wg] if dq_shared else ds_scratch.at[wg]
      with jax.named_scope("ds_store"):
        ds_smem[...] = ds_t.astype(kp.dtype)
        plgpu.commit_smem()
      if dq_shared:
        # Both dSᵀ tiles are needed. The double buffer (by step parity) makes this the only
        # barrier: a WG overwrites a parity slot two steps later, after this barrier of the
        # step in between has seen the other WG finish reading it.
        with jax.named_scope("sync_ds"):
          _common.sync(ds_ready)
      wait_dq_staging()
      plan, dst = dq_plan(t)
      with jax.named_scope("grad_mm"):
        dv, dk = _gradient_matmuls(
            dv, dk, p_t.astype(kp.dtype), ds_smem, q_smem, do_smem, plan, _at(p_scratch, wg),
            lambda: plgpu.barrier_arrive(do_free.at[slot]),
            lambda: plgpu.barrier_arrive(q_free.at[slot]), kp)
      with jax.named_scope("reduce_dq"):
        _reduce_dq(dq_smem, dq_acc_ref, dst, wg, _at(dq_loaded, wg), kp)
      return dk, dv

    zeros = plgpu.layout_cast(jnp.zeros((bkv, kp.d), jnp.float32), plgpu.Layout.WGMMA)
    carry = (zeros, zeros)
    # Causal: q blocks before `first` do not see these keys, blocks in [first, full) cross the
    # diagonal and are masked, blocks from `full` on see every key of the tile. With dq_shared
    # both WGs run every CTA step (the other WG needs this one's dSᵀ), the ones before `first`
    # masked to zero.
    if dq_shared:
      first = jnp.zeros((), jnp.int32)
    else:
      first = (_first_q_block(k0, kp) - cta_first) * g_size
      lax.fori_loop(0, first, functools.partial(_skip_step, streams=streams, stages=stages),
                    None)
    full = first
    if kp.causal:
      full = _first_unmasked_step(k0, cta_first, kp)
    if kp.kv_tail:
      # Padded keys are zero, so their dQ_part terms vanish, unless exp2(0 − lse2) overflows
      # (rows whose scores are all far below 0): the tile holding the tail masks every step.
      full = jnp.where(k0 + bkv > kp.kv_len, cta_steps, full)
    if defer_dq == "inline":
      if dq_first:  # step 0 reduce-adds its dQ_part of slot 3: zeros
        ds_scratch.at[3, wg][...] = plgpu.layout_cast(jnp.zeros((bkv, bq), kp.dtype),
                                                      plgpu.Layout.WGMMA)
        plgpu.commit_smem()
      # Step 0's dQ_part (unreduced, or zeros) waits for the other WG's "step -1", slot 3.
      pl.when(cta_steps > 0)(lambda: plgpu.barrier_arrive(ds_handoff.at[wg, 3]))
    if offset:
      pl.when((wg == 1) & (cta_steps > 0))(lambda: plgpu.barrier_wait(start))
      # WG 0 releases WG 1 from a loop of its own over the first step (masked if any step
      # may be), so that the main loops hold no branch: a conditional arrive inside them made
      # ptxas serialise every wgmma of the inline form (C7512).
      peeled = jnp.minimum(first + 1, cta_steps)
      carry = lax.fori_loop(first, peeled, functools.partial(step, masked=kp.needs_mask,
                                                             release=True), carry)
      first, full = peeled, jnp.maximum(full, peeled)
    if split_loop and not (kp.causal or kp.kv_tail):
      # Same steps; only the code ptxas makes of the main loop changes (MosaicConfig says).
      lead = jnp.minimum(first + (wg + 1) * g_size, cta_steps)
      carry = lax.fori_loop(first, lead, functools.partial(step, masked=False), carry)
      first = lead
    if kp.needs_mask:
      carry = lax.fori_loop(first, full, functools.partial(step, masked=True), carry)
      first = full
    dk, dv = lax.fori_loop(first, cta_steps, functools.partial(step, masked=False), carry)
    if defer_dq:
      pl.when(cta_steps > 0)(lambda: deferred_dq(cta_steps - 1))
    if dq_shared:
      # The other WG's last dQ matmul reads this WG's K tile, about to be overwritten.
      _common.sync(kv_done)
    # Also the last dQ reduction.
    _store_dk_dv(dk, dv, k_smem, v_smem, dk_ref, dv_ref, (out_b, *rows[1:]), kp)

  if static_wg:
    # `wg * 0 + w`, not `w`: a literal ref index closed over by run_state's body becomes one
    # of its outputs, which the lowering rejects; MLIR folds this one to the constant.
    for w in range(2):
      pl.when(wg == w)(functools.partial(_consumer, wg * 0 + w))
  else:
    pl.when(wg < 2)(functools.partial(_consumer, wg))

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(kp.producer_registers, action="decrease")
    _produce_query_streams(cta_steps, stages, streams, index, b, bq, kp)


def fused_call(q, k, v, do, lse2, delta, *, kp: _common.KernelParams, stagger_q: bool = False,
               dq_blocks: int = 1, dq_shared: bool = False, overlap: bool = False,
               dq_slots: int = 1, defer_dq: bool | str = False, offset: bool = False,
               auto_barriers: bool = True, dq_head_major: bool = False,
               batch_slowest: bool = False, per_batch_entry: bool = False,
               split_loop: bool = False, early_probs: bool = False, dq_first: bool = False,
               static_wg: bool = False):
  """q/do [B, T', H, D], k/v [B, S', K, D] (T', S' padded as _common.operand_rows says, the
  tiles covering kp.t_pad / kp.s_pad rows), lse2/delta [B, H, Tp] -> (dq_acc [B, T', H, D] f32
  unscaled ([B, H, T', D] with dq_head_major), dk [B, S', K, D] scaled, dv [B, S', K, D]).

  per_batch_entry: one launch per batch entry (the entry static in the kernel), each adding into
  the one dQ buffer and returning its entry's dK / dV, concatenated. kp.flat_stats: the kernel
  reads lse2 / delta as [1, B·H, Tp] (2-D TMA loads at any batch).

  auto_barriers False (MosaicConfig.fused_auto_barriers; ignored when interpreting, whose dQ
  read-modify-write needs them) compiles without Pallas' barriers around shared-memory stores.
  No thread reads shared memory that a thread wrote; the stores' hazards are ordered by:
  dSᵀ (read by wgmma only): its slot's last readers, the wgmmas of two steps before, retired
  before this WG's wait and before the other WG's arrival on the step between; commit_smem's
  fence and barrier publish it. The dQ_part staging (read by TMA only): the wait for the last
  reduction's reads ends in a warpgroup barrier (Mosaic's await_async_copy); _reduce_dq's
  commit_smem publishes it. The dK / dV tiles at the end: written after the last matmuls
  that read them (with dq_shared both WGs': the kv_done sync), published by commit_smem."""
  bsz, _, kh, d = k.shape
  s_pad = kp.s_pad
  bq, bkv = kp.block_q, kp.block_kv
  # MosaicConfig.bwd_head_group is not applied here: with fused_dq_shared, causal, the grouped
  # launch deadlocked in the Mosaic GPU interpreter (two warpgroups in a barrier wait), even
  # with one head per group, whose grid and (kt, kvh) values equal the tiles-fastest order's:
  # taking them from axis_index directly ran, computing the same kvh as group + rem(flat, 1)
  # hung (kt as div(flat, 1) ran). That was before the suite set _common.INTERPRET_XLA_FLAG,
  # the cause of the interpreter's other such deadlocks (not retried), so the fused kernel
  # keeps the plain heads-fastest (or tiles-fastest) order.
  kp = dataclasses.replace(kp, bwd_head_group=0)
  tiles = _common.smem_transforms(kp.dtype)
  scratch = [
      *kv_stream_smem(kp, d),
      plgpu.SMEM(((ds_slots(dq_shared, defer_dq),) if dq_shared else ()) + (2, bkv, bq),
                 kp.dtype, transforms=tiles),
      plgpu.SMEM(((dq_slots,) if overlap else ()) + (2, bq, d // 2 if dq_shared else d),
                 jnp.float32, transforms=_common.smem_transforms(jnp.float32)),
      plgpu.SMEM((2, bkv, bq), kp.dtype, transforms=tiles) if kp.interpret else None,
      *kv_stream_barriers(kp),
      plgpu.Barrier(num_barriers=2) if kp.interpret else None,
      plgpu.Barrier(num_arrivals=2) if dq_shared else None,
      plgpu.Barrier(num_arrivals=2) if dq_shared else None,
      plgpu.Barrier(num_barriers=(2, 4)) if defer_dq else None,
      plgpu.Barrier() if offset else None,
  ]
  # The kernel only adds: the zeros come from XLA (a memset) and reach the kernel as a mutable
  # input, aliased to the result. Their scalar passes through an optimization barrier with dO:
  # constant zeros have no operands, and XLA fused the memsets of a whole model's backward
  # into one at its start, all the buffers live at once (12 layers at 2x16384x8x128: +1.4 GiB).
  acc_shape = (bsz, q.shape[2], q.shape[1], d) if dq_head_major else q.shape
  zero, _ = lax.optimization_barrier((jnp.zeros((), jnp.float32), do))
  dq_acc = jax.new_ref(jnp.broadcast_to(zero, ((2,) if kp.interpret else ()) + acc_shape))

  stats = (kp.stats_view(lse2), kp.stats_view(delta))

  def launch(entry):
    rows = k.shape if entry is None else (1, *k.shape[1:])
    kv_out = jax.ShapeDtypeStruct(rows, k.dtype)
    return plgpu.kernel(
        functools.partial(_bwd_fused_kernel, kp=kp, stagger_q=stagger_q, dq_blocks=dq_blocks,
                          dq_shared=dq_shared, overlap=overlap, dq_slots=dq_slots,
                          defer_dq=defer_dq, offset=offset and defer_dq,
                          dq_head_major=dq_head_major, split_loop=split_loop,
                          early_probs=early_probs, dq_first=dq_first and defer_dq == "inline",
                          static_wg=static_wg, entry=entry),
        out_type=(kv_out, kv_out),
        scratch_types=scratch,
        **_common.launch_grid(s_pad // (2 * bkv), kh, bsz if entry is None else 1,
                              ("kt", "kvh", "b"), heads_fastest=kp.bwd_heads_fastest,
                              batch_slowest=batch_slowest),
        num_threads=3, thread_name="wg",
        compiler_params=_common.compiler_params(kp, min(profile_steps(kp), PROFILE_STEPS),
                                                auto_barriers=auto_barriers or kp.interpret),
        interpret=_common.interpret_params(kp.interpret),
    )(q, k, v, do, *stats, dq_acc)

  if per_batch_entry and bsz > 1:
    parts = [launch(entry) for entry in range(bsz)]
    dk, dv = (jnp.concatenate(grads, axis=0) for grads in zip(*parts))
  else:
    dk, dv = launch(None)
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
  kp = _common.KernelParams.make(
      q, k, params=params, block_q=bq, block_kv=bkv,
      stages=min(config.fused_stages, t_pad // bq), t_pad=t_pad, s_pad=s_pad, kv_len=s,
      config=config, q_tile_rows=bq)
  # Operands padded only to TMA's 8-row tile (the split backward's rule): the producer's first
  # `stages` q blocks load at static offsets, the K/V tiles at dynamic ones.
  t_in = _common.operand_rows(t, t_pad, config.interpret, kp.stages * bq)
  s_in = _common.operand_rows(s, s_pad, config.interpret, 0)
  qp, dop = _tiling.pad_axis(q, 1, t_in), _tiling.pad_axis(do, 1, t_in)
  kpad, vpad = _tiling.pad_axis(k, 1, s_in), _tiling.pad_axis(v, 1, s_in)
  # lse in log2 units so that P = exp2(S·c − lse2); padded rows get +inf (P = 0, so their dS,
  # dQ_part rows and contributions to dK/dV are 0).
  lse2 = _tiling.pad_axis(lse * LOG2E, 2, t_pad, jnp.inf)
  delta = _tiling.pad_axis(delta, 2, t_pad)
  dq_acc, dk, dv = fused_call(qp, kpad, vpad, dop, lse2, delta, kp=kp,
                              stagger_q=config.fused_stagger_q and not params.is_causal,
                              dq_blocks=config.fused_dq_blocks,
                              dq_shared=config.fused_dq_shared,
                              overlap=config.fused_overlap,
                              dq_slots=dq_slots(q.shape[3], config, jnp.dtype(q.dtype).itemsize),
                              defer_dq=("inline" if config.fused_defer_inline
                                        else config.fused_defer_dq),
                              offset=config.fused_offset,
                              auto_barriers=config.fused_auto_barriers,
                              dq_head_major=config.fused_dq_head_major,
                              batch_slowest=config.fused_batch_slowest,
                              per_batch_entry=config.fused_per_batch_entry,
                              split_loop=config.fused_split_loop,
                              early_probs=config.fused_early_probs,
                              dq_first=config.fused_dq_first,
                              static_wg=config.fused_static_wg)
  if config.fused_dq_head_major:
    dq_acc = dq_acc.transpose(0, 2, 1, 3)
  dq = (dq_acc[:, :t] * params.scale).astype(q.dtype)
  return dq, dk[:, :s], dv[:, :s]
