"""FLOP counts, by the convention of shared/ANCHORS.md and the FlashAttention benchmarks.

Only the matrix work counts: the forward does two matmuls of 2*B*H*T*S*D each (q.k^T and p.v),
so 4*B*H*T*S*D (2*B*H*T*S*(D + Dv) with a value head dim Dv of its own), halved when causal
(the exact causal count is a little over half; the convention ignores that so numbers compare
across papers). The backward does 2.5x the forward's matmuls, so forward+backward is 3.5x the
forward.
"""

from __future__ import annotations

from pallas_flash.bench.shapes import ShapeSpec

MODES: tuple[str, ...] = ("fwd", "fwdbwd")
_MODE_FACTOR = {"fwd": 1.0, "fwdbwd": 3.5}


def attention_flops(spec: ShapeSpec, *, is_causal: bool, mode: str) -> float:
  """Matmul FLOPs of one call on `spec` (self-attention: S = T)."""
  if mode not in _MODE_FACTOR:
    raise ValueError(f"Unknown mode {mode!r}; choose one of {MODES}.")
  b, t, h, d = spec.shape
  forward = 2.0 * b * h * t * t * (d + spec.dv)
  if is_causal:
    forward /= 2
  return forward * _MODE_FACTOR[mode]


def window_pairs(n: int, left: int, right: int = 0) -> int:
  """(query, key) pairs of n tokens with i - left <= j <= i + right (a causal window of
  left + 1 keys where right = 0): sum over i of min(i, left) + 1, plus min(n - 1 - i, right)."""
  ramp = min(n, left + 1)  # queries 0 .. ramp - 1 see every earlier key
  ahead = min(n - 1, right)  # keys after the query: n - d pairs at each distance d <= ahead
  return ramp * (ramp + 1) // 2 + (n - ramp) * (left + 1) + ahead * n - ahead * (ahead + 1) // 2


def window_flops(spec: ShapeSpec, *, left: int, right: int = 0, mode: str) -> float:
  """Matmul FLOPs of one call whose query i sees keys i - left .. i + right (right = 0: a
  causal window of left + 1 keys): the band's exact pair count (window_pairs)."""
  if mode not in _MODE_FACTOR:
    raise ValueError(f"Unknown mode {mode!r}; choose one of {MODES}.")
  b, t, h, d = spec.shape
  return 2.0 * b * h * window_pairs(t, left, right) * (d + spec.dv) * _MODE_FACTOR[mode]


def tflops(flops: float, seconds: float) -> float:
  """TFLOP/s (10^12 FLOP per second)."""
  return flops / seconds / 1e12


def format_tflops(x: float | None) -> str:
  """TFLOP/s for tables: whole numbers on a GPU, significant digits for tiny CPU runs."""
  if x is None:
    return "-"
  return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2g}"
