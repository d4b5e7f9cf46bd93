"""Block-sparse masks (pallas_flash.masks.BlockMask) in the sm90 kernels.

A kernel with a block mask streams, per CTA tile, the other axis' blocks listed in a table,
partial ones first: step j is block table[b, tile, j], steps [0, num_partial) evaluate the mask
function on the tile, the others are wholly visible. The tables are at the kernel's own tiles
(CTA rows x streamed block), derived in XLA from the BlockMask's block states (`kernel_tables`),
so a mask built at any blocks runs: a kernel tile is skipped when every mask block it overlaps
is, unmasked when every one is full, and partial otherwise. Mask blocks equal to or dividing the
kernel's tiles (64 x 64 divides all of them) lose nothing; coarser or straddling ones turn some
of the kernel's tiles partial (computed and masked, still exact).

The mask function is evaluated on a [rows, cols] tile in the WGMMA layout from position iotas
and, for SegmentMask, the ids of the rows (ROW) and columns (COL) loaded from GMEM, for the
functions of pallas_flash.masks: CausalMask, LocalMask, SegmentMask and PrefixLMMask combined
with & and | (`SUPPORTED_FNS`; others are refused, `fn_reason`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_flash import masks
from pallas_flash.mosaic_gpu.sm90 import common
from pallas_flash.mosaic_gpu.sm90.common import COL, ROW

# The mask functions the kernels evaluate on a tile.
SUPPORTED_FNS = (masks.CausalMask, masks.LocalMask, masks.SegmentMask, masks.PrefixLMMask,
                 masks.AndMask, masks.OrMask)


def fn_reason(types) -> str | None:
  """Why the kernels cannot evaluate a mask function with nodes of these classes
  (AttentionParams.block_mask_fn_types), or None."""
  other = sorted({t.__name__ for t in types if t not in SUPPORTED_FNS})
  if not other:
    return None
  return (f"block_mask function {', '.join(other)} is not evaluated in the wgmma kernels (they "
          "take CausalMask, LocalMask, SegmentMask and PrefixLMMask combined with & and |)")


@dataclasses.dataclass(frozen=True)
class Info:
  """What a kernel needs statically about its block mask (KernelParams.block_mask): the mask
  function's pytree structure, the kind (masks.Q, KV, BATCH) of each leaf and the batch size
  of its tables and leaves (1: shared by the batch)."""

  treedef: Any
  kinds: tuple[str, ...]
  batch: int

  @staticmethod
  def of(bm: masks.BlockMask) -> Info:
    return Info(jax.tree_util.tree_structure(bm.mask_fn), bm.mask_fn.leaf_kinds(), bm.batch)


class Refs(NamedTuple):
  """A kernel's block-mask inputs (GMEM): table [B', tiles, n] int32 (streamed blocks, partial
  ones first), counts [B', tiles, 2] int32 (active, partial) and the mask function's leaves
  (Q-indexed [B', Tp], KV-indexed [B', Sp], per batch [B'])."""

  table: Any
  counts: Any
  leaves: tuple


# Units past the mask's query coverage: padded rows, which no state counts (BlockMask.build).
_NO_ROWS = 3


def _regrid(state, block: int, tile: int, n_tiles: int, axis: int):
  """state [B, .., n, ..] at `block`-sized blocks along `axis` -> [B, .., n_tiles, ..] at
  `tile`-sized tiles: FULL where every overlapped block is, SKIPPED where every one is,
  PARTIAL otherwise. Past the mask's coverage, keys (axis 2) are padding and count as
  SKIPPED; query rows (axis 1) are padding and count as nothing (a tile of them only is
  SKIPPED)."""
  g = math.gcd(block, tile)
  x = jnp.repeat(state, block // g, axis=axis)  # g-sized units
  units = n_tiles * (tile // g)
  if x.shape[axis] < units:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, units - x.shape[axis])
    x = jnp.pad(x, pad, constant_values=_NO_ROWS if axis == 1 else masks.SKIPPED)
  x = lax.slice_in_dim(x, 0, units, axis=axis)
  x = x.reshape(*x.shape[:axis], n_tiles, tile // g, *x.shape[axis + 1:])
  none = x == _NO_ROWS
  full = ((x == masks.FULL) | none).all(axis + 1) & ~none.all(axis + 1)
  skipped = ((x == masks.SKIPPED) | none).all(axis + 1)
  return jnp.where(full, masks.FULL, jnp.where(skipped, masks.SKIPPED,
                                               masks.PARTIAL)).astype(jnp.int8)


def kernel_tables(bm: masks.BlockMask, *, q_tile: int, kv_tile: int, t_pad: int, s_pad: int,
                  by_q: bool):
  """(table, counts) of `bm` at a kernel's tiles: q_tile query rows by kv_tile keys over
  t_pad x s_pad. by_q: one row per query tile listing key tiles (forward, dQ); else one per key
  tile listing query tiles (dK/dV). table [B', owners, others] int32 (partial tiles first,
  each ascending), counts [B', owners, 2] int32 (active, partial)."""
  state = _regrid(bm.block_state, bm.block_q, q_tile, t_pad // q_tile, 1)
  state = _regrid(state, bm.block_kv, kv_tile, s_pad // kv_tile, 2)
  if not by_q:
    state = jnp.swapaxes(state, 1, 2)
  table, count, num_partial = masks.block_tables(state)
  return table, jnp.stack([count, num_partial], -1).astype(jnp.int32)


def inputs(bm: masks.BlockMask, *, q_tile: int, kv_tile: int, t_pad: int, s_pad: int,
           by_q: bool) -> tuple:
  """A kernel's block-mask operands, Refs' order: table, counts, then the mask function's leaves
  padded to t_pad / s_pad (their last value repeated: the key tail is masked by position)."""
  table, counts = kernel_tables(bm, q_tile=q_tile, kv_tile=kv_tile, t_pad=t_pad, s_pad=s_pad,
                                by_q=by_q)
  leaves = jax.tree_util.tree_leaves(masks.pad_leaves(bm.mask_fn, t_pad, s_pad))
  return (table, counts, *leaves)


def backward_inputs(bm: masks.BlockMask | None, kp_dq, kp_dkdv, *, dq_tiles: tuple[int, int],
                    dkdv_tiles: tuple[int, int], t_pad: int, s_pad: int):
  """(kp_dq, kp_dkdv, dQ operands, dK/dV operands) of a backward's two kernels: their
  KernelParams with the mask's Info and `inputs` at each kernel's (q tile, kv tile), by q
  tile for the dQ kernel and by kv tile for the dK/dV one; unchanged and () without a mask."""
  if bm is None:
    return kp_dq, kp_dkdv, (), ()
  info = Info.of(bm)
  return (dataclasses.replace(kp_dq, block_mask=info),
          dataclasses.replace(kp_dkdv, block_mask=info),
          inputs(bm, q_tile=dq_tiles[0], kv_tile=dq_tiles[1], t_pad=t_pad, s_pad=s_pad,
                 by_q=True),
          inputs(bm, q_tile=dkdv_tiles[0], kv_tile=dkdv_tiles[1], t_pad=t_pad, s_pad=s_pad,
                 by_q=False))


def with_block_refs(make_body, num_inputs: int, num_refs: int):
  """A plgpu.kernel body whose call passes `num_refs` block-mask operands (`inputs`) after its
  first `num_inputs` inputs: make_body(Refs) gives the body of the call without them."""
  def body(*refs):
    blk = refs[num_inputs:num_inputs + num_refs]
    return make_body(Refs(blk[0], blk[1], tuple(blk[2:])))(*refs[:num_inputs],
                                                          *refs[num_inputs + num_refs:])
  return body


class Sparse(NamedTuple):
  """One CTA tile's view of its table: `steps` blocks, the first `masked` of them partial
  (at least one step for forms that need one: an empty tile then masks block 0, which no real
  row sees), the block of step j (`block`) and the element mask (`mask`)."""

  refs: Refs
  info: Info
  b: Any  # the batch index into the tables and leaves (0 when they are shared)
  tile: Any
  steps: Any
  masked: Any

  def block(self, j):
    return self.refs.table[self.b, self.tile, j]

  def mask(self, row0, col0, shape, kv_len: int, kv_tail: bool, *, transposed: bool = False):
    """[rows, cols] bool in the WGMMA layout: the mask function on the tile whose rows start at
    position row0 and columns at col0 (queries by keys, or keys by queries when transposed),
    and keys past kv_len hidden (kv_tail: there is a padded key tail)."""
    if transposed:  # [rows, cols] iotas: fewer spills in the dK/dV kernel (deviceless ptxas)
      r = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row0
      c = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + col0
    else:  # position vectors broadcast to the tile (as common.alibi): none in the dQ kernel
      rows = plgpu.broadcasted_iota(jnp.int32, (shape[0],), 0, layout=ROW) + row0
      cols = plgpu.broadcasted_iota(jnp.int32, (shape[1],), 0, layout=COL) + col0
      r = lax.broadcast_in_dim(rows, shape, [0])
      c = lax.broadcast_in_dim(cols, shape, [1])
    qi, kj = (c, r) if transposed else (r, c)
    fn = self.info.treedef.unflatten(self.refs.leaves)
    ctx = _TileCtx(self.b, row0, col0, shape, transposed)
    visible = _evaluate(fn, qi, kj, ctx)
    if kv_tail:
      visible = visible & (kj < kv_len)
    return visible


def sparse(refs: Refs, info: Info, b, tile, *, min_steps: int = 0) -> Sparse:
  """The Sparse view of CTA tile `tile` of batch entry b; min_steps 1: an empty tile runs one
  masked step (a forward CTA needs one to write o = 0 and lse = -inf)."""
  bb = b if info.batch > 1 else 0
  count, num_partial = refs.counts[bb, tile, 0], refs.counts[bb, tile, 1]
  if min_steps:
    empty = count == 0
    return Sparse(refs, info, bb, tile, jnp.maximum(count, min_steps),
                  jnp.where(empty, min_steps, num_partial))
  return Sparse(refs, info, bb, tile, count, num_partial)


class _TileCtx(NamedTuple):
  b: Any
  row0: Any
  col0: Any
  shape: tuple
  transposed: bool


def _ids(ref, b, pos0, n: int, layout):
  return plgpu.load(ref.at[b, pl.ds(pos0, n)], layout=layout, optimized=False)


def _evaluate(fn, qi, kj, ctx: _TileCtx):
  """The mask function `fn` (its leaves GMEM refs) on query positions qi and key positions kj
  [rows, cols]."""
  if isinstance(fn, masks.OrMask):
    return _evaluate(fn.a, qi, kj, ctx) | _evaluate(fn.b, qi, kj, ctx)
  if isinstance(fn, masks.AndMask):
    local = [m for m in (fn.a, fn.b) if isinstance(m, masks.LocalMask)]
    if local and any(isinstance(m, masks.CausalMask) for m in (fn.a, fn.b)):
      # causal & local(left, right) is the band (left, 0): one compare (common.band)
      return common.band(qi, kj, local[0].left, 0)
    return _evaluate(fn.a, qi, kj, ctx) & _evaluate(fn.b, qi, kj, ctx)
  if isinstance(fn, masks.CausalMask):
    return kj <= qi
  if isinstance(fn, masks.LocalMask):
    return common.band(qi, kj, fn.left, fn.right)
  if isinstance(fn, masks.PrefixLMMask):
    return (kj < fn.prefix_len[ctx.b]) | (kj <= qi)
  if isinstance(fn, masks.SegmentMask):
    rows_ref, cols_ref = (fn.kv_seg, fn.q_seg) if ctx.transposed else (fn.q_seg, fn.kv_seg)
    rows = _ids(rows_ref, ctx.b, ctx.row0, ctx.shape[0], ROW)
    cols = _ids(cols_ref, ctx.b, ctx.col0, ctx.shape[1], COL)
    return (lax.broadcast_in_dim(rows, ctx.shape, [0])
            == lax.broadcast_in_dim(cols, ctx.shape, [1]))
  raise NotImplementedError(fn_reason((type(fn),)))
