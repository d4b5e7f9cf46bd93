"""Tiling arithmetic shared by the blocked backends: padding to whole blocks, and which blocks
of a tiled score matrix a band of diagonals or packed segment ids leave to compute.

Causal masking and sliding windows are both a band `lo <= j - i <= hi` of the [T, S] score
matrix (see `AttentionParams.band`). For a block of rows, the blocks of columns split into three
runs, which the blocked kernels iterate as three loops:

  [first, full_lo)    crosses the band's lower edge: scores need the element mask
  [full_lo, full_hi)  wholly inside the band: no element mask (unless data-dependent masks apply)
  [full_hi, last)     crosses the upper edge: element mask

and everything outside [first, last) is skipped, so a window of w tokens costs T·w, not T·S.
The same arithmetic serves the transposed direction (key blocks owning a run of query blocks)
with the band mirrored.

Segment ids (packed documents) narrow [first, last) further with data: `segment_block_limits`
keeps, for each block, the hull of the blocks whose id ranges overlap its own, so a packed batch
of documents costs Σ len², not (Σ len)², when the ids are sorted (as packing makes them). It also
keeps the run of blocks that lie wholly inside the same document as the owner block; the middle
run is narrowed to it, so inside a long document only the blocks on its edges pay for the
segment-id test.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_flash.call import KV_PAD_SEGMENT, Q_PAD_SEGMENT


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  return cdiv(a, b) * b


def pad_axis(x: jax.Array | None, axis: int, size: int, value=0) -> jax.Array | None:
  """Pads `x` along `axis` at the end up to `size` (no copy when already that size)."""
  if x is None or x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def pad_segments(
    q_seg: jax.Array | None, kv_seg: jax.Array | None, t_pad: int, s_pad: int
) -> tuple[jax.Array | None, jax.Array | None]:
  """Pads segment ids so that padded queries and padded keys never match anything."""
  return pad_axis(q_seg, 1, t_pad, Q_PAD_SEGMENT), pad_axis(kv_seg, 1, s_pad, KV_PAD_SEGMENT)


def mirrored(band: tuple[int | None, int | None]) -> tuple[int | None, int | None]:
  """The band of i - j given that of j - i."""
  lo, hi = band
  return (None if hi is None else -hi), (None if lo is None else -lo)


def band_mask(rows, cols, band: tuple[int | None, int | None]):
  """bool [len(rows), len(cols)] (broadcasting rows[:, None], cols[None, :]): cols - rows in band;
  None when the band is unbounded."""
  lo, hi = band
  mask = None
  diff = cols[None, :] - rows[:, None]
  if lo is not None:
    mask = diff >= lo
  if hi is not None:
    mask = diff <= hi if mask is None else mask & (diff <= hi)
  return mask


def block_runs(owner, *, owner_block: int, other_block: int, num_other: int,
               band: tuple[int | None, int | None], element_mask: bool, other_len: int | None,
               limits=None, full_limits=None, div: Callable = lax.div,
               maximum: Callable = jnp.maximum, minimum: Callable = jnp.minimum):
  """(first, full_lo, full_hi, last): the runs of other-axis blocks that owner block `owner` visits.

  Args:
    owner: index of the owning block (a traced int32 scalar in kernels, or a numpy array).
    owner_block, other_block, num_other: block sizes and the number of other-axis blocks.
    band: (lo, hi) bounds of other_pos - owner_pos (None: unbounded).
    element_mask: data-dependent masks apply, so no block may skip the mask test.
    other_len: the other axis' true length (None: num_other whole blocks): where it is shorter,
      blocks from other_len // other_block on hold padding and need the mask (a length padded
      for other tiles too may add whole blocks past the tail's).
    limits: optional (first, last) from `segment_block_limits` to intersect with.
    full_limits: optional (full_first, full_last) from `segment_block_limits`: other blocks that
      share the owner's single segment id at every position. When `element_mask` is due to
      segment ids alone, the unmasked middle run is narrowed to them instead of emptied.
    div, maximum, minimum: integer ops (numerators are kept non-negative, so truncating division
      is floor division); pass numpy's for static use.
  """
  lo, hi = band
  o_first, o_last = owner * owner_block, (owner + 1) * owner_block - 1
  first = 0 if lo is None else div(maximum(o_first + lo, 0), other_block)
  last = num_other if hi is None else minimum(
      num_other, div(maximum(o_last + hi + other_block, 0), other_block))
  # Fully inside: the block's first position - the owner's last >= lo, and last - first <= hi.
  full_lo = 0 if lo is None else div(maximum(o_last + lo + other_block - 1, 0), other_block)
  full_hi = num_other if hi is None else div(maximum(o_first + hi + 1, 0), other_block)
  if limits is not None:
    first, last = maximum(first, limits[0]), minimum(last, limits[1])
  # An owner that sees no other block (queries past every key under a window, say) would get
  # first > last, even first > num_other; callers that loop over [0, first) to zero the blocks
  # they skip (the Triton dQ kernel's dbias) would then write past the row.
  first = minimum(first, last)
  if other_len is not None and other_len < num_other * other_block:
    full_hi = minimum(full_hi, other_len // other_block)
  if element_mask and full_limits is None:
    full_lo = full_hi = last
  elif element_mask:  # an empty intersection leaves a zero-length middle run after the clamps
    full_lo, full_hi = maximum(full_lo, full_limits[0]), minimum(full_hi, full_limits[1])
  full_lo = minimum(maximum(full_lo, first), last)
  full_hi = minimum(maximum(full_hi, full_lo), last)
  return first, full_lo, full_hi, last


def fraction_computed(*, q_len: int, kv_len: int, block_q: int, block_kv: int,
                      band: tuple[int | None, int | None]) -> float:
  """Fraction of the (query block, key block) pairs a blocked kernel visits under `band`."""
  nq, nk = -(-q_len // block_q), -(-kv_len // block_kv)
  first, _, _, last = block_runs(np.arange(nq), owner_block=block_q, other_block=block_kv,
                                 num_other=nk, band=band, element_mask=False, other_len=None,
                                 div=np.floor_divide, maximum=np.maximum, minimum=np.minimum)
  visited = np.maximum(np.broadcast_to(last, (nq,)) - np.broadcast_to(first, (nq,)), 0).sum()
  return float(visited) / (nq * nk)


def segment_block_limits(q_seg: jax.Array, kv_seg: jax.Array, *, block_q: int, block_kv: int):
  """Per block, the hull of the other axis's blocks that may share a segment id with it, and the
  run of those that share its one id everywhere.

  Args:
    q_seg, kv_seg: [B, T_pad] / [B, S_pad] int32 ids, padded positions with the pad ids.
    block_q, block_kv: block sizes dividing T_pad / S_pad.

  Returns:
    kv_limits [B, nq, 4] and q_limits [B, nk, 4] int32 (first, last, full_first, full_last):
    blocks outside [first, last) share no id (a superset of the visible blocks for any ids, exact
    for sorted ones; an all-padding block gets (0, 0)); in [full_first, full_last) every
    position of both blocks carries the same real id, so the segment test can be skipped there
    (empty when the owner block holds several ids or padding, or those blocks are not
    contiguous).
  """
  def id_range(seg, block, pad):
    x = seg.reshape(seg.shape[0], -1, block)
    real = x != pad
    info = jnp.iinfo(jnp.int32)
    lo, hi = jnp.where(real, x, info.max).min(-1), jnp.where(real, x, info.min).max(-1)
    single = real.all(-1) & (lo == hi)  # one real id at every position
    return lo, hi, single

  q_lo, q_hi, q_single = id_range(q_seg, block_q, Q_PAD_SEGMENT)  # [B, nq]
  k_lo, k_hi, k_single = id_range(kv_seg, block_kv, KV_PAD_SEGMENT)  # [B, nk]
  overlap = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
  same = q_single[:, :, None] & k_single[:, None, :] & (q_lo[:, :, None] == k_lo[:, None, :])

  def hull(ov):  # [B, n, m] -> [B, n, 2]
    m = ov.shape[-1]
    any_ = ov.any(-1)
    first = jnp.argmax(ov, -1)
    last = m - jnp.argmax(ov[..., ::-1], -1)
    return jnp.stack([jnp.where(any_, first, 0), jnp.where(any_, last, 0)], -1).astype(jnp.int32)

  def run(sm):  # the hull of `sm`, emptied unless every block in it is in `sm`
    h = hull(sm)
    whole = sm.sum(-1, dtype=jnp.int32) == h[..., 1] - h[..., 0]
    return jnp.where(whole[..., None], h, 0)

  def limits(ov, sm):
    return jnp.concatenate([hull(ov), run(sm)], -1)

  return (limits(overlap, same),
          limits(jnp.swapaxes(overlap, 1, 2), jnp.swapaxes(same, 1, 2)))
