"""Static description of one decode call, and the contract every decode backend provides.

Shape letters (as in pallas_flash.call): B batch, T = Tq new query tokens per sequence, H query
heads, K key/value heads, G = H // K, D head dim, L the cache's capacity per sequence, P pages in
the pool, M = Tq * G query rows per key/value head (GQA packing: row r is token r // G of head
k * G + r % G, so one read of a kv head's keys serves all its query heads and tokens).

Backend contract (pallas_flash.decode.xla, .triton and .mosaic, the Hopper kernel, provide it;
decode/api.py loads them):

  attend(q, key_cache, value_cache, lengths, page_table, *, params, config, kv_descale=None)
      -> (out, lse)
    q [B, Tq, H, D] in the cache dtype (with an FP8 cache: bf16, f16 or f32), already rotated.
    key_cache, value_cache: contiguous [B, L, K, D], or a page pool [P, page_size, K, D] with
      page_table [B, max_pages] int32 (None for a contiguous cache). New tokens are already
      appended.
    kv_descale: None, or with float8_e4m3fn caches float32 [2, K]: a key's real value is
      float32(k8) * kv_descale[0, kv head], a value's float32(v8) * kv_descale[1, kv head].
    lengths [B] int32: cache_seqlens as passed (before the append). The backend derives n_b,
      the valid tokens of each sequence, as `sequence_lengths` does: clamped to [0, L]
      (unchecked calls may pass anything), plus Tq when params.appends. Query token i sits
      at position n_b - Tq + i and sees keys max(0, pos - window) .. pos (end-aligned
      causal).
    out [B, Tq, H, D] in q.dtype (zeros for a query that sees no key) and lse [B, H, Tq]
      float32, natural log (-inf there). With params.programs = N the backend cuts the
      batch's key blocks into N balanced runs (config.balanced_partition, computed on
      device from the lengths), computes a normalised partial per (run, sequence) piece and
      combines each sequence's pieces (merge_attention_states' rule: the xla backend computes
      it per sequence, the Triton one has a kernel).
    `config` is the resolved one (config_for): the API resolves it once per call.
  unsupported_reason(info: DecodeInfo, config) -> str | None
  config_for(info: DecodeInfo, config: CONFIG_TYPE | None) -> CONFIG_TYPE: the config the call
    runs (the given one completed with the backend's defaults, fitted to the call).
  tiles(config) -> (block_m, block_kv): rows and keys one program handles per step (what the
    split heuristic counts programs and blocks with; block_m None: all M rows at once).
  CONFIG_TYPE: the backend's frozen config dataclass.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeInfo:
  """Shapes, features and target device of a decode call: what `decode_explain` reasons about.

  Attributes:
    capacity: L, the most tokens a sequence can hold (L_max, or max_pages * page_size).
    page_size, num_pages, max_pages: the paged layout (None for a contiguous cache).
    dtype: the query's (and output's) dtype; cache_dtype: the caches' (dtype, or
      float8_e4m3fn with kv_descale).
    appends: new_key / new_value are written into the cache by this call.
    window: query at position p sees keys p - window .. p (None: all earlier keys).
    num_cores: streaming multiprocessors of the target GPU (None off-GPU).
  """

  batch: int
  q_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: jnp.dtype
  cache_dtype: jnp.dtype
  capacity: int
  page_size: int | None
  num_pages: int | None
  max_pages: int | None
  appends: bool
  scale: float
  window: int | None
  logits_soft_cap: float | None
  rotary: bool
  platform: str
  compute_capability: tuple[int, int] | None
  device_kind: str
  num_cores: int | None

  @property
  def group(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def rows(self) -> int:
    """M = Tq * G: the query rows one key/value head serves (GQA packing)."""
    return self.q_len * self.group

  @property
  def paged(self) -> bool:
    return self.page_size is not None

  @property
  def fp8_cache(self) -> bool:
    return self.cache_dtype != self.dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeParams:
  """What a backend needs to know statically (hashable: kernels are cached on it)."""

  scale: float
  q_len: int
  group: int
  window: int | None
  logits_soft_cap: float | None
  programs: int | None  # balanced runs per kv head and row tile; None: one per sequence
  page_size: int | None
  appends: bool = False  # the call appended its Tq tokens: n_b = seqlens + Tq

  @classmethod
  def create(cls, info: DecodeInfo, programs: int | None) -> DecodeParams:
    return cls(scale=info.scale, q_len=info.q_len, group=info.group, window=info.window,
               logits_soft_cap=info.logits_soft_cap, programs=programs,
               page_size=info.page_size, appends=info.appends)


def cache_layout(key_cache, page_table, params: DecodeParams):
  """(capacity L, num_pages, max_pages) of a call's cache: a contiguous [B, L, K, D] cache
  (the pages None), or with params.page_size a pool [P, page_size, K, D] read through
  page_table [B, max_pages]."""
  if params.page_size is None:
    return key_cache.shape[1], None, None
  num_pages, max_pages = key_cache.shape[0], page_table.shape[1]
  return max_pages * params.page_size, num_pages, max_pages


def sequence_lengths(seqlens, *, q_len: int, appends: bool, capacity: int):
  """n_b: the tokens each sequence holds during the attention (after the append), from
  cache_seqlens as passed: clamped to [0, L] first (what an unchecked call may hold), plus
  Tq when the call appended, at most L (the tokens that did not fit were dropped)."""
  n = jnp.clip(seqlens, 0, capacity)
  return jnp.minimum(n + q_len, capacity) if appends else n
