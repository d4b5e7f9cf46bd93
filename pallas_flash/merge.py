"""Exact merge of attention computed over disjoint sets of keys.

Attention over keys K = K_1 ∪ ... ∪ K_N (disjoint) is a weighted sum of the partial results:
with o_i the softmax-normalised output over K_i and lse_i its log-sum-exp,

  lse = log Σ_i exp(lse_i),   o = Σ_i exp(lse_i − lse) · o_i.

Split-KV decoding, context-parallel (ring) attention and cascades over a shared prefix all
reduce their partial `(out, lse)` pairs this way.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def merge_attention_states(outputs: jax.Array | Sequence[jax.Array],
                           lses: jax.Array | Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """Merges N partial attention results over disjoint key sets into the result over all keys.

  Args:
    outputs: N partial outputs [B, T, H, D] (a sequence, or stacked as [N, B, T, H, D]), each
      normalised over its own keys, as `flash_attention(..., return_residuals=True)` returns.
    lses: their log-sum-exps [B, H, T] float32 (or stacked [N, B, H, T]), natural log, -inf
      where a query saw no key of that part.

  Returns:
    (out [B, T, H, D] in the outputs' dtype, lse [B, H, T] float32). A query that saw no key
    in any part gets zeros and lse -inf. Differentiable in both arguments.
  """
  outputs = _stacked("outputs", outputs, 4, "[B, T, H, D]")
  lses = _stacked("lses", lses, 3, "[B, H, T]")
  n, b, t, h, _ = outputs.shape
  if n == 0:
    raise ValueError("Nothing to merge: `outputs` and `lses` hold no partial result.")
  if lses.shape != (n, b, h, t):
    raise ValueError(f"`lses` must have shape {(n, b, h, t)} to match `outputs` "
                     f"{outputs.shape}, got {lses.shape}.")
  if not (jnp.issubdtype(outputs.dtype, jnp.floating)
          and jnp.issubdtype(lses.dtype, jnp.floating)):
    raise TypeError(f"`outputs` and `lses` must be float arrays, got {outputs.dtype} and "
                    f"{lses.dtype}.")
  lses = lses.astype(jnp.float32)
  m = jnp.max(lses, axis=0)
  # Shift by a finite max: rows where every part is empty keep weights exp(-inf) = 0, not NaN.
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  w = jnp.exp(lses - m)  # [N, B, H, T]
  total = w.sum(axis=0)
  safe = jnp.where(total == 0.0, 1.0, total)
  weights = (w / safe).transpose(0, 1, 3, 2)[..., None]  # [N, B, T, H, 1]
  out = (weights * outputs.astype(jnp.float32)).sum(axis=0)
  lse = jnp.where(total == 0.0, -jnp.inf, m + jnp.log(safe))
  return out.astype(outputs.dtype), lse


def _stacked(name: str, x, rank: int, layout: str) -> jax.Array:
  """x as one [N, ...] array of rank + 1 (stacked if a sequence of N rank-`rank` arrays), or a
  ValueError naming the argument."""
  if not hasattr(x, "ndim"):
    parts = list(x)
    shapes = {tuple(getattr(p, "shape", ())) for p in parts}
    if len(shapes) > 1 or any(not hasattr(p, "ndim") or p.ndim != rank for p in parts):
      raise ValueError(f"`{name}` as a sequence must hold arrays {layout} of one shape, got "
                       f"shapes {[tuple(getattr(p, 'shape', ())) for p in parts]}.")
    x = jnp.stack(parts) if parts else jnp.zeros((0,) + (1,) * rank)
  if x.ndim != rank + 1:
    raise ValueError(f"`{name}` must be [N, {layout[1:]} (or a sequence of N {layout} arrays), "
                     f"got shape {x.shape}.")
  return x


def add_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Attention with attention sinks from attention without them.

  A sink is one more logit per head that joins every row's softmax denominator and carries a
  zero value (gpt-oss): a merge with the state (out 0, lse sink), so each row is rescaled by
  sigmoid(lse - sink) and its log-sum-exp becomes logaddexp(lse, sink).

  Args:
    out: [B, T, H, D] attention over the keys; lse: [B, H, T] float32, -inf for no key.
    sinks: [H] float, one logit per query head (in the scaled-logit units of `lse`).

  Returns:
    (out [B, T, H, D] in out's dtype, lse [B, H, T] float32). A row that saw no key keeps zeros
    and gets lse = sink. A sink of -inf is no sink: that head's rows pass unchanged. Finite
    gradients in all three arguments, there too.
  """
  sink = sinks.astype(jnp.float32)[None, :, None]  # [1, H, 1]
  none = sink == -jnp.inf
  sink = jnp.where(none, 0.0, sink)  # a finite stand-in: -inf - -inf would be NaN
  rel = lse - sink  # [B, H, T]
  # sigmoid(rel) and logaddexp(lse, sink), written so that autodiff forms their slopes from
  # exp(-softplus(-rel)) and logaddexp's exp(x - out), never as 1 - sigmoid(rel): that lost
  # the float32 digits of the sinks' gradient on rows with lse >> sink (5e-5 relative, seen
  # with an lse cotangent). Finite with zero slope at rel = -inf (a row that saw no key).
  weight = jnp.where(none, 1.0, jnp.exp(-jax.nn.softplus(-rel))).transpose(0, 2, 1)[..., None]
  out = (out.astype(jnp.float32) * weight).astype(out.dtype)  # weight [B, T, H, 1]
  return out, jnp.where(none, lse, jnp.logaddexp(lse, sink))


def sinks_grad(sinks: jax.Array, lse: jax.Array, delta: jax.Array) -> jax.Array:
  """d sinks of attention whose softmax included the sinks (a backend that adds them itself).

  The sink's column has probability p = exp(sink - lse) and a zero value, so lse' = p and
  o' = -p·o along the sink: with delta = rowsum(do * o) - dlse, d sinks[h] = -Σ_{b,t} p·delta.

  Args:
    sinks: [H] float32; lse: [B, H, T] float32 of the sinks' softmax (-inf only where a sink of
      -inf met a row that saw no key: p = 0 there); delta: [B, H, T] float32 as above.

  Returns:
    [H] float32.
  """
  sink = sinks.astype(jnp.float32)[None, :, None]  # [1, H, 1]
  seen = lse != -jnp.inf
  p = jnp.where(seen, jnp.exp(sink - jnp.where(seen, lse, 0.0)), 0.0)
  return -(p * delta).sum(axis=(0, 2))
