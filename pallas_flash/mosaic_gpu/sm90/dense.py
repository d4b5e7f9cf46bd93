"""The dense bias and boolean mask ([B|1, H|1, T, S]) of the sm90 kernels.

Each kernel that forms scores (forward, dQ, dK/dV) loads the [rows, cols] tile of the bias
and the bits of the mask's tile (`pack_mask`: one bit a key, laid out so that each thread
loads the 32-bit words of its own scores) that match its score tile straight from GMEM into
the wgmma accumulator layout where they are added to the scores (`load` says why not
earlier); the forward's 16-bit bias tiles instead come through a shared-memory ring that its
producer fills beside K and V (`BiasRing`: 1.28x the forward's speed of 4-byte GMEM loads that
each span 8 rows, one H100, 2026-12-06), and the dK/dV kernel's stream in beside Q
(`StreamedBias`), each warpgroup reading its transposed half [keys, queries] from shared
memory; a bias of other dtypes is loaded there in the transposed accumulator layout, whose
vectors run along the keys (contiguous in GMEM), and changed to the accumulator layout in
registers. The dK/dV kernel's mask bits are maskᵀ's, packed by XLA. Broadcast axes (size 1)
read index 0. The bias is added after the soft cap and ALiBi (the default "cap_then_bias" order;
with "bias_then_cap" before the cap and the mask after it: `add`'s cap); masked scores become
-inf, so P is 0 there in every kernel and a fully masked row gives o = 0, lse = -inf and zero
gradients. dbias = dS (the raw scores' dS with "bias_then_cap"), written by the dQ kernel to a
[B, H, Tp, Sp] buffer (`dbias_tile`, through O's shared-memory tile and TMA stores where it
fits: `o_tile_stages`; in the bias's dtype where that is a 16-bit float, else float32:
`dbias_dtype`) and summed over the broadcast axes by XLA in float32, which also selects the
zeros of the key blocks the kernel skips; or, for a bias broadcast over the batch, added by
the batch's CTAs into one zeroed batch entry by TMA reduce-adds (`dbias_form`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_flash import _tiling, masks, reference
from pallas_flash.call import AttentionParams, FeatureArrays


class DenseRefs(NamedTuple):
  """A kernel's dense inputs (GMEM): the bias [B|1, H|1, Tp, Sp] in its dtype and the mask's
  bits [B|1, H|1, Tp, Sp'/16] int32 (`pack_mask`; the dK/dV kernel's of maskᵀ), None where the
  call has none."""

  bias: Any
  mask: Any


class MaskBits(NamedTuple):
  """A score tile's mask bits as loaded: words, one [rows, MASK_WORDS] int32 tile (WGMMA
  layout) for each equal chunk of the tile's columns (within one MASK_BLOCK), and shift, the
  bit of the tile's first 8 columns (column c's bit is (shift + c // 8) mod 16). Only arrays:
  a loop may carry it."""

  words: tuple
  shift: Any


# The mask's bits (`pack_mask`): a row's 128-key block is MASK_WORDS int32 words, word j
# holding keys 8k + j at bit k (k = 0..15): the keys that the wgmma accumulator layout gives
# the thread holding column j of each 8, so a [rows, MASK_WORDS] tile in that layout brings a
# thread exactly the words of its own scores (two 8-byte loads a step, not 32 of 2 bytes).
MASK_BLOCK, MASK_WORDS = 128, 8
_COL = plgpu.Layout.WGMMA.reduce(0)  # common.COL (common imports this module)


def pack_mask(mask, *, transposed: bool = False):
  """mask [B|1, H|1, Tp, Sp] (bool or nonzero: visible) -> int32 [B|1, H|1, Tp, Sp'/16] bits
  (MASK_BLOCK's layout; Sp' = Sp rounded up to MASK_BLOCK, the padding hidden), or with
  `transposed` the bits of maskᵀ [.., Sp, Tp'/16] (the dK/dV kernel's [keys, queries] tiles):
  packed along the queries in mask's own layout, then the 16x smaller words transposed (XLA's
  fusion of the bool transpose with the packing took 310 µs at 4x4096x4096 on an H100)."""
  axis = 2 if transposed else 3
  mask = mask != 0
  mask = _tiling.pad_axis(mask, axis, _tiling.round_up(mask.shape[axis], MASK_BLOCK))
  n = mask.shape[axis]
  grouped = (n // MASK_BLOCK, MASK_BLOCK // MASK_WORDS, MASK_WORDS)
  blocks = mask.reshape(*mask.shape[:axis], *grouped, *mask.shape[axis + 1:])
  bits = jnp.left_shift(1, jnp.arange(MASK_BLOCK // MASK_WORDS, dtype=jnp.int32))
  bits = bits.reshape(-1, *([1] * (blocks.ndim - axis - 2)))
  words = jnp.sum(blocks.astype(jnp.int32) * bits, axis=axis + 1, dtype=jnp.int32)
  words = words.reshape(*mask.shape[:axis], n // MASK_BLOCK * MASK_WORDS,
                        *mask.shape[axis + 1:])
  return jnp.swapaxes(words, 2, 3) if transposed else words


def _padded(arrays: FeatureArrays | None, params: AttentionParams, t_pad: int, s_pad: int):
  """(bias, mask) padded to [.., t_pad, s_pad] (no copy where T and S fill the tiles; padded
  keys are masked by the kernels' tail mask, padded queries dropped), None where absent."""
  def pad(x):
    return _tiling.pad_axis(_tiling.pad_axis(x, 2, t_pad), 3, s_pad)
  return (pad(arrays.bias) if params.has_bias else None,
          pad(arrays.mask) if params.has_mask else None)


def _present(*xs) -> tuple:
  return tuple(x for x in xs if x is not None)


def inputs(arrays: FeatureArrays | None, params: AttentionParams, t_pad: int,
           s_pad: int) -> tuple:
  """The forward's dense inputs, each where the call has it: the bias (its dtype) and the
  mask's bits (`pack_mask`), padded to [.., t_pad, s_pad]."""
  bias, mask = _padded(arrays, params, t_pad, s_pad)
  return _present(bias, None if mask is None else pack_mask(mask))


def backward_inputs(arrays: FeatureArrays | None, params: AttentionParams, t_pad: int,
                    s_pad: int) -> tuple[tuple, tuple]:
  """(the dQ kernel's dense inputs, the dK/dV kernel's): one padded bias for both; the mask's
  bits and, for the dK/dV kernel's [keys, queries] tiles, maskᵀ's."""
  bias, mask = _padded(arrays, params, t_pad, s_pad)
  if mask is None:
    return _present(bias), _present(bias)
  return _present(bias, pack_mask(mask)), _present(bias, pack_mask(mask, transposed=True))


class BiasRing(NamedTuple):
  """The forward's shared-memory ring of 16-bit bias tiles: tiles [stages, 2, block_q,
  block_kv] (a CTA step's rows, one half per consumer warpgroup, TMA'd by the producer beside
  K and V and freed with V), ready [2·stages] (one barrier per half), and the warpgroup that
  reads (None on the producer's side)."""

  tiles: Any
  ready: Any
  wg: Any = None


def in_shared_memory(dense: tuple, kp) -> bool:
  """Whether a kernel may take the call's dense bias through shared memory (the forward's
  BiasRing, the dK/dV kernel's StreamedBias) where its tiles fit: a 16-bit bias (dense: the
  kernel's dense inputs, the bias first where kp.dense[0]) in a kernel that is not profiled
  (kp.profile_dir: the profiler's event buffer takes the room)."""
  return (kp.dense[0] and jnp.dtype(dense[0].dtype).itemsize == 2
          and not kp.profile_dir)


def ring_scratch(dtype, stages: int, block_q: int, block_kv: int, transforms) -> list:
  """The forward's scratch for a BiasRing: the tiles (with `transforms`, common.smem_transforms'
  swizzle, so that a warpgroup reads its half into the accumulator layout without bank
  conflicts) and the ready barriers."""
  tiles = plgpu.SMEM((stages, 2, block_q, block_kv), dtype, transforms=transforms)
  return [tiles, plgpu.Barrier(num_barriers=2 * stages)]


def ring_bytes(dtype, stages: int, block_q: int, block_kv: int) -> int:
  """Shared memory of a BiasRing's tiles [stages, 2, block_q, block_kv], and of a
  StreamedBias's [stages, block_q, 2·block_kv]."""
  return stages * 2 * block_q * block_kv * jnp.dtype(dtype).itemsize


def fill_ring(dense: DenseRefs, ring: BiasRing, b, h, row0, col0, slot, shape):
  """TMA-loads the bias tile [2·rows, cols] at (row0, col0) of batch b and head h into ring
  slot `slot`, one copy per warpgroup's half (shape: a half's [rows, cols])."""
  rows, cols = shape
  b, h = _batch_head(dense.bias, b, h)
  for half in range(2):
    src = dense.bias.at[b, h, pl.ds(row0 + half * rows, rows), pl.ds(col0, cols)]
    plgpu.copy_gmem_to_smem(src, ring.tiles.at[slot, half], ring.ready.at[2 * slot + half])


def wait_ring(ring: BiasRing, slot):
  """Waits until this warpgroup's half of ring slot `slot` is filled; returns that half."""
  plgpu.barrier_wait(ring.ready.at[2 * slot + ring.wg])
  return ring.tiles.at[slot, ring.wg]


class StreamedBias(NamedTuple):
  """The dK/dV kernel's 16-bit bias tiles, streamed beside Q (kv_stream's query streams):
  tiles [stages, block_q, 2·block_kv] (a step's queries by the CTA's keys, TMA'd by the
  producer; its ready barriers are waited for with Q's), free (both consumer warpgroups
  arrive once their half is in registers) and the warpgroup that reads."""

  tiles: Any
  free: Any
  wg: Any


def stream_scratch(dtype, stages: int, block_q: int, block_kv: int) -> list:
  """The dK/dV kernel's scratch for a StreamedBias: the tiles (TMA's 128-byte swizzle, in
  64-column tiles, so that a warpgroup's half is whole tiles), then ready and free
  barriers."""
  tiles = plgpu.SMEM((stages, block_q, 2 * block_kv), dtype,
                     transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
  return [tiles, plgpu.Barrier(num_barriers=stages),
          plgpu.Barrier(num_arrivals=2, num_barriers=stages)]


def stream_rows(bias_ref, b, block_q: int, block_kv: int, k0, index):
  """rows(t): the GMEM slice of step t's StreamedBias tile, bias_ref[b, h, queries of q block
  i, keys k0 .. k0 + 2·block_kv) with (i, h) = index(t) (broadcast axes at 0)."""
  def rows(t):
    i, h = index(t)
    bb, hh = _batch_head(bias_ref, b, h)
    return bb, hh, pl.ds(i * block_q, block_q), pl.ds(k0, 2 * block_kv)
  return rows


class StagedBias(NamedTuple):
  """The dQ kernel's 16-bit bias tile [block_q, block_kv] in this warpgroup's O tile
  (`o_tile_stages`), TMA-loaded by the warpgroup itself at each step's start
  (`fill_staged`), and its ready barrier."""

  tile: Any
  ready: Any


def o_tile_stages(kp, arrays: FeatureArrays | None, *, with_o: bool):
  """The dQ kernel's KernelParams kp with o_tile_stages: whether its O tile [block_q, Dv],
  which exists where the kernel loads O (with_o) and which nothing reads once the row
  statistics are formed, stages each step's bias tile in (StagedBias) and its dS out to
  dbias (`dbias_tile`, TMA stores): where the tile has their shape (Dv = block_kv: a narrower
  view is not contiguous, which TMA needs) and dtype (a bias in the inputs' 16-bit dtype,
  hence dbias_dtype's too). Elsewhere each thread loads its bias entries from GMEM and stores
  its dS entries there, 4 bytes an instruction that span 8 rows."""
  bias = None if arrays is None else arrays.bias
  stages = (with_o and bias is not None and jnp.dtype(bias.dtype) == jnp.dtype(kp.dtype)
            and kp.dv == kp.block_kv)
  return dataclasses.replace(kp, o_tile_stages=stages)


def fill_staged(dense: DenseRefs, staged: StagedBias, b, h, row0, col0):
  """TMA-loads the bias tile [rows, cols] at (row0, col0) of batch b and head h into the
  StagedBias's tile, once the previous step's dS store has read it and every thread of the
  warpgroup has read the previous bias (both waits end in a warpgroup barrier; the fence
  orders those reads before the TMA's writes)."""
  rows, cols = staged.tile.shape
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  plgpu.commit_smem()
  b, h = _batch_head(dense.bias, b, h)
  src = dense.bias.at[b, h, pl.ds(row0, rows), pl.ds(col0, cols)]
  plgpu.copy_gmem_to_smem(src, staged.tile, staged.ready)


def take_refs(refs, dense: tuple[bool, bool]) -> DenseRefs | None:
  """DenseRefs of the leading refs (the bias, then the mask, where `dense` says present)."""
  if not any(dense):
    return None
  it = iter(refs)
  return DenseRefs(*(next(it) if on else None for on in dense))


def _batch_head(ref, b, h):
  """(b, h) as indices into ref [B|1, H|1, ...]: 0 along a broadcast axis."""
  return (b if ref.shape[0] > 1 else 0), (h if ref.shape[1] > 1 else 0)


def _tile(ref, b, h, row0, col0, shape, transposed: bool):
  """ref's [rows, cols] tile at (row0, col0) for batch b and head h in the WGMMA layout, or
  with `transposed` the [cols of GMEM, rows of GMEM] tile: ref[.., row0:, col0:]ᵀ where row0
  indexes the GMEM columns (keys) and col0 the GMEM rows (queries)."""
  b, h = _batch_head(ref, b, h)
  if not transposed:
    view = ref.at[b, h, pl.ds(row0, shape[0]), pl.ds(col0, shape[1])]
    return plgpu.load(view, layout=plgpu.Layout.WGMMA, optimized=False)
  view = ref.at[b, h, pl.ds(col0, shape[1]), pl.ds(row0, shape[0])].T
  return plgpu.load(view, layout=plgpu.Layout.WGMMA_TRANSPOSED, optimized=False)


def _mask_bits(ref, b, h, row0, col0, shape) -> MaskBits:
  """The bits (`pack_mask`) of the mask's [rows, cols] tile at (row0, col0) for batch b and
  head h (col0 a multiple of cols, cols a multiple of 8): one load of 8 words a row for each
  chunk of columns, the largest of 128, 64, .. 8 that divides cols (one chunk where cols
  divides 128; three at 192, two at 256). The dK/dV kernel's ref holds maskᵀ's bits, so its
  transposed tiles load the same way."""
  rows, cols = shape
  chunk = next(n for n in (MASK_BLOCK, 64, 32, 16, MASK_WORDS) if cols % n == 0)
  b, h = _batch_head(ref, b, h)
  words = tuple(
      plgpu.load(ref.at[b, h, pl.ds(row0, rows),
                        pl.ds((col0 + i) // MASK_BLOCK * MASK_WORDS, MASK_WORDS)],
                 layout=plgpu.Layout.WGMMA, optimized=False)
      for i in range(0, cols, chunk))
  return MaskBits(words, col0 % MASK_BLOCK // MASK_WORDS)


def _visible(bits: MaskBits, shape):
  """[rows, cols] bool of a tile's MaskBits: each 8 columns take their words' bit (words
  repeated along the columns are the same registers; the bits a COL vector)."""
  repeat = shape[1] // len(bits.words) // MASK_WORDS
  words = jnp.concatenate([w for w in bits.words for _ in range(repeat)], axis=1)
  wide = shape[1] > 128  # a COL vector past 128 columns fails Mosaic's layout inference
  col = (plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) if wide
         else plgpu.broadcasted_iota(jnp.int32, shape[1:], 0, layout=_COL))
  group = col // MASK_WORDS + bits.shift
  if MASK_BLOCK % shape[1]:  # the tile's columns cross a MASK_BLOCK
    group = group % (MASK_BLOCK // MASK_WORDS)
  col_bits = jnp.left_shift(1, group)
  if not wide:
    col_bits = lax.broadcast_in_dim(col_bits, shape, [1])
  return (words & col_bits) != 0


def load(dense: DenseRefs | None, b, h, row0, col0, shape, *, transposed: bool = False,
         ring: BiasRing | None = None, slot=None, streamed: StreamedBias | None = None,
         staged: StagedBias | None = None):
  """tiles() -> (the bias tile [rows, cols] (WGMMA layout), the mask's MaskBits), None where
  absent, of a score tile whose rows are queries from row0 and columns keys from col0 (with
  `transposed`, rows keys and columns queries); None without dense inputs. `add` calls it, so
  the loads are issued where the tiles are added: loaded ahead of S = Q·Kᵀ (or beside the
  in-flight P·V), the tiles' registers made ptxas spill in every kernel (deviceless,
  1x4096x16x128: 532 B in the forward's overlapped loop at 192-key tiles, 226 B in the dQ
  kernel), loaded there none in the forward. A 16-bit bias stays 16-bit through the
  transposed tiles' register transpose (which takes 16 or 32-bit entries). ring, slot: the
  forward's BiasRing and the step's slot, where the bias comes from shared memory; streamed
  (with `transposed` and slot): the dK/dV kernel's StreamedBias, whose slot is freed once
  this warpgroup's half is loaded; staged: the dQ kernel's StagedBias, filled for this step
  (`fill_staged`)."""
  if dense is None:
    return None

  def bias_tile():
    if dense.bias is None:
      return None
    if ring is not None:  # a swizzled shared-memory tile: conflict-free vector loads
      return plgpu.load(wait_ring(ring, slot), layout=plgpu.Layout.WGMMA)
    if staged is not None:
      plgpu.barrier_wait(staged.ready)
      return plgpu.load(staged.tile, layout=plgpu.Layout.WGMMA)
    if streamed is not None:  # this WG's keys of the step's [queries, keys] tile, transposed
      half = streamed.tiles.at[slot, :, pl.ds(streamed.wg * shape[0], shape[0])]
      x = plgpu.load(half.T, layout=plgpu.Layout.WGMMA)
      plgpu.barrier_arrive(streamed.free.at[slot])
      return x
    x = _tile(dense.bias, b, h, row0, col0, shape, transposed)
    if transposed:
      dtype = dense.bias.dtype if jnp.dtype(dense.bias.dtype).itemsize == 2 else jnp.float32
      x = plgpu.layout_cast(x.astype(dtype), plgpu.Layout.WGMMA)
    return x

  def mask_bits():
    return None if dense.mask is None else _mask_bits(dense.mask, b, h, row0, col0, shape)

  return lambda: (bias_tile(), mask_bits())


def issue(tiles):
  """`load`'s tiles() issued now and its (bias, mask) returned, None without tiles. A kernel
  calls it right after issuing the score matmul, so the GMEM loads run under the matmul
  rather than after its wait, where `add` needs them (the loads bound the dense kernels)."""
  return None if tiles is None else tiles()


def issued(tiles, loaded):
  """`add`'s tiles: the tiles `issue` loaded (as a thunk), else `tiles` itself."""
  return tiles if loaded is None else (lambda: loaded)


def add(s, tiles, scale: float, cap=None):
  """Raw scores s [rows, cols] float32 plus the bias tile in raw-score units (bias / scale:
  the kernels multiply scores by scale·log2(e) inside exp2), -inf where the mask tile hides a
  key; tiles: `load`'s (none for None), loaded here. With `cap` (logits_soft_cap_order=
  "bias_then_cap": common.soft_cap_with_slope bound to the kernel's params) the biased scores
  go through the cap before the mask hides keys (a hidden score must stay -inf), and
  (s, the cap's slope) is returned."""
  if tiles is None and cap is None:
    return s
  bias, mask = (None, None) if tiles is None else tiles()
  if bias is not None:
    s = s + bias.astype(jnp.float32) * (1.0 / scale)
  if cap is not None:
    s, slope = cap(s)
  if mask is not None:
    s = jnp.where(_visible(mask, s.shape), s, -jnp.inf)
  return s if cap is None else (s, slope)


def dbias_dtype(bias_dtype):
  """The dQ kernel's dS buffer's dtype for a bias of bias_dtype: a 16-bit float bias's own
  (the gradient is returned in it; half the bytes of float32 to write, and to read where XLA
  sums broadcast axes), else float32."""
  bias_dtype = jnp.dtype(bias_dtype)
  return bias_dtype if bias_dtype.itemsize == 2 else jnp.dtype(jnp.float32)


def dbias_tile(dbias_ref, ds, b, h, row0, col0, staging=None, *, add: bool = False,
               interpret: bool = False):
  """Stores dS [rows, cols] float32 (WGMMA layout) in dbias_ref's dtype to dbias_ref
  [B, H, Tp, Sp] at (b, h, row0, col0): through `staging` (the O tile: `o_tile_stages`) and
  a TMA store, once the previous tile's store has read it, or with no staging each thread its
  own entries to GMEM. With `add` (KernelParams.dbias_batch_sum; staging needed) a TMA
  reduce-add in place of the store; the interpreter, which has none, adds to GMEM's values
  itself (its CTAs run one at a time)."""
  view = dbias_ref.at[b, h, pl.ds(row0, ds.shape[0]), pl.ds(col0, ds.shape[1])]
  if staging is None:
    assert not add, "a reduce-add goes through the staging tile"
    view[...] = ds.astype(dbias_ref.dtype)
    return
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  staging[...] = ds.astype(staging.dtype)
  plgpu.commit_smem()
  if add and interpret:
    view[...] = (view[...].astype(jnp.float32) + staging[...].astype(jnp.float32)).astype(
        view.dtype)
    return
  plgpu.copy_smem_to_gmem(staging, view, reduction_op="add" if add else None)


def zero_dbias_blocks(dbias_ref, b, h, row0, rows: int, block: int, lo, hi):
  """Writes zero tiles [rows, block] to dbias_ref's key blocks [lo, hi) of rows row0..: the
  blocks a dQ warpgroup never streams (no key visible), whose dbias is 0."""
  zeros = plgpu.layout_cast(jnp.zeros((rows, block), jnp.float32), plgpu.Layout.WGMMA)

  @pl.loop(lo, hi)
  def _(j):
    dbias_tile(dbias_ref, zeros, b, h, row0, j * block)


def _sum_axes(bias_shape, dbias_shape) -> tuple[int, ...]:
  """The axes of dbias [B, H, Tp, Sp] that the bias [B|1, H|1, T, S] broadcasts over."""
  return tuple(a for a in (0, 1) if bias_shape[a] == 1 and dbias_shape[a] != 1)


def dbias_form(kp_dq, params: AttentionParams, arrays: FeatureArrays | None, q_seg, kv_seg, *,
               batch: int, heads: int, t: int, s: int, block_mask=None):
  """(kp_dq, visible): how the dQ kernel (KernelParams kp_dq, `o_tile_stages` applied) leaves
  dbias for a backward of q [batch, t, heads, D], k [.., s, ..] (arrays: the call's, whose
  bias is read where kp_dq.dbias).

  A bias broadcast over a batch of several, written through the staging tile, outside
  `deterministic`: the CTAs of a tile's batch entries, consecutive in the launch, add their
  dS into one batch entry zeroed by XLA (kp_dq.dbias_batch_sum: TMA reduce-adds in L2 in a
  varying order, in place of B writes that XLA reads back to sum; no zero tiles needed).
  Else, where XLA runs an op on dbias anyway (a sum over the bias's broadcast axes, or a cut
  to [T, S]) and the call hides keys by band or segment ids, the kernel writes no zero tiles
  (kp_dq.dbias_zero_tiles False: half of a causal call's dS stores) and visible,
  reference.visible_mask's [B|1, 1, T, S], tells reduce_dbias where to keep dS. Otherwise
  (kp_dq, None). A block mask has its own select (reduce_dbias)."""
  if not kp_dq.dbias:
    return kp_dq, None
  bias = arrays.bias
  if batch > 1 and bias.shape[0] == 1 and not params.deterministic and kp_dq.o_tile_stages:
    return dataclasses.replace(kp_dq, dbias_batch_sum=True, dbias_zero_tiles=False), None
  if block_mask is not None:
    return kp_dq, None
  dbias_shape = (batch, heads, kp_dq.t_pad, kp_dq.s_pad)
  if not _sum_axes(bias.shape, dbias_shape) and dbias_shape[2:] == (t, s):
    return kp_dq, None  # no XLA op follows the kernel
  visible = reference.visible_mask(q_seg, kv_seg, q_len=t, kv_len=s,
                                   is_causal=params.is_causal, params=params)
  if visible is None:
    return kp_dq, None
  return dataclasses.replace(kp_dq, dbias_zero_tiles=False), visible


def reduce_dbias(dbias, bias_shape, t: int, s: int, block_mask=None, visible=None, *,
                 zeroed: bool = False):
  """dbias [B|1, H, Tp, Sp] (`dbias_dtype`) cut to [T, S] and summed over the bias's
  broadcast axes in float32, bias_shape [B|1, H|1, T, S] (no XLA op where the bias has no
  other broadcast axis and T, S fill the tiles). With a block mask (masks.BlockMask) the dQ
  kernel wrote only the blocks its tables stream: the others, whose keys no query sees,
  become 0 here (a select that XLA fuses into the sum; the buffer's unwritten blocks may hold
  anything) unless the buffer was `zeroed` (KernelParams.dbias_batch_sum); so do the
  elements outside `visible` (dbias_form's), whose blocks the kernel left unwritten."""
  if block_mask is not None and not zeroed:
    dbias = jnp.where(_streamed(block_mask, dbias.shape[2:]), dbias, 0)
  axes = _sum_axes(bias_shape, dbias.shape)
  dbias = dbias[:, :, :t, :s]
  if visible is not None:
    dbias = jnp.where(visible, dbias, 0)
  if axes:
    dbias = dbias.astype(jnp.float32).sum(axes, keepdims=True)
  return dbias


def _streamed(bm, shape):
  """[B'|1, 1, Tp, Sp] bool: the elements of mask blocks that are not skipped (every block the
  kernels' tables stream holds them; a skipped block's dS is 0), the padding false."""
  tp, sp = shape
  live = bm.block_state != masks.SKIPPED  # [B', T / block_q, S / block_kv], rounded up
  live = jnp.repeat(jnp.repeat(live, bm.block_q, axis=1), bm.block_kv, axis=2)
  live = live[:, :min(tp, live.shape[1]), :min(sp, live.shape[2])]
  live = jnp.pad(live, ((0, 0), (0, tp - live.shape[1]), (0, sp - live.shape[2])))
  return live[:, None]
