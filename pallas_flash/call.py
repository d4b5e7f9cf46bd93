"""Static description of one attention call, shared by every backend.

Shape letters (used in every docstring of the package):
  B batch, T query length, S key/value length, H query heads, K key/value heads,
  G = H // K query heads per key/value head, D head dim.

Backend contract (each of `xla`, `triton`, `mosaic_gpu` provides these; pallas_flash.backends
reads them into one record):

  forward(q, k, v, q_seg, kv_seg, *, params, config[, arrays]) -> (o, lse)
    q [B, T, H, D], k/v [B, S, K, D], q_seg [B, T] int32 | None, kv_seg [B, S] int32 | None
    o [B, T, H, D] in q.dtype; lse [B, H, T] float32, natural log, -inf on fully masked rows.
    lse is that of the softmax before dropout.

  backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, *, params, config[, arrays])
      -> (dq, dk, dv), then dbias when params.returns_dbias, then dsinks when params.has_sinks
    lse has +inf (not -inf) on fully masked rows, so exp(s - lse) is 0 there without a select;
    delta [B, H, T] float32 = rowsum(do * o) - dlse, computed by the API in XLA.
    A backend whose module sets BACKWARD_COMPUTES_DELTA = True (mosaic_gpu: it does this in a
    kernel, saving XLA's extra pass over O and dO) instead gets lse as forward returned it
    (-inf on fully masked rows) and delta = -dlse, or None when lse has no cotangent, and
    computes rowsum(do * o) itself.
    dbias has the shape of arrays.bias (summed over its broadcast batch / head axes). With
    params.bias_grad False (a bias that nothing differentiates) it is not returned, and the
    kernels skip dS's stores.

  config is always given: the API resolves it once, the user's or `default_config(call)`.

  A backend whose module sets FUSES_SINKS = True (mosaic_gpu) gets a call with attention sinks
  as params.has_sinks and arrays.sinks: its forward returns o and lse with the sinks in the
  softmax (lse = logaddexp(lse, sink); sink on fully masked rows), and its backward, given
  those, is unchanged (P = exp(s - lse), delta = rowsum(do * o) already include the sink's
  column) and also returns dsinks [H] float32 (merge.sinks_grad of its delta). Other backends
  never see sinks.

  default_config(call: CallInfo) -> CONFIG_TYPE: the config of a call that passes none.
  unsupported_reason(call: CallInfo, config: CONFIG_TYPE | None) -> str | None
  CONFIG_TYPE: the backend's frozen config dataclass.
  SUPPORTED_FEATURES: frozenset[str]: the names in `FEATURES` the backend implements. The API
    rejects calls using any other feature before asking `unsupported_reason`, and passes
    `arrays=` only to calls that use a feature.

Logits are computed in this order (FlashAttention-2's softcap/ALiBi order; bias as jax.nn):
  s = scale * q·kᵀ;  s = c·tanh(s / c) (soft cap);  s += -slope_h·|i - j| (ALiBi);  s += bias;
  then masking, softmax, dropout on the probabilities (kept ones scaled by 1 / (1 - rate)).
  With params.bias_in_cap (logits_soft_cap_order="bias_then_cap") ALiBi and the bias go inside
  the cap instead: s = c·tanh((scale * q·kᵀ - slope_h·|i - j| + bias) / c).

Masking is one rule for every backend: key j is visible to query i iff
q_seg[i] == kv_seg[j] (when segment ids are given), j <= i (when causal),
i - left <= j <= i + right (with local_window=(left, right)), mask[b, h, i, j] (dense mask) and
block_mask.mask_fn (a block-sparse mask, which excludes causal, window and segment ids).
Sequence lengths are folded into the segment ids by the API (validation._fold_lengths).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

# Finite stand-in for -inf in masked scores: exp(MASK_VALUE - m) underflows to 0, while
# MASK_VALUE - MASK_VALUE stays 0 rather than the NaN that (-inf) - (-inf) gives.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Segment ids given to padded positions: distinct from each other so that a padded query never
# matches a padded key, and far from the small non-negative ids users pass.
Q_PAD_SEGMENT = -(2**31)
KV_PAD_SEGMENT = -(2**31) + 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionParams:
  """What every backend needs to know statically about a call.

  Attributes:
    scale: softmax scale applied to q·kᵀ.
    is_causal: query i sees keys 0..i (top-left alignment, as jax.nn.dot_product_attention).
    has_segments: q_seg / kv_seg arrays are present and must be compared.
    local_window: (left, right): query i sees keys i - left .. i + right (jax.nn's
      local_window_size); None for no window.
    logits_soft_cap: c in c·tanh(s / c), or None.
    bias_in_cap: ALiBi and the bias are added before the soft cap (c·tanh((s + bias) / c))
      rather than after it; True only when a cap and ALiBi or a bias are both present, so that
      calls the order cannot change keep one static description.
    has_alibi: arrays.alibi_slopes [H] float32 is present.
    dropout_rate: probability of dropping an attention probability; 0 for no dropout (then
      arrays.dropout_seed is None).
    has_bias: arrays.bias [B|1, H|1, T, S] is present (differentiable).
    bias_grad: the backward returns dbias (`returns_dbias`). The API sets it False in the
      backward of a call whose bias its differentiation does not perturb (a constant, or
      under stop_gradient), so that no [B, H, T, S] dS is written and reduced for nothing.
    has_mask: arrays.mask [B|1, H|1, T, S] bool is present.
    block_mask_blocks: (block_q, block_kv) of arrays.block_mask (a masks.BlockMask),
      which then replaces causal / window / segment masking; None without a block mask.
    block_mask_fn_types: the classes of its mask function's nodes (masks.node_types), for
      backends that evaluate only some mask functions; () without a block mask.
    deterministic: gradients must be bitwise identical run to run (backends whose fastest
      backward sums in a varying order choose another; see flash_attention).
    has_sinks: arrays.sinks [H] float32 is present and the backend's forward adds them (only
      a backend that sets FUSES_SINKS gets it; the API adds the sinks of every other call
      after the backend, merge.add_sinks). Not in `features`: every backend can take a call
      with sinks, so they never decide which one runs it.
  """

  scale: float
  is_causal: bool
  has_segments: bool
  local_window: tuple[int, int] | None = None
  logits_soft_cap: float | None = None
  bias_in_cap: bool = False
  has_alibi: bool = False
  dropout_rate: float = 0.0
  has_bias: bool = False
  bias_grad: bool = True
  has_mask: bool = False
  block_mask_blocks: tuple[int, int] | None = None
  block_mask_fn_types: tuple[type, ...] = ()
  deterministic: bool = False
  has_sinks: bool = False

  @property
  def features(self) -> frozenset[str]:
    """The names (from `FEATURES`) of the optional features this call uses."""
    used = {"local_window_size": self.local_window is not None,
            "logits_soft_cap": self.logits_soft_cap is not None,
            "alibi_slopes": self.has_alibi, "dropout": self.dropout_rate > 0.0,
            "bias": self.has_bias, "mask": self.has_mask,
            "block_mask": self.block_mask_blocks is not None}
    return frozenset(name for name, on in used.items() if on)

  @property
  def returns_dbias(self) -> bool:
    """Whether the backward returns dbias (and its kernels write dS for it)."""
    return self.has_bias and self.bias_grad

  @property
  def band(self) -> tuple[int | None, int | None]:
    """(lo, hi): key j is visible to query i only if lo <= j - i <= hi; None is unbounded.

    Combines causal masking (hi = 0) and the local window (lo = -left, hi = right).
    """
    lo = hi = None
    if self.local_window is not None:
      lo, hi = -self.local_window[0], self.local_window[1]
    if self.is_causal:
      hi = 0 if hi is None else min(hi, 0)
    return lo, hi

  @property
  def has_element_mask(self) -> bool:
    """Whether masks depend on data (segments, dense mask): no block can skip the mask test."""
    return self.has_segments or self.has_mask


# The optional features a backend may declare in SUPPORTED_FEATURES.
FEATURES = frozenset({"local_window_size", "logits_soft_cap", "alibi_slopes", "dropout", "bias",
                      "mask", "block_mask"})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FeatureArrays:
  """The array inputs of optional features; unused ones are None (no pytree leaves).

  Attributes:
    bias: [B|1, H|1, T, S] additive logits bias (any float dtype); differentiable.
    mask: [B|1, H|1, T, S] bool, True where a query may see a key.
    alibi_slopes: [H] float32 per-head ALiBi slopes (not differentiated).
    dropout_seed: [2] int32, the dropout hash's seed (derived from `dropout_rng`).
    block_mask: a `pallas_flash.BlockMask` (a pytree of int tables and the mask function).
    sinks: [H] float32 attention-sink logits (params.has_sinks); differentiable.
  """

  bias: jax.Array | None = None
  mask: jax.Array | None = None
  alibi_slopes: jax.Array | None = None
  dropout_seed: jax.Array | None = None
  block_mask: Any = None
  sinks: jax.Array | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallInfo:
  """Shapes, dtype, features and target device of a call: what `explain` reasons about."""

  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  value_head_dim: int  # may differ from head_dim (query/key), e.g. MLA's 192 / 128
  dtype: jnp.dtype
  params: AttentionParams
  platform: str  # "cpu", "gpu", ...
  compute_capability: tuple[int, int] | None  # (9, 0) on Hopper; None off-GPU or unknown
  device_kind: str
  bias_dtype: jnp.dtype | None = None  # the dense bias's, kept by the kernels that load it


def backward_inputs(computes_delta: bool, o, lse, cotangents: tuple, dtype):
  """(do in `dtype`, delta, lse) for a backend's `backward` from the forward's o [B, T, H, Dv]
  and lse [B, H, T] and the cotangents (do, dlse), either of which may be a SymbolicZero;
  computes_delta: the backend's BACKWARD_COMPUTES_DELTA."""
  do, dlse = cotangents
  if isinstance(do, SymbolicZero):  # only lse is differentiated
    do = jnp.zeros(o.shape, dtype)
  # None when lse is unused (symbolic zeros), so that no zero array is materialised.
  dlse = None if isinstance(dlse, SymbolicZero) else dlse
  # delta = rowsum(dO * O) is FA2's backward preprocessing; a cotangent on lse enters the
  # score gradient as p * dlse, which is the same as subtracting it from delta.
  if computes_delta:
    delta = None if dlse is None else -dlse
  else:
    delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32))
    if dlse is not None:
      delta = delta - dlse
    # +inf on fully masked rows makes every recomputed probability exp(s - lse) exactly 0.
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
  return do.astype(dtype), delta, lse
