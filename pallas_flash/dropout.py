"""The counter-based hash behind attention dropout: keep(seed, b, h, row, col), no stored mask.

Every implementation (the kernels, the blockwise XLA path and the reference) calls these same
jnp functions on int32 values, so a given (seed, batch, head, query row, key column) is kept or
dropped identically everywhere, whatever the block sizes: the backward regenerates the forward's
mask instead of storing it (FlashAttention §3.1 "dropout", done with a hash instead of Philox).

Keys: MurmurHash3's 32-bit finaliser (fmix32, a bijection with full avalanche) turns
(seed, batch, head) into a head key, that and the query row into a row key, and the key column
alone into a column key; both keys are made odd. Row and column keys are hoisted out of a tile
(one per row, one per column), so the per-element work is what `keep` does: one 32-bit multiply
of the two keys and a signed compare of the product's top bits with the rate's threshold. An
odd row key makes the product a bijection of the column key (no row can lose randomness), and
the top bits of a product depend on every bit of both factors. The kernels' per-element budget
is that small on purpose: with xor-shift-multiply per element (5 integer ops) the Triton forward
on the H200 ran at 0.74x of plain Triton attention, with this multiply-compare at 0.84x
(docs/perf.md, "Triton"; the likely reason, not profiled: Hopper issues integer logic and
shifts at half the FP32 rate, while the multiply goes to the FMA pipe). The Mosaic kernels'
0.67x: the narrower tiles and serial dK/dV steps their key vectors force (docs/mosaic.md).
Kept fraction, per-row / column / head fractions, neighbour and 2x2 rectangle correlations
are checked in tests/test_features.py. Everything is written with
wrapping int32 arithmetic and logical shifts so that it lowers to Triton and runs in the Pallas
interpreter unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _i32(u: int) -> jnp.int32:
  """An unsigned 32-bit constant as the int32 with the same bits."""
  return jnp.int32(u - (1 << 32) if u >= 1 << 31 else u)


_GOLDEN = 0x9E3779B9
_C_HEAD, _C_ROW, _C_COL = 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F


def mix32(x):
  """MurmurHash3 fmix32 on int32 bits (a bijection)."""
  x = x ^ lax.shift_right_logical(x, jnp.int32(16))
  x = x * _i32(0x85EBCA6B)
  x = x ^ lax.shift_right_logical(x, jnp.int32(13))
  x = x * _i32(0xC2B2AE35)
  return x ^ lax.shift_right_logical(x, jnp.int32(16))


def threshold(rate: float) -> int:
  """int32 threshold: an element is kept iff its (signed, uniform) hash >= threshold, which
  happens with probability 1 - rate up to 2**-32."""
  return min(int(round(rate * 2.0**32)) - 2**31, 2**31 - 1)


def head_key(seed0, seed1, b, h):
  """int32 key of one (batch, query head) from the two seed words; all arguments broadcast."""
  x = mix32(seed0 + b * _i32(_GOLDEN))
  return mix32(x ^ (seed1 + h * _i32(_C_HEAD)))


def row_keys(key, rows):
  """Odd int32 keys of query rows (global positions) under one head key."""
  return mix32(key ^ (rows * _i32(_C_ROW))) | 1


def col_keys(cols):
  """Odd int32 keys of key columns (global positions); independent of seed, batch and head,
  since the row key already carries those."""
  return mix32(cols * _i32(_C_COL) + _i32(_GOLDEN)) | 1


def keep_keys(row_key, col_key, thresh: int):
  """bool: which (row, col) pairs survive, from their keys (broadcasting): the per-element work."""
  return row_key * col_key >= thresh


def keep(row_key, cols, thresh: int):
  """bool: which (row, col) pairs survive; row_key and cols (global key positions) broadcast."""
  return keep_keys(row_key, col_keys(cols), thresh)


def key_tables(seed: jax.Array, batch: int, num_heads: int, q_len: int, kv_len: int):
  """(row keys [B, H, q_len], column keys [kv_len]) int32 of a call.

  The Triton kernels read these instead of hashing: a key computed in a tile is recomputed by
  every thread holding that row or column, which at 128-wide tiles cost as much as the
  per-element work itself.
  """
  b = jnp.arange(batch, dtype=jnp.int32)[:, None, None]
  h = jnp.arange(num_heads, dtype=jnp.int32)[None, :, None]
  rows = jnp.arange(q_len, dtype=jnp.int32)[None, None, :]
  return (row_keys(head_key(seed[0], seed[1], b, h), rows),
          col_keys(jnp.arange(kv_len, dtype=jnp.int32)))


def seed_from_rng(rng: jax.Array) -> jax.Array:
  """[2] int32 seed words from a JAX PRNG key (typed or raw uint32[2])."""
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.wrap_key_data(rng)
  bits = jax.random.bits(rng, (2,), jnp.uint32)
  return lax.bitcast_convert_type(bits, jnp.int32)


def keep_mask(seed: jax.Array, batch: int, num_heads: int, q_len: int, kv_len: int,
              rate: float) -> jax.Array:
  """The dense [B, H, T, S] keep mask of a call: what the reference applies, for tests."""
  b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
  h = jnp.arange(num_heads, dtype=jnp.int32)[None, :, None, None]
  rows = jnp.arange(q_len, dtype=jnp.int32)[None, None, :, None]
  cols = jnp.arange(kv_len, dtype=jnp.int32)[None, None, None, :]
  return keep(row_keys(head_key(seed[0], seed[1], b, h), rows), cols, threshold(rate))
