"""Decode arguments checked, completed and described before any backend sees them.

Every shape, dtype and static error raises a ValueError / TypeError naming the argument and the
fix. Value errors (lengths past the cache, an append that overflows it, a page index outside the
pool) are checked here when the values are concrete (eager calls); under `jit` they are data,
and `runtime_checks` (the API's `checked=True`) turns them into `checkify` errors.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from pallas_flash import fp8
from pallas_flash import validation as flash_validation
from pallas_flash.decode.call import DecodeInfo

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class DecodeCall:
  """A canonical decode call: int32 lengths and page table, rotary as tables or a base period,
  and the static description."""

  q: jax.Array
  key_cache: jax.Array
  value_cache: jax.Array
  seqlens: jax.Array
  page_table: jax.Array | None
  new_key: jax.Array | None
  new_value: jax.Array | None
  rotary_theta: float | None
  rotary_cos: jax.Array | None
  rotary_sin: jax.Array | None
  kv_descale: jax.Array | None  # float32 [2, K] with an FP8 cache (keys', values' factors)
  info: DecodeInfo


def _rank4(name: str, x, layout: str) -> None:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"`{name}` must be a jax or numpy array, got {type(x).__name__}.")
  if x.ndim != 4:
    raise ValueError(f"`{name}` must have rank 4 {layout}, got shape {tuple(x.shape)}.")


def _concrete(x) -> np.ndarray | None:
  """x as numpy when its values are known now (not traced), else None."""
  if x is None or isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
    return None
  return np.asarray(x)


def _int_array(name: str, x, shape: tuple[int, ...] | None, layout: str) -> jax.Array:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"`{name}` must be an int32 array {layout}, got {type(x).__name__}.")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"`{name}` must be an int32 array {layout}, got dtype {x.dtype}; "
                    f"pass `{name}.astype(jnp.int32)`.")
  if shape is not None and tuple(x.shape) != shape:
    raise ValueError(f"`{name}` must have shape {shape} {layout}, got {tuple(x.shape)}.")
  return jnp.asarray(x).astype(jnp.int32)


def _cache_layout(query, key_cache, page_table) -> tuple[int, int | None, int | None, int | None]:
  """(capacity, page_size, num_pages, max_pages) of the cache, after checking its shape."""
  b = query.shape[0]
  if page_table is None:
    layout = "[batch, L_max, num_kv_heads, head_dim] (contiguous; pass `page_table` for pages)"
    _rank4("key_cache", key_cache, layout)
    if key_cache.shape[0] != b:
      raise ValueError(f"A contiguous `key_cache` needs one row per sequence: batch "
                       f"{key_cache.shape[0]} != query batch {b}. For a page pool "
                       "[num_pages, page_size, K, D], pass `page_table`.")
    return key_cache.shape[1], None, None, None
  _rank4("key_cache", key_cache, "[num_pages, page_size, num_kv_heads, head_dim] (paged)")
  if not hasattr(page_table, "shape") or page_table.ndim != 2:
    raise ValueError(f"`page_table` must have rank 2 [batch, max_pages_per_seq] (int32 page "
                     f"indices into key_cache's pool), got shape "
                     f"{tuple(getattr(page_table, 'shape', ()))}.")
  if page_table.shape[0] != b:
    raise ValueError(f"`page_table` needs one row per sequence: {page_table.shape[0]} rows, "
                     f"query batch {b}.")
  num_pages, page_size = key_cache.shape[:2]
  return page_table.shape[1] * page_size, page_size, num_pages, page_table.shape[1]


def _check_shapes(query, key_cache, value_cache, new_key, new_value) -> None:
  _rank4("query", query, "[batch, q_len, num_heads, head_dim]")
  _rank4("key_cache", key_cache, "[batch, L_max, num_kv_heads, head_dim] (contiguous) or "
         "[num_pages, page_size, num_kv_heads, head_dim] (paged)")
  b, t, h, d = query.shape
  if 0 in query.shape or 0 in key_cache.shape:
    raise ValueError(f"Empty input: query {query.shape}, key_cache {key_cache.shape}.")
  if not hasattr(value_cache, "shape") or value_cache.shape != key_cache.shape:
    raise ValueError(f"`key_cache` and `value_cache` must have the same shape, got "
                     f"{key_cache.shape} and {getattr(value_cache, 'shape', None)}.")
  kh = key_cache.shape[2]
  if key_cache.shape[3] != d:
    raise ValueError(f"`query` and `key_cache` must have the same head_dim, got {d} and "
                     f"{key_cache.shape[3]}.")
  if h % kh:
    raise ValueError(f"num_heads of `query` ({h}) must be a multiple of the caches' num_kv_heads "
                     f"({kh}) (MHA: equal; GQA: a multiple; MQA: 1 kv head).")
  if jnp.dtype(query.dtype) not in [jnp.dtype(x) for x in SUPPORTED_DTYPES]:
    raise TypeError(f"Unsupported `query` dtype {query.dtype}: use bfloat16, float16 or "
                    "float32 (an FP8 cache takes a query of one of these).")
  cache_dtypes = {jnp.dtype(key_cache.dtype), jnp.dtype(value_cache.dtype)}
  if cache_dtypes != {jnp.dtype(query.dtype)} and cache_dtypes != {fp8.E4M3}:
    raise TypeError(f"`key_cache` and `value_cache` must have the query's dtype, or both be "
                    f"float8_e4m3fn (with `kv_descale`), got {key_cache.dtype} and "
                    f"{value_cache.dtype} for a {query.dtype} query.")
  if (new_key is None) != (new_value is None):
    raise ValueError("Pass both `new_key` and `new_value` (the tokens to append), or neither.")
  for name, x in (("new_key", new_key), ("new_value", new_value)):
    if x is None:
      continue
    _rank4(name, x, "[batch, q_len, num_kv_heads, head_dim]")
    if tuple(x.shape) != (b, t, kh, d):
      raise ValueError(f"`{name}` must have shape {(b, t, kh, d)} (one key/value per query "
                       f"token), got {tuple(x.shape)}.")
    if jnp.dtype(x.dtype) != jnp.dtype(query.dtype):
      raise TypeError(f"`{name}` must have the query's dtype {query.dtype}, got {x.dtype} (an "
                      "FP8 cache quantises the new tokens itself, with `kv_descale`).")


def check_kv_descale(kv_descale, cache_dtype, num_kv_heads: int) -> jax.Array | None:
  """float32 [2, K] from `kv_descale` = (key_descale, value_descale), each [] or [K], for a
  float8_e4m3fn cache; None for a cache in the query's dtype (which takes none). Also what
  FlashMultiHeadAttention.init_cache checks its cache's descales with."""
  is_fp8 = jnp.dtype(cache_dtype) == fp8.E4M3
  if kv_descale is None:
    if is_fp8:
      raise ValueError("A float8_e4m3fn cache needs `kv_descale=(key_descale, value_descale)`: "
                       "float32 factors, [] or [num_kv_heads], with real value = float32(x8) * "
                       "descale (e.g. max |k| / 448 from calibration).")
    return None
  if not is_fp8:
    raise ValueError(f"`kv_descale` applies to float8_e4m3fn caches only; this cache is "
                     f"{jnp.dtype(cache_dtype).name}: drop it, or make the cache float8_e4m3fn.")
  return kv_descale_array(kv_descale, num_kv_heads)


def kv_descale_array(kv_descale, num_kv_heads: int) -> jax.Array:
  """float32 [2, K] (keys' factors, values') from `kv_descale` = (key_descale, value_descale),
  each a float [] or [K]; concrete ones must be finite and positive."""
  if not isinstance(kv_descale, (tuple, list)) or len(kv_descale) != 2:
    raise TypeError("`kv_descale` must be a pair (key_descale, value_descale), got "
                    f"{type(kv_descale).__name__}.")
  rows = []
  for name, x in zip(("key_descale", "value_descale"), kv_descale):
    if not hasattr(x, "shape"):
      if isinstance(x, bool) or not isinstance(x, (int, float, np.number)):
        raise TypeError(f"`kv_descale`'s {name} must be a float or a float array, got "
                        f"{type(x).__name__}.")
      x = jnp.asarray(x, jnp.float32)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"`kv_descale`'s {name} must be a float array, got {x.dtype}.")
    if tuple(x.shape) not in ((), (num_kv_heads,)):
      raise ValueError(f"`kv_descale`'s {name} must have shape () (per tensor) or "
                       f"({num_kv_heads},) (per kv head), got {tuple(x.shape)}.")
    concrete = _concrete(x)
    if concrete is not None and not (np.all(np.isfinite(concrete)) and np.all(concrete > 0)):
      raise ValueError(f"`kv_descale`'s {name} must be finite and positive, got {concrete}.")
    rows.append(jnp.broadcast_to(jnp.asarray(x, jnp.float32), (num_kv_heads,)))
  return jnp.stack(rows)


def _check_rotary(rotary, head_dim: int, capacity: int):
  """(theta, cos, sin) from `rotary`: None, a base period, or (cos, sin) tables."""
  if rotary is None:
    return None, None, None
  if isinstance(rotary, (int, float)) and not isinstance(rotary, bool):
    if not math.isfinite(rotary) or rotary <= 0:
      raise ValueError(f"`rotary` as a base period must be a positive float, got {rotary!r}.")
    if head_dim % 2:
      raise ValueError(f"Rotary embeddings need an even head_dim, got {head_dim}.")
    return float(rotary), None, None
  if not isinstance(rotary, (tuple, list)) or len(rotary) != 2:
    raise TypeError("`rotary` must be None, a base period (e.g. 10000.0) or a (cos, sin) pair of "
                    f"[max_position, rotary_dim // 2] tables, got {type(rotary).__name__}.")
  cos, sin = (jnp.asarray(x) for x in rotary)
  if cos.ndim != 2 or cos.shape != sin.shape or 2 * cos.shape[1] > head_dim:
    raise ValueError(f"`rotary` tables must both be [max_position, rotary_dim // 2] with "
                     f"rotary_dim <= head_dim ({head_dim}), got {cos.shape} and {sin.shape}.")
  if cos.shape[0] < capacity:
    raise ValueError(f"`rotary` tables cover positions 0..{cos.shape[0] - 1}, but the cache "
                     f"holds {capacity} positions: build them for at least {capacity}.")
  if not jnp.issubdtype(cos.dtype, jnp.floating):
    raise TypeError(f"`rotary` tables must be float arrays, got {cos.dtype}.")
  return None, cos.astype(jnp.float32), sin.astype(jnp.float32)


def _check_window(w) -> int | None:
  pair = flash_validation._check_window(w)  # same spelling as flash_attention's
  return None if pair is None else pair[0]


def canonicalize(query, key_cache, value_cache, cache_seqlens, *, page_table, new_key,
                 new_value, rotary, scale, local_window_size, logits_soft_cap,
                 kv_descale) -> DecodeCall:
  _check_shapes(query, key_cache, value_cache, new_key, new_value)
  kv_descale = check_kv_descale(kv_descale, key_cache.dtype, key_cache.shape[2])
  b, t, _, d = query.shape
  capacity, page_size, num_pages, max_pages = _cache_layout(query, key_cache, page_table)
  page_table_arg = page_table  # its values as given: int64 ones are checked before the cast
  if page_table is not None:
    page_table = _int_array("page_table", page_table, None,
                            "[batch, max_pages_per_seq] of page indices")
  seqlens = _int_array("cache_seqlens", cache_seqlens, (b,),
                       "[batch]: the valid tokens of each sequence before this call")
  if t > capacity:
    raise ValueError(f"q_len {t} exceeds the cache's capacity of {capacity} tokens per sequence.")
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  elif not isinstance(scale, (int, float)) or not math.isfinite(scale):
    raise TypeError(f"`scale` must be a finite Python float (it is static), got {scale!r}.")
  window = _check_window(local_window_size)
  if logits_soft_cap is not None and (
      not isinstance(logits_soft_cap, (int, float)) or isinstance(logits_soft_cap, bool)
      or not math.isfinite(logits_soft_cap) or logits_soft_cap <= 0):
    raise ValueError(f"`logits_soft_cap` must be a positive finite Python float (static), got "
                     f"{logits_soft_cap!r}.")
  theta, cos, sin = _check_rotary(rotary, d, capacity)
  info = _describe(query, key_cache, capacity=capacity, page_size=page_size,
                   num_pages=num_pages, max_pages=max_pages, appends=new_key is not None,
                   scale=float(scale), window=window, rotary=rotary is not None,
                   logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap))
  call = DecodeCall(query, key_cache, value_cache, seqlens, page_table, new_key, new_value,
                    theta, cos, sin, kv_descale, info)
  check_values(info, cache_seqlens, page_table_arg)
  return call


def _describe(query, key_cache, **kwargs) -> DecodeInfo:
  b, t, h, d = query.shape
  platform, cc, kind = flash_validation.target_device()
  return DecodeInfo(batch=b, q_len=t, num_heads=h, num_kv_heads=key_cache.shape[2], head_dim=d,
                    dtype=jnp.dtype(query.dtype), cache_dtype=jnp.dtype(key_cache.dtype),
                    platform=platform, compute_capability=cc,
                    device_kind=kind, num_cores=num_cores(platform), **kwargs)


def num_cores(platform: str) -> int | None:
  """SMs of the target GPU: the abstract device's when lowering for one, else the device's."""
  if platform != "gpu":
    return None
  abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if abstract is not None:
    return getattr(abstract, "num_cores", None)
  return getattr(jax.devices()[0], "core_count", None)


# ---------------------------------------------------------------------------------------------
# Value checks: eager (concrete values) and checkify (traced values)


def _capacity_text(info: DecodeInfo) -> str:
  if info.paged:
    return (f"{info.capacity} tokens (max_pages_per_seq {info.max_pages} x page_size "
            f"{info.page_size})")
  return f"L_max = {info.capacity} tokens"


def _length_message(info: DecodeInfo) -> str:
  return (f"cache_seqlens[{{b}}] = {{n}} is outside [0, capacity] for the cache of "
          f"{_capacity_text(info)}")


def _append_message(info: DecodeInfo) -> str:
  return (f"appending q_len = {info.q_len} tokens to sequence {{b}} (cache_seqlens[{{b}}] = "
          f"{{n}}) would overflow the cache of {_capacity_text(info)}; allocate more "
          f"{'pages per sequence' if info.paged else 'cache positions'}, or evict tokens first")


def _page_message(info: DecodeInfo) -> str:
  return (f"page_table[{{b}}, {{i}}] = {{page}} is outside the pool of {info.num_pages} pages "
          f"(key_cache.shape[0]); every page a sequence uses (its first "
          f"ceil(length / {info.page_size}) entries) must index the pool")


def _needed(info: DecodeInfo, seqlens):
  """Tokens each sequence holds after this call (the append counted)."""
  return seqlens + (info.q_len if info.appends else 0)


def check_values(info: DecodeInfo, seqlens_arg, page_table_arg) -> None:
  """Raises ValueError for bad concrete lengths, appends or page indices (no-op when traced)."""
  lens = _concrete(seqlens_arg)
  if lens is None:
    return
  bad = np.flatnonzero((lens < 0) | (lens > info.capacity))
  if bad.size:
    b = int(bad[0])
    raise ValueError(_length_message(info).format(b=b, n=int(lens[b])) + ".")
  needed = _needed(info, lens.astype(np.int64))
  bad = np.flatnonzero(needed > info.capacity)
  if bad.size:
    b = int(bad[0])
    raise ValueError(_append_message(info).format(b=b, n=int(lens[b])) + ".")
  pages = _concrete(page_table_arg)
  if pages is None:
    return
  used = -(-needed // info.page_size)  # [B] pages in use per sequence
  in_use = np.arange(info.max_pages)[None, :] < used[:, None]
  bad = np.argwhere(in_use & ((pages < 0) | (pages >= info.num_pages)))
  if bad.size:
    b, i = (int(x) for x in bad[0])
    raise ValueError(_page_message(info).format(b=b, i=i, page=int(pages[b, i])) + ".")


def runtime_checks(call: DecodeCall) -> None:
  """The checks of `check_values` as `jax.experimental.checkify` checks on traced values.

  They need functionalising: run the caller under `checkify.checkify(...)` (jitted or not) and
  read the error with `err.get()` / `err.throw()`. Each message names the first offending
  sequence and its values.
  """
  info, lens = call.info, call.seqlens

  def first(bad):
    return jnp.argmax(bad).astype(jnp.int32)

  bad = (lens < 0) | (lens > info.capacity)
  b = first(bad)
  checkify.check(~jnp.any(bad), _length_message(info), b=b, n=lens[b])
  needed = _needed(info, lens)
  bad = needed > info.capacity
  b = first(bad)
  checkify.check(~jnp.any(bad), _append_message(info), b=b, n=lens[b])
  if call.page_table is None:
    return
  used = -(-jnp.clip(needed, 0, info.capacity) // info.page_size)
  in_use = jnp.arange(info.max_pages)[None, :] < used[:, None]
  pt = call.page_table
  bad = in_use & ((pt < 0) | (pt >= info.num_pages))
  flat = first(bad.reshape(-1))
  b, i = flat // info.max_pages, flat % info.max_pages
  checkify.check(~jnp.any(bad), _page_message(info), b=b, i=i, page=pt[b, i])


def abstract_info(query, key_cache, value_cache, cache_seqlens, kwargs: dict) -> DecodeInfo:
  """Describes a call from arrays or ShapeDtypeStructs, without computing anything. Concrete
  values (descales, lengths, a page table) get the checks the call gives them, which tracing
  would skip."""
  if kwargs.get("kv_descale") is not None and getattr(key_cache, "ndim", 0) == 4:
    kv_descale_array(kwargs["kv_descale"], key_cache.shape[2])
  arrays = {n: x for n, x in kwargs.items() if hasattr(x, "shape") and hasattr(x, "dtype")}
  for name in ("rotary", "kv_descale"):  # pairs of arrays: (cos, sin) tables, descales
    if isinstance(kwargs.get(name), (tuple, list)):
      arrays[name] = tuple(kwargs[name])
  statics = {n: x for n, x in kwargs.items() if n not in arrays}
  infos = []

  def trace(q, k, v, lens, arrays):
    infos.append(canonicalize(q, k, v, lens, **statics, **arrays).info)
    return jnp.zeros(())

  jax.eval_shape(trace, query, key_cache, value_cache, cache_seqlens, arrays)
  check_values(infos[0], cache_seqlens, kwargs.get("page_table"))
  return infos[0]


# decode_attention's keyword arguments that describe the call, with their defaults.
DEFAULTS: dict[str, Any] = {"page_table": None, "new_key": None, "new_value": None,
                            "rotary": None, "scale": None, "local_window_size": None,
                            "logits_soft_cap": None, "kv_descale": None}


def with_defaults(kwargs: dict) -> dict:
  unknown = set(kwargs) - set(DEFAULTS)
  if unknown:
    raise TypeError(f"Unexpected arguments {sorted(unknown)}.")
  return {n: kwargs.get(n, default) for n, default in DEFAULTS.items()}
