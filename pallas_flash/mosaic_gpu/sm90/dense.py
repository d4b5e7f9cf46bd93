"""The dense bias and boolean mask ([B|1, H|1, T, S]) of the sm90 kernels.

Each kernel that forms scores (forward, dQ, dK/dV) loads the [rows, cols] tile of the bias
and of the mask that matches its score tile straight from GMEM into the wgmma accumulator
layout where they are added to the scores (no shared memory, no barriers; `load` says why
not earlier). The dK/dV kernel's transposed tiles [keys, queries] are
loaded in the transposed accumulator layout, whose vectors run along the keys (contiguous in
GMEM), and changed to the accumulator layout in registers. Broadcast axes (size 1) read
index 0. The bias is added after the soft cap and ALiBi (the default "cap_then_bias" order;
with "bias_then_cap" before the cap and the mask after it: `add`'s cap); masked scores become
-inf, so P is 0 there in every kernel and a fully masked row gives o = 0, lse = -inf and zero
gradients. dbias = dS (the raw scores' dS with "bias_then_cap"), written by the dQ kernel to a
[B, H, Tp, Sp] buffer (`dbias_tile`; in the bias's dtype where that is a 16-bit float, else
float32: `dbias_dtype`) and summed over the broadcast axes by XLA in float32.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_flash import _tiling
from pallas_flash.call import AttentionParams, FeatureArrays


class DenseRefs(NamedTuple):
  """A kernel's dense inputs (GMEM): the bias [B|1, H|1, Tp, Sp] in its dtype and the mask
  [B|1, H|1, Tp, Sp] int8 (nonzero: visible), None where the call has none."""

  bias: Any
  mask: Any


def flags(params: AttentionParams) -> tuple[bool, bool]:
  """(bias, mask): which dense inputs a call passes to its kernels."""
  return params.has_bias, params.has_mask


def inputs(arrays: FeatureArrays | None, params: AttentionParams, t_pad: int,
           s_pad: int) -> tuple:
  """The kernels' dense inputs: the bias (its dtype) and the mask (as int8: Mosaic GPU has no
  bool loads), each present one padded to [.., t_pad, s_pad] (no copy where T and S fill the
  tiles; padded keys are masked by the kernels' tail mask, padded queries dropped)."""
  out = []
  for on, x in zip(flags(params), (None if arrays is None else arrays.bias,
                                   None if arrays is None else arrays.mask)):
    if on:
      x = x.astype(jnp.int8) if x.dtype == jnp.bool_ else x
      out.append(_tiling.pad_axis(_tiling.pad_axis(x, 2, t_pad), 3, s_pad))
  return tuple(out)


def take_refs(refs, dense: tuple[bool, bool]) -> DenseRefs | None:
  """DenseRefs of the leading refs (the bias, then the mask, where `dense` says present)."""
  if not any(dense):
    return None
  it = iter(refs)
  return DenseRefs(*(next(it) if on else None for on in dense))


def _tile(ref, b, h, row0, col0, shape, transposed: bool):
  """ref's [rows, cols] tile at (row0, col0) for batch b and head h in the WGMMA layout, or
  with `transposed` the [cols of GMEM, rows of GMEM] tile: ref[.., row0:, col0:]ᵀ where row0
  indexes the GMEM columns (keys) and col0 the GMEM rows (queries)."""
  b = b if ref.shape[0] > 1 else 0
  h = h if ref.shape[1] > 1 else 0
  if not transposed:
    view = ref.at[b, h, pl.ds(row0, shape[0]), pl.ds(col0, shape[1])]
    return plgpu.load(view, layout=plgpu.Layout.WGMMA, optimized=False)
  view = ref.at[b, h, pl.ds(col0, shape[1]), pl.ds(row0, shape[0])].T
  return plgpu.load(view, layout=plgpu.Layout.WGMMA_TRANSPOSED, optimized=False)


def load(dense: DenseRefs | None, b, h, row0, col0, shape, *, transposed: bool = False):
  """tiles() -> the (bias, mask) tiles [rows, cols] (WGMMA layout; None where absent) of a
  score tile whose rows are queries from row0 and columns keys from col0 (with `transposed`,
  rows keys and columns queries); None without dense inputs. `add` calls it, so the loads are
  issued where the tiles are added: loaded ahead of S = Q·Kᵀ (or beside the in-flight P·V),
  the tiles' registers made ptxas spill in every kernel (deviceless, 1x4096x16x128: 532 B in
  the forward's overlapped loop at 192-key tiles, 226 B in the dQ kernel), loaded there none
  in the forward. A 16-bit bias stays 16-bit through the transposed tiles' register
  transpose (which takes 16 or 32-bit entries), the int8 mask becomes int16 for it."""
  if dense is None:
    return None

  def tile(ref, dtype):
    if ref is None:
      return None
    x = _tile(ref, b, h, row0, col0, shape, transposed)
    if transposed:
      x = plgpu.layout_cast(x.astype(dtype), plgpu.Layout.WGMMA)
    return x

  bias_dtype = None if dense.bias is None else (
      dense.bias.dtype if jnp.dtype(dense.bias.dtype).itemsize == 2 else jnp.float32)
  return lambda: (tile(dense.bias, bias_dtype), tile(dense.mask, jnp.int16))


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
    s = jnp.where(mask != 0, s, -jnp.inf)
  return s if cap is None else (s, slope)


def dbias_dtype(bias_dtype):
  """The dQ kernel's dS buffer's dtype for a bias of bias_dtype: a 16-bit float bias's own
  (the gradient is returned in it; half the bytes of float32 to write, and to read where XLA
  sums broadcast axes), else float32."""
  bias_dtype = jnp.dtype(bias_dtype)
  return bias_dtype if bias_dtype.itemsize == 2 else jnp.dtype(jnp.float32)


def dbias_tile(dbias_ref, ds, b, h, row0, col0):
  """Stores dS [rows, cols] float32 (WGMMA layout) in dbias_ref's dtype to dbias_ref
  [B, H, Tp, Sp] at (b, h, row0, col0): each thread writes its own entries to GMEM."""
  view = dbias_ref.at[b, h, pl.ds(row0, ds.shape[0]), pl.ds(col0, ds.shape[1])]
  view[...] = ds.astype(dbias_ref.dtype)


def zero_dbias_blocks(dbias_ref, b, h, row0, rows: int, block: int, lo, hi):
  """Writes zero tiles [rows, block] to dbias_ref's key blocks [lo, hi) of rows row0..: the
  blocks a dQ warpgroup never streams (no key visible), whose dbias is 0."""
  zeros = plgpu.layout_cast(jnp.zeros((rows, block), jnp.float32), plgpu.Layout.WGMMA)

  @pl.loop(lo, hi)
  def _(j):
    dbias_tile(dbias_ref, zeros, b, h, row0, j * block)


def reduce_dbias(dbias, bias_shape, t: int, s: int):
  """dbias [B, H, Tp, Sp] (`dbias_dtype`) summed over the bias's broadcast axes in float32
  and cut to bias_shape [B|1, H|1, T, S] (no XLA op where the bias has no broadcast axis and
  T, S fill the tiles)."""
  axes = tuple(a for a in (0, 1) if bias_shape[a] == 1 and dbias.shape[a] != 1)
  if axes:
    dbias = dbias.astype(jnp.float32).sum(axes, keepdims=True)
  return dbias[:, :, :t, :s]
