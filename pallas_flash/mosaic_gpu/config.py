"""MosaicConfig and the per-(head_dim, causal) tuning table of the Hopper kernels."""

from __future__ import annotations

import dataclasses

from pallas_flash.call import AttentionParams, CallInfo

# Shared memory per CTA on H100/H200 (227 KiB), enforced again by the Mosaic lowering.
SMEM_LIMIT_BYTES = 232_448


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicConfig:
  """Static tuning knobs of the Mosaic GPU (sm_90) kernels.

  Forward: a CTA has 2 consumer warpgroups of `block_q` query rows each plus one TMA producer
  warpgroup streaming `block_kv`-row K/V tiles through a `num_stages`-slot shared-memory ring.
  Backward: a dQ kernel (2 WGs x `block_q_dq` rows, K/V streamed in `block_kv_dq` tiles) and a
  dK/dV kernel (2 WGs x `block_kv_dkv` rows, Q/dO streamed in `block_q_dkv` tiles, all G query
  heads of a kv head reduced in-kernel).

  Attributes:
    heads_fastest: forward launch order (after the batch entries, which always vary fastest;
      _common.launch_grid). False: consecutive CTAs take consecutive q tiles of one head (causal
      tiles heaviest first), so the CTAs running together share one head's K/V. True:
      they take the same q tile of consecutive heads. False measured 4-8 % faster non-causal
      on the H200 (623 vs 577 TFLOP/s at 4x4096x16x128) and 2-7 % faster causal and
      non-causal at 16K-32K (eighth session). Before the eighth session the two values
      selected each other's grid (the grid's last axis, not its first, varies fastest), so
      earlier notes that credit "heads fastest" with these gains mean this order.
    fwd_intra_wg_overlap: forward, FA3's intra-warpgroup 2-stage pipelining: each consumer WG
      issues S_{j+1} = Q·K_{j+1}ᵀ together with O += P_j·V_j and runs the softmax of S_{j+1}
      while P_j·V_j is still on the tensor cores (the ping-pong between the two WGs is kept).
      Holds S, P and O of two steps in registers, so unless compute_registers /
      producer_registers are changed from their defaults the forward then runs at FA3's 240 / 24
      split. On in the head_dim 128 table (+2-3 % at 4K and 16K, level at 4K causal); slower at
      head_dim 64 (390 vs 434 TFLOP/s at 4x4096x32x64).
    fwd_q_registers: forward with fwd_intra_wg_overlap: each consumer warpgroup loads its Q
      tile into registers once per tile (32 registers per thread at 64 x 128) and issues
      S = Q·Kᵀ with Q as the register operand, so the tensor cores read only K from shared
      memory (per step at head_dim 128, 64 x 128 tiles: 80 instead of 96 KiB of operand reads
      per warpgroup, beside the 64 KiB of K/V that TMA writes per CTA). Same products, same
      order: bitwise equal outputs. On at head_dim 128 with 128-key tiles: causal, and the
      persistent non-causal kernel up to MEDIUM_KV_LEN keys (`tuned`); with the long
      non-causal default's 192-key tiles it does not fit (C7512). (Eighteenth session, run1,
      fwd TFLOP/s, same run as cuDNN, bitwise equal: 4x4096x16x128 583 -> 592, causal 523 ->
      522, 1x16384x16x128 597 -> 603, causal 589 -> 599, 1x32768x16x128 607 -> 612, causal
      602 -> 606, 2x16384x8x128 with 4 kv heads 592 -> 601, causal 589 -> 600; 128-key
      tiles everywhere then.) Ignored by the plain loop, where ptxas miscompiles it
      (forward._q_operand), and in interpret mode (no register-operand wgmma there).
    fwd_persistent: forward, non-causal: one CTA per SM loops over the (q tile, head, batch)
      tiles instead of one CTA per tile; the K/V ring runs on across tiles and Q is
      double-buffered, so the next tile's loads overlap the current tile's last steps and
      epilogue. Needs room for the second Q buffer (not at head_dim 256, where it is ignored);
      causal calls always run one CTA per tile (their launch order balances the SMs).
      The default for non-causal calls with at most SHORT_KV_LEN keys (`tuned`): +12 % at
      16x1024x16x128, +7 % at head_dim 64, level at 4K, 5-6 % slower at 16K-32K (H200).
      With heads_fastest=False (q tiles fastest) and the intra-WG overlap, +5 % at
      4x4096x16x128 and 6 % behind the grid at 16K; the default of head-dim-128 calls up to
      MEDIUM_KV_LEN keys (thirty-second session: +1.7-3.4 % over the plain loop at 2K, level
      at 1K); head dim 64's plain-loop default up to SHORT_KV_LEN runs heads fastest (`tuned`).
      The persistent kernel computes its tile order itself, so its heads_fastest always meant
      what it says.
    bwd_heads_fastest: the backward kernels' launch order, as heads_fastest is the forward's.
      False: consecutive CTAs take consecutive q tiles (dQ kernel) or kv tiles (dK/dV and fused
      kernels) of one head, and the causal dQ kernel launches its heaviest q tiles (the last
      ones) first, an LPT order (the dK/dV kernel's causal tiles are heaviest first anyway).
      True: the same tile of consecutive heads. Same products in the same order per tile
      (bitwise equal gradients, checked on the H200). Measured (sixth session, run4, fwd+bwd
      TFLOP/s, same run, True -> False): 4x4096x16x128 453 -> 492, causal 408 -> 449,
      1x16384x16x128 502 -> 515, causal 471 -> 507, so False is the default. (Until the eighth
      session the two values selected each other's grid, see heads_fastest; the sixth
      session's notes call this order "heads fastest".)
    bwd_head_group: split backward, with bwd_heads_fastest=True: heads fastest within groups
      of this many heads (query heads for the dQ kernel, kv heads for the dK/dV kernel), which
      take all their tiles before the next group starts, so the CTAs running together stream
      the K/V or Q/dO of G heads only. 0, or a G that does not divide the head count, means all
      heads. The fused kernel ignores it (backward_fused.fused_call says why). Unmeasured in
      this form: the seventh session's "2-4 % slower" runs launched, through the grid mix-up
      above, every group's first tile before any second tile (heads fastest, permuted).
    persistent_ctas: CTAs of the persistent forward; 0 = the GPU's SM count (132 on H100 SXM
      and H200). Tests set it to exercise several tiles per CTA.
    fwd_split_tail: forward, non-causal, one CTA per tile (not persistent, no segment ids):
      the tiles of the last, partly filled wave are split along the keys. With N tiles and W
      CTAs per wave, the first N - (N mod W) tiles in launch order run one CTA each; each of
      the N mod W others runs as `parts` CTAs that stream consecutive shares of its key blocks
      and write a float32 partial (o, lse), merged by XLA afterwards (forward.combine_tail).
      At 1x16384x16x128 (2048 tiles = 15.5 waves of 132) the last half wave otherwise leaves
      half the SMs idle for one tile's time (~3 %, eleventh session: 33 heads ran 3 % faster
      per FLOP than 32). Needs room for a [2, block_q, D] float32 staging tile (not at head_dim
      256 with 2 stages, nor beside 192-key tiles at 128; ignored there). On in the head_dim
      64 non-causal table; head_dim 128's 192-key tiles gain more than it did.
    bwd_split_tail: the split backward's kernels named here ("dq", "dkdv", or "dq,dkdv"; ""
      none), non-causal, no segment ids: the same split of each kernel's last wave
      (split_tail.py), along its streamed axis: a
      dQ tile's parts stream shares of its key blocks, a dK/dV tile's equal shares of its
      (q block, query head) steps (the parts divide them, so that its loops have static
      lengths), and each stores its float32 partial gradient straight from
      registers (the dQ kernel has no shared memory left for a staging tile); XLA sums the
      parts. Deterministic (a fixed order), but not bitwise the unsplit kernels' sums.
      Off in every tuned config: on the H200 (thirteenth session, fwd+bwd) "dq" moved
      -0.9 % to +1.0 %, within noise, and "dq,dkdv" -2.6 % to +1.6 %, when the split
      dK/dV kernel still reloaded 11 spilled words per step at 240 registers (1 since the
      fourteenth session).
    tail_parts: fwd_split_tail / bwd_split_tail: CTAs per tail tile of every split kernel; 0 =
      `split_tail.tail_parts`' choice per kernel (the cheapest in its cost model: rounds of
      parts, plus fixed costs per part and merge).
    wave_ctas: fwd_split_tail / bwd_split_tail: CTAs per wave they plan for; 0 = the GPU's SM
      count (each of these kernels runs one CTA per SM). Tests set it to split small grids.
    fused_backward: backward algorithm. True: one FlashAttention-3 style kernel per kv tile
      (backward_fused.py: 5 tile matmuls per tile pair instead of 7, dK/dV in registers, dQ
      summed into a float32 buffer by TMA reduce-add), so dQ is not bitwise reproducible run to
      run (the order of the float32 atomics varies). False: the two-kernel split (dQ kernel,
      then dK/dV kernel), bitwise deterministic. Falls back to the split, with a warning, where
      `backward_fused.unsupported_reason` says the fused kernel cannot run.
    block_q_fused, block_kv_fused, fused_stages: the fused backward's query tile (streamed),
      key rows per consumer warpgroup (a CTA holds 2 x block_kv_fused keys) and Q/dO ring depth.
      At head_dim 128, 64/64 with 2 stages uses ~210 KiB of shared memory (3 stages fit only
      with fused_dq_shared: ~226 KiB).
    fused_stagger_q: fused backward, non-causal only: kv tile kt visits q blocks starting at
      kt (mod the count) rather than all at block 0, spreading the dQ reductions of CTAs that
      run together over different rows (a contention hypothesis; measured no faster, sixth
      session: 443 vs 449 TFLOP/s fwd+bwd at 4x4096x16x128, 497 vs 497 at 16K).
    fused_dq_blocks: fused backward: dQ_part = dS·K in this many column blocks of
      head_dim / fused_dq_blocks (a multiple of 64). 1 issues it with dV and dK back to back
      (dK, dV and dQ_part accumulators all live: ~208 registers per thread at head_dim 128);
      2 keeps one half live at a time (~176) at the cost of a wait between the halves.
    fused_dq_shared: fused backward, head_dim a multiple of 128: the two consumer WGs share
      one dQ_part over the CTA's 2 x block_kv_fused keys, each computing D/2 of its columns
      from both WGs' dSᵀ (FA3's split). Halves the dQ reduce-add traffic and the dQ_part
      registers (~32 per thread at head_dim 128) for one 2-WG barrier per step; causal CTAs
      run their later WG through the earlier WG's extra (masked, zero) steps.
    fused_overlap: fused backward, fused_dq_blocks 1: overlap within each consumer warpgroup
      as FA3 does. Pᵀ is computed while dPᵀ = V·dOᵀ is still running, dV += Pᵀ·dO runs while
      dSᵀ is computed, dQ_part and dK += dSᵀ·Q are issued back to back (dQ_part is stored
      while dK runs), and the dQ staging buffer is double-buffered so that a step's TMA
      reduce-add overlaps the next step. At head_dim 128 only fused_dq_shared with 2 stages
      has room for the second dQ slot (~226 KiB of shared memory); other configurations keep
      one slot and get only the matmul overlap.
    fused_defer_dq: fused backward with fused_dq_shared, not fused_overlap: step t issues
      dQ_part of step t-1, so a warpgroup waits for the other's dSᵀ of the step before, not of
      the current one, and the two may run up to a step apart instead of meeting at a barrier
      every step (the seventh session's profile found their elementwise phases coinciding).
      dSᵀ gets 4 slots per warpgroup (~226 KiB of shared memory at head_dim 128).
    fused_defer_inline: with fused_defer_dq: dV, dK and the previous step's dQ_part are issued
      in one accumulator scope, with the wait for the other WG's dSᵀ between them (the plain
      form waits for dV and dK to retire before issuing dQ_part; step 0 then computes an
      unreduced dQ_part instead of a branch).
    fused_offset: with fused_defer_dq: warpgroup 1 starts once warpgroup 0 has its first
      Sᵀ and dPᵀ, so that one's elementwise work runs while the other's matmuls do.
    fused_auto_barriers: fused backward on the GPU: False drops the warpgroup barriers Pallas
      puts before and after every shared-memory store (4 of the 7 per step at head_dim 128,
      around the dSᵀ and dQ_part staging stores); the fences and barriers the kernel issues
      itself order what needs ordering (backward_fused.fused_call says why).
    fused_dq_head_major: fused backward: its float32 dQ accumulator is [B, H, T, D] (a
      q tile's reduce-add one contiguous block) instead of [B, T, H, D] (rows H·D·4 bytes
      apart), transposed when it is scaled and cast.
    fused_batch_slowest: fused backward: launch one batch entry's CTAs after the other's
      (bwd_heads_fastest's order within each) instead of the entries of one (tile, head)
      consecutively. Twenty-fourth session, run1, 2x16384x8x128 causal fwd+bwd TFLOP/s, same
      process: 477.2 plain, 481.0 head-major, 473.9 batch-slowest, 493.0 both (split 513.7);
      at 1x16384x16x128 causal 522.7 / 527.7 / 531.9 / 532.7 (batch_slowest a no-op there).
    fused_per_batch_entry: fused backward: one kernel launch per batch entry, each adding into
      the one dQ buffer. Twenty-fourth session (scripts/bwd_probe.py, causal, the backward
      alone): a launch over batch 2 took 6.03 ms at 2x16384x8x128 and 6.31 ms with 4 kv heads,
      two batch-1 calls 5.50 and 5.47 (the split: 5.67, 5.70). The cause was the 3-D loads of
      lse and delta (bwd_flat_stats): one launch over the batch is now the faster form.
    fused_split_loop: fused backward, non-causal calls without a key tail (elsewhere ignored):
      warpgroup w runs its first (w + 1)·G steps (its first q block's G query heads, and WG 1
      its second's) in a loop of their own, then the rest. Same steps in the same order; what
      changes is the code ptxas makes of the main loop. Twenty-sixth session, the backward alone
      at 1x16384x16x128 non-causal (scripts/bwd_probe.py, runs 5 and 8): 10.45 and 10.33 ms
      against 12.31 and 12.30 without it (the split 11.01 and 11.25); fwd+bwd in
      FUSED_NONCAUSAL's comment. Measured as a "skew" (those steps masked, as a causal CTA's
      diagonal masks them) whose mask compiled away: the SASS of this form is identical to
      that build's. Deviceless, the single loop reloads 6-9 spilled values (mostly 64-bit
      pairs) between a step's Q / dO waits and its first wgmma, the split loop's main loop 0-1
      (1x16384x16x128; 2x16384x8x128 with 4 kv heads); beside ~227 KiB of shared memory the
      L1 keeps little of the spill space, so that is the likely cause (not established).
      With a mask that stays (a WGMMA-layout iota against the key length), those and other
      first steps masked ran 12.8-13.6 ms (run 7).
    fused_early_probs: fused backward: a step waits for Sᵀ alone and forms Pᵀ while dPᵀ is
      still on the tensor cores, then waits for dPᵀ (the dK/dV kernel's "overlap" order for its
      first two products), and loads delta only then. Same arithmetic; fewer spills in the main
      loop (deviceless). Part of the fused defaults (FUSED_LONG_CAUSAL, FUSED_NONCAUSAL, whose
      comments have the measurements).
    fused_dq_first: fused backward with fused_defer_inline: a step issues the previous step's
      dQ_part between dV and dK (FA3's order) and stores and reduce-adds it while dK is still
      on the tensor cores, instead of waiting for all three first. Same sums. Not faster:
      twenty-eighth session (run 1, config_ab, fwd+bwd TFLOP/s, default / with it / with it
      and fused_early_probs): 4x4096x16x128 509.2 / 490.7 / 507.7, 1x16384x16x128 546.7 /
      530.1 / 548.7, 2x16384x8x128 with 4 kv heads (the early Pᵀ in all three there) 554.1 /
      552.9 / 550.9;
      causal 1x16384x16x128 527.8 / 534.7, 2x16384x8x128 with 4 kv heads 532.8 / 519.7.
    fused_static_wg: fused backward: each consumer warpgroup runs its own copy of the
      kernel body, in which its index is a constant (the body is traced once per warpgroup), so
      that its shared-memory addresses and key offsets are too. Same steps and sums. Deviceless
      SASS (compute_registers 240, FUSED_NONCAUSAL without the early Pᵀ at 4x4096x16x128 and
      1x16384x16x128): 92 / 128 spilled bytes stored / loaded and none in the main loops,
      against 356 / 388 and 4 / 22 spill instructions per step with one body for both
      (with fused_early_probs at 2x16384x8x128, 4 kv heads: 16 / 16 and none, against 292 /
      320 and 7 / 17; FUSED_LONG_CAUSAL's at 1x16384x16x128: 200 / 176, against 436 / 452).
      Part of the fused defaults (FUSED_LONG_CAUSAL, FUSED_NONCAUSAL, whose comments have the
      measurements).
    bwd_flat_stats: the dK/dV-style kernels (the split's, head dim 256's, the fused one) read
      lse and delta ([B, H, T] float32, one block_q slice each step) as a [1, B·H, T] view, so
      that their TMA loads are 2-D at any batch (3-D otherwise from batch 2; at batch 1 the
      unit dimension is dropped either way). Twenty-fifth session, the fused backward alone
      (scripts/bwd_probe.py, causal, ms): 2x16384x8x128 with 4 kv heads 5.27 flat against
      6.42 with 3-D loads (the split 5.51), 2x16384x8x128 5.34 against 6.15 (split 5.69). The
      split's kernels gave bitwise the same gradients either way and ran level (5.84 / 5.81
      ms at 2x16384x8x128 with 4 kv heads causal, 11.12 / 11.38 non-causal).
    dkdv_schedule: the split backward's dK/dV kernel, per (q block, query head) step of a
      warpgroup. "serial": Sᵀ and dPᵀ, wait; Pᵀ, dSᵀ; dV += Pᵀ·dO, wait; dK += dSᵀ·Q, wait.
      "batched": dV and dK issued back to back with one wait (dO released as soon as dV
      retired). Both sum in the same order (bitwise equal gradients, checked on the H200).
      "overlap" (tokamax's and FA3's order): Sᵀ and dPᵀ issued together, Pᵀ formed while dPᵀ
      runs, dV issued, dSᵀ formed while dV runs, then dK; same order of sums (bitwise equal
      gradients, checked on the H200); interpret mode runs it as "serial". Its unmasked steps
      need 240/24 registers to compile without spills. The head_dim 128 default at 240/24
      since the sixth session (0-2 % over "batched", TUNED); "batched" was +1-2 % over
      "serial" at 4K-32K (fourth and fifth sessions); at head_dim 64 "batched" was 1.4 %
      slower, so head_dim 64 stays "serial". Issuing the
      next step's Sᵀ and dPᵀ behind dV and dK (with or without forming Pᵀ while they run)
      was tried and dropped: ptxas serialises every wgmma for lack of registers (C7512) at 232
      and at 240 (docs/mosaic.md).
    dkdv_pingpong: the split backward's dK/dV kernel: a two-warpgroup schedule barrier makes
      the consumers alternate as in the forward (FA3's ping-pong): one WG's Pᵀ/dSᵀ
      elementwise work runs while the other WG's matmuls occupy the tensor cores. Without it
      both WGs read the same Q/dO ring slot each step and tend to run in phase, so the tensor
      cores idle during both elementwise phases. Same summation order (bitwise equal
      gradients, checked on the H200). Measured slower, so off: the dK/dV kernel alone took
      2.033 vs 1.899 ms at 4x4096x16x128, 1.064 vs 1.030 causal, 7.392 vs 7.190 at 16K, 3.758
      vs 3.541 16K causal (fifth session, run6; the free-running warpgroups do not lock-step
      in a way that costs time, or the forced alternation costs more than it hides).
    dkdv_fold_stats: the split backward's dK/dV kernel, the "overlap" schedule's unmasked
      steps: the Sᵀ and dPᵀ accumulators start from -lse2/c and -delta (broadcast along their
      rows) instead of zero, so that Pᵀ = exp2(c·Sᵀ) and dSᵀ = Pᵀ∘dPᵀ, and a step's lse and
      delta (32 registers per thread at 64-row tiles) are consumed before its matmuls are
      issued instead of held while they run. Removes the causal kernel's in-loop spills
      (deviceless SASS at 2x16384x8x128: 15 loads / 11 stores per unmasked step -> 0) but
      puts the accumulators' initialisation between a step's wait and its first wgmma, and
      is no faster: on the H200 (fourteenth session, fwd+bwd, two runs) -1.9 / -2.2 % at
      the training shape causal (2x16384x8x128, 4 kv heads), +1.2 % at 32K non-causal, within
      +-1 % elsewhere. Off everywhere. The float32 sums differ in their last bits from the
      unfolded form (deterministic still).
    wide_backward: the backward at head_dim 256, where the split kernels do not fit: "mosaic"
      (the default; backward_wide.py: a dK/dV kernel whose two warpgroups split the tile's
      products by role, and the dQ kernel with two K slots and one V slot) or "triton"
      (Pallas' Triton backward kernels). On the H200 at 4x4096x8x256, fwd+bwd (sixteenth session,
      same runs as cuDNN): "triton" 223 / 242 TFLOP/s causal / not (0.59 / 0.57x cuDNN,
      run1), "mosaic" 375 / 398 (0.99 / 0.94x, run1) with one K/V slot in its dQ kernel and
      395 / 431 (1.09 / 1.05x, run5) with two K slots. Segment ids and lengths run on both
      (the Mosaic kernels compare ids since the seventeenth session).
    window_backward: the backward of a call with local_window_size: "mosaic" (the default
      since the twenty-second session: the split kernels, or backward_wide's at head_dim 256,
      on the segment-id path with the band's block limits; 437.7 against "triton"'s 410.9
      TFLOP/s fwd+bwd over the band, 0.91 / 0.85x cuDNN, at a 4K window over 1x32768x16x128,
      same run) or "triton" (Pallas' Triton backward kernels, which also skip the blocks
      outside the band).
    bwd_delta_in_kernel: split backward: True: the dQ kernel also TMA-loads its O tile, computes
      delta = rowsum(O∘dO) (float32, minus the lse cotangent) and lse in log2 units itself and
      stores both for the dK/dV kernel, so fwd+bwd runs no XLA op besides the Mosaic kernels
      (one more [2, block_q_dq, D] shared-memory tile: 231,552 of 232,448 B at head_dim 128
      with block_kv_dq 128 and 2 stages; where it does not fit, the XLA path runs with a
      warning). False: both come from XLA before the kernels (FA2's preprocessing: an extra
      read of O and dO from HBM). Same math. On the H200 (fifth session, scripts/
      mosaic_bwd_kernels.py, run5) the XLA pass took 0.05-0.06 ms and the in-kernel form
      made the dQ kernel 0.016-0.06 ms slower: net -0.047 ms (1.1 % of fwd+bwd) at
      4x4096x16x128, level (within 0.01 ms) at 4K causal and 16K causal / non-causal.
    profile_dir: debugging: when set, the forward, dK/dV and fused backward kernels run with
      Mosaic's profiler and write one Perfetto/Chrome trace (`<ns>-trace.json`) per launch
      into this directory, one track per warpgroup with the kernel's named regions (wait,
      issue, softmax, ...); `scripts/mosaic_profile.py` summarises them. Slows the kernel;
      never for timing.
    interpret: run in the Mosaic GPU interpreter (CPU). Also switches the register-operand wgmma
      and `run_state` accumulators, which the interpreter cannot run, to operands staged through
      shared memory and scoped accumulators: same math, slower kernel.
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  block_q_dq: int = 64
  block_kv_dq: int = 128
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  bwd_stages: int = 2
  heads_fastest: bool = False
  bwd_heads_fastest: bool = False
  bwd_head_group: int = 0
  fwd_intra_wg_overlap: bool = False
  fwd_q_registers: bool = False
  fwd_persistent: bool = False
  persistent_ctas: int = 0
  fwd_split_tail: bool = False
  bwd_split_tail: str = ""
  tail_parts: int = 0
  wave_ctas: int = 0
  fused_backward: bool = False
  block_q_fused: int = 64
  block_kv_fused: int = 64
  fused_stages: int = 2
  fused_stagger_q: bool = False
  fused_dq_blocks: int = 1
  fused_dq_shared: bool = False
  fused_overlap: bool = False
  fused_defer_dq: bool = False
  fused_defer_inline: bool = False
  fused_offset: bool = False
  fused_auto_barriers: bool = True
  fused_dq_head_major: bool = False
  fused_batch_slowest: bool = False
  fused_per_batch_entry: bool = False
  fused_split_loop: bool = False
  fused_early_probs: bool = False
  fused_dq_first: bool = False
  fused_static_wg: bool = False
  dkdv_schedule: str = "serial"
  dkdv_pingpong: bool = False
  dkdv_fold_stats: bool = False
  wide_backward: str = "mosaic"
  window_backward: str = "mosaic"
  bwd_delta_in_kernel: bool = True
  bwd_flat_stats: bool = True
  profile_dir: str = ""
  compute_registers: int = 232
  producer_registers: int = 40
  interpret: bool = False

  def __post_init__(self):
    for name in ("block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_q_dkv",
                 "block_kv_dkv", "block_q_fused", "block_kv_fused"):
      value = getattr(self, name)
      # wgmma: M is a multiple of 64 per warpgroup; the P.V / dS.K contraction (K) must be a
      # multiple of the 128-byte swizzle width, i.e. 64 16-bit elements.
      if value < 64 or value % 64:
        raise ValueError(f"MosaicConfig.{name} must be a positive multiple of 64, got {value}")
    if self.bwd_head_group < 0:
      raise ValueError(f"MosaicConfig.bwd_head_group must be >= 0, got {self.bwd_head_group}")
    for name in ("persistent_ctas", "tail_parts", "wave_ctas"):
      if getattr(self, name) < 0:
        raise ValueError(f"MosaicConfig.{name} must be >= 0, got {getattr(self, name)}")
    for name in ("num_stages", "bwd_stages", "fused_stages", "fused_dq_blocks"):
      if getattr(self, name) < 1:
        raise ValueError(f"MosaicConfig.{name} must be >= 1, got {getattr(self, name)}")
    if not set(filter(None, self.bwd_split_tail.split(","))) <= {"dq", "dkdv"}:
      raise ValueError("MosaicConfig.bwd_split_tail names the split backward kernels whose "
                       f"last wave is split: 'dq', 'dkdv' or 'dq,dkdv', got "
                       f"{self.bwd_split_tail!r}")
    for name in ("wide_backward", "window_backward"):
      if getattr(self, name) not in ("triton", "mosaic"):
        raise ValueError(f"MosaicConfig.{name} must be 'triton' or 'mosaic', got "
                         f"{getattr(self, name)!r}")
    if self.dkdv_schedule not in ("serial", "batched", "overlap"):
      raise ValueError("MosaicConfig.dkdv_schedule must be 'serial', 'batched' or 'overlap', "
                       f"got {self.dkdv_schedule!r}")
    for name in ("compute_registers", "producer_registers"):
      if getattr(self, name) % 8 or not 24 <= getattr(self, name) <= 256:
        raise ValueError(f"MosaicConfig.{name} must be a multiple of 8 in [24, 256]")
    if 2 * self.compute_registers + self.producer_registers > 504:
      # setmaxnreg only moves registers between a CTA's warps: the pool is what the launch
      # gave 3 warpgroups, 168 each (65,536 / 384 threads, in steps of 8). Asking for more
      # leaves a warpgroup's setmaxnreg.inc waiting forever (a hang on the GPU, which neither
      # the interpreter nor ptxas reports).
      raise ValueError("2 * compute_registers + producer_registers must be <= 504 (3 "
                       "warpgroups x 168 registers per thread at launch), e.g. 240 / 24")


# Keyed by (head_dim, is_causal). Device NVIDIA H200, jax 0.11.2, CUDA 13, 2026-11-29; command:
# `PYTHONPATH=. python3 scripts/mosaic_gpu_check.py --sweep` (numbers in docs/mosaic.md).
# Swept (fwd, TFLOP/s at 4x4096x16x128 / 1x16384x16x128 / 16K causal / 4x4096x32x64):
#   default 577/582/658/417, heads_fastest 623/612/643/432 (the flag as it worked then:
#   today's heads_fastest=False, the default), 3 stages 568/579/655/418,
#   block_kv 192 533/608/592/397, registers 240/24 579/583/659/391.
# Backward (fwd+bwd): block_kv_dq 128 beat 64 by 1-5 %; 3 bwd stages did not help.
# hd256 rows are SMEM-fitting defaults, not swept.
TUNED: dict[tuple[int, bool], MosaicConfig] = {
    # hd64: 3 stages measured equal to 2 (418 vs 417); kept 2 (less SMEM).
    # Non-causal hd64: the last wave split along the keys (fwd_split_tail; twelfth session,
    # s12 run2, fwd TFLOP/s, grid -> split, same run as cuDNN: 1x16384x16x128 602 -> 615
    # (cuDNN 612), 1x32768x16x128 604 -> 618 (616), 2x16384x8x128 with 4 kv heads 603 ->
    # 606-611 (620); run3: 4x4096x32x64 416 -> 429 (440); the cost model leaves 8K unsplit,
    # where it gained nothing). hd128 had it too until the nineteenth session's 192-key tiles,
    # which leave no room for its staging tile and gain more.
    # hd64 non-causal: 256-key forward tiles (S of 64 x 256 per warpgroup fits beside a
    # 64-register O at hd64; seventeenth session, run8, fwd TFLOP/s, same run as cuDNN, 128 ->
    # 256 keys: 4x4096x32x64 428 -> 453 (cuDNN 444), 1x16384x32x64 447 -> 486 (454),
    # 16x1024x16x64 395 -> 413 (378); 192 keys was slower everywhere, 64 slower causal).
    # And the dK/dV kernel streams 128-row q tiles (its dK and dV take only 64
    # registers at hd64, so Sᵀ and dPᵀ fit at 64 x 128 per warpgroup: less shared-memory
    # traffic per product; seventeenth session, run5, fwd+bwd, same run as cuDNN, bitwise equal
    # gradients: 4x4096x32x64 368 -> 393 (cuDNN 415), 16x1024x16x64 324 -> 342 (321); causal
    # level, +2 % at 4K and -1 % at 1K, so not there).
    (64, False): MosaicConfig(block_q=64, block_kv=256, num_stages=2, fwd_split_tail=True,
                              block_q_dkv=128),
    (64, True): MosaicConfig(block_q=64, block_kv=128, num_stages=2),
    # hd128: 2 x 64-row WGs x 128 kv, 2 stages = 160 KiB SMEM (FA3's 128x128 tile), with the
    # intra-WG overlap (fourth session, same run as cuDNN: 4K 621 vs 609, 16K 616 vs 602, 4K
    # causal 558 vs 562, 16K causal 648 vs 631; slower at hd64, so off there). dK/dV
    # "batched" (fifth session, run1, fwd+bwd: 4K 461 vs 451, 4K causal 428 vs 420, 16K 495
    # vs 486, 16K causal 473 vs 467, 32K 486 vs 482; at hd64 349 vs 354, so serial there).
    # dK/dV "overlap" at 240/24 registers for the backward too (sixth session, run1, same run:
    # 4K 453 vs 450, 4K causal 416 vs 422, 16K 498 vs 487, 16K causal 463 vs 458; the forward
    # with the intra-WG overlap already ran at 240/24).
    # And Q as the register operand of S = Q·Kᵀ (fwd_q_registers; eighteenth session, run1:
    # +0.9 to +1.9 % forward, level at 4K causal).
    # Non-causal, past MEDIUM_KV_LEN keys (the grid kernel; `tuned` switches shorter calls to
    # the persistent kernel with 128-key tiles and Q in registers): 192-key tiles, Q from
    # shared memory (S of 64 x 192 beside the overlap's other live tiles leaves no room for
    # Q's 32 registers: C7512 and spills, deviceless) and no split tail (its float32 staging
    # tile does not fit beside the 192-key ring). Nineteenth session, run3, fwd TFLOP/s, same
    # run as cuDNN, 128-key default -> 192: 1x16384x16x128 619 -> 647 (cuDNN 621),
    # 1x32768x16x128 622 -> 653 (610), 2x16384x8x128 with 4 kv heads 615 -> 643 (621);
    # 4x4096x16x128 605 -> 594 (the persistent kernel there stays at 128); causal 16K 619 ->
    # 522, so causal stays at 128. (The seventeenth session measured 192 level at 16K and
    # collapsing at 32K: 16384 and 32768 keys are no multiple of 192, and every step of the
    # overlapped loop was masked then; the key tail now streams first,
    # forward._last_block_first.)
    (128, False): MosaicConfig(block_q=64, block_kv=192, num_stages=2, fwd_intra_wg_overlap=True,
                               dkdv_schedule="overlap", compute_registers=240,
                               producer_registers=24),
    (128, True): MosaicConfig(block_q=64, block_kv=128, num_stages=2, fwd_intra_wg_overlap=True,
                              fwd_q_registers=True, dkdv_schedule="overlap",
                              compute_registers=240, producer_registers=24),
    # hd256: a 128-row kv tile does not fit next to Q (354 KiB); 64 rows = 192 KiB.
    (256, False): MosaicConfig(block_q=64, block_kv=64, num_stages=2),
    (256, True): MosaicConfig(block_q=64, block_kv=64, num_stages=2),
}


# Non-causal calls with at most this many keys run the persistent forward with the plain kv
# loop (fifth session, run1, fwd TFLOP/s, same run as cuDNN; default -> persistent plain):
# 16x1024x16x128 485 -> 544 (cuDNN 500), 16x1024x16x64 331 -> 353 (361); level at 4K (622 ->
# 611 with the plain loop, 622 with the overlap), slower at 16K (613 -> 576) and 32K (608 ->
# 580). 2K is between the measured lengths (unmeasured). Head dim 64 only since the
# thirty-second session: head-dim-128 calls of up to MEDIUM_KV_LEN keys all run the medium
# form below.
SHORT_KV_LEN = 2048
# Non-causal head-dim-128 calls with up to this many keys run the persistent forward with the
# intra-WG overlap, Q in registers and q tiles fastest (sixth session, run4, same run, fwd
# TFLOP/s at 4x4096x16x128: grid 609, persistent heads-fastest 603, persistent q-tiles-fastest
# 638, cuDNN 607). From 1K keys: thirty-second session (run2, config_ab, fwd TFLOP/s, 10 loops,
# plain heads-fastest form / this one / cuDNN, loops won by this one): 16x1024x16x128 527.3 /
# 531.4 / 491.9 (9 of 10), 32x1024x8x128 527.0 / 539.4 / 500.7 (9), 4x1536x16x128 542.9 /
# 541.6 / 506.1 (5), 4x2048x16x128 553.1 / 568.1 / 538.2 (10), 8x2048x16x128 558.3 / 568.8 /
# 551.0 (8), 2x2048x32x128 536.9 / 555.4 / 523.3 (9), 8x2048x16x128 with 4 kv heads 572.1 /
# 587.5 / 558.1 (10); fwd+bwd 16x1024x16x128 425.6 / 432.8 / 388.4, 8x2048x16x128 467.9 /
# 475.8 / 468.0. Rechecked at 1K (run4): 16x1024x16x128 509.8 (this form) / 512.8 (plain),
# 4x1000x16x128 480.1 / 477.7: level there. At 1x16384x16x128 the grid kernel stays ahead
# (644 vs 605; heads-fastest persistent 570): with q tiles fastest the CTAs running together
# share one head's K/V, which stays in L2, where all 16 heads' K/V at 16K does not.
# Past it the grid kernel runs TUNED's 192-key tiles (nineteenth session, run3 and run6, fwd
# TFLOP/s, same run: 4x4096x16x128 persistent 605 vs 192-key grid 594; 3x5120x16x128 585 vs
# 593, 2x8192x16x128 588 vs 613).
MEDIUM_KV_LEN = 4096
# The fused backward in its deferred form (seventh session): fwd+bwd +3.0 % at 1x16384x16x128
# and +4.1 % at 1x32768x16x128 causal over the split, but -5 % at 2x8192x16x128 causal and
# -2.6 % / -5.6 % at the training preset's 2x16384x8x128 causal (MHA / 4 kv heads). Its dQ sums
# vary run to run (float32 atomics).
FUSED_DEFERRED = dict(fused_backward=True, fused_dq_shared=True, fused_defer_dq=True,
                      fused_defer_inline=True, compute_registers=240, producer_registers=24)
# ... compiled without Pallas' automatic barriers: the default backward of causal head-dim-128
# calls of at most FUSED_MAX_BATCH entries with at least FUSED_MIN_KV_LEN keys (`call_config`).
# Twenty-third session, fwd+bwd TFLOP/s against the split, same process (runs 4-6):
# 1x16384x16x128 537.8 / 534.2, 531.2 / 511.6; 1x32768x16x128 546.6 / 518.4, 541.9 / 513.6;
# 1x65536x16x128 548.2 / 515.7; 1x16384x16x128 with 8 kv heads 537.0 / 511.2. Slower: batch 2
# (2x16384x8x128 482.9 / 504.9, with 4 kv heads 466.4 / 513.1), 4x4096x16x128 causal (426.2 /
# 470.3) and non-causal calls (497-501 / 529-530). The batch-2 loss was the 3-D TMA loads of lse
# and delta (bwd_flat_stats, twenty-fifth session).
# With one consumer body per warpgroup (fused_static_wg) and the early Pᵀ since the thirty-fourth
# session (run 2, config_ab, fwd+bwd TFLOP/s, 8 loops, without both / fused_static_wg alone /
# both / cuDNN, loops both won against without): 1x16384x16x128 522.6 / 527.4 / 534.4 / 523.6
# (8 of 8), 2x16384x8x128 with 4 kv heads 522.5 / 534.8 / 539.2 / 517.7 (8 of 8). From 8K keys
# since then (run 3, the split / this form / cuDNN): 2x8192x16x128 494.6 / 507.6 / 483.4 (8 of
# 8); at 4x4096x16x128 level (459.1 / 461.3 / 429.2, 5 of 8), so the split stays below 8K.
FUSED_LONG_CAUSAL = dict(FUSED_DEFERRED, fused_auto_barriers=False, fused_static_wg=True,
                         fused_early_probs=True)
FUSED_MIN_KV_LEN = 8192
# ... and at most this batch, the largest measured. Twenty-fifth session (run3), with
# bwd_flat_stats, fwd+bwd TFLOP/s fused / split / cuDNN, causal, same process: 2x16384x8x128
# with 4 kv heads 534.1 / 506.8 / 511.0, 2x16384x8x128 531.5 / 509.3 / 515.4, 4x16384x8x128
# with 4 kv heads 532.6 / 503.2 / 511.5, 8x16384x8x128 with 4 kv heads 527.5 / 497.9 / 517.1,
# 1x16384x16x128 527.8 / 509.6 / 516.3. Below 16K keys the split stays: 4x4096x16x128 449.6 /
# 460.4, 2x8192x16x128 502.7 / 497.3 (within noise). The training step (run4): 151.3 / 150.9 ms
# against cuDNN's 153.0 / 153.7.
FUSED_MAX_BATCH = 8
# Non-causal head-dim-128 calls with at least FUSED_NONCAUSAL_MIN_KV_LEN keys, a whole number
# of the fused kernel's 128-key CTA tiles (a key tail masks every step of its tile, where the
# split loop does not apply) and at most FUSED_NONCAUSAL_MAX_BATCH entries run the same kernel
# with fused_split_loop. Twenty-sixth session (run9), fwd+bwd TFLOP/s split loop / one loop /
# split backward / cuDNN, same process: 1x16384x16x128 538.9 / 484.8 / 515.9 / 546.3,
# 1x32768x16x128 542.6 / 488.7 / 512.4 / 554.7, 2x16384x8x128 with 4 kv heads 531.2 / 458.0 /
# 522.3 / 547.0, 2x8192x16x128 529.6 / 438.4 / 511.4 / 539.7, 4x4096x16x128 502.0 / 421.1 /
# 493.4 / 513.4. Twenty-seventh session (run5), split loop / split backward / cuDNN at batch 8:
# 8x4096x16x128 504.8 / 481.3 / 508.8, 8x8192x16x128 525.5 / 500.2 / 532.0. The early Pᵀ
# alone helped only GQA/MQA (twenty-seventh session, runs 8-9: 2x16384x8x128 with 4 kv heads
# 542-548 against 524-527, 4x4096x16x128 498.7 against 503.9); with fused_static_wg, whose main
# loops spill nothing (deviceless), it helps everywhere. Thirty-fourth session (run 1, config_ab,
# fwd+bwd TFLOP/s, 10 loops, the split loop alone / with fused_static_wg / with both / cuDNN,
# loops both won against the first): 4x4096x16x128 503.6 / 510.8 / 514.6 / 512.6 (10 of 10),
# 1x16384x16x128 542.4 / 541.6 / 552.9 / 550.2 (10 of 10); 2x16384x8x128 with 4 kv heads (the
# early Pᵀ in all) 547.4 / 554.7 / 552.2 / 545.8. From 2K keys and up to batch 16 since then
# (run 3, the split / this form / cuDNN, 8 loops): 8x2048x16x128 466.7 / 479.9 / 469.1 (7 of
# 8), 16x4096x16x128 483.6 / 510.3 / 510.9 (8 of 8).
FUSED_NONCAUSAL = dict(FUSED_LONG_CAUSAL, fused_split_loop=True)
FUSED_NONCAUSAL_MIN_KV_LEN = 2048
FUSED_NONCAUSAL_MAX_BATCH = 16


def with_overrides(config: MosaicConfig, overrides: str) -> MosaicConfig:
  """`config` with 'key=value,...' applied (True/False, integers, else strings), e.g.
  'fused_backward=True,block_kv_dq=64': the command-line form of dataclasses.replace."""
  kw = {}
  for item in filter(None, (x.strip() for x in overrides.split(","))):
    key, sep, value = item.partition("=")
    if not sep or key not in {f.name for f in dataclasses.fields(MosaicConfig)}:
      raise ValueError(f"Mosaic config override {item!r}: expected key=value with a "
                       f"MosaicConfig field as key")
    kw[key] = ({"True": True, "False": False}[value] if value in ("True", "False")
               else int(value) if value.lstrip("-").isdigit() else value)
  return dataclasses.replace(config, **kw)


def tuned(head_dim: int, is_causal: bool, kv_len: int) -> MosaicConfig:
  """The tuned config of a call: TUNED[(head_dim, is_causal)], switched to the persistent
  forward for short non-causal calls: at head_dim 64 the plain loop with heads fastest up to
  SHORT_KV_LEN keys, at head_dim 128 the overlapped loop with q tiles fastest, 128-key tiles
  and Q in registers up to MEDIUM_KV_LEN (the persistent kernel's second Q buffer leaves no
  room for TUNED's 192-key ring there)."""
  config = TUNED.get((head_dim, is_causal), MosaicConfig())
  if not is_causal and kv_len <= MEDIUM_KV_LEN and head_dim == 128:
    config = dataclasses.replace(config, fwd_persistent=True, block_kv=128,
                                 fwd_q_registers=True)
  elif not is_causal and kv_len <= SHORT_KV_LEN and head_dim == 64:
    config = dataclasses.replace(config, fwd_intra_wg_overlap=False, fwd_persistent=True,
                                 heads_fastest=True)
  return config


def call_config(head_dim: int, params: AttentionParams, kv_len: int, batch: int) -> MosaicConfig:
  """The config of a call that passes none: `tuned`, with the fused backward for head-dim-128
  calls: FUSED_LONG_CAUSAL for causal ones with at least FUSED_MIN_KV_LEN keys and at most
  FUSED_MAX_BATCH batch entries, FUSED_NONCAUSAL for non-causal ones as its comment says;
  neither where a call asks for bitwise-reproducible gradients (the fused dQ is summed by
  float32 atomics) or carries segment ids, lengths, a window (which the fused kernel does not
  stream) or a soft cap (not measured with it)."""
  config = tuned(head_dim, params.is_causal, kv_len)
  if (head_dim != 128 or params.deterministic or params.has_segments
      or params.local_window is not None or params.logits_soft_cap is not None):
    return config
  if params.is_causal and kv_len >= FUSED_MIN_KV_LEN and batch <= FUSED_MAX_BATCH:
    return dataclasses.replace(config, **FUSED_LONG_CAUSAL)
  if (not params.is_causal and kv_len >= FUSED_NONCAUSAL_MIN_KV_LEN
      and kv_len % (2 * config.block_kv_fused) == 0 and batch <= FUSED_NONCAUSAL_MAX_BATCH):
    return dataclasses.replace(config, **FUSED_NONCAUSAL)
  return config


def default_config(info: CallInfo) -> MosaicConfig:
  return call_config(info.head_dim, info.params, info.kv_len, info.batch)
