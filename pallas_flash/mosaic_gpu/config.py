"""MosaicConfig and the tuning rules of the Hopper kernels.

Each field is a choice a default makes or a user has a reason to make; forms measured slower
were deleted (docs/mosaic.md keeps the table of what was tried and rejected, with the deciding
numbers). The measurements behind the rules below are in docs/mosaic.md and docs/perf.md.
"""

from __future__ import annotations

import dataclasses

from pallas_flash.call import AttentionParams, CallInfo

# Shared memory per CTA on H100/H200 (227 KiB), enforced again by the Mosaic lowering.
SMEM_LIMIT_BYTES = 232_448


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicDebug:
  """Knobs for testing and profiling, never for speed.

  Attributes:
    interpret: run in the Mosaic GPU interpreter (CPU). Register-operand wgmma and `run_state`
      accumulators, which the interpreter cannot run, become operands staged through shared
      memory and scoped accumulators: same math, slower kernel.
    profile_dir: run the forward, dK/dV and fused kernels under Mosaic's profiler, one
      Perfetto/Chrome trace per launch in this directory (one track per warpgroup with the
      kernels' named regions). Slows the kernels; the forward then loads a 16-bit dense bias
      from GMEM (the profiler's buffer takes its shared-memory ring's room).
    persistent_ctas: CTAs of the persistent forward (0: the GPU's SM count); tests set it to
      run several tiles per CTA.
    wave_ctas, tail_parts: the split tail's wave (0: the SM count) and parts per tile (0: its
      cost model's choice); tests set them to split small grids.
  """

  interpret: bool = False
  profile_dir: str = ""
  persistent_ctas: int = 0
  wave_ctas: int = 0
  tail_parts: int = 0

  def __post_init__(self):
    for name in ("persistent_ctas", "wave_ctas", "tail_parts"):
      if getattr(self, name) < 0:
        raise ValueError(f"MosaicDebug.{name} must be >= 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicConfig:
  """Static tuning knobs of the Mosaic GPU (sm_90) kernels.

  Forward: a CTA has 2 consumer warpgroups of `block_q` query rows each plus one TMA producer
  warpgroup streaming `block_kv`-row K/V tiles through a `num_stages`-slot shared-memory ring.
  Split backward: a dQ kernel (2 WGs x `block_q_dq` rows, K/V streamed in `block_kv_dq` tiles),
  then a dK/dV kernel (2 WGs x `block_kv_dkv` rows, Q/dO streamed in `block_q_dkv` tiles, all
  query heads of a kv head summed in-kernel), `bwd_stages`-deep rings. Fused backward: one
  kernel per 2 x `block_kv_fused` keys, Q/dO streamed in `block_q_fused` tiles.

  Attributes:
    heads_fastest: forward launch order after the batch entries of one (q tile, head), which
      come first in the grid kernel. False: then consecutive q tiles of one head (causal
      tiles heaviest first), so CTAs running together share one head's K/V. True: then the
      same q tile of consecutive heads.
    fwd_intra_wg_overlap: FA3's intra-warpgroup pipelining: S_{j+1} = Q·K_{j+1}ᵀ is issued with
      O += P_j·V_j and its softmax runs while P_j·V_j is on the tensor cores. Holds two steps'
      S in registers: runs at 240 / 24 registers unless the config sets others.
    fwd_q_registers: with the overlap, Q is loaded into registers once per tile and S = Q·Kᵀ
      takes it as the register operand (less shared-memory traffic; bitwise equal outputs).
    fwd_persistent: non-causal, or a window alone: one CTA per SM loops over the tiles, the
      K/V ring running on across tiles and Q double-buffered (not at head dim 256: no room
      for the second Q).
    fwd_split_tail: non-causal grid kernel: the tiles of the last, partly filled wave run as
      several CTAs, each streaming a share of the key blocks; XLA merges their (o, lse).
    dkdv_overlap: the dK/dV kernel's unmasked steps form Pᵀ while dPᵀ runs and dSᵀ while dV
      runs (FA3's order; bitwise equal gradients); needs 240 / 24 registers.
    fused_backward: the single FA3-style backward kernel (head dim 128; dQ summed with float32
      atomics, so not bitwise reproducible) instead of the two split kernels. Head dims 80 / 96
      run it zero-padded to 128; `default_config` leaves it off for them.
    compute_registers, producer_registers: setmaxnreg of the consumer and producer warpgroups.
    native_value_head_dim: a call whose value head dim Dv is below its query/key head dim D
      runs kernels that take V, O, dO and dV at their own Dv columns (O's accumulator, P·V, its
      epilogue and store, dP = dO·Vᵀ, dV += Pᵀ·dO), Q, K, dQ and dK at D, instead of V, O and
      dO zero-padded to D (`kernel_head_dims`). Built for D = 192 or 256 (the forward and
      hd256.py's backward; MLA's 192 / 128) with Dv a multiple of 64 below D; the backend
      refuses other pairs of Dv != D with it (`native_value_reason`), Dv = D runs as without
      it. `default_config` sets it for every pair the kernels take (a config a user builds
      keeps the field's False: V padded). H200, 4x4096x32, 192 / 128, x padded V: forward
      1.19 / 1.26, fwd+bwd 1.11 / 1.16 (non-causal / causal); GPU tests at 192 / 128,
      256 / 128 and 192 / 64.
    fp8_block_kv: the FP8 forward's key tile (float8_e4m3fn inputs, sm90/fp8_forward.py), a
      multiple of 128 (an e4m3 P·V contracts over 128-key swizzle groups); 0: its default per
      head dim (256 up to 128, 128 at 256). Its own field, so that a config passed for the
      bf16 backward of `quantized_attention` (block_kv 128 by default, 192 tuned) leaves the
      FP8 forward's tile alone.
    debug: MosaicDebug (interpreter, profiler, test sizes).
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  heads_fastest: bool = False
  fwd_intra_wg_overlap: bool = False
  fwd_q_registers: bool = False
  fwd_persistent: bool = False
  fwd_split_tail: bool = False
  block_q_dq: int = 64
  block_kv_dq: int = 128
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  bwd_stages: int = 2
  dkdv_overlap: bool = False
  fused_backward: bool = False
  block_q_fused: int = 64
  block_kv_fused: int = 64
  fused_stages: int = 2
  compute_registers: int = 232
  producer_registers: int = 40
  native_value_head_dim: bool = False
  fp8_block_kv: int = 0
  debug: MosaicDebug = MosaicDebug()

  def __post_init__(self):
    for name in ("block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_q_dkv",
                 "block_kv_dkv", "block_q_fused", "block_kv_fused"):
      value = getattr(self, name)
      # wgmma: M is a multiple of 64 per warpgroup; the P.V / dS.K contraction (K) must be a
      # multiple of the 128-byte swizzle width, i.e. 64 16-bit elements.
      if value < 64 or value % 64:
        raise ValueError(f"MosaicConfig.{name} must be a positive multiple of 64, got {value}")
    for name in ("num_stages", "bwd_stages", "fused_stages"):
      if getattr(self, name) < 1:
        raise ValueError(f"MosaicConfig.{name} must be >= 1, got {getattr(self, name)}")
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
    if not isinstance(self.fp8_block_kv, int) or self.fp8_block_kv < 0 or self.fp8_block_kv % 128:
      raise ValueError("MosaicConfig.fp8_block_kv must be 0 (the FP8 forward's default) or a "
                       f"positive multiple of 128, got {self.fp8_block_kv!r}")
    if not isinstance(self.native_value_head_dim, bool):
      raise ValueError("MosaicConfig.native_value_head_dim must be True or False, got "
                       f"{self.native_value_head_dim!r}")
    if not isinstance(self.debug, MosaicDebug):
      raise TypeError(f"MosaicConfig.debug must be a MosaicDebug, got {self.debug!r}")

  @property
  def interpret(self) -> bool:
    return self.debug.interpret


# FA3's register split, for the forms that hold more live tiles (the overlapped forward and
# dK/dV steps, the fused backward).
WIDE_REGISTERS = dict(compute_registers=240, producer_registers=24)

# Keyed by (head_dim, is_causal); measured on one H200 (jax 0.11.2, CUDA 13), docs/mosaic.md.
TUNED: dict[tuple[int, bool], MosaicConfig] = {
    # 256-key forward tiles non-causal (S of 64 x 256 fits beside a 64-register O), the last
    # wave split along the keys; the dK/dV kernel streams 128-row q tiles (dK, dV take only
    # 64 registers each).
    (64, False): MosaicConfig(block_kv=256, fwd_split_tail=True, block_q_dkv=128),
    (64, True): MosaicConfig(),
    # The intra-WG overlap forward and dK/dV steps; non-causal past MEDIUM_KV_LEN keys
    # 192-key tiles with Q from shared memory (no room for Q's 32 registers beside them).
    (128, False): MosaicConfig(block_kv=192, fwd_intra_wg_overlap=True, dkdv_overlap=True,
                               **WIDE_REGISTERS),
    (128, True): MosaicConfig(fwd_intra_wg_overlap=True, fwd_q_registers=True,
                              dkdv_overlap=True, **WIDE_REGISTERS),
    # A 128-row kv tile does not fit next to Q at head dim 256 (354 KiB); 64 rows = 192 KiB.
    (256, False): MosaicConfig(block_kv=64),
    (256, True): MosaicConfig(block_kv=64),
    # Head dim 192 (MLA's query/key head dim) runs head dim 256's forms at 64-key tiles. Not yet
    # measured on the GPU.
    (192, False): MosaicConfig(block_kv=64),
    (192, True): MosaicConfig(block_kv=64),
}

# Non-causal head-dim-64 calls up to this many keys run the persistent forward with the plain
# kv loop and heads fastest.
SHORT_KV_LEN = 2048
# Non-causal head-dim-128 calls up to this many keys run the persistent forward with the
# overlap, 128-key tiles, Q in registers and q tiles fastest.
MEDIUM_KV_LEN = 4096
# The fused backward: causal head-dim-128 calls with at least FUSED_MIN_KV_LEN keys and at most
# FUSED_MAX_BATCH entries; non-causal ones with at least FUSED_NONCAUSAL_MIN_KV_LEN keys, a
# whole number of its 128-key CTA tiles and at most FUSED_NONCAUSAL_MAX_BATCH entries.
FUSED = dict(fused_backward=True, **WIDE_REGISTERS)
FUSED_MIN_KV_LEN = 8192
FUSED_MAX_BATCH = 8
FUSED_NONCAUSAL_MIN_KV_LEN = 2048
FUSED_NONCAUSAL_MAX_BATCH = 16


def tuned(head_dim: int, is_causal: bool, kv_len: int) -> MosaicConfig:
  """TUNED[(head_dim, is_causal)], switched to the persistent forward for short non-causal
  calls (head dim 128: up to MEDIUM_KV_LEN keys, the overlapped loop at 128-key tiles with Q in
  registers; head dim 64: up to SHORT_KV_LEN, the plain loop with heads fastest)."""
  config = TUNED.get((head_dim, is_causal), MosaicConfig())
  if not is_causal and kv_len <= MEDIUM_KV_LEN and head_dim == 128:
    config = dataclasses.replace(config, fwd_persistent=True, block_kv=128,
                                 fwd_q_registers=True)
  elif not is_causal and kv_len <= SHORT_KV_LEN and head_dim == 64:
    config = dataclasses.replace(config, fwd_intra_wg_overlap=False, fwd_persistent=True,
                                 heads_fastest=True)
  return config


def dense_config(config: MosaicConfig, head_dim: int, is_causal: bool,
                 both: bool = False, block_masked: bool = False) -> MosaicConfig:
  """`config` for a call with a dense bias or mask (sm90/dense.py; `both`: a bias and a mask;
  `block_masked`: with a block mask): the forward's grid kernel (no persistent form, no split
  tail: those do not load the dense tiles), and the tiles at which the dense tiles, loaded
  under the score matmuls (`dense.issue`), fit in registers beside the kernels' own.
  Deviceless ptxas at 4x4096x32x128: no spills in the forward's loops at 128-key tiles with Q
  read from shared memory and, with both inputs, the plain loop (192-key tiles or Q in
  registers spilled 54-174 spill loads per step, the overlapped loop with both 82); at
  1x4096x16xD dK/dV steps of 128 queries spilled 208 B at head dim 64, causal dQ steps of 128
  keys 116 B at head dim 128. With a block mask the plain loop as well: the overlapped one
  with a bias ran its forward at 0.49x (one H100, 2026-12-06; docs/mosaic.md)."""
  overlap = config.fwd_intra_wg_overlap and not both and not block_masked
  config = dataclasses.replace(config, fwd_persistent=False, fwd_split_tail=False,
                               block_kv=min(config.block_kv, 128), fwd_q_registers=False,
                               fwd_intra_wg_overlap=overlap,
                               block_q_dkv=min(config.block_q_dkv, 64))
  if is_causal and head_dim >= 128:
    config = dataclasses.replace(config, block_kv_dq=min(config.block_kv_dq, 64))
  return config


def dropout_tiles(config: MosaicConfig) -> MosaicConfig:
  """A tuned config's tiles for a call with dropout: at most 128-key forward tiles (with Q in
  registers where the wider tile took it from shared memory) and 64-row dK/dV q tiles. The
  keep mask's key vector costs block_kv / 4 registers per thread in the wgmma layout; with it,
  ptxas (deviceless, CUDA 13.0, 1x4096x16xD) spilled in the main loops of head dim 128's
  192-key forward (16 / 15 spill loads / stores), head dim 64's 256-key forward (38 / 35) and
  its dK/dV kernel at 128-row q tiles (46 / 46); these tiles spill none there."""
  changes = {}
  if config.block_kv > 128:
    changes.update(block_kv=128, fwd_q_registers=config.fwd_q_registers
                   or config.fwd_intra_wg_overlap)
  if config.block_q_dkv > 64:
    changes.update(block_q_dkv=64)
  return dataclasses.replace(config, **changes) if changes else config


def feature_tiles(config: MosaicConfig, head_dim: int, params: AttentionParams) -> MosaicConfig:
  """`config` with the tiles the call's features need: `dense_config` for a dense bias or
  mask (a block mask's call as a causal one: it takes the causal forms), `dropout_tiles` for
  dropout, else unchanged."""
  block_masked = params.block_mask_blocks is not None
  if params.has_bias or params.has_mask:
    config = dense_config(config, head_dim, params.is_causal or block_masked,
                          both=params.has_bias and params.has_mask, block_masked=block_masked)
  if params.dropout_rate:
    config = dropout_tiles(config)
  return config


def window_form(config: MosaicConfig, head_dim: int, params: AttentionParams) -> MosaicConfig:
  """`config` with the persistent forward for a causal window alone (no segment ids) at head
  dim 128: its band's tiles are of nearly equal length, and a window of T/4 gives a grid CTA
  few key steps (9 at 4K), over which its launch, Q load and epilogue weigh. One H100,
  2026-12-06 (`python -m pallas_flash.bench --features window,window_both --impl mosaic,cudnn
  --variant mosaic:grid:fwd_persistent=False`, 4x4096x32x128, left 1K): forward 433 against
  the grid kernel's 394 TFLOP/s, forward+backward level (358 / 366; 1.01x in an earlier
  run). Non-causal calls take it from `tuned` (512 keys either side: 460 against 402)."""
  if (params.is_causal and params.local_window is not None and not params.has_segments
      and head_dim == 128):
    return dataclasses.replace(config, fwd_persistent=True)
  return config


def call_config(head_dim: int, params: AttentionParams, kv_len: int, batch: int) -> MosaicConfig:
  """`tuned` with `window_form` and `feature_tiles` (a dense bias or mask, dropout), and
  the fused backward where FUSED's rules say; never where a call asks for bitwise-reproducible
  gradients, or carries segment ids, lengths, a window (which the fused kernel does not
  stream), a soft cap (not measured with it), ALiBi, dropout, a dense bias or mask (the fused
  kernel adds none of them; backward.py would warn and run the split kernels). A block mask
  takes the causal forms (128-key tiles: finer sparsity than the non-causal 192 or 256), with
  its features' tiles, and the split backward (the fused kernel takes none)."""
  block_masked = params.block_mask_blocks is not None
  # The features' tiles last: a dense bias or mask turns the persistent forward off again.
  config = feature_tiles(window_form(tuned(head_dim, params.is_causal or block_masked, kv_len),
                                     head_dim, params), head_dim, params)
  if block_masked:
    return config
  if (head_dim != 128 or params.deterministic or params.has_segments
      or params.local_window is not None or params.logits_soft_cap is not None
      or params.has_alibi or params.dropout_rate or params.has_bias or params.has_mask):
    return config
  if params.is_causal and kv_len >= FUSED_MIN_KV_LEN and batch <= FUSED_MAX_BATCH:
    return dataclasses.replace(config, **FUSED)
  if (not params.is_causal and kv_len >= FUSED_NONCAUSAL_MIN_KV_LEN
      and kv_len % (2 * config.block_kv_fused) == 0 and batch <= FUSED_NONCAUSAL_MAX_BATCH):
    return dataclasses.replace(config, **FUSED)
  return config


# The head dims the kernels run at (192: the head-dim-256 backward kernels and the forward at
# 64-key tiles, as 256). A call with other head dims (query/key D, value Dv, both at most the
# last) runs them zero-padded to kernel_head_dim(D, Dv).
KERNEL_HEAD_DIMS = (64, 80, 96, 128, 192, 256)
# Head dims that the forward and the split backward kernels run at their own width, with a
# narrower shared-memory swizzle (sm90/common.swizzle_bytes: 64 bytes at 96, 32 at 80), and
# with head dim 128's configs (config_head_dim). The fused backward is built for head dim 128
# only: a config that asks for it runs its backward zero-padded to 128 (backward_head_dim).
NARROW_HEAD_DIMS = (80, 96)


def kernel_head_dim(head_dim: int, value_head_dim: int) -> int:
  """The kernels' head dim for a call with query/key head dim `head_dim` and value head dim
  `value_head_dim` (each at most 256): the least of KERNEL_HEAD_DIMS that holds both. Zero
  columns appended to Q and K change no score, zero columns appended to V only add zero
  columns to O (and to dQ, dK, dV), so the padded call's kept columns are the call's."""
  return next(d for d in KERNEL_HEAD_DIMS if d >= max(head_dim, value_head_dim))


def config_head_dim(head_dim: int, value_head_dim: int) -> int:
  """The head dim whose tuned config (TUNED, `tuned`, `call_config`) a call takes: its kernel
  head dim, or 128 for NARROW_HEAD_DIMS (the same kernels at fewer columns)."""
  p = kernel_head_dim(head_dim, value_head_dim)
  return 128 if p in NARROW_HEAD_DIMS else p


def backward_head_dim(head_dim: int, value_head_dim: int, config: MosaicConfig) -> int:
  """The head dim the backward kernels run at: kernel_head_dim, except 128 for a
  NARROW_HEAD_DIMS call whose config asks for the fused backward (head dim 128 only)."""
  p = kernel_head_dim(head_dim, value_head_dim)
  return 128 if p in NARROW_HEAD_DIMS and config.fused_backward else p


# Query/key head dims whose kernels take a value head dim of its own
# (MosaicConfig.native_value_head_dim): the forward and hd256.py's backward, whose every
# [rows, Dv] tile and Dv-wide product is sized by the value head dim apart from the D-wide ones.
NATIVE_VALUE_HEAD_DIMS = (192, 256)


def native_value_reason(head_dim: int, value_head_dim: int) -> str | None:
  """Why the kernels cannot take V at its own head dim for a call of query/key head dim
  `head_dim` and value head dim `value_head_dim` (config.native_value_head_dim), or None.
  Dv must be a multiple of 64 (16-bit: one 128-byte swizzle group, so that V, O and dO tiles
  share the swizzle of Q, K and of P, dS) and below D, which must be one of
  NATIVE_VALUE_HEAD_DIMS (the split and fused backward at D <= 128 take one head dim)."""
  if head_dim not in NATIVE_VALUE_HEAD_DIMS:
    return (f"config.native_value_head_dim=True takes query/key head dims "
            f"{NATIVE_VALUE_HEAD_DIMS}, this call has {head_dim} (value head dim "
            f"{value_head_dim}); pass native_value_head_dim=False to run V zero-padded")
  if value_head_dim % 64 or value_head_dim >= head_dim:
    return (f"config.native_value_head_dim=True takes value head dims that are multiples of "
            f"64 below the query/key head dim {head_dim}, this call has {value_head_dim}; pass "
            "native_value_head_dim=False to run V zero-padded")
  return None


def kernel_head_dims(head_dim: int, value_head_dim: int, config: MosaicConfig, *,
                     backward: bool = False) -> tuple[int, int]:
  """(query/key, value) head dims the forward (or with `backward` the backward) kernels of a
  call run at, the one place that decides: the call's own (D, Dv) where they differ and
  config.native_value_head_dim is set (the backend refused the pairs `native_value_reason`
  rules out), else one head dim for Q, K and V, kernel_head_dim (backward_head_dim)."""
  if config.native_value_head_dim and value_head_dim != head_dim:
    return head_dim, value_head_dim
  p = (backward_head_dim(head_dim, value_head_dim, config) if backward
       else kernel_head_dim(head_dim, value_head_dim))
  return p, p


def default_config(info: CallInfo) -> MosaicConfig:
  """The config of a call that passes none: that of the head dim its kernels run at
  (config_head_dim), with the split backward at NARROW_HEAD_DIMS' own width rather than the
  fused one padded to 128, and V at its own head dim where the kernels take it (H200,
  4x4096x32, fwd+bwd x the other form: head dims 80 / 96 1.24 / 1.21 non-causal and
  1.03 / 1.01 causal; 192 / 128 1.11 / 1.16, its forward 1.19 / 1.26; docs/mosaic.md)."""
  d, dv = info.head_dim, info.value_head_dim
  config = call_config(config_head_dim(d, dv), info.params, info.kv_len, info.batch)
  if kernel_head_dim(d, dv) in NARROW_HEAD_DIMS and config.fused_backward:
    config = dataclasses.replace(config, fused_backward=False)
  if dv != d and native_value_reason(d, dv) is None:
    config = dataclasses.replace(config, native_value_head_dim=True)
  steps = staged_dbias_steps(info, config)
  if steps:
    config = dataclasses.replace(config, block_kv_dq=steps)
  return config


def staged_dbias_steps(info: CallInfo, config: MosaicConfig) -> int | None:
  """The dQ key step of a call with a dense bias in the inputs' dtype at kernel head dim 64 or
  128 whose config steps by other than O's width (causal head-dim-128 calls, narrowed to 64
  by `dense_config`; head dim 64's 128): O's width, at which its dS goes to dbias through
  the O tile and TMA stores (sm90/dense.o_tile_stages), and a bias shared by the batch is
  summed there (dense.dbias_form); None otherwise. One H100, 2026-12-06 (bias_causal,
  4x4096x32x128, `--variant mosaic:kv128:block_kv_dq=128` at c2ec79b): 1.13x fwd+bwd over
  64-key steps with per-thread stores, though deviceless ptxas counts 17 / 2 spill loads /
  stores a step at 128 keys. Head dim 64 (64-key steps in place of 128; `--features-shape
  4x4096x32x64x8 --variant mosaic:kv128:block_kv_dq=128`, the H200, 2026-12-06 at 0edf277):
  fwd+bwd 1.29x, causal 1.37x. A block mask with a bias (`blockmask_bias`, the H200): 1.50x
  at head dim 128 (64-key steps before), 1.50x at 64."""
  width = kernel_head_dim(info.head_dim, info.value_head_dim)
  if (info.params.has_bias and info.bias_dtype == info.dtype and info.dtype.itemsize == 2
      and width in (64, 128) and config.block_kv_dq != width):
    return width
  return None
