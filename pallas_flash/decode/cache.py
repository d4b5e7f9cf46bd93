"""The cache append and the rotary embedding of a decode call, shared by every backend.

The append is one XLA scatter of the new tokens into the cache (`.at[...].set(mode="drop")`),
not a kernel with `input_output_aliases`: XLA updates the cache's buffer in place whenever that
buffer is dead afterwards, which is the case in a `lax.scan` / `while_loop` carry and for a
cache argument donated to `jit` (`donate_argnums`); it then writes B * Tq * K * D elements, the
new tokens only. Without donation XLA copies the cache once first, as it would for an aliased
kernel output, so a kernel would buy nothing there; the scatter also serves the XLA path and any
future kernel unchanged, and its out-of-range updates are dropped rather than clamped (a
`dynamic_update_slice` would move an overflowing write onto earlier tokens).

The rotation (rotate-half layout: feature i pairs with i + R/2, as `flax.nnx.RoPE`, Llama and
GPT-NeoX) is elementwise, so XLA fuses it into the scatter's update and into the packing of the
query for the kernel: it adds no kernel and no pass over memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash import fp8
from pallas_flash.decode.call import DecodeInfo


def rotate(x: jax.Array, positions: jax.Array, *, theta: float | None, cos: jax.Array | None,
           sin: jax.Array | None) -> jax.Array:
  """x [B, T, N, D] rotated at integer positions [B, T].

  theta: base period (angles pos / theta^(2i / D), as pallas_flash.flax.rotary); or cos, sin
  [max_position, R / 2] tables rotating the first R features (R <= D; the rest pass through).
  The rotation runs in float32 and the result is cast back to x.dtype.
  """
  if theta is not None:
    d = x.shape[-1]
    freqs = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [B, T, D/2]
    c, s = jnp.cos(angles), jnp.sin(angles)
  else:
    idx = jnp.clip(positions, 0, cos.shape[0] - 1)
    c, s = cos[idx], sin[idx]  # [B, T, R/2]
  c, s = c[:, :, None, :], s[:, :, None, :]
  r = 2 * c.shape[-1]
  x32 = x.astype(jnp.float32)
  x1, x2, rest = x32[..., :r // 2], x32[..., r // 2:r], x32[..., r:]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1).astype(x.dtype)


def append(info: DecodeInfo, key_cache, value_cache, new_key, new_value, seqlens, page_table,
           kv_descale=None):
  """Writes the new tokens at positions seqlens .. seqlens + Tq - 1 of each sequence.

  Returns (key_cache, value_cache). Tokens past the capacity (or on a page index outside the
  pool) are dropped, never written elsewhere (checked=True reports such calls); the
  attention's lengths follow from call.sequence_lengths. FP8 caches (kv_descale float32
  [2, K]) take the new tokens quantised: e4m3 of x / descale of their kv head (fp8.to_e4m3).
  """
  if kv_descale is not None:
    new_key = fp8.to_e4m3(new_key, kv_descale[0][:, None])
    new_value = fp8.to_e4m3(new_value, kv_descale[1][:, None])
  lens = jnp.clip(seqlens, 0, info.capacity)
  pos = lens[:, None] + jnp.arange(info.q_len, dtype=jnp.int32)[None, :]  # [B, Tq]
  if info.paged:
    ps, num_pages = info.page_size, info.num_pages
    slot = pos // ps
    page = jnp.take_along_axis(page_table, jnp.clip(slot, 0, info.max_pages - 1), axis=1)
    ok = (slot < info.max_pages) & (page >= 0) & (page < num_pages)
    index = (jnp.where(ok, page, num_pages), pos % ps)  # num_pages: out of range, dropped
  else:
    index = (jnp.arange(info.batch)[:, None], jnp.where(pos < info.capacity, pos, info.capacity))
  key_cache = key_cache.at[index].set(new_key, mode="drop")
  value_cache = value_cache.at[index].set(new_value, mode="drop")
  return key_cache, value_cache


def query_positions(info: DecodeInfo, lengths: jax.Array) -> jax.Array:
  """[B, Tq] positions of the query tokens: n_b - Tq + i (end-aligned)."""
  return lengths[:, None] - info.q_len + jnp.arange(info.q_len, dtype=jnp.int32)[None, :]
