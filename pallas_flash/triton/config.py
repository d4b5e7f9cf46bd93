"""Block sizes, warps and stages of the Triton-lowered kernels, and the tuning table."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

_BLOCK_FIELDS = ("block_q", "block_kv", "block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq")


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonConfig:
  """Tiling of the Triton-lowered kernels.

  Forward: `block_q` query rows per program streaming `block_kv` keys per step.
  Backward: the dK/dV kernel owns `block_kv_dkv` keys and streams `block_q_dkv` queries; the dQ
  kernel owns `block_q_dq` queries and streams `block_kv_dq` keys. Blocks are powers of two >= 16
  (Triton's tiles); sequences are padded up to them and the tail is masked.
  """

  block_q: int = 128
  block_kv: int = 64
  num_warps: int = 4
  num_stages: int = 3
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  block_q_dq: int = 64
  block_kv_dq: int = 64
  num_warps_bwd: int = 4
  num_stages_bwd: int = 2

  def __post_init__(self):
    for name in _BLOCK_FIELDS:
      value = getattr(self, name)
      if not _is_pow2(value) or value < 16:
        raise ValueError(f"TritonConfig.{name} must be a power of two >= 16, got {value}.")
    for name in ("num_warps", "num_warps_bwd"):
      if not _is_pow2(getattr(self, name)):
        raise ValueError(f"TritonConfig.{name} must be a power of two, got {getattr(self, name)}.")
    for name in ("num_stages", "num_stages_bwd"):
      if getattr(self, name) < 1:
        raise ValueError(f"TritonConfig.{name} must be >= 1, got {getattr(self, name)}.")


# Keyed by (head_dim_padded, is_causal, dtype itemsize). Measured on one H200 with the bench's
# interleaved timing, each row's alternatives in one run; rows without a measurement note are
# the heuristic default and say so.
TUNED: dict[tuple[int, bool, int], TritonConfig] = {
    # Heuristic (not swept): hd64 forward measured 0.77-0.80x cuDNN with these on the H200.
    (64, False, 2): TritonConfig(block_q=128, block_kv=64, num_warps=4, num_stages=3),
    (64, True, 2): TritonConfig(block_q=128, block_kv=64, num_warps=4, num_stages=3),
    # Forward swept on one H200, 2026-11-29, commit 6dfeb72:
    # forward TFLOP/s at 4x4096x16x128 / 1x16384x16x128, non-causal | causal:
    #   128x128 8w 3st 444/490 | 376/449   128x64 8w 3st 414/441 | 355/431
    #   128x64 8w 4st  412/441 | 358/426   128x128 8w 2st 402/431 | 340/383
    #   128x128 4w 3st 321/277 | 255/314   64x64 4w 3st  372/387 | 368/383
    # Backward rows are first guesses (fwd+bwd already 0.7x+ cuDNN), not swept.
    (128, False, 2): TritonConfig(block_q=128, block_kv=128, num_warps=8, num_stages=3),
    (128, True, 2): TritonConfig(block_q=128, block_kv=128, num_warps=8, num_stages=3),
    # D=256: forward heuristic (a 128-row accumulator spills; halved tiles). Backward swept on
    # one H200, 2026-12-01 (the Mosaic backend's backward at this head dim):
    # fwd+bwd TFLOP/s at 4x4096x8x256, non-causal | causal, blocks
    # q_dkv x kv_dkv / q_dq x kv_dq, warps, stages:
    #   64x32/32x64 4w 2st 234.0 | 209.2   128x32/32x128 4w 2st 214.0 | 188.9
    #   64x32/32x64 4w 3st 207.3 | 186.6   64x64/64x64 8w 1st  192.0 | 144.0
    #   32x32/32x32 4w 2st 181.7 | 171.4 (the heuristic before)   32x64/64x32 4w 2st 120.4 | 119.0
    # Each kernel owns 32 rows and streams 64: its float32 accumulators are what a D=256
    # tile pair fills first.
    (256, False, 2): TritonConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2,
                                  block_q_dkv=64, block_kv_dkv=32, block_q_dq=32,
                                  block_kv_dq=64),
    (256, True, 2): TritonConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2,
                                 block_q_dkv=64, block_kv_dkv=32, block_q_dq=32, block_kv_dq=64),
}


# float32 at D >= 128 (unswept): halved tiles everywhere.
WIDE_FLOAT32 = TritonConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2, block_q_dkv=32,
                            block_kv_dkv=32, block_q_dq=32, block_kv_dq=32)


# Forward tiles for calls whose per-element work differs from plain attention, keyed by
# (feature, head_dim_padded, is_causal, dtype itemsize); the backward keeps TUNED's (its sweep
# with the feature on picked the same backward tiles). Measured on one H200, 2026-11-29,
# commit ba77277, causal 1x8192x16x128: soft-cap 30 forward TFLOP/s
#   64x64 4w 3st 380.8, 128x128 8w 3st 353.7, 128x64 8w 353.3, 128x64 4w 334.1
# (dropout 0.1 kept 128x128 8w: 325.7 vs 321.7 at 64x64).
# Non-causal (same day, commit dff7f71): 64x64 4w 442.7, 128x128 8w 431.8, 128x64 8w 422.6.
# "dense" (a [.., T, S] bias or mask tile streams next to K and V): 128x128 tiles with 3 stages
# asked for 352-384 KiB of shared memory on the H200 (limit 227 KiB) in
# tests/test_gpu_triton.py; 64-key tiles and 2 stages halve the tiles and drop a buffer.
FEATURE_TUNED: dict[tuple[str, int, bool, int], dict] = {
    ("softcap", 128, False, 2): dict(block_q=64, block_kv=64, num_warps=4, num_stages=3),
    ("softcap", 128, True, 2): dict(block_q=64, block_kv=64, num_warps=4, num_stages=3),
    ("dense", 128, False, 2): dict(block_kv=64, num_stages=2),
    ("dense", 128, True, 2): dict(block_kv=64, num_stages=2),
}


def default_config(head_dim_padded: int, is_causal: bool, dtype,
                   feature: str | None = None) -> TritonConfig:
  """The tuned config for this call, or a heuristic one for untuned keys (e.g. float32).

  feature: "dense" / "softcap" / "dropout" when the call has that feature (FEATURE_TUNED).
  """
  itemsize = jnp.dtype(dtype).itemsize
  key = (head_dim_padded, is_causal, itemsize)
  if key in TUNED:
    override = FEATURE_TUNED.get((feature, *key))
    return dataclasses.replace(TUNED[key], **override) if override else TUNED[key]
  # float32 tiles take twice the registers and shared memory of 16-bit ones: the small tiles
  # that D = 256 used before its sweep (whose 64-row streamed tiles would double again).
  if itemsize == 4 and head_dim_padded >= 128:
    return WIDE_FLOAT32
  if head_dim_padded >= 256:
    return TUNED[(256, is_causal, 2)]
  if head_dim_padded <= 64:
    return TUNED[(64, is_causal, 2)]
  return TUNED[(128, is_causal, 2)]
