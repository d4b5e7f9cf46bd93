"""Decode configs and the split-KV heuristic.

The runs are chosen from static shapes only (batch, kv heads, rows, the cache's capacity, the
kernel's shared memory and the GPU's SM count), so they cost no host planning and no
device-to-host copy: inside a `jit`-compiled generation loop they are a constant. Which keys
each program reads is computed on the device from the lengths (`cache_seqlens`): N runs per
kv head and row tile, and `balanced_partition` hands each about 1 / N of the batch's key
blocks, so a ragged batch keeps every program as busy as a uniform one (see docs/decode.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp

from pallas_flash import backends as flash_backends
from pallas_flash import validation
from pallas_flash.decode.call import DecodeInfo


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def _check_ints(config, names: tuple[str, ...]) -> None:
  """TypeError naming the field for a value that is neither None nor an integer (a string or
  a float would fail later, deep inside a kernel's tiling); NumPy integers are stored as Python
  ints, so that equal configs compare and hash alike."""
  for name in names:
    value = getattr(config, name)
    if value is None:
      continue
    if not validation.is_int(value):
      raise TypeError(f"{type(config).__name__}.{name} must be a Python int or None, got "
                      f"{value!r}.")
    object.__setattr__(config, name, int(value))


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
    _check_ints(self, ("block_kv", "block_m", "num_warps", "num_stages"))
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
class MosaicDecodeConfig:
  """Tiling of the Mosaic GPU (Hopper) decode kernel (decode/mosaic.py).

  A program owns the Tq * G query rows of one kv head (padded to 64, one wgmma tile) and
  streams `block_kv` keys per step through a ring of `num_stages` TMA-fed K/V buffers; None
  picks the default for the call. `interpret` runs the kernel in the Mosaic GPU interpreter
  (any platform, for tests).
  """

  block_kv: int | None = None
  num_stages: int | None = None
  interpret: bool = False

  def __post_init__(self):
    _check_ints(self, ("block_kv", "num_stages"))
    if self.block_kv is not None and (not _is_pow2(self.block_kv) or self.block_kv < 64):
      raise ValueError(f"MosaicDecodeConfig.block_kv must be a power of two >= 64, got "
                       f"{self.block_kv}.")
    if self.num_stages is not None and self.num_stages < 1:
      raise ValueError(f"MosaicDecodeConfig.num_stages must be >= 1, got {self.num_stages}.")
    if not isinstance(self.interpret, bool):
      raise TypeError(f"MosaicDecodeConfig.interpret must be a bool, got {self.interpret!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaDecodeConfig:
  """Keys per step of the blockwise XLA decode path (None: sized so that a step's float32
  scores stay near 16 MiB)."""

  block_kv: int | None = None

  def __post_init__(self):
    _check_ints(self, ("block_kv",))
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
# head and splits the keys to fill the GPU. On one H200 against a 32K cache (2026-12-04,
# `python -m pallas_flash.bench --decode --prefill only`): Tq 256 route 318 TFLOP/s vs
# split-KV 419; Tq 512 595 vs 429.
FLASH_SPLIT_MIN_Q_LEN = 512


# First guesses, not yet swept on the H200 (`python -m pallas_flash.bench --decode
# --block-kv/--num-warps/--num-stages` sweeps them): decode tiles (at most 64 rows) stream 128
# keys with 4 warps and 3 stages, 2 x 32 KiB of K and V per stage at D = 128; prefill-sized tiles
# take the flash forward's tuned 128 x 128, 8 warps, 3 stages (triton/config.py).
DECODE_TRITON = TritonDecodeConfig(block_kv=128, block_m=64, num_warps=4, num_stages=3)
PREFILL_TRITON = TritonDecodeConfig(block_kv=128, block_m=128, num_warps=8, num_stages=3)
# Rows above which a call takes the prefill tiles (Tq * G > 64: e.g. 17+ tokens at G = 4).
PREFILL_ROWS = 64

DEFAULT_NUM_CORES = 132  # an H100 / H200, when the device does not say
# From this many waves of one-program-per-sequence programs the call takes them, unsplit: the
# GPU's block scheduler keeps every SM busy (ragged lengths too) and no merge runs.
ONE_SPLIT_WAVES = 2
# Where several CTAs fit an SM (e4m3 caches, D = 64), the one-wave rule is not yet measured:
# those calls keep splits per sequence, up to WAVES waves while a split holds LONG_SPLIT_BLOCKS
# key blocks (measured there: FP8 caches at B = 8, 32K keys on the H200, 2026-12-06, 2 splits
# 1.08-1.51x the time of 4; docs/decode.md).
LONG_SPLIT_BLOCKS = 64
WAVES = 4


def runs_of_splits(splits: int, batch: int) -> int | None:
  """The runs of S splits per sequence: S * B, or None (one program per sequence) for S = 1."""
  return None if splits == 1 else splits * batch


def choose_runs(info: DecodeInfo, *, block_m: int, block_kv: int,
                per_sm: int = 1) -> tuple[int | None, str]:
  """(runs, why): the balanced runs per kv head and row tile (`balanced_partition`), or None
  for one program per sequence and no merge, for programs of `block_m` rows stepping
  `block_kv` keys, `per_sm` of which fit one SM.

  Runs fill one wave (one program on each SM), never more runs than the batch's key blocks;
  from ONE_SPLIT_WAVES waves of one program per sequence, no split (one H100, 2026-12-08,
  docs/decode.md "Runs"). Off-GPU no split; per_sm > 1: _splits_per_sequence.
  """
  heads = info.num_kv_heads * -(-info.rows // block_m)
  if info.platform != "gpu":
    return None, "one program per sequence off-GPU (runs spread work over a GPU's SMs)"
  if per_sm > 1:
    splits, why = _splits_per_sequence(info, block_m=block_m, block_kv=block_kv)
    return runs_of_splits(splits, info.batch), why
  cores = info.num_cores or DEFAULT_NUM_CORES
  if info.batch * heads >= ONE_SPLIT_WAVES * cores:
    return None, (f"{info.batch * heads} programs of one sequence each fill "
                  f"{info.batch * heads / cores:.1f} waves on {cores} SMs")
  blocks = info.batch * -(-info.capacity // block_kv)
  runs = max(1, min(cores // heads, blocks))
  return runs, (f"{runs} runs x {heads} (kv heads x row tiles): one wave on {cores} SMs, "
                f"{blocks} {block_kv}-key blocks at most")


def _splits_per_sequence(info: DecodeInfo, *, block_m: int, block_kv: int) -> tuple[int, str]:
  """(S, why): S splits per sequence (S * B runs) for calls that fit several CTAs an SM.

  Splits multiply the B * K * ceil(M / block_m) programs up to one wave (one per SM), and up
  to WAVES waves while each split keeps LONG_SPLIT_BLOCKS key blocks; never more splits than
  key blocks.
  """
  programs = info.batch * info.num_kv_heads * -(-info.rows // block_m)
  blocks = -(-info.capacity // block_kv)
  cores = info.num_cores or DEFAULT_NUM_CORES
  one_wave = cores // programs
  long_splits = min(-(-WAVES * cores // programs), blocks // LONG_SPLIT_BLOCKS)
  splits = max(1, min(max(one_wave, long_splits), blocks))
  waves = splits * programs / cores
  why = (f"{programs} programs (B={info.batch} x K={info.num_kv_heads} x "
         f"{-(-info.rows // block_m)} row tiles) x {splits} splits of "
         f"{-(-blocks // splits)} {block_kv}-key blocks: {waves:.1f} waves on {cores} SMs "
         f"(splits per sequence where several CTAs fit an SM)")
  return splits, why


# ---------------------------------------------------------------------------------------------
# The balanced partition (traced: the same jnp code runs inside the Triton kernels, where the
# arrays are [B_pad] vectors, and in the xla path).


class Partition(NamedTuple):
  """Key blocks of a batch laid end to end and cut into runs of `per`, one run per program.

  Sequence b's blocks are global blocks starts[b] .. starts[b] + counts[b] - 1, and program i
  takes global blocks [i * per, (i + 1) * per). When `aligned`, each sequence's extent is
  padded to whole runs, so a program holds blocks of one sequence only.
  """

  starts: Any  # [B] int32
  per: Any  # int32 scalar
  aligned: Any  # bool scalar

  def extent(self, counts):
    """The global blocks a sequence of `counts` blocks spans: padded to whole runs if aligned."""
    return jnp.where(self.aligned, (counts + self.per - 1) // self.per * self.per, counts)


def balanced_partition(counts, num_programs: int) -> Partition:
  """Cuts the key blocks of all sequences (counts [B] int32, the blocks each sequence's
  queries see) into num_programs runs of per = ceil(total / num_programs) blocks (at least 1):
  no program holds more than 1 / num_programs of the batch's blocks, rounded up.

  When padding every sequence to whole runs still fits num_programs runs, it is padded
  (aligned): always with equal counts c and num_programs = S * B, which gives per =
  ceil(c / S) and each sequence's blocks in S splits exactly as a per-sequence split would.
  Otherwise runs cross sequence boundaries (a program may hold the end of one sequence, a few
  short ones and the start of the next).
  """
  per = jnp.maximum((jnp.sum(counts) + num_programs - 1) // num_programs, 1)
  padded = (counts + per - 1) // per * per
  aligned = jnp.sum(padded) <= num_programs * per
  extents = jnp.where(aligned, padded, counts)
  return Partition(jnp.cumsum(extents) - extents, per, aligned)


def program_sequences(part: Partition, counts, program):
  """[first, stop): the sequences program `program`'s run touches, in order. Empty sequences
  between two touched ones are included (their share of the run is empty)."""
  extents = part.extent(counts)
  lo = program * part.per
  hi = jnp.minimum(lo + part.per, jnp.sum(extents))
  return (jnp.sum((part.starts + extents <= lo).astype(jnp.int32)),
          jnp.sum((part.starts < hi).astype(jnp.int32)))


def sequence_share(part: Partition, start, count, program):
  """[lo, hi): the blocks of a sequence (its global start and its count) that program
  `program` holds, counted from the sequence's first visible block."""
  return (jnp.clip(program * part.per - start, 0, count),
          jnp.clip((program + 1) * part.per - start, 0, count))


def sequence_slots(part: Partition, start, count, seq):
  """[lo, hi): the partial slots of sequence `seq` (its global start and its count).

  Program i writes its share of sequence b to slot i + b. The (program, sequence) pairs that
  hold blocks form a staircase (each step moves to the next program or to a later sequence),
  so i + b grows along it and no two pairs share a slot; B + num_programs - 1 slots hold all.
  """
  first = start // part.per
  last = (start + count - 1) // part.per
  return first + seq, jnp.where(count > 0, last + 1, first) + seq
