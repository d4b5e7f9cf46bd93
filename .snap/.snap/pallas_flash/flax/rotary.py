"""Rotary position embeddings (RoFormer), in the rotate-half layout `flax.nnx.RoPE` uses."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rotary_angles(positions: jax.Array, head_dim: int, theta: float) -> jax.Array:
  """Rotation angle of each (position, frequency) pair.

  Args:
    positions: [B, T] (or [T]) integer or float positions.
    head_dim: D, even.
    theta: base period (10_000 in RoFormer; larger for long context).

  Returns:
    [B, T, D // 2] float32 angles.
  """
  if head_dim % 2:
    raise ValueError(f"Rotary embeddings need an even head_dim, got {head_dim}.")
  freqs = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  return positions.astype(jnp.float32)[..., None] * freqs


def apply_rotary(x: jax.Array, positions: jax.Array, *, theta: float = 10_000.0) -> jax.Array:
  """Rotates each head's feature pairs (i, i + D/2) by a position-dependent angle.

  Args:
    x: [B, T, H, D] queries or keys.
    positions: [B, T] positions; packed documents restart at 0 (only differences matter for
      q·k, but restarting keeps the angles small and equal across documents).
    theta: base period.

  Returns:
    [B, T, H, D] in x.dtype; the rotation is computed in float32 so that bf16 inputs lose no
    positional precision at long context.
  """
  angles = rotary_angles(positions, x.shape[-1], theta)[..., None, :]  # [B, T, 1, D/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
