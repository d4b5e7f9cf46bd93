"""Pieces shared by the sm90 kernels: static kernel parameters, masks, launch order, producers."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, NamedTuple
import warnings

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_flash import _tiling, dropout as dropout_hash
from pallas_flash.mosaic_gpu.config import MosaicConfig
from pallas_flash.mosaic_gpu.sm90 import dense as sm90_dense
from pallas_flash.call import AttentionParams, FeatureArrays

# Per-row vectors (m, l, lse, delta) of a wgmma accumulator tile; `COL` for its columns.
ROW = plgpu.Layout.WGMMA.reduce(1)
COL = plgpu.Layout.WGMMA.reduce(0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelParams:
  """Everything a kernel body needs statically (shapes after padding, blocks, masking)."""

  dtype: jnp.dtype
  d: int
  group: int  # G = H // K
  block_q: int
  block_kv: int
  stages: int
  num_q_tiles: int  # forward: tiles of 2 * block_q rows
  num_kv_blocks: int
  t_pad: int
  s_pad: int
  kv_len: int  # true S: keys >= kv_len are padding
  q_len: int  # true T: every caller hands `make` the unpadded q (or its shape)
  causal: bool
  scale: float
  heads_fastest: bool
  compute_registers: int
  producer_registers: int
  interpret: bool
  intra_wg_overlap: bool = False  # forward: MosaicConfig.fwd_intra_wg_overlap
  q_registers: bool = False  # forward: MosaicConfig.fwd_q_registers
  dkdv_overlap: bool = False  # dK/dV kernel: MosaicConfig.dkdv_overlap
  profile_dir: str = ""  # MosaicDebug.profile_dir
  segments: bool = False  # the segment-id path (segment_path): per-tile block limits
  # The backward kernels compare ids (False for a window alone, one document; the forward
  # compares its zero ids all the same).
  segment_ids: bool = False
  v_stages: int = 0  # dQ kernel: depth of the V ring where it differs from K's (0: stages)
  softcap: float | None = None  # AttentionParams.logits_soft_cap
  # AttentionParams.bias_in_cap: ALiBi and a dense bias go inside the cap (added before it),
  # a dense mask after it (dense.add's cap).
  bias_in_cap: bool = False
  # AttentionParams.local_window (left, right); the kernels stream its band's blocks through
  # the segment-id path (band_limits).
  window: tuple[int, int] | None = None
  # AttentionParams.has_alibi: the kernels take raw_alibi_slopes' [H] vector as an input.
  alibi: bool = False
  # A block mask (block_mask.Info: the mask function's structure): the kernels stream the
  # blocks of their tile's table and evaluate the function on its partial ones.
  block_mask: Any = None
  # (AttentionParams.has_bias, .has_mask): the kernels take dense.inputs' arrays, after the
  # ALiBi slopes, the sinks and the dropout keys (sm90/dense.py).
  dense: tuple[bool, bool] = (False, False)
  # AttentionParams.returns_dbias: the dQ kernel writes dS to a dbias output.
  dbias: bool = False
  # The dQ kernel writes dbias's zero tiles on the key blocks no query of a warpgroup sees
  # (False: dense.reduce_dbias selects those zeros in the XLA op it runs anyway).
  dbias_zero_tiles: bool = True
  # The dbias buffer has one batch entry, zeroed by XLA, into which the CTAs of a tile's batch
  # entries (consecutive in the launch) add their dS by TMA reduce-add (dense.dbias_form).
  dbias_batch_sum: bool = False
  # The dQ kernel's O tile stages the bias in and dS out (dense.o_tile_stages).
  o_tile_stages: bool = False
  # AttentionParams.dropout_rate: the kernels take dropout_keys' row and column keys as inputs.
  dropout: float = 0.0
  # The value head dim Dv: the columns of V, O, dO and dV (0 given: d). Differs from d only
  # with MosaicConfig.native_value_head_dim (config.kernel_head_dims).
  dv: int = 0

  def __post_init__(self):
    if not self.dv:
      object.__setattr__(self, "dv", self.d)

  @staticmethod
  def stats_view(x):
    """lse / delta [B, H, Tp] as the kernels that stream them take them: a [1, B·H, Tp] view,
    so that their TMA loads are 2-D at any batch (3-D loads cost 15-20 % of the fused
    backward at batch 2, docs/mosaic.md)."""
    return x.reshape(1, -1, x.shape[2])

  @property
  def c(self) -> float:
    """softmax_scale·log2(e): scores times c are in log2 units for exp2."""
    return self.scale * math.log2(math.e)

  @property
  def inv_keep(self) -> float:
    """1 / (1 - dropout rate): the scale of the probabilities dropout keeps."""
    return 1.0 / (1.0 - self.dropout)

  @property
  def dq_v_stages(self) -> int:
    """The dQ kernel's V ring depth (its K ring has `stages`)."""
    return self.v_stages or self.stages

  @property
  def kv_tail(self) -> bool:
    return self.kv_len != self.s_pad

  @property
  def needs_mask(self) -> bool:
    return self.causal or self.kv_tail or self.segments

  def kv_steps(self, q_end):
    """Key blocks that query rows [.., q_end) see: all of them, or up to the causal diagonal."""
    if not self.causal:
      return self.num_kv_blocks
    return jnp.minimum(self.num_kv_blocks, lax.div(q_end + self.block_kv - 1, self.block_kv))

  @staticmethod
  def make(q, k, *, params: AttentionParams, block_q: int, block_kv: int, stages: int,
           t_pad: int, s_pad: int, kv_len: int, config: MosaicConfig,
           q_tile_rows: int | None = None, value_head_dim: int = 0) -> KernelParams:
    """value_head_dim: V's columns (0: q's head dim)."""
    return KernelParams(
        dtype=jnp.dtype(q.dtype), d=q.shape[3], dv=value_head_dim, group=q.shape[2] // k.shape[2],
        block_q=block_q, block_kv=block_kv, stages=stages,
        num_q_tiles=t_pad // (q_tile_rows or 2 * block_q), num_kv_blocks=s_pad // block_kv,
        t_pad=t_pad, s_pad=s_pad, kv_len=kv_len, q_len=q.shape[1], causal=params.is_causal,
        scale=params.scale,
        heads_fastest=config.heads_fastest,
        compute_registers=config.compute_registers,
        producer_registers=config.producer_registers, interpret=config.interpret,
        intra_wg_overlap=config.fwd_intra_wg_overlap, q_registers=config.fwd_q_registers,
        dkdv_overlap=config.dkdv_overlap,
        profile_dir=config.debug.profile_dir, segments=segment_path(params),
        segment_ids=params.has_segments,
        softcap=params.logits_soft_cap, bias_in_cap=params.bias_in_cap,
        window=params.local_window, alibi=params.has_alibi,
        dense=(params.has_bias, params.has_mask), dbias=params.returns_dbias,
        dropout=params.dropout_rate)


def early_probs(kp: KernelParams, *, dense, sparse) -> bool:
  """Whether a split backward step waits for S (Sᵀ) alone and forms P (Pᵀ) while dP (dPᵀ) runs
  instead of waiting for both: 1.03-1.07x fwd+bwd on the H200 and bitwise the other order's
  results there for plain, key-tail and ALiBi calls at head dims 64 and 128 (docs/mosaic.md
  "Instruction order"). Dropout, segment ids and windows, soft caps and block masks keep the
  other order (0.97-1.02x this way on the H200: docs/mosaic.md, tried and rejected), as do
  dense tiles (level on one H100); other head dims were not run this way; the interpreter
  keeps it too."""
  return not (kp.interpret or kp.d not in (64, 128) or kp.dropout or kp.segments
              or kp.softcap is not None or dense is not None or sparse is not None)


def online_softmax(s, m, l, c, *, log2_scale: int = 0, fixed_max: float | None = None):
  """Online softmax (FA2 Alg. 1) of one score tile s [rows, cols] f32 in log2 units: the
  forward's, the FP8 forward's and the decode kernel's step.

  m, l [rows]: running row max (c-scaled log2 units) and row sum; c: the scores' factor to log2
  units (None: s is in them already). Returns (P = 2^log2_scale · exp2(s·c − m_new) float32,
  m_new, l_new, alpha), alpha = exp2(m − m_new) being the factor that brings O from m to m_new.
  log2_scale: the FP8 forward's exact power-of-two factor on P (l then sums the scaled P).
  fixed_max: fixed_row_max's M (m is M throughout): P = exp2(s·c − M), m returned as it came,
  l_new = l + rowsum(P) and alpha None (O needs no rescale)."""
  scaled = (lambda x: x) if c is None else (lambda x: x * c)
  if fixed_max is not None:
    p = jnp.exp2(scaled(s) - fixed_max)
    return p, m, l + p.sum(axis=1), None
  m_new = jnp.maximum(m, scaled(s.max(axis=1)))
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(scaled(s) - lax.broadcast_in_dim(m_new - log2_scale if log2_scale else m_new,
                                                s.shape, [0]))
  return p, m_new, l * alpha + p.sum(axis=1), alpha


def soft_cap(s, kp: KernelParams, *, folded: bool = False):
  """Raw scores s = Q·Kᵀ [rows, cols] f32 through logits_soft_cap c: (c/scale)·tanh(s·scale/c),
  the capped logit c·tanh(s·scale/c) still in raw-score units, so that the softmax after it
  (times kp.c, masked to -inf where hidden) is the uncapped one's. The identity without a cap.

  tanh is one MUFU op (tanh.approx.f32 under the kernels' approx_math, relative error about
  2**-11), like the Triton kernels' soft cap. folded (cap_fold): tanh alone, the cap's factor
  left to exp2's."""
  if kp.softcap is None:
    return s
  t = jnp.tanh(s * (kp.scale / kp.softcap))
  return t if folded else t * (kp.softcap / kp.scale)


def cap_fold(kp: KernelParams, *, biased: bool) -> tuple[bool, float]:
  """(folded, c): whether the scores leave the cap's factor cap/scale out of soft_cap and into
  exp2's factor c, and that factor (kp.c, scale·log2(e) on raw scores, times cap/scale when
  folded). biased: the scores take ALiBi or a dense bias / mask. They fold where nothing is
  added after the cap (no bias, or "bias_then_cap", which puts it inside): the scores then
  only meet the max, exp2 and masks of -inf, so tanh times c is the same softmax, one multiply
  per score fewer."""
  folded = kp.softcap is not None and (kp.bias_in_cap or not biased)
  return folded, kp.c * (kp.softcap / kp.scale) if folded else kp.c


# log2 of the largest and smallest probability exp2(s·c − M) of a visible key under
# fixed_row_max's M: P ≤ 2^90 leaves O room for S·|V| up to 2^38 before float32 overflows, and
# P ≥ 2^-100 keeps the P·V products normal for |V| ≥ 2^-26 (the GPU flushes subnormals) and a
# sink's lost share of the row sum (below 2^-126 against P) under 2^-26.
FIXED_MAX_TOP, FIXED_MAX_LOW = 90, -100


def fixed_row_max(kp: KernelParams, folded: bool, c: float) -> float | None:
  """The forward's fixed row max M = c − FIXED_MAX_TOP where it is exact, else None (the
  running max). folded, c: cap_fold's.

  A folded soft cap's scores are tanh values in [-1, 1] (or -inf where hidden), so every
  finite s·c lies in [-c, c] and P = exp2(s·c − M) in [2^(FIXED_MAX_TOP − 2c), 2^FIXED_MAX_TOP]:
  for c ≤ 95 (cap ≤ ~65.8) within [2^FIXED_MAX_LOW, 2^FIXED_MAX_TOP], in float32 and in
  kp.dtype, which P·V takes, where that has float32's exponent range (bfloat16; not float16,
  whose 2^16 overflows). A fixed M is the same softmax (each row's P shares the factor
  2^(m − M)), exact up to rounding, and needs no row max, no alpha = exp2(m − m_new) and no O
  rescale per step: m stays M, l = l + rowsum(P). A cap that is not folded (ALiBi or a bias
  after it) bounds nothing.
  Fully hidden rows keep l = 0, which the epilogue reads as empty, as with the running max."""
  if not folded:
    return None
  if FIXED_MAX_TOP - 2 * c < FIXED_MAX_LOW or FIXED_MAX_TOP >= jnp.finfo(kp.dtype).maxexp:
    return None
  return c - FIXED_MAX_TOP


def soft_cap_with_slope(s, kp: KernelParams, *, folded: bool = False):
  """(soft_cap(s, folded=folded), its derivative d soft_cap(s)/ds = 1 − tanh², None without a
  cap): the raw scores' dS is the capped scores' dS times it."""
  if kp.softcap is None:
    return s, None
  t = jnp.tanh(s * (kp.scale / kp.softcap))
  return (t if folded else t * (kp.softcap / kp.scale)), 1.0 - t * t


def cap_after_bias(kp: KernelParams):
  """soft_cap_with_slope bound to kp, folded (cap_fold's case: nothing follows the cap):
  dense.add's `cap` (and the dK/dV biases') under logits_soft_cap_order="bias_then_cap", where
  ALiBi and the bias go inside the cap."""
  return functools.partial(soft_cap_with_slope, kp=kp, folded=True)


# Longest sequence the ALiBi distances handle: positions are built as float32 2**23 + i from
# the bits of an int32 (`_alibi_positions`), exact below 2**23.
ALIBI_MAX_LEN = 2**23
_F32_TWO_POW_23 = 0x4B000000  # the float32 2**23's bits


def raw_alibi_slopes(arrays: FeatureArrays | None, params: AttentionParams) -> tuple:
  """() without ALiBi, else (-slopes / scale,) [H] float32: ALiBi's -slope·|i - j| on the
  scaled logits in the raw-score units the kernels keep scores in (they multiply by
  c = scale·log2(e) only inside exp2, after the soft cap), so a tile takes it with one FMA."""
  if not params.has_alibi:
    return ()
  return (arrays.alibi_slopes.astype(jnp.float32) * (-1.0 / params.scale),)


def _alibi_positions(pos0, n: int, layout):
  """2**23 + pos0 + arange(n) float32 [n] in `layout`, from the bits of the int32 sum: an
  integer add per entry instead of an int-to-float conversion (a quarter-rate op, like ex2)."""
  idx = plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=layout) + (pos0 + _F32_TWO_POW_23)
  return lax.bitcast_convert_type(idx, jnp.float32)


def _alibi_offsets(n: int, layout):
  """0 .. n - 1 float32 [n] in `layout` (_alibi_positions less the exact 2**23)."""
  return _alibi_positions(0, n, layout) - float(2**23)


def alibi_drops_rows(kp: KernelParams) -> bool:
  """Whether the forward adds ALiBi without its row term (alibi's `drop_rows`): causal calls
  with ALiBi outside the cap, whose visible keys all lie at or left of the diagonal."""
  return kp.alibi and kp.causal and not kp.bias_in_cap


def alibi(s, row0, col0, slope, *, drop_rows: bool = False):
  """Raw scores s [rows, cols] float32 plus ALiBi's slope·|row - col|, row = row0 + r and
  col = col0 + c (queries and keys, or keys and queries in a transposed tile: the distance is
  symmetric); slope is the head's raw_alibi_slopes entry, None for no ALiBi (s unchanged).

  Applied after the soft cap and before the mask, as every backend does. The offset 2**23
  of both position vectors cancels exactly in the difference, so each entry costs a subtract,
  an absolute value and an FMA (FP32 pipe, no conversion), and a tile rows + cols integer
  adds for the position vectors.

  drop_rows (a causal forward, alibi_drops_rows): every visible key has col <= row, so the
  bias is slope·(row - row0) + slope·(row0 - col), and the first term, constant along each
  row, leaves the softmax unchanged: it is left out (one add per entry of a [cols] vector)
  and put back into the row max by alibi_row_term at the end. Keeping row0 (the tile's first
  row) in the second term keeps the scores near the diagonal, where the row max lies, small:
  relative to row 0 they would reach slope·T (float32 steps of 0.01 at 128K)."""
  if slope is None:
    return s
  if drop_rows:
    offset = lax.convert_element_type(row0 - col0, jnp.float32)  # one conversion per tile
    return s + lax.broadcast_in_dim(slope * (offset - _alibi_offsets(s.shape[1], COL)),
                                    s.shape, [1])
  rows = _alibi_positions(row0, s.shape[0], ROW)
  cols = _alibi_positions(col0, s.shape[1], COL)
  dist = jnp.abs(lax.broadcast_in_dim(rows, s.shape, [0])
                 - lax.broadcast_in_dim(cols, s.shape, [1]))
  return s + slope * dist


def alibi_row_term(n: int, slope, c: float):
  """ALiBi's row term that alibi(drop_rows=True) leaves out, in the row max's log2 units:
  slope·c·r for the tile's rows r = 0 .. n - 1 [n] ROW."""
  return _alibi_offsets(n, ROW) * (slope * c)


class DropoutKeys(NamedTuple):
  """A kernel's dropout inputs (GMEM, dropout_keys): `rows` [B, H, rows_pad] int32 keys of the
  query rows under each (batch, query head), `cols` [cols_pad] int32 keys of the key columns."""

  rows: Any
  cols: Any


def dropout_keys(arrays: FeatureArrays | None, params: AttentionParams, *, batch: int,
                 heads: int, t_pad: int, s_pad: int) -> tuple:
  """() without dropout, else pallas_flash.dropout.key_tables' (row keys [B, H, t_pad], column
  keys [s_pad]) int32: the keys that every other implementation hashes or reads, so that the
  kernels' keep mask is bitwise theirs (dropout.keep_keys)."""
  if not params.dropout_rate:
    return ()
  return dropout_hash.key_tables(arrays.dropout_seed, batch, heads, t_pad, s_pad)


def dropout_row_keys(keys: DropoutKeys, b, h, row0, n: int, layout=ROW):
  """Keys [n] of query rows row0.. of (batch b, query head h), in `layout` (ROW for a
  [queries, keys] tile, COL for a transposed one), loaded from GMEM."""
  return plgpu.load(keys.rows.at[b, h, pl.ds(row0, n)], layout=layout, optimized=False)


def dropout_col_keys(keys: DropoutKeys, col0, n: int, layout=COL):
  """Keys [n] of key columns col0.. in `layout` (COL for a [queries, keys] tile, ROW for a
  transposed one), loaded from GMEM."""
  return plgpu.load(keys.cols.at[pl.ds(col0, n)], layout=layout, optimized=False)


def dropout_keep(row_keys, col_keys, shape, kp: KernelParams):
  """[rows, cols] bool: which entries of a tile dropout keeps, from the key vectors of its rows
  (ROW) and columns (COL), dropout.keep_keys' multiply-compare: one 32-bit multiply and one
  compare per entry, the vectors broadcast (no full-tile iota). Row and column keys are those
  of queries and keys, or keys and queries in a transposed tile (the product commutes)."""
  return (lax.broadcast_in_dim(row_keys, shape, [0])
          * lax.broadcast_in_dim(col_keys, shape, [1])) >= dropout_hash.threshold(kp.dropout)


def sm_count() -> int:
  """Streaming multiprocessors of the local GPU; 132 (H100 SXM, H200) where none is visible,
  as when lowering for an abstract device."""
  try:
    return jax.local_devices(backend="gpu")[0].core_count
  except Exception:  # no GPU backend here (CPU, interpret mode, deviceless lowering)
    return 132


# Rows of the TMA tiles of 16-bit [rows, D] data (smem_transforms' tiling): the length of a
# kernel's [B, N, H, D] GMEM operand must be a multiple of it.
TMA_ROWS = 8


def operand_rows(n: int, n_pad: int, interpret: bool, static_rows: int) -> int:
  """The length the kernels' [B, N, H, D] GMEM operands (true length n, tiles covering n_pad)
  are padded to: n rounded up to TMA_ROWS, since TMA reads the rows past the end as zeros
  and drops stores past it (padding to n_pad cost XLA copies of q, k, v and o: ~20 % of the
  forward at 1x5000x16x128); but n_pad for the interpreter, whose copies are clamped slices,
  and where that would end inside the first `static_rows` rows: the producers load their
  first `stages` blocks at Python-int offsets, which Pallas checks against the length."""
  rows = _tiling.round_up(n, TMA_ROWS)
  return n_pad if interpret or rows < static_rows else rows


def swizzle_bytes(d: int, itemsize: int = 2) -> int:
  """The shared-memory swizzle of a kernel's tiles at head dim d: the widest of 128, 64 and 32
  bytes whose swizzle group (that many bytes of a row) divides a d-element row. Head dims
  that are multiples of 64 (16-bit) take 128 bytes; 96 = 3 x 32 takes 64 and 80 = 5 x 16 32.
  wgmma takes one swizzle for both operands, so every tile of a kernel uses its head dim's:
  the [rows, D] tiles (Q, K, V, dO, O) and the register operands or staged [rows, keys]
  tiles (P, dS) contracted against them, whose key count is a multiple of 64 elements."""
  row = d * itemsize
  swizzle = next((s for s in (128, 64, 32) if row % s == 0), None)
  if swizzle is None:
    raise ValueError(f"head dim {d} has no 32-byte multiple of row bytes ({row}); the kernels "
                     "take head dims that are multiples of 16")
  return swizzle


def smem_transforms(dtype, d: int | None = None):
  """Tiling + swizzle that wgmma and TMA expect for 16-bit [rows, D] tiles (and the tiles
  contracted against them) at head dim d: swizzle_bytes(d), 128 bytes when d is None."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = 128 if d is None else swizzle_bytes(d, itemsize)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def compiler_params(kp: KernelParams | None = None, steps: int = 0, *,
                    auto_barriers: bool = True):
  """kp: the kernel's parameters (only kp.profile_dir is read); steps: the most loop steps a
  warpgroup runs, to size the profiler's event buffer. auto_barriers False: Pallas adds no
  warpgroup barrier around shared-memory stores (`unsafe_no_auto_barriers`); the kernel's own
  fences and barriers must order them (see fused.fused_call)."""
  # approx_math: exp2 -> ex2.approx.ftz.f32, log2 -> lg2.approx (one MUFU op each).
  # reduction_scratch_bytes=0: only per-row reductions (inside a warp) are used, and the 2 KiB
  # it would reserve is what lets 3 stages or 192-row kv tiles fit at head_dim 128.
  common = dict(approx_math=True, reduction_scratch_bytes=0,
                unsafe_no_auto_barriers=not auto_barriers)
  if kp is None or not kp.profile_dir:
    return plgpu.CompilerParams(**common)
  return plgpu.CompilerParams(**common, profile_space=profile_space(steps),
                              profile_dir=kp.profile_dir, profile_bounds_check=True)


def profile_space(steps: int) -> int:
  """The profiler's budget of named-region ranges per warpgroup for `steps` loop steps: up to
  16 a step (the bounds check truncates a trace rather than overrun the buffer if that is ever
  too few)."""
  return 16 * steps + 64


# The Mosaic GPU interpreter runs each warpgroup of a CTA as its own XLA:CPU computation, whose
# barrier waits block inside host callbacks. XLA's concurrency-optimised schedule lets those
# callbacks run on XLA's intra-op thread pool (one thread per core): on a 2-core machine two
# consumer warpgroups waiting for their first K/V tile hold both threads, and the producer's
# computation, which would issue that copy, never gets one. The launch deadlocks with no CPU
# in use. XLA reads the flag
# when its CPU client starts, so it must be in XLA_FLAGS before JAX's first computation.
INTERPRET_XLA_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
_warned_interpret_flag = False


def with_interpret_xla_flag(xla_flags: str) -> str:
  """XLA_FLAGS with INTERPRET_XLA_FLAG added (unchanged when the option is already set)."""
  if INTERPRET_XLA_FLAG.split("=")[0] in xla_flags:
    return xla_flags
  return f"{xla_flags} {INTERPRET_XLA_FLAG}".strip()


def interpret_params(interpret: bool):
  """plgpu.InterpretGPUParams for the Mosaic GPU interpreter, or None to compile for a GPU.

  Warns once when XLA_FLAGS lacks INTERPRET_XLA_FLAG, without which some launches deadlock.
  """
  global _warned_interpret_flag
  if not interpret:
    return None
  flags = os.environ.get("XLA_FLAGS", "")
  if not _warned_interpret_flag and with_interpret_xla_flag(flags) != flags:
    _warned_interpret_flag = True
    warnings.warn(
        "The Mosaic GPU interpreter can deadlock on machines with few cores unless XLA's "
        "concurrency-optimised CPU schedule is off: start Python with XLA_FLAGS containing "
        f"{INTERPRET_XLA_FLAG} (the test suite's conftest.py sets it).", RuntimeWarning,
        stacklevel=2)
  return plgpu.InterpretGPUParams()


# Longer than any sequence: a band side past it changes nothing, and two of them fit uint32.
_BAND_SIDE_MAX = 2**30


def band(qi, kj, left: int, right: int):
  """qi - left <= kj <= qi + right (int32 positions [rows, cols]; left, right >= 0
  static) as one unsigned compare, uint32(qi - kj + right) <= left + right: one ISETP where
  the two sides (and a causal bound) took one each, and each its own FSEL."""
  left, right = min(left, _BAND_SIDE_MAX), min(right, _BAND_SIDE_MAX)
  return lax.bitcast_convert_type(qi - kj + right, jnp.uint32) <= jnp.uint32(left + right)


def visible(row0, col0, shape, kp: KernelParams, *, transposed: bool = False):
  """[rows, cols] bool: which keys each query sees (causal, local window and padded-key tail).

  Rows are queries and columns keys; with `transposed`, rows are keys and columns queries.
  A causal mask or a window compares position vectors broadcast to the tile (the block masks'
  way), with fewer live registers than two [rows, cols] iotas (docs/mosaic.md, "Position
  vectors", for what it measured).
  """
  # [rows, cols] iotas past 128 columns and for a key tail alone: a COL vector of 192 or 256,
  # or one compared alone, fails Mosaic's layout inference.
  if (kp.causal or kp.window is not None) and shape[1] <= 128:
    rows = plgpu.broadcasted_iota(jnp.int32, (shape[0],), 0, layout=ROW) + row0
    cols = plgpu.broadcasted_iota(jnp.int32, (shape[1],), 0, layout=COL) + col0
    r = lax.broadcast_in_dim(rows, shape, [0])
    c = lax.broadcast_in_dim(cols, shape, [1])
  else:
    r = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row0
    c = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + col0
  qi, kj = (c, r) if transposed else (r, c)
  mask = None
  if kp.window is not None:  # causal: the band's right side is 0
    left, right = kp.window
    mask = band(qi, kj, left, 0 if kp.causal else right)
  elif kp.causal:
    mask = qi >= kj
  # Causal with T <= S, the padded keys (kj >= S >= T) lie above the diagonal for every real
  # query; the padded queries' results are dropped, so the causal mask covers the tail (and
  # the extra select per score made the dQ kernel spill 55 words per step at 1x5000x16x128).
  if kp.kv_tail and not (kp.causal and kp.q_len <= kp.kv_len):
    tail = kj < kp.kv_len
    mask = tail if mask is None else mask & tail
  return mask


def first_masked_block(q0, steps, kp: KernelParams):
  """First kv block that rows [q0, q0 + block_q) must mask; blocks before it are all visible."""
  lo = steps
  if kp.causal:
    lo = jnp.minimum(lo, lax.div(q0, kp.block_kv))
  if kp.kv_tail:  # the first block holding a padded key (the backward's s_pad may add blocks)
    lo = jnp.minimum(lo, kp.kv_len // kp.block_kv)
  return lo


class SegmentRefs(NamedTuple):
  """A kernel's segment-id inputs (GMEM): `rows` [B, rows_pad] ids of the rows its consumer
  warpgroups own, `cols` [B, cols_pad] ids of the blocks it streams, and `limits` [B, tiles, 4]
  (_tiling.segment_block_limits of one CTA tile of rows against the streamed blocks)."""

  rows: Any
  cols: Any
  limits: Any


def with_segment_refs(kernel, num_inputs: int, segmented: bool, alibi: bool = False,
                      sinks: bool = False, dropout: bool = False,
                      dense: tuple[bool, bool] = (False, False)):
  """A plgpu.kernel body for `kernel(*inputs, *outputs, *scratch, seg=...[, slopes=...]
  [, sinks=...][, keys=...][, dense=...])` whose call passes the 3 SegmentRefs arrays after its
  `num_inputs` inputs when `segmented`, then with `alibi` the raw_alibi_slopes [H] (GMEM),
  handed over as `slopes`, then with `sinks` the forward's sink logits [H] (GMEM), handed over
  as `sinks`, then with `dropout` dropout_keys' two arrays (GMEM), handed over as `keys`, then
  the dense bias and mask where `dense` (KernelParams.dense) says, handed over as `dense` (a
  dense.DenseRefs)."""
  def body(*refs):
    if not (segmented or alibi or sinks or dropout or any(dense)):
      return kernel(*refs, seg=None)
    n = num_inputs + 3 * segmented
    seg = SegmentRefs(*refs[num_inputs:n]) if segmented else None
    m = n + alibi + sinks + 2 * dropout
    extra = {} if not any(dense) else {"dense": sm90_dense.take_refs(refs[m:], dense)}
    return kernel(*refs[:num_inputs], *refs[m + sum(dense):], seg=seg,
                  **head_refs(refs[n:], alibi, sinks, dropout), **extra)
  return body


def head_refs(refs, alibi: bool, sinks: bool, dropout: bool = False) -> dict:
  """The per-head GMEM inputs that lead `refs` (the ALiBi slopes, then the sinks, then the
  dropout keys' two arrays, where present) as the kernels' keyword arguments `slopes`, `sinks`
  and `keys`."""
  heads = {}
  if alibi:
    heads["slopes"] = refs[0]
  if sinks:
    heads["sinks"] = refs[int(alibi)]
  if dropout:
    heads["keys"] = DropoutKeys(*refs[alibi + sinks:alibi + sinks + 2])
  return heads


def segment_path(params: AttentionParams) -> bool:
  """Whether the kernels run their segment-id path (per-tile block limits, masks on the blocks
  not wholly inside them): segment ids, or a local window, whose band gives the limits (a
  window alone carries the zero ids of one document: the forward compares them on masked
  blocks, the backward kernels skip them, see KernelParams.segment_ids)."""
  return params.has_segments or params.local_window is not None


def path_segment_ids(q, k, q_seg, kv_seg, params: AttentionParams):
  """(q_seg [B, T], kv_seg [B, S]) int32 for the segment-id path: the call's ids, or for a
  window alone one document's zeros."""
  if params.has_segments:
    return q_seg, kv_seg
  return jnp.zeros(q.shape[:2], jnp.int32), jnp.zeros(k.shape[:2], jnp.int32)


def band_limits(seg_limits, band, *, tiles: int, tile_rows: int, block: int, length: int,
                batch: int):
  """[B, tiles, 4] int32 in _tiling.segment_block_limits' form (first, last, full_first,
  full_last streamed blocks per CTA tile of `tile_rows` owned positions) for `band`, the
  bounds of streamed_pos - owned_pos (AttentionParams.band for a tile of queries streaming
  keys, its _tiling.mirrored form for a tile of keys streaming queries): a tile streams only
  the blocks its positions' band touches, and skips the mask only on those every position
  sees whole. length: the streamed axis' true length (blocks past it are never streamed, a
  partial last one is masked). seg_limits: the segment ids' limits to intersect with, or None
  (the call has none)."""
  owner = jnp.arange(tiles, dtype=jnp.int32)[None, :]
  segmented = seg_limits is not None
  first, full_lo, full_hi, last = _tiling.block_runs(
      owner, owner_block=tile_rows, other_block=block, num_other=-(-length // block),
      band=band, element_mask=segmented, other_len=length,
      limits=(seg_limits[..., 0], seg_limits[..., 1]) if segmented else None,
      full_limits=(seg_limits[..., 2], seg_limits[..., 3]) if segmented else None)
  return jnp.stack([jnp.broadcast_to(x, (batch, tiles)) for x in (first, last, full_lo, full_hi)],
                   -1).astype(jnp.int32)


def segment_limits(limits, b, tile):
  """(first, last, full_first, full_last) streamed blocks of a CTA tile: those outside
  [first, last) share no segment id with it; in [full_first, full_last) every position of
  both carries the tile's one id (an empty run when the tile holds several ids)."""
  return tuple(limits[b, tile, i] for i in range(4))


def cta_kv_range(kp: KernelParams, seg: SegmentRefs | None, b, tile):
  """(q0, steps, kv0, full) of a CTA of two warpgroups' query rows that streams key blocks
  (forward, dQ): its first query row; how many key blocks it streams, from its first one kv0
  (the causal bound, cut with segment ids / a window to the hull of the blocks its rows may
  see); and their full run (segment_limits; None without seg). At least one block with seg,
  so that a tile whose rows see no key still runs and writes o = 0 / dQ = 0."""
  q0 = tile * (2 * kp.block_q)
  steps = kp.kv_steps(q0 + 2 * kp.block_q)
  if seg is None:
    return q0, steps, 0, None
  first, last, *full = segment_limits(seg.limits, b, tile)
  end = jnp.maximum(jnp.minimum(last, steps), 1)
  kv0 = jnp.minimum(first, end - 1)
  return q0, end - kv0, kv0, full


def row_and_col_ids(seg: SegmentRefs, b, row0, rows: int, cols: int):
  """ids(col0) -> (ids of rows row0.. [rows] ROW, ids of columns col0.. [cols] COL): the
  row ids are loaded once, the column ids at each call."""
  row_seg = row_ids(seg.rows, b, row0, rows)
  return lambda col0: (row_seg, col_ids(seg.cols, b, col0, cols))


def unmasked_run(q0, steps, kp: KernelParams, *, kv0=0, full=None):
  """[u0, u1): the steps of a WG's kv loop (step j is key block kv0 + j, rows q0..) that need
  no mask: those before the causal diagonal and the padded tail and, with segment ids, inside
  `full` = (full_first, full_last) of segment_limits. Without segment ids u0 is 0."""
  u1 = first_masked_block(q0, kv0 + steps, kp) - kv0
  if full is None:
    return 0, u1
  u0 = jnp.clip(full[0] - kv0, 0, steps)
  return u0, jnp.clip(jnp.minimum(u1, full[1] - kv0), u0, steps)


def kv_loop(step, carry, q0, steps, kp: KernelParams, *, kv0=0, full=None, sparse=None):
  """carry through steps 0 .. steps - 1 of a WG's kv loop, step(j, carry, masked=...): with
  segment ids the masked steps before unmasked_run's run, the run, then the masked rest (the
  causal diagonal's blocks and the padded tail) where kp.needs_mask; with a block mask's
  `sparse` view, its table's partial blocks, then the full ones."""
  if sparse is not None:
    carry = lax.fori_loop(0, sparse.masked, functools.partial(step, masked=True), carry)
    return lax.fori_loop(sparse.masked, steps, functools.partial(step, masked=False), carry)
  u0, u1 = unmasked_run(q0, steps, kp, kv0=kv0, full=full)
  if full is not None:
    carry = lax.fori_loop(0, u0, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(u0, u1, functools.partial(step, masked=False), carry)
  if kp.needs_mask:
    carry = lax.fori_loop(u1, steps, functools.partial(step, masked=True), carry)
  return carry


def row_ids(ids_ref, b, row0, n: int):
  """Segment ids [n] of rows row0.. in the ROW layout (loaded from GMEM)."""
  return plgpu.load(ids_ref.at[b, pl.ds(row0, n)], layout=ROW, optimized=False)


def col_ids(ids_ref, b, col0, n: int):
  """Segment ids [n] of columns col0.. in the COL layout (loaded from GMEM)."""
  return plgpu.load(ids_ref.at[b, pl.ds(col0, n)], layout=COL, optimized=False)


def tile_mask(row0, col0, shape, kp: KernelParams, *, transposed: bool = False, ids=None):
  """`visible` and, with ids = (row ids [rows] ROW, col ids [cols] COL), equal segment ids."""
  mask = visible(row0, col0, shape, kp, transposed=transposed)
  if ids is not None:
    rows, cols = ids
    same = (lax.broadcast_in_dim(rows, shape, [0]) == lax.broadcast_in_dim(cols, shape, [1]))
    mask = same if mask is None else mask & same
  return mask


def named(body, name: str):
  """body under `name`: Mosaic names a kernel after its body's function, and profiles
  (`bench --kernels`, nsys) show that name, where every wrapped body would read "body"."""
  def kernel(*refs, **kwargs):
    return body(*refs, **kwargs)
  kernel.__name__ = kernel.__qualname__ = name
  return kernel


def launch_grid(tiles, heads, bsz, names, *, heads_fastest: bool) -> dict:
  """plgpu.kernel's grid and grid_names for a (tile, head, batch) launch; names are the tile,
  head and batch axis names.

  The grid's *last* dimension varies fastest: Mosaic GPU reverses the grid into CUDA's
  (x, y, z), and CTAs are dispatched x fastest. The batch axis is always last (consecutive
  CTAs take the batch entries of one tile and head), then: tiles (heads_fastest False: all
  tiles of a head before the next head) or heads (True: one tile of every head before the
  next tile)."""
  tile_name, head_name, b_name = names
  if heads_fastest:
    return dict(grid=(tiles, heads, bsz), grid_names=names)
  return dict(grid=(heads, tiles, bsz), grid_names=(head_name, tile_name, b_name))


def launch_on_zeroed_last(launch, operands, out_type) -> tuple:
  """Runs launch(out_type=())(*operands, *refs) (a partial plgpu.kernel) on refs for
  out_type's buffers, the last zeroed by XLA (the target of TMA reduce-adds), the others
  left uninitialised (lax.empty: no XLA op), and returns their values: the kernel's outputs
  in the same order for its body. plgpu.kernel takes no input_output_aliases; pl.run_state's
  discharge passes the refs it writes as aliased operands. pl.run_state has no batching
  rule, so under jax.vmap the launches run one per entry of the mapped axis (lax.map)."""
  @jax.custom_batching.custom_vmap
  def call(*operands):
    def run(refs):
      launch(out_type=())(*operands, *refs)

    init = [lax.empty(x.shape, x.dtype) for x in out_type[:-1]]
    init.append(_zeros(out_type[-1].shape, out_type[-1].dtype))
    return tuple(pl.run_state(run)(tuple(init)))

  @call.def_vmap
  def _(axis_size, in_batched, *operands):
    del axis_size

    def one(mapped):
      it = iter(mapped)
      return call(*(next(it) if b else x for x, b in zip(operands, in_batched)))

    outs = lax.map(one, [x for x, b in zip(operands, in_batched) if b])
    return outs, (True,) * len(out_type)

  return call(*operands)


def _zeros(shape, dtype):
  """Zeros of shape and dtype; a 16-bit array with an even last axis as 32-bit words, bitcast:
  XLA's broadcast wrote bfloat16 zeros at 1.7 TB/s (631 µs for 1 GiB, one H100), and the word
  form took 4.7 % off a causal bias's forward+backward at 4x4096x32x128 (2.7 % non-causal;
  the jitted calls of both forms alternated 40 rounds in one process, 2026-12-06)."""
  dtype = jnp.dtype(dtype)
  if dtype.itemsize != 2 or shape[-1] % 2:
    return jnp.zeros(shape, dtype)
  words = jnp.zeros((*shape[:-1], shape[-1] // 2), jnp.uint32)
  return lax.bitcast_convert_type(words, dtype).reshape(shape)


def sync(barrier):
  """Arrive on and wait for a barrier that every party arrives on once per phase (the
  consumer warpgroups' schedule / hand-off barriers)."""
  plgpu.barrier_arrive(barrier)
  plgpu.barrier_wait(barrier)


class KvBarriers(NamedTuple):
  """The consumer side of a forward's K/V ring and the two-WG schedule barrier."""

  k_ready: Any
  v_ready: Any
  k_free: Any
  v_free: Any
  sched: Any


def pv_step(acc, p, v_op, p_smem, bars: KvBarriers, *, j, steps, slot, ring_slot,
            kp: KernelParams):
  """acc + P·V at step j of a ping-pong kv loop (forward.py's plain loop, fp8_forward's):
  hands the tensor cores to the other WG (the schedule barrier), waits for the V tile of
  `slot`, issues P·V with P from registers and, while it runs, waits for step j + 1's K tile
  (ring_slot(j + 1), where j + 1 < steps); then frees the V slot. v_op: the [block_kv, Dv]
  operand view of the slot's V tile; p_smem: the interpreter's staging buffer for P."""
  with jax.named_scope("wait_kv"):
    plgpu.barrier_arrive(bars.sched)
    plgpu.barrier_wait(bars.v_ready.at[slot])
    plgpu.barrier_wait(bars.sched)

  def wait_next_k():
    @pl.when(j + 1 < steps)
    def _():
      plgpu.barrier_wait(bars.k_ready.at[ring_slot(j + 1)])

  if kp.interpret:
    acc = acc + staged_matmul(p, p_smem, v_op, acc.shape)
    wait_next_k()
  else:
    def pv(acc_ref):
      with jax.named_scope("issue"):
        plgpu.wgmma(acc_ref, p, v_op)  # P from registers (RS wgmma)
      with jax.named_scope("wait_kv"):
        wait_next_k()  # overlaps the P·V wgmma
    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
  plgpu.barrier_arrive(bars.v_free.at[slot])
  return acc


def idle_kv_step(j, carry, *, bars: KvBarriers, stages: int, ring=None):
  """One step of a consumer WG past its last causal block: it keeps the shared ring and the
  schedule barrier in lock-step with the other WG (fori_loop body; carry passes through);
  ring: the forward's dense.BiasRing, whose half it observes too, or None."""
  slot = lax.rem(j, stages)
  if ring is not None:
    sm90_dense.wait_ring(ring, slot)
  plgpu.barrier_wait(bars.k_ready.at[slot])
  plgpu.barrier_arrive(bars.k_free.at[slot])
  plgpu.barrier_wait(bars.v_ready.at[slot])
  plgpu.barrier_arrive(bars.v_free.at[slot])
  sync(bars.sched)
  sync(bars.sched)
  return carry


def observe_last_releases(frees, num_steps, slots: int):
  """A ring producer's tail: waits on each free barrier array in `frees` for the releases of
  the last `slots` of `num_steps` steps, which it never waited for to refill a slot. Every
  waiter of an mbarrier must observe each of its phases (the interpreter checks this)."""
  @pl.loop(jnp.maximum(num_steps - slots, 0), num_steps)
  def _(j):
    for free in frees:
      plgpu.barrier_wait(free.at[lax.rem(j, slots)])


def smem_matmul(a_smem, b_smem, out_shape):
  """a_smem @ b_smem [out_shape] float32, both operands in SMEM (returns once it is done)."""
  def mm(acc_ref):
    plgpu.wgmma(acc_ref, a_smem, b_smem)
    return acc_ref[...]

  return pl.run_scoped(mm, plgpu.ACC(out_shape, jnp.float32))


def staged_matmul(a, a_smem, b_smem, out_shape):
  """a @ b with `a` (registers) written to SMEM first: the interpretable form of an RS wgmma."""
  a_smem[...] = a
  plgpu.commit_smem()
  return smem_matmul(a_smem, b_smem, out_shape)


def accumulate(acc, a, a_smem, b_smem, kp: KernelParams):
  """acc += a @ b_smem, through a register-operand wgmma (GPU) or SMEM staging (interpret)."""
  if kp.interpret:
    return acc + staged_matmul(a, a_smem, b_smem, acc.shape)

  def mm(acc_ref):
    plgpu.wgmma(acc_ref, a, b_smem)

  return pl.run_state(mm)(plgpu.ACC.init(acc))


def at(ref, i):
  """ref.at[i], or None for the staging buffers that exist only in interpret mode."""
  return None if ref is None else ref.at[i]


def produce(num_steps, stages, streams):
  """Producer loop: TMA step j of every (gmem, smem ring, ready, free, index) stream into slot
  j % stages, where index(j) gives the gmem slice (stages: one depth for all streams, or a
  tuple of one per stream).

  A slot is refilled once its free barrier completed; the last releases are observed as well,
  since every waiter of an mbarrier must see each of its phases.
  """
  if not isinstance(stages, int):
    if len(set(stages)) > 1:
      return produce_rings(num_steps, stages, streams)
    stages = stages[0]

  def load(j, slot):
    for src, dst, ready, _, index in streams:
      plgpu.copy_gmem_to_smem(src.at[index(j)], dst.at[slot], ready.at[slot])

  for i in range(stages):
    pl.when(i < num_steps)(functools.partial(load, i, i))

  @pl.loop(stages, num_steps)
  def _(j):
    slot = lax.rem(j, stages)
    for src, dst, ready, free, index in streams:
      with jax.named_scope("wait_free"):
        plgpu.barrier_wait(free.at[slot])
      plgpu.copy_gmem_to_smem(src.at[index(j)], dst.at[slot], ready.at[slot])

  observe_last_releases([free for _, _, _, free, _ in streams], num_steps, stages)


def produce_rings(num_steps, depths, streams):
  """produce with a ring depth per stream: step j of a stream of depth n waits for the
  release of step j - n (from j = n on), in stream order, so a shallow ring's wait holds back
  the deeper rings' next loads only once they are a step ahead."""
  @pl.loop(0, num_steps)
  def _(j):
    for n, (src, dst, ready, free, index) in zip(depths, streams):
      slot = lax.rem(j, n)
      pl.when(j >= n)(lambda: plgpu.barrier_wait(free.at[slot]))
      plgpu.copy_gmem_to_smem(src.at[index(j)], dst.at[slot], ready.at[slot])

  for n, stream in zip(depths, streams):
    observe_last_releases([stream[3]], num_steps, n)


def xla_row_stats(o, lse, do, correction):
  """The API's preprocessing, for the paths that do not compute it in a kernel: lse with +inf
  on fully masked rows and delta = rowsum(dO∘O) + correction [B, H, T] float32."""
  delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32))
  if correction is not None:
    delta = delta + correction
  return jnp.where(lse == -jnp.inf, jnp.inf, lse), delta


def segment_inputs(q_seg, kv_seg, t_pad: int, s_pad: int, *, dq_tiles: tuple[int, int],
                   dkdv_tiles: tuple[int, int], params: AttentionParams):
  """(dQ kernel's, dK/dV kernel's) segment inputs: the ids q_seg [B, T] / kv_seg [B, S] (zeros,
  one document, for a window alone) padded to t_pad / s_pad, and the hull of blocks each CTA
  tile may share an id with (_tiling.segment_block_limits), cut to the local window's band
  (band_limits).

  dq_tiles: (query rows per dQ CTA, keys per step); dkdv_tiles: (query rows per step, keys per
  dK/dV CTA)."""
  (batch, t), s = q_seg.shape, kv_seg.shape[1]
  q_seg, kv_seg = _tiling.pad_segments(q_seg, kv_seg, t_pad, s_pad)
  kv_limits = q_limits = None
  if params.has_segments:
    kv_limits, _ = _tiling.segment_block_limits(q_seg, kv_seg, block_q=dq_tiles[0],
                                              block_kv=dq_tiles[1])
    _, q_limits = _tiling.segment_block_limits(q_seg, kv_seg, block_q=dkdv_tiles[0],
                                             block_kv=dkdv_tiles[1])
  if params.local_window is not None:
    kv_limits = band_limits(
        kv_limits, params.band, tiles=t_pad // dq_tiles[0], tile_rows=dq_tiles[0],
        block=dq_tiles[1], length=s, batch=batch)
    q_limits = band_limits(
        q_limits, _tiling.mirrored(params.band), tiles=s_pad // dkdv_tiles[1],
        tile_rows=dkdv_tiles[1], block=dkdv_tiles[0], length=t, batch=batch)
  return (q_seg, kv_seg, kv_limits), (kv_seg, q_seg, q_limits)
