"""Token placement over the devices of a context-parallel mesh axis.

The global sequence is cut into equal chunks and each device holds some of them, in order:

  "contiguous": P chunks; device r holds chunk r (what sharding the sequence axis gives).
  "zigzag":     2P chunks; device r holds chunks r and 2P-1-r. Under causal masking every
                device then sees the same number of (query, key) pairs, so no device waits
                for another at a ring step (ring-flash-attention's zigzag; Llama 3's CP).

`to_zigzag` / `from_zigzag` reorder a global sequence (data, positions, segment ids) so that
sharding it contiguously gives the zigzag placement: apply them in the data pipeline, and feed
`to_zigzag(positions)` to rotary embeddings. Inside `shard_map`, `contiguous_to_zigzag` /
`zigzag_to_contiguous` move local shards between the two placements with two `ppermute`s
(what the sharding entry point does for a causal call).
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
import numpy as np
from jax import lax

Layout = Literal["zigzag", "contiguous"]
LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")


def chunks_per_device(layout: str) -> int:
  return {"zigzag": 2, "contiguous": 1}[layout]


def device_chunks(layout: str, axis_size: int, r: int) -> tuple[int, ...]:
  """The global chunk indices device `r` holds, in local order."""
  if layout == "zigzag":
    return (r, 2 * axis_size - 1 - r)
  return (r,)


def chunk_table(layout: str, axis_size: int) -> np.ndarray:
  """[axis_size, chunks_per_device] int32: global chunk of each (device, local slot)."""
  return np.array([device_chunks(layout, axis_size, r) for r in range(axis_size)], np.int32)


def _zigzag_order(axis_size: int) -> np.ndarray:
  """Global chunk indices in zigzag storage order: 0, 2P-1, 1, 2P-2, ..."""
  return chunk_table("zigzag", axis_size).reshape(-1)


def _reorder_chunks(x, order: np.ndarray, axis: int):
  n = len(order)
  if x.shape[axis] % n:
    raise ValueError(f"The sequence axis ({x.shape[axis]}) must divide into {n} equal chunks "
                     f"(2 x axis_size) for the zigzag layout.")
  shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
  x = jnp.take(jnp.reshape(x, shape), jnp.asarray(order), axis=axis)
  return jnp.reshape(x, x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def to_zigzag(x, axis_size: int, *, axis: int = 1):
  """Reorders the global sequence axis of `x` so that sharding it contiguously over `axis_size`
  devices puts chunks r and 2P-1-r (of 2P equal chunks) on device r.

  Apply it to every per-token array (tokens, targets, segment ids, positions) before sharding;
  `from_zigzag` undoes it (e.g. on per-token losses or outputs). For rank-1 arrays use axis=0.
  """
  return _reorder_chunks(x, _zigzag_order(axis_size), axis)


def from_zigzag(x, axis_size: int, *, axis: int = 1):
  """Inverse of `to_zigzag`."""
  return _reorder_chunks(x, np.argsort(_zigzag_order(axis_size)), axis)


def _halves(x, axis: int):
  n = x.shape[axis]
  if n % 2:
    raise ValueError(f"The local sequence length ({n}) must be even for the zigzag layout.")
  return (lax.slice_in_dim(x, 0, n // 2, axis=axis), lax.slice_in_dim(x, n // 2, n, axis=axis))


def _zigzag_perms(axis_size: int):
  """ppermute pairs moving contiguous halves to zigzag owners: (even chunk, odd chunk).

  Contiguous device d holds chunks 2d (even) and 2d+1 (odd) of 2P; zigzag device r holds r and
  2P-1-r, one even and one odd, so each parity is a permutation of the devices.
  """
  even, odd = [], []
  for r in range(axis_size):
    mine = device_chunks("zigzag", axis_size, r)
    e, o = (mine if mine[0] % 2 == 0 else mine[::-1])
    even.append((e // 2, r))
    odd.append((o // 2, r))
  return even, odd


def contiguous_to_zigzag(x, axis_name, *, axis: int = 1):
  """Inside shard_map: a contiguous local shard -> the zigzag local shard (two ppermutes)."""
  p = lax.axis_size(axis_name)
  if p == 1:
    return x
  even_perm, odd_perm = _zigzag_perms(p)
  first, second = _halves(x, axis)  # chunks 2d and 2d+1
  even, odd = lax.ppermute(first, axis_name, even_perm), lax.ppermute(second, axis_name, odd_perm)
  r_even = lax.axis_index(axis_name) % 2 == 0  # then the even chunk (r) comes first
  return jnp.where(r_even, jnp.concatenate([even, odd], axis), jnp.concatenate([odd, even], axis))


def zigzag_to_contiguous(x, axis_name, *, axis: int = 1):
  """Inside shard_map: inverse of `contiguous_to_zigzag`."""
  p = lax.axis_size(axis_name)
  if p == 1:
    return x
  even_perm, odd_perm = _zigzag_perms(p)
  first, second = _halves(x, axis)
  r_even = lax.axis_index(axis_name) % 2 == 0
  even, odd = jnp.where(r_even, first, second), jnp.where(r_even, second, first)
  inv = lambda perm: [(dst, src) for src, dst in perm]
  even = lax.ppermute(even, axis_name, inv(even_perm))
  odd = lax.ppermute(odd, axis_name, inv(odd_perm))
  return jnp.concatenate([even, odd], axis)


def natural_order(x, layout: str, axis_size: int, *, axis: int = 1):
  """A gathered array in device order (device 0's local shard, then device 1's, ...) put back
  into global sequence order (a static reordering of chunks)."""
  if layout == "contiguous":
    return x
  return from_zigzag(x, axis_size, axis=axis)


def device_order(x, layout: str, axis_size: int, *, axis: int = 1):
  """Inverse of `natural_order`."""
  if layout == "contiguous":
    return x
  return to_zigzag(x, axis_size, axis=axis)


def check_layout(layout) -> str:
  if layout not in LAYOUTS:
    raise ValueError(f"`layout` must be one of {LAYOUTS}, got {layout!r}.")
  return layout


__all__ = [
  "LAYOUTS",
  "Layout",
  "chunk_table",
  "chunks_per_device",
  "contiguous_to_zigzag",
  "device_chunks",
  "device_order",
  "from_zigzag",
  "natural_order",
  "to_zigzag",
  "zigzag_to_contiguous",
]
