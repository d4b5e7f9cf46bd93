"""Helpers shared by the blocked backends: padding to block multiples and block ranges."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash.params import KV_PAD_SEGMENT, Q_PAD_SEGMENT


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  return cdiv(a, b) * b


def pad_axis(x: jax.Array | None, axis: int, size: int, value=0) -> jax.Array | None:
  """Pads `x` along `axis` at the end up to `size` (no copy when already that size)."""
  if x is None or x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def pad_segments(
    q_seg: jax.Array | None, kv_seg: jax.Array | None, t_pad: int, s_pad: int
) -> tuple[jax.Array | None, jax.Array | None]:
  """Pads segment ids so that padded queries and padded keys never match anything."""
  return pad_axis(q_seg, 1, t_pad, Q_PAD_SEGMENT), pad_axis(kv_seg, 1, s_pad, KV_PAD_SEGMENT)


def causal_kv_blocks(q_block, *, block_q: int, block_kv: int, num_kv_blocks: int):
  """Number of kv blocks query block `q_block` needs under causal masking (top-left aligned)."""
  last_row = (q_block + 1) * block_q - 1
  return jnp.minimum(num_kv_blocks, last_row // block_kv + 1)


def causal_first_q_block(kv_block, *, block_q: int, block_kv: int):
  """First query block that sees any key of `kv_block` under causal masking."""
  return (kv_block * block_kv) // block_q
