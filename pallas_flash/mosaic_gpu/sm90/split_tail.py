"""The last wave of the forward's grid of equal tiles, split along the keys (the split tail).

A non-causal forward launches N equal tiles, one CTA each, W of them at a time (W = the SM
count). When N mod W ≠ 0 its last wave leaves SMs idle for one tile's time: 16 heads at 16K are
2048 tiles, 15.5 waves of 132, ~3 % of the kernel. The split tail runs the first N − (N mod W)
tiles one CTA each, in the grid's launch order, and each tile of the last wave as `parts` CTAs,
part p streaming key blocks [p·n / parts, (p+1)·n / parts) of its n and writing a float32
partial (o, lse); XLA merges the parts afterwards (MosaicConfig.fwd_split_tail).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import jax.numpy as jnp
from jax import lax

from pallas_flash.mosaic_gpu.config import MosaicConfig
from pallas_flash.mosaic_gpu.sm90 import common

# tail_parts' cost model, in the time of one forward key-block step at head_dim 128 (two
# 64-row warpgroups against 128 keys): the fixed cost of a CTA (prologue, epilogue, the
# partial's store) and of merging one float32 [2, 64, D] partial tensor (an XLA pass over the
# partials and the scatter into the output). Fitted to H200 runs of the forward: at
# 1x16384x16x128 9 parts gained 2.1 %, 5 1.6 %, 3 0.9 %, 17 0.4 %; at 1x8192x16x128 (100 tiles
# in the last wave of 7.8) 5 parts gained nothing.
PART_OVERHEAD_BLOCKS = 3.0
MERGE_OVERHEAD_BLOCKS = 6.0
MAX_TAIL_PARTS = 64


@dataclasses.dataclass(frozen=True)
class TailSplit:
  """How a grid of `tiles` equal tiles splits its last wave.

  Tiles are numbered in launch order (`coords`); the first `main` run one CTA each, and each
  later one runs as `parts` CTAs, part p streaming steps [p·n / parts, (p+1)·n / parts) of its
  n. The CTA after the main ones with index u is part u mod parts of tile main + u // parts,
  and writes its partial result to row u of the partial outputs.
  """

  tiles: int
  main: int
  parts: int
  batch: int
  heads: int
  num_tiles: int  # q tiles per head
  heads_fastest: bool

  @property
  def ctas(self) -> int:
    return self.main + (self.tiles - self.main) * self.parts

  @property
  def tail_tiles(self) -> int:
    return self.tiles - self.main

  def coords(self, t, div=lax.div, rem=lax.rem):
    """(b, h, tile) of tile t: batch fastest, then tiles of one head (heads_fastest: heads),
    as common.launch_grid's grid dispatches them."""
    b, r = rem(t, self.batch), div(t, self.batch)
    if self.heads_fastest:
      return b, rem(r, self.heads), div(r, self.heads)
    return b, div(r, self.num_tiles), rem(r, self.num_tiles)

  def tail_coords(self):
    """(b, h, tile) int arrays [tail_tiles] of the split tiles, in partial-row order."""
    return self.coords(np.arange(self.main, self.tiles), div=np.floor_divide,
                       rem=np.remainder)

  def this_cta(self, axis: str = "t"):
    """In a kernel launched on grid (ctas,) named (axis,): (is_part, part_row, (b, h, tile))
    of this CTA; part_row (0 for the main CTAs) indexes the partial outputs."""
    u = lax.axis_index(axis) - self.main
    is_part = u >= 0
    row = jnp.maximum(u, 0)
    tile = jnp.where(is_part, self.main + lax.div(row, self.parts), lax.axis_index(axis))
    return is_part, row, self.coords(tile)

  def bounds(self, is_part, row, n):
    """[lo, hi) of the n steps of a tile that this CTA streams (all of them unless a part)."""
    p = lax.rem(row, self.parts)
    lo = jnp.where(is_part, lax.div(p * n, self.parts), 0)
    hi = jnp.where(is_part, lax.div((p + 1) * n, self.parts), n)
    return lo, hi


def tail_parts(tiles: int, steps: int, wave: int) -> int:
  """How many CTAs each tile of the last wave runs as (1: no split).

  tiles: tiles of the launch; steps: key-block steps per tile; wave: CTAs running at once.
  Unsplit, the r = tiles mod wave tiles of the last wave take one tile's time, c = steps +
  PART_OVERHEAD_BLOCKS; as `parts` CTAs each they run in ceil(r·parts / wave) rounds of
  c' = steps / parts + PART_OVERHEAD_BLOCKS, plus the merge. Returns the parts (at most
  `steps`, so that every part streams one) that minimise that, if it is less."""
  r = tiles % wave
  if not r:
    return 1
  best, best_cost = 1, steps + PART_OVERHEAD_BLOCKS
  for parts in range(2, min(steps, MAX_TAIL_PARTS) + 1):
    rounds = -(-r * parts // wave)
    cost = rounds * (steps / parts + PART_OVERHEAD_BLOCKS) + MERGE_OVERHEAD_BLOCKS
    if cost < best_cost:
      best, best_cost = parts, cost
  return best


def plan(num_tiles: int, heads: int, batch: int, steps: int, *, heads_fastest: bool,
         config: MosaicConfig) -> TailSplit | None:
  """The split of a launch of batch · heads · num_tiles tiles of `steps` steps, or None where
  none pays (whole waves, or the cost model's choice is 1). config.debug.tail_parts forces the
  parts (capped at `steps`) and config.debug.wave_ctas the wave (0: the GPU's SM count)."""
  tiles = batch * heads * num_tiles
  wave = config.debug.wave_ctas or common.sm_count()
  parts = min(config.debug.tail_parts, steps) or tail_parts(tiles, steps, wave)
  if parts < 2 or not tiles % wave:
    return None
  return TailSplit(tiles=tiles, main=tiles - tiles % wave, parts=parts, batch=batch,
                   heads=heads, num_tiles=num_tiles, heads_fastest=heads_fastest)


def set_tiles(x, values, split: TailSplit):
  """x [B, R, H, D] with the rows of each split tile replaced: values [tail_tiles, rows, D],
  a tile's rows being rows·tile .. rows·(tile + 1) - 1 of head h and batch entry b; rows past
  R (an unpadded x) are dropped."""
  b, h, tile = split.tail_coords()
  rows_per_tile = values.shape[1]
  rows = tile[:, None] * rows_per_tile + np.arange(rows_per_tile)
  return x.at[b[:, None], rows, h[:, None]].set(values.astype(x.dtype), unique_indices=True,
                                                 mode="drop")
