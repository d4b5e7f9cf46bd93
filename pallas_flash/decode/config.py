"""Decode configs and the split-KV heuristic.

The split count is chosen from static shapes only (batch, kv heads, rows, the cache's capacity
and the GPU's SM count), so it costs no host planning and no device-to-host copy: inside a
`jit`-compiled generation loop it is a constant. Where each split starts and ends is computed on
the device from the lengths (`cache_seqlens`), so ragged batches split every sequence evenly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pallas_flash import backends as flash_backends
from pallas_flash.decode.call import DecodeInfo


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonDecodeConfig:
  """Tiling of the Triton decode kernel.

  A program owns `block_m` query rows (Tq * G rows of one kv head, padded to 16) and streams
  `block_kv` keys per step through `num_stages` buffers; None picks the default for the call.
  """

  block_kv: int | None = None
  block_m: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None

  def __post_init__(self):
    for name in ("block_kv", "block_m"):
      value = getattr(self, name)
      if value is not None and (not _is_pow2(value) or value < 16):
        raise ValueError(f"TritonDecodeConfig.{name} must be a power of two >= 16, got {value}.")
    if self.num_warps is not None and not _is_pow2(self.num_warps):
      raise ValueError(f"TritonDecodeConfig.num_warps must be a power of two, got "
                       f"{self.num_warps}.")
    if self.num_stages is not None and self.num_stages < 1:
      raise ValueError(f"TritonDecodeConfig.num_stages must be >= 1, got {self.num_stages}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaDecodeConfig:
  """Keys per step of the blockwise XLA decode path (None: sized so that a step's float32
  scores stay near 16 MiB)."""

  block_kv: int | None = None

  def __post_init__(self):
    if self.block_kv is not None and self.block_kv < 1:
      raise ValueError(f"XlaDecodeConfig.block_kv must be positive, got {self.block_kv}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlashSplitConfig:
  """The chunked-prefill route (implementation "flash", decode/flash_split.py): the call as
  two `flash_attention` calls (the cached prefix, the new tokens), merged.

  flash_implementation: flash_attention's implementation for both calls; None takes the one
    flash_attention's `explain` chooses for them ("mosaic" on Hopper, "xla" off-GPU).
    "xla", "interpret" or "reference" run the route on a CPU for tests.
  flash_config: that implementation's config (a MosaicConfig, TritonConfig or XlaConfig) for
    both calls; None: each call's default.
  """

  flash_implementation: str | None = None
  flash_config: Any = None

  def __post_init__(self):
    if (self.flash_implementation is not None
        and self.flash_implementation not in flash_backends.IMPLEMENTATIONS):
      raise ValueError(f"FlashSplitConfig.flash_implementation must be None or one of "
                       f"flash_attention's {flash_backends.IMPLEMENTATIONS}, got "
                       f"{self.flash_implementation!r}.")


# Query tokens from which `implementation=None` runs a call on the "flash" route, where
# flash_attention would run its pieces on the Mosaic (Hopper) kernels. Below it a chunk fills
# few of those kernels' 128-row query tiles (B * H * ceil(Tq / 128) CTAs: 64 at B = 1, 32
# heads, Tq = 256, half of an H200's SMs), while the split-KV kernel packs Tq * G rows per kv
# head and splits the keys to fill the GPU. A first guess between the two, not yet measured on
# the GPU (`python -m pallas_flash.bench --decode --prefill only` times both at 256-4096).
FLASH_SPLIT_MIN_Q_LEN = 256


# First guesses, not yet swept on the H200 (`python -m pallas_flash.bench --decode
# --block-kv/--num-warps/--num-stages` sweeps them): decode tiles (at most 64 rows) stream 128
# keys with 4 warps and 3 stages, 2 x 32 KiB of K and V per stage at D = 128; prefill-sized tiles
# take the flash forward's tuned 128 x 128, 8 warps, 3 stages (triton/config.py).
DECODE_TRITON = TritonDecodeConfig(block_kv=128, block_m=64, num_warps=4, num_stages=3)
PREFILL_TRITON = TritonDecodeConfig(block_kv=128, block_m=128, num_warps=8, num_stages=3)
# Rows above which a call takes the prefill tiles (Tq * G > 64: e.g. 17+ tokens at G = 4).
PREFILL_ROWS = 64

# Key blocks each split streams at least: with fewer, the merge kernel and each program's
# pipeline start cost more than the split buys (B = 1, 1K cache: 4 splits 9.9 µs, 8 splits 11.4).
MIN_BLOCKS_PER_SPLIT = 2
# Splits of at least this many key blocks may go past one wave, up to WAVES: the extra waves
# cost uniform batches little there and let ragged ones balance (B = 8 at 128K: 2 splits
# uniform 4.51 / ragged 3.01 TB/s, 9 splits 4.13 / 3.81).
LONG_SPLIT_BLOCKS = 64
WAVES = 4
DEFAULT_NUM_CORES = 132  # an H100 / H200, when the device does not say


def choose_num_splits(info: DecodeInfo, *, block_m: int, block_kv: int) -> tuple[int, str]:
  """(num_splits, why) for a call whose programs own `block_m` rows and step `block_kv` keys.

  Splits multiply the B * K * ceil(M / block_m) programs up to one wave (about one program
  per SM), and up to WAVES waves while each split keeps LONG_SPLIT_BLOCKS key blocks; never
  below MIN_BLOCKS_PER_SPLIT blocks per split. Measured on the H200 (bench --decode,
  2026-12-04): B = 1 at 128K, 16 splits 3.78 TB/s, 33 splits 3.04, 66 splits 2.40; B = 8 at
  8K, 2 splits 3.65, 9 splits 2.80. Off-GPU one split.
  """
  programs = info.batch * info.num_kv_heads * -(-info.rows // block_m)
  blocks = -(-info.capacity // block_kv)
  if info.platform != "gpu":
    return 1, "one split off-GPU (splits spread work over a GPU's SMs)"
  cores = info.num_cores or DEFAULT_NUM_CORES
  one_wave = cores // programs
  long_splits = min(-(-WAVES * cores // programs), blocks // LONG_SPLIT_BLOCKS)
  splits = max(1, min(max(one_wave, long_splits), blocks // MIN_BLOCKS_PER_SPLIT))
  waves = splits * programs / cores
  why = (f"{programs} programs (B={info.batch} x K={info.num_kv_heads} x "
         f"{-(-info.rows // block_m)} row tiles) x {splits} splits of "
         f"{-(-blocks // splits)} {block_kv}-key blocks: {waves:.1f} waves on {cores} SMs")
  return splits, why
