"""Decode test cases: random caches (contiguous or paged, pages shuffled), poisoned where no
sequence holds a token, and the comparison of an implementation with the float32 reference."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from testing import (assert_close_to_ref, export_for_h200, jitted, split_arrays, to_f32,
                     tolerance)

import pallas_flash
from pallas_flash import fp8

# A page-table entry past the pages a sequence uses: never a valid page, must be ignored.
GARBAGE_PAGE = 1 << 20


@dataclasses.dataclass(frozen=True)
class DecodeCase:
  """One decode problem. seqlens: cache_seqlens per sequence (before the append)."""

  seqlens: tuple[int, ...] = (0, 37, 99)
  q_len: int = 1
  num_heads: int = 8
  num_kv_heads: int = 2
  head_dim: int = 32
  capacity: int = 100  # L: L_max, or max_pages * page_size when paged
  page_size: int | None = None
  append: bool = False
  window: int | None = None
  softcap: float | None = None
  rotary: float | str | None = None  # a base period, or "tables"
  dtype: type = jnp.float32  # the query's (and the caches', unless fp8)
  fp8: str | None = None  # float8_e4m3fn caches with kv_descale per "tensor" or per kv "head"
  query_scale: float = 1.0  # the query's standard deviation

  @property
  def batch(self) -> int:
    return len(self.seqlens)

  @property
  def id(self) -> str:
    parts = [(f"b{self.batch}_t{self.q_len}_h{self.num_heads}:{self.num_kv_heads}"
              f"_d{self.head_dim}_L{self.capacity}"), jnp.dtype(self.dtype).name]
    for name, on in (("page", self.page_size), ("append", self.append), ("win", self.window),
                     ("cap", self.softcap), ("rope", self.rotary), ("fp8", self.fp8),
                     ("qx", self.query_scale != 1.0 and self.query_scale)):
      if on:
        parts.append(name if on is True else f"{name}{on}")
    return "-".join(parts)


def case_seed(case: DecodeCase) -> int:
  return zlib.crc32(case.id.encode()) % 1000


def make_decode_inputs(case: DecodeCase, seed: int = 0):
  """(query, key_cache, value_cache, cache_seqlens, kwargs) with NaN in every cache slot no
  sequence holds (before the append) and garbage in unused page-table entries. With case.fp8
  the caches are float8_e4m3fn (NaN stays NaN), quantised with kwargs["kv_descale"] mapping
  max |x| (per tensor or per kv head) to 448."""
  rng = np.random.default_rng(seed)
  b, t, kh, d, cap = case.batch, case.q_len, case.num_kv_heads, case.head_dim, case.capacity
  lens = np.asarray(case.seqlens, np.int32)
  q = rng.standard_normal((b, t, case.num_heads, d), np.float32) * case.query_scale
  logical_k = rng.standard_normal((b, cap, kh, d), np.float32)
  logical_v = rng.standard_normal((b, cap, kh, d), np.float32)
  held = np.arange(cap)[None, :] < lens[:, None]  # [B, L]
  logical_k[~held], logical_v[~held] = np.nan, np.nan
  kwargs: dict = {}
  if case.page_size is None:
    k_cache, v_cache = logical_k, logical_v
  else:
    ps = case.page_size
    max_pages = -(-cap // ps)
    assert max_pages * ps == cap, "paged cases give capacity = max_pages * page_size"
    num_pages = b * max_pages + 3  # spare pages that no sequence uses
    order = rng.permutation(num_pages)  # pages out of order, sequences interleaved
    used = np.minimum(-(-(lens + (t if case.append else 0)) // ps), max_pages)
    table = np.full((b, max_pages), GARBAGE_PAGE, np.int32)
    k_cache = np.full((num_pages, ps, kh, d), np.nan, np.float32)
    v_cache = np.full((num_pages, ps, kh, d), np.nan, np.float32)
    taken = 0
    for i in range(b):
      for p in range(used[i]):
        page = order[taken]
        taken += 1
        table[i, p] = page
        k_cache[page] = logical_k[i, p * ps:(p + 1) * ps]
        v_cache[page] = logical_v[i, p * ps:(p + 1) * ps]
    kwargs["page_table"] = jnp.asarray(table)
  if case.append:
    kwargs["new_key"] = jnp.asarray(rng.standard_normal((b, t, kh, d), np.float32), case.dtype)
    kwargs["new_value"] = jnp.asarray(rng.standard_normal((b, t, kh, d), np.float32), case.dtype)
  if case.window is not None:
    kwargs["local_window_size"] = case.window
  if case.softcap is not None:
    kwargs["logits_soft_cap"] = case.softcap
  if case.rotary == "tables":
    ang = np.arange(cap)[:, None] * (1.0 / 500.0 ** (np.arange(0, d // 2, 2) / (d // 2)))
    kwargs["rotary"] = (jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang),
                                                                           jnp.float32))
  elif case.rotary is not None:
    kwargs["rotary"] = case.rotary
  if case.fp8 is None:
    k_cache, v_cache = jnp.asarray(k_cache, case.dtype), jnp.asarray(v_cache, case.dtype)
  else:
    axes = (0, 1, 3) if case.fp8 == "head" else None
    descale = tuple(jnp.asarray(np.nanmax(np.abs(x), axis=axes) / 448.0, jnp.float32)
                    for x in (logical_k, logical_v))
    k_cache, v_cache = (fp8.to_e4m3(x, jnp.broadcast_to(s, (kh,))[:, None])
                        for x, s in zip((k_cache, v_cache), descale))
    kwargs["kv_descale"] = descale
  return jnp.asarray(q, case.dtype), k_cache, v_cache, jnp.asarray(lens), kwargs


def fill_page_table(table: jax.Array, num_pages: int) -> jax.Array:
  """`table` with its unused (garbage) entries given the pool's free pages, so that sequences
  can grow into them (e.g. a generation loop's appends)."""
  table = np.asarray(table).copy()
  free = iter(sorted(set(range(num_pages)) - set(table[table != GARBAGE_PAGE].tolist())))
  for idx in np.argwhere(table == GARBAGE_PAGE):
    table[tuple(idx)] = next(free)
  return jnp.asarray(table)


def _upcast(kwargs: dict) -> dict:
  return {n: (to_f32(x) if n in ("new_key", "new_value") else x)
          for n, x in kwargs.items()}


def _reference_by_row(q, kc, vc, lens, kwargs: dict):
  """decode_reference one sequence at a time, concatenated: its float32 scores [B, H, Tq, L]
  at serving sizes (16 GiB of temporaries at 4 x 512 x 32K) outgrow a GPU that two test
  workers share. One program for every row (the row index traced). A page pool passes from row
  to row, so it gathers every row's append."""
  paged = "page_table" in kwargs
  per_row = ("page_table", "new_key", "new_value")
  arrays, closed = split_arrays(kwargs)

  @jax.jit
  def row(i, q, kc, vc, lens, arrays):
    def take(x):
      return jax.lax.dynamic_slice_in_dim(x, i, 1)
    arrays = {n: take(x) if n in per_row else x for n, x in arrays.items()}
    return pallas_flash.decode_reference(take(q), *((kc, vc) if paged else (take(kc), take(vc))),
                                         take(lens), **arrays, **closed)

  rows = []
  for i in range(q.shape[0]):
    out, lse, kc_i, vc_i = row(i, q, kc, vc, lens, arrays)
    rows.append((out, lse) if paged else (out, lse, kc_i, vc_i))
    if paged:
      kc, vc = kc_i, vc_i
  joined = [jnp.asarray(np.concatenate([np.asarray(r) for r in x])) for x in zip(*rows)]
  return (*joined, kc, vc) if paged else tuple(joined)


def check_decode(impl: str, case: DecodeCase, *, seed: int = 0, **call_kwargs) -> None:
  """Output, lse and (with an append) the updated caches of `impl` against the float32
  reference on the same (upcast) inputs."""
  q, kc, vc, lens, kwargs = make_decode_inputs(case, seed)
  got = jitted(pallas_flash.decode_attention, return_residuals=True, implementation=impl,
               **call_kwargs)(q, kc, vc, lens, **kwargs)
  # FP8 caches stay e4m3: the reference dequantises them with kv_descale.
  up = [x if x.dtype == fp8.E4M3 else to_f32(x) for x in (q, kc, vc)]
  want = _reference_by_row(*up, lens, _upcast(kwargs))
  tol = tolerance(case.dtype)
  assert got[0].dtype == q.dtype and got[0].shape == q.shape
  assert_close_to_ref("out", got[0], want[0], tol)
  assert_close_to_ref("lse", got[1], want[1], max(tol, 1e-5))
  if case.append:
    for name, x, ref in zip(("key_cache", "value_cache"), got[2:], want[2:]):
      assert x.shape == ref.shape and x.dtype == kc.dtype
      # The new tokens land in the cache dtype (rotated in float32, then rounded: e4m3 has a
      # 2**-3 step, which a float32 rounding difference may cross).
      rounded = 0.0 if case.rotary is None else 0.125 if case.fp8 else tol
      assert_close_to_ref(name, x, ref, rounded, poisoned=True)
  else:
    assert len(got) == 2


def lowered_for_h200(implementation: str, *, pool: tuple[int, int] | None, max_pages: int = 0,
                     num_splits: int | None = None, fp8_cache: bool = False) -> str:
  """The MLIR module of a decode call lowered for an H200: Llama-like heads (32 / 8, D 128),
  B 2, Tq 4 appended and rotated, a window and a soft cap; a contiguous cache of 1024 keys, or
  with `pool` = (pages, page_size) a page pool read through a [2, max_pages] table; bf16, or
  with fp8_cache float8_e4m3fn caches (per kv head descales)."""
  b, h, kh, d = 2, 32, 8, 128
  q = jax.ShapeDtypeStruct((b, 4, h, d), jnp.bfloat16)
  new = jax.ShapeDtypeStruct((b, 4, kh, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((*pool, kh, d) if pool else (b, 1024, kh, d),
                            fp8.E4M3 if fp8_cache else jnp.bfloat16)
  table = jax.ShapeDtypeStruct((b, max_pages), jnp.int32) if pool else None
  lens = jax.ShapeDtypeStruct((b,), jnp.int32)
  descale = dict(kv_descale=(jnp.full((kh,), 0.01), jnp.full((kh,), 0.02))) if fp8_cache else {}

  def f(q, kc, vc, lens, table, nk, nv):
    return pallas_flash.decode_attention(q, kc, vc, lens, page_table=table, new_key=nk,
                                         new_value=nv, rotary=1e4, logits_soft_cap=30.0,
                                         local_window_size=256, num_splits=num_splits,
                                         implementation=implementation, **descale)

  return export_for_h200(f, q, kv, kv, lens, table, new, new).mlir_module()
