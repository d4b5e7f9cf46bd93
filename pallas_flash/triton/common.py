"""Pieces shared by the Triton forward and backward kernels and their wrappers."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_flash import _tiling, dropout, masks
from pallas_flash.call import AttentionParams, CallInfo, FeatureArrays
from pallas_flash.triton.config import TritonConfig, default_config

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MAX_HEAD_DIM = 256
# Pallas-Triton addresses an operand of at most this many bytes with int32 element offsets,
# which a one-byte operand of more than 2^31 elements overflows (jax 0.11's lowering).
INT32_OFFSET_BYTES = 2**32
# Largest soft-cap for which the forward skips the running max (KernelParams.fixed_max):
# probabilities stay within [2**-87, 2**87], and l, acc far below float32's 2**128.
FIXED_MAX_SOFTCAP = 60.0
SUPPORTED_FEATURES = frozenset({"local_window_size", "logits_soft_cap", "alibi_slopes", "dropout",
                                "bias", "mask", "block_mask"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelParams:
  """Static facts a kernel body needs besides its refs."""

  scale: float
  is_causal: bool
  has_segments: bool
  kv_len: int  # true key length; keys at or past it are padding and are masked
  block_q: int
  block_kv: int
  num_kv_blocks: int
  num_q_blocks: int
  group_size: int
  band: tuple[int | None, int | None] = (None, None)  # AttentionParams.band
  has_mask: bool = False  # a dense int8 mask block comes with the scores
  softcap: float | None = None
  bias_in_cap: bool = False  # AttentionParams.bias_in_cap
  has_alibi: bool = False
  dropout_rate: float = 0.0
  # Soft-cap's tanh as one MUFU instruction (tanh.approx.f32, relative error 2**-11, below the
  # rounding of 16-bit inputs) instead of exp2 plus an IEEE division: False for float32 inputs
  # and in the interpreter, which cannot run inline PTX.
  approx_tanh: bool = False
  # Soft-capped scores are bounded, |s| <= softcap·log2(e), so the forward can use 0 as a fixed
  # softmax max (exp2(s) stays within float32 and bfloat16 range for softcap <= 60) and skip the
  # running max and every rescale of l and acc. Not with ALiBi / bias (unbounded) or float16
  # (P cast to float16 would overflow above 65504).
  fixed_max: bool = False
  has_bias: bool = False
  # float32 inputs: the lse goes between log2 and natural units with fewer roundings at its
  # magnitude (see `probabilities`); 16-bit inputs keep the shorter code, their rounding is larger.
  precise_lse: bool = False
  bias_per_batch: bool = False  # the bias has a batch axis (else it broadcasts over batch)
  bias_per_head: bool = False
  # Block mask: the mask function's pytree structure, the kind of each of its leaves and the
  # batch size of its tables (1: shared by the batch). mask_def None: no block mask.
  mask_def: Any = None
  mask_kinds: tuple[str, ...] = ()
  mask_batch: int = 1

  @classmethod
  def create(cls, params: AttentionParams, *, dtype, interpret: bool, **kwargs) -> KernelParams:
    return cls(scale=params.scale, is_causal=params.is_causal, has_segments=params.has_segments,
               band=params.band, has_mask=params.has_mask, softcap=params.logits_soft_cap,
               bias_in_cap=params.bias_in_cap,
               has_alibi=params.has_alibi, dropout_rate=params.dropout_rate,
               approx_tanh=not interpret and jnp.dtype(dtype).itemsize == 2,
               fixed_max=(params.logits_soft_cap is not None
                          and params.logits_soft_cap <= FIXED_MAX_SOFTCAP
                          and not params.has_alibi and not params.has_bias
                          and jnp.dtype(dtype) != jnp.float16),
               has_bias=params.has_bias, precise_lse=jnp.dtype(dtype) == jnp.float32, **kwargs)

  @property
  def block_sparse(self) -> bool:
    return self.mask_def is not None

  @property
  def has_element_mask(self) -> bool:
    return self.has_segments or self.has_mask

  @property
  def dropout_threshold(self) -> int:
    return dropout.threshold(self.dropout_rate)

  @property
  def scale_log2(self) -> float:
    """softmax scale with log2(e) folded in, so exp(x * scale) == exp2(x * scale_log2)."""
    return self.scale * LOG2E

  @property
  def kv_tail(self) -> bool:
    return self.kv_len % self.block_kv != 0


def unsupported_reason(call: CallInfo, config: TritonConfig | None = None, *,
                       interpret: bool) -> str | None:
  """Why the Triton kernels cannot run `call` with `config` (features are checked by the API)."""
  from pallas_flash.xla.blockwise import block_mask_reason
  if call.head_dim > MAX_HEAD_DIM:
    return f"head_dim {call.head_dim} > {MAX_HEAD_DIM} is not supported by the Triton kernels"
  blocks = call.params.block_mask_blocks
  if blocks is not None and not all(n >= 16 and n & (n - 1) == 0 for n in blocks):
    return (f"block_mask blocks {blocks} must be powers of two >= 16 for the Triton kernels "
            "(Triton tiles); rebuild the BlockMask with such blocks")
  if (why := block_mask_reason(call, config)) is not None:
    return why
  if interpret:
    return None
  if (why := platform_reason(call.platform, call.compute_capability)) is not None:
    return why
  return shared_memory_reason(call, config or fitted_config(call))


def fitted_config(call: CallInfo) -> TritonConfig:
  """The tuned config of `call` (config.TUNED, FEATURE_TUNED), its stages lowered where a block
  mask's blocks would not fit in shared memory (fit_shared_memory)."""
  return fit_shared_memory(call_config(call.head_dim, call.dtype, call.params), call)


# Shared memory one thread block may ask for, by compute capability (CUDA's limits, bytes).
SHARED_MEMORY = {(8, 0): 163 << 10, (8, 7): 163 << 10, (9, 0): 227 << 10, (10, 0): 227 << 10,
                 (10, 3): 227 << 10}
SHARED_MEMORY_OTHER = 99 << 10  # the consumer parts' (8.6, 8.9, 12.x)


def shared_memory(call: CallInfo, config: TritonConfig) -> tuple[int, int]:
  """Bytes of shared memory (forward, the larger backward kernel) the kernels ask for at a
  block mask's blocks, which replace the config's ((0, 0) without one): a kernel keeps its own
  tiles (the forward's Q, the backward's K and V or Q and dO) and a copy per pipeline stage of
  each tile it streams (K and V, or Q and dO, and the dense bias and mask tiles). Triton's
  requests on one H100 (2026-12-06) were these: 320 KiB for the forward at head dim 256, 128 x
  128 blocks and 2 stages, 256 KiB for the backward with a bf16 bias at head dim 128."""
  if call.params.block_mask_blocks is None:
    return 0, 0
  bq, bk = call.params.block_mask_blocks
  size = call.dtype.itemsize
  qv = (padded_head_dim(call.head_dim) + padded_head_dim(call.value_head_dim)) * size
  bias = (call.bias_dtype or call.dtype).itemsize if call.params.has_bias else 0
  dense = bq * bk * (bias + (1 if call.params.has_mask else 0))  # the mask as int8
  forward = bq * padded_head_dim(call.head_dim) * size + config.num_stages * (bk * qv + dense)
  backward = max(bq, bk) * qv + config.num_stages_bwd * (max(bq, bk) * qv + dense)
  return forward, backward


def _shared_memory_limit(call: CallInfo) -> int | None:
  if call.platform != "gpu" or call.compute_capability is None:
    return None
  return SHARED_MEMORY.get(tuple(call.compute_capability), SHARED_MEMORY_OTHER)


def fit_shared_memory(config: TritonConfig, call: CallInfo) -> TritonConfig:
  """`config` with its forward and backward pipeline stages each lowered (to 1 at least) until
  a block mask's blocks fit in this GPU's shared memory (shared_memory)."""
  limit = _shared_memory_limit(call)
  if limit is None or call.params.block_mask_blocks is None:
    return config
  for field, which in (("num_stages", 0), ("num_stages_bwd", 1)):
    while shared_memory(call, config)[which] > limit and getattr(config, field) > 1:
      config = dataclasses.replace(config, **{field: getattr(config, field) - 1})
  return config


def shared_memory_reason(call: CallInfo, config: TritonConfig) -> str | None:
  """Why the kernels' tiles at a block mask's blocks do not fit in this GPU's shared memory
  with `config`'s stages (shared_memory), or None."""
  limit = _shared_memory_limit(call)
  need = max(shared_memory(call, config))
  if limit is None or need <= limit:
    return None
  return (f"the Triton kernels' tiles at the block_mask's blocks "
          f"{call.params.block_mask_blocks} need {need >> 10} KiB of shared memory with "
          f"{config.num_stages} / {config.num_stages_bwd} stages (forward / backward), this GPU "
          f"has {limit >> 10} KiB; build the BlockMask with smaller blocks (e.g. 64) or pass "
          "a TritonConfig with fewer stages")


def platform_reason(platform: str, compute_capability: tuple[int, int] | None) -> str | None:
  """Why the Triton kernels (compiled, not interpreted) cannot run here, or None."""
  if platform != "gpu":
    return f"needs an NVIDIA GPU (platform is {platform!r}); 'interpret' runs it anywhere"
  if compute_capability is not None and compute_capability < (8, 0):
    return f"needs compute capability >= 8.0 (Ampere), this GPU is {compute_capability}"
  return None


def padded_head_dim(d: int) -> int:
  return max(16, pl_next_pow2(d))


def pl_next_pow2(n: int) -> int:
  return 1 << (n - 1).bit_length()


def fit_block(block: int, n: int) -> int:
  """Shrinks a block to the (power-of-two) sequence length; Triton tiles need >= 16 rows."""
  return max(16, min(block, pl_next_pow2(n)))


def call_config(head_dim: int, dtype, params: AttentionParams) -> TritonConfig:
  """The tuned config of a call (the kernels shrink its blocks to fit short sequences)."""
  return default_config(padded_head_dim(head_dim), params.is_causal, dtype,
                        feature=tuned_feature(params))


def tuned_feature(params: AttentionParams) -> str | None:
  """The feature whose tiles the call takes from config.FEATURE_TUNED: a dense bias or mask
  (whatever else is on: their tiles must fit in shared memory), else soft-capping or dropout
  alone (other combinations and ALiBi keep the plain tiles)."""
  if params.has_bias or params.has_mask:
    return "dense"
  if params.has_alibi:
    return None
  if params.logits_soft_cap is not None and not params.dropout_rate:
    return "softcap"
  if params.dropout_rate and params.logits_soft_cap is None:
    return "dropout"
  return None


def pad_inputs(q, k, v, q_seg, kv_seg, *, q_multiple: int, kv_multiple: int):
  """Pads sequences to block multiples and the head dims (q/k's, v's) to powers of two (zeros
  change no dot)."""
  t, s, d = q.shape[1], k.shape[1], q.shape[3]
  t_pad, s_pad, d_pad = (_tiling.round_up(t, q_multiple), _tiling.round_up(s, kv_multiple),
                         padded_head_dim(d))
  q = _tiling.pad_axis(_tiling.pad_axis(q, 1, t_pad), 3, d_pad)
  k = _tiling.pad_axis(_tiling.pad_axis(k, 1, s_pad), 3, d_pad)
  v = _tiling.pad_axis(_tiling.pad_axis(v, 1, s_pad), 3, padded_head_dim(v.shape[3]))
  q_seg, kv_seg = _tiling.pad_segments(q_seg, kv_seg, t_pad, s_pad)
  return q, k, v, q_seg, kv_seg


def pad_arrays(arrays: FeatureArrays | None, *, batch: int, heads: int, t_pad: int, s_pad: int):
  """Feature arrays as the kernels read them: bias / mask padded to whole blocks (mask as int8,
  Triton has no bool loads), slopes padded to a power-of-two length for scalar loads, and the
  dropout seed expanded to its row keys [B, H, T_pad] and column keys [S_pad]
  (dropout.key_tables). Returns (bias, mask, slopes, row_keys, col_keys), None where unused."""
  arrays = arrays or FeatureArrays()

  def pad2(x, value=0):
    return _tiling.pad_axis(_tiling.pad_axis(x, 2, t_pad, value), 3, s_pad, value)

  bias = None if arrays.bias is None else pad2(arrays.bias)
  mask = None if arrays.mask is None else pad2(arrays.mask.astype(jnp.int8))
  if bias is not None and mask is not None:  # one broadcast shape: both share index maps
    lead = tuple(max(m, n) for m, n in zip(bias.shape[:2], mask.shape[:2]))
    bias, mask = (jnp.broadcast_to(x, lead + x.shape[2:]) for x in (bias, mask))
  if mask is not None:
    mask = _int32_offsets_safe(mask)
  slopes, seed = arrays.alibi_slopes, arrays.dropout_seed
  if slopes is not None:
    slopes = _tiling.pad_axis(slopes, 0, pl_next_pow2(slopes.shape[0]))
  row_keys = col_keys = None
  if seed is not None:
    row_keys, col_keys = dropout.key_tables(seed, batch, heads, t_pad, s_pad)
  return bias, mask, slopes, row_keys, col_keys


def _int32_offsets_safe(mask):
  """An int8 mask [B|1, H|1, T_pad, S_pad] whose element offsets would pass int32
  (INT32_OFFSET_BYTES) grown along T past that many bytes, so that the kernels address it
  with int64 offsets: the rows past T_pad are never read (at most a copy's worth more memory,
  for masks of 2-4 GiB)."""
  if not INT32_OFFSET_BYTES // 2 < mask.size <= INT32_OFFSET_BYTES:
    return mask
  per_row = mask.size // mask.shape[2]
  return _tiling.pad_axis(mask, 2, INT32_OFFSET_BYTES // per_row + 1)


def _limits(limits_ref, p: KernelParams):
  """(limits, full_limits) for _tiling.block_runs from a [4] segment-limits ref, or Nones."""
  if not p.has_segments:
    return None, None
  # A dense mask is data too: no block may skip the element test then.
  full = None if p.has_mask else (limits_ref[2], limits_ref[3])
  return (limits_ref[0], limits_ref[1]), full


def kv_runs(q_block, p: KernelParams, limits_ref=None):
  """(first, full_lo, full_hi, last) key blocks of query block `q_block` (_tiling.block_runs),
  narrowed to the segment limits in `limits_ref` [4] when there are segment ids."""
  limits, full = _limits(limits_ref, p)
  return _tiling.block_runs(q_block, owner_block=p.block_q, other_block=p.block_kv,
                          num_other=p.num_kv_blocks, band=p.band,
                          element_mask=p.has_element_mask, other_len=p.kv_len, limits=limits,
                          full_limits=full)


def q_runs(kv_block, p: KernelParams, limits_ref=None):
  """(first, full_lo, full_hi, last) query blocks that see key block `kv_block`."""
  limits, full = _limits(limits_ref, p)
  # With segment ids the key tail block holds padding ids, so its full run is empty by data;
  # without them a tail needs the test on every query block of the last key block.
  return _tiling.block_runs(kv_block, owner_block=p.block_kv, other_block=p.block_q,
                          num_other=p.num_q_blocks, band=_tiling.mirrored(p.band),
                          element_mask=p.has_element_mask or p.kv_tail, other_len=None,
                          limits=limits, full_limits=full)


def segment_limits(q_seg, kv_seg, *, block_q: int, block_kv: int):
  """(kv_limits [B, nq, 2], q_limits [B, nk, 2]) or (None, None) without segment ids."""
  if q_seg is None:
    return None, None
  return _tiling.segment_block_limits(q_seg, kv_seg, block_q=block_q, block_kv=block_kv)


def logits(qk, rows, cols, slope, bias, p: KernelParams):
  """Scores of a tile in log2 units (exp(x) == exp2(x * log2 e)), and tanh(s / cap) or None.

  qk is the raw q·kᵀ tile; rows / cols the positions along its axes (either may be the query
  axis: ALiBi's |i - j| is symmetric); bias the tile of the dense bias in the same orientation.
  """
  if p.softcap is None and slope is None and bias is None:
    return qk * p.scale_log2, None
  if p.bias_in_cap:
    return _logits_bias_in_cap(qk, rows, cols, slope, bias, p)
  t = None
  if p.softcap is not None:
    if p.approx_tanh:
      t = pltriton.approx_tanh(qk * (p.scale / p.softcap))
    else:  # tanh(x) = 1 - 2 / (1 + e^2x) saturates cleanly to ±1 (e^2x -> inf or 0)
      t = 1.0 - 2.0 / (1.0 + jnp.exp2(qk * (2.0 * LOG2E * p.scale / p.softcap)))
    s = t * (p.softcap * LOG2E)
  else:
    s = qk * p.scale_log2
  if slope is not None:
    dist = jnp.abs(rows[:, None] - cols[None, :]).astype(jnp.float32)
    s = s - (slope * LOG2E) * dist
  if bias is not None:
    s = s + bias.astype(jnp.float32) * LOG2E
  return s, t


def probabilities(qk, lse, lse2, rows, cols, slope, bias, p: KernelParams, *, lse_on_rows):
  """exp(logits - lse) of a tile, recomputed from the raw qk tile, and `logits`' tanh.

  lse / lse2: the log-sum-exp in natural / log2 units, one per row of the tile (lse_on_rows)
  or per column (the transposed frame); broadcast here, after the scores, so that 16-bit
  kernels lower as before. For float32
  inputs without logit modifiers the difference is taken in natural units before scaling by
  log2(e): rounding qk·scale·log2(e) and lse·log2(e) (|x| ~ 30 for D = 64) each cost a relative
  error in P of up to 1e-6, which made dV 2x less accurate than plain float32 attention.
  """
  def along(x):
    return x[:, None] if lse_on_rows else x[None, :]

  if p.precise_lse and p.softcap is None and slope is None and bias is None:
    return jnp.exp2((qk * p.scale - along(lse)) * LOG2E), None
  s, t = logits(qk, rows, cols, slope, bias, p)
  return jnp.exp2(s - along(lse2)), t


def _logits_bias_in_cap(qk, rows, cols, slope, bias, p: KernelParams):
  """`logits` for c·tanh((scale·qk - slope·|i - j| + bias) / c), in natural units until the cap."""
  s = qk * p.scale
  if slope is not None:
    s = s - slope * jnp.abs(rows[:, None] - cols[None, :]).astype(jnp.float32)
  if bias is not None:
    s = s + bias.astype(jnp.float32)
  if p.approx_tanh:
    t = pltriton.approx_tanh(s * (1.0 / p.softcap))
  else:
    t = 1.0 - 2.0 / (1.0 + jnp.exp2(s * (2.0 * LOG2E / p.softcap)))
  return t * (p.softcap * LOG2E), t




def dot(a, b, *, trans_b: bool = False):
  """a @ b (or a @ b.T) with float32 accumulation; float32 inputs get full precision, not tf32."""
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return pltriton.dot(a, b, trans_b=trans_b, precision=precision)


def block_mask(q_pos, kv_pos, q_seg, kv_seg, p: KernelParams, dense=None, *, fn=None):
  """[len(q_pos), len(kv_pos)] bool: which scores of a block pair are visible.

  Args:
    q_pos, kv_pos: int32 positions of the block's rows / columns.
    q_seg, kv_seg: their segment ids (ignored unless p.has_segments).
    dense: the int8 tile of the dense mask, or None.
    fn: (fn_refs, b, q_start, kv_start) of the block mask's function (used when p.block_sparse).
  """
  mask = kv_pos[None, :] < p.kv_len
  band = _tiling.band_mask(q_pos, kv_pos, p.band)
  if band is not None:
    mask = mask & band
  if p.has_segments:
    mask = mask & (q_seg[:, None] == kv_seg[None, :])
  if dense is not None:
    mask = mask & (dense != 0)
  if p.block_sparse:
    mask = mask & mask_fn_tile(*fn, q_pos, kv_pos, p)
  return mask


# ---------------------------------------------------------------------------------------------
# Block masks (pallas_flash.masks)


def sparse_params(bm) -> dict:
  """KernelParams fields describing block mask `bm` (none without one)."""
  if bm is None:
    return {}
  return dict(mask_def=jax.tree_util.tree_structure(bm.mask_fn),
              mask_kinds=bm.mask_fn.leaf_kinds(), mask_batch=bm.batch)


def sparse_inputs(bm, p: KernelParams, *, t_pad: int, s_pad: int, by_q: bool):
  """(args, specs) of the block mask for a kernel on a grid (owner block, B, heads).

  args = (table [Bm, n_owner, n_other] int32, counts [Bm, n_owner, 2] (active, partial),
  mask function leaves); by_q: the owner is the query block (forward, dQ), else the key block.
  """
  if bm is None:
    return (None, None, None), (None, None, None)

  def bsel(bi):
    return bi if p.mask_batch > 1 else 0

  if by_q:
    table, counts = bm.kv_blocks, jnp.stack([bm.kv_count, bm.kv_num_partial], -1)
  else:
    table, counts = bm.q_blocks, jnp.stack([bm.q_count, bm.q_num_partial], -1)
  leaves, leaf_specs = [], []
  fn = masks.pad_leaves(bm.mask_fn, t_pad, s_pad)
  for kind, x in zip(p.mask_kinds, jax.tree_util.tree_leaves(fn)):
    if kind == masks.BATCH:  # read as a scalar: pad to a power-of-two length
      x = _tiling.pad_axis(x, 0, pl_next_pow2(x.shape[0]))
      leaf_specs.append(pl.BlockSpec(x.shape, lambda *_: (0,)))
    else:
      leaf_specs.append(pl.BlockSpec((None, x.shape[1]), lambda i, bi, hi: (bsel(bi), 0)))
    leaves.append(x)
  specs = (pl.BlockSpec((None, None, table.shape[2]), lambda i, bi, hi: (bsel(bi), i, 0)),
           pl.BlockSpec((None, None, 2), lambda i, bi, hi: (bsel(bi), i, 0)),
           tuple(leaf_specs) or None)
  return (table, counts, tuple(leaves) or None), specs


def mask_fn_tile(fn_refs, b, q_start, kv_start, q_pos, kv_pos, p: KernelParams):
  """[block_q, block_kv] bool: the block mask's function on one tile, loading its leaves."""
  tiles = []
  for kind, ref in zip(p.mask_kinds, fn_refs or ()):
    if kind == masks.Q:
      tiles.append(ref[pl.ds(pl.multiple_of(q_start, p.block_q), p.block_q)])
    elif kind == masks.KV:
      tiles.append(ref[pl.ds(pl.multiple_of(kv_start, p.block_kv), p.block_kv)])
    else:
      tiles.append(ref[b if p.mask_batch > 1 else 0])
  return p.mask_def.unflatten(tiles).tile(q_pos, kv_pos)


def sparse_loop(table_ref, counts_ref, body, carry):
  """body(other_block, carry, masked=...) over the block mask's active blocks: the partial ones
  (listed first) with the element mask, then the full ones without."""
  count, num_partial = counts_ref[0], counts_ref[1]

  def run(masked):
    return lambda n, c: body(table_ref[n], c, masked=masked)

  carry = lax.fori_loop(0, num_partial, run(True), carry)
  return lax.fori_loop(num_partial, count, run(False), carry)
