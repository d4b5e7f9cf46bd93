"""Static description of one attention call, shared by every backend.

Shape letters (used in every docstring of the package):
  B batch, T query length, S key/value length, H query heads, K key/value heads,
  G = H // K query heads per key/value head, D head dim.

Backend contract (each of `xla`, `triton`, `mosaic_gpu` provides these):

  forward(q, k, v, q_seg, kv_seg, *, params, config) -> (o, lse)
    q [B, T, H, D], k/v [B, S, K, D], q_seg [B, T] int32 | None, kv_seg [B, S] int32 | None
    o [B, T, H, D] in q.dtype; lse [B, H, T] float32, natural log, -inf on fully masked rows.

  backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, *, params, config) -> (dq, dk, dv)
    lse has +inf (not -inf) on fully masked rows, so exp(s - lse) is 0 there without a select;
    delta [B, H, T] float32 = rowsum(do * o) - dlse, computed by the API in XLA.

  unsupported_reason(call: CallInfo) -> str | None

Masking is one rule for every backend: key j is visible to query i iff
q_seg[i] == kv_seg[j] (when segment ids are given) and, when causal, j <= i.
Sequence lengths are folded into the segment ids by the API (see api._fold_lengths).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

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
  """

  scale: float
  is_causal: bool
  has_segments: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallInfo:
  """Shapes, dtype, features and target device of a call: what `explain` reasons about."""

  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: jnp.dtype
  params: AttentionParams
  platform: str  # "cpu", "gpu", ...
  compute_capability: tuple[int, int] | None  # (9, 0) on Hopper; None off-GPU or unknown
  device_kind: str

  @property
  def group_size(self) -> int:
    return self.num_heads // self.num_kv_heads
