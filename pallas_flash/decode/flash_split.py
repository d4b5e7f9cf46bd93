"""The chunked-prefill route of decode_attention (implementation "flash"): the call as two
`flash_attention` calls over disjoint keys, merged exactly.

With n_b the tokens sequence b holds during the call (call.sequence_lengths), P_b =
max(n_b - Tq, 0) and d_b = max(Tq - n_b, 0) (queries placed before the sequence's first
token; 0 whenever n_b >= Tq), query i sits at position P_b + i - d_b and sees keys 0 ..
P_b + i - d_b, which split into

  prefix: keys 0 .. P_b - 1, seen whole by every query: flash_attention over the cache,
    non-causal, key_value_seq_lengths = P_b (with P_b = 0 every row gets lse -inf);
  own tokens: the Tq tokens from P_b on, seen top-left causally (query i sees own token j
    <= i): flash_attention(is_causal=True) on new_key / new_value when the call appends
    them; else on the cache's last Tq tokens of each sequence, gathered into [B, Tq, K, D],
    where the d_b positions before the first token get key segment id 1 (queries 0 ..
    d_b - 1 then see no key at all, as the end-aligned rule says).

merge_attention_states combines the two (out, lse) pairs; a part whose row saw no key (lse
-inf) has its output zeroed first, so it weighs nothing whatever its row holds. The soft cap
applies per score and the scale per call, so both pass through; rotary, the append and sinks
stay where decode/api.py applies them (before, before, after).

Not routed: a local window (the prefix call would need a per-sequence band offset), a paged
cache (the prefix call would need the pages gathered into a contiguous copy, a pass over the
cache next to an attention that reads it once) and an explicit num_splits (the route splits no
keys).

Stale cache slots. The split-KV kernels never read a slot past a sequence's length. The prefix
call reads the cache tile by tile: the Mosaic kernels stream only key blocks that hold an
unmasked key, so their last block ends less than one block past P_b, inside the sequence's
own tokens when the block is at most Tq keys (the automatic route requires it); rows with
P_b = 0 may stream stale keys but are dropped by the merge. flash_attention's "xla",
"interpret" and "reference" implementations read the whole cache, where a NaN or inf in a
masked slot reaches the output (0 x NaN): with them, slots past the lengths must be finite.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_flash import backends as flash_backends
from pallas_flash import merge
from pallas_flash import validation as flash_validation
from pallas_flash.api import flash_attention
from pallas_flash.call import CallInfo
from pallas_flash.decode import config as decode_config
from pallas_flash.decode.call import DecodeInfo, sequence_lengths
from pallas_flash.decode.config import FlashSplitConfig

CONFIG_TYPE = FlashSplitConfig
NAME = "flash"
# flash_attention's implementation the automatic route is for.
ROUTED_FLASH = "mosaic"


def _pieces(info: DecodeInfo) -> tuple[dict, dict]:
  """flash_attention's arguments (ShapeDtypeStructs) of the prefix and own-token calls."""
  b, t, h, kh, d = info.batch, info.q_len, info.num_heads, info.num_kv_heads, info.head_dim
  sds = jax.ShapeDtypeStruct
  q = sds((b, t, h, d), info.dtype)
  cache, own = sds((b, info.capacity, kh, d), info.dtype), sds((b, t, kh, d), info.dtype)
  common = dict(scale=info.scale, logits_soft_cap=info.logits_soft_cap)
  prefix = dict(query=q, key=cache, value=cache, key_value_seq_lengths=sds((b,), jnp.int32),
                **common)
  own_tokens = dict(query=q, key=own, value=own, is_causal=True, **common)
  if not info.appends:
    seg = sds((b, t), jnp.int32)
    own_tokens.update(query_segment_ids=seg, key_value_segment_ids=seg)
  return prefix, own_tokens


@functools.cache
def _piece_infos(info: DecodeInfo) -> tuple[CallInfo, CallInfo]:
  """flash_attention's CallInfo of the prefix and own-token calls (cached: decode calls of one
  shape ask for them at every trace)."""
  infos = []
  for kw in _pieces(info):
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    infos.append(flash_validation.abstract_call_info(q, k, v, flash_validation.with_defaults(kw)))
  return infos[0], infos[1]


def _flash_choice(info: DecodeInfo, config: FlashSplitConfig) -> tuple[str | None, str | None]:
  """(flash_attention's implementation for both calls, None) or (None, why none runs them)."""
  prefix, own = _piece_infos(info)
  name = config.flash_implementation
  if name is None:
    reasons = {n: flash_backends.auto_reason(n, prefix, config.flash_config)
               for n in flash_backends.IMPLEMENTATIONS}
    name = flash_backends.auto_choice(reasons)
    if name is None:
      return None, ("flash_attention cannot run the prefix call: " + "; ".join(
          f"{n}: {r}" for n, r in reasons.items()))
  for piece, piece_info in (("prefix", prefix), ("own-token", own)):
    why = flash_backends.reason(name, piece_info, config.flash_config)
    if why is not None:
      return None, f"flash_attention's {name!r} cannot run the {piece} call: {why}"
  return name, None


def reason(info: DecodeInfo, config, num_splits: int | None, *, auto: bool) -> str | None:
  """Why the route cannot run the call (auto: or is not chosen for it), None when it is."""
  if (why := flash_backends.config_type_reason(NAME, FlashSplitConfig, config)) is not None:
    return why
  if info.window is not None:
    return ("a local window does not split into a prefix and the new tokens (the prefix call "
            "would need a per-sequence band offset)")
  if info.paged:
    return ("a paged cache: the prefix call would read a contiguous copy of the pages, a pass "
            "over the cache beside the attention")
  if info.fp8_cache:
    return ("an FP8 cache: flash_attention's FP8 kernel takes FP8 queries, and a dequantized "
            "copy of the cache would be a pass over it beside the attention")
  if num_splits is not None:
    return "num_splits splits the keys of the split-KV kernels; this route splits none"
  explicit = config is not None  # a FlashSplitConfig asks for the route: no threshold
  if auto and not explicit and info.q_len < decode_config.FLASH_SPLIT_MIN_Q_LEN:
    return (f"Tq={info.q_len} < FLASH_SPLIT_MIN_Q_LEN={decode_config.FLASH_SPLIT_MIN_Q_LEN} "
            "(decode/config.py): short chunks fill few of flash_attention's query tiles")
  name, why = _flash_choice(info, config or FlashSplitConfig())
  if why is not None or not auto or explicit:
    return why
  if name != ROUTED_FLASH:
    return (f"flash_attention would run its calls on {name!r}; the route is chosen for its "
            f"{ROUTED_FLASH!r} (Hopper) kernels")
  block_kv = getattr(flash_backends.resolve_config(name, _piece_infos(info)[0], None),
                     "block_kv", 0)
  if block_kv > info.q_len:
    return (f"the prefix call's {block_kv}-key tiles exceed Tq={info.q_len}: its last tile "
            "could read cache slots past the sequence's length")
  return None


def config_for(info: DecodeInfo, config: FlashSplitConfig | None) -> FlashSplitConfig:
  """The config the call runs: flash_implementation resolved to flash_attention's choice."""
  config = config or FlashSplitConfig()
  name, why = _flash_choice(info, config)
  assert why is None, why  # reason() refused such calls
  return FlashSplitConfig(flash_implementation=name, flash_config=config.flash_config)


def describe(info: DecodeInfo, config: FlashSplitConfig) -> str:
  """One line for decode_explain: what the route runs."""
  return (f"the cached prefix (non-causal, key_value_seq_lengths) and the {info.q_len} new "
          f"tokens (causal) as two flash_attention calls on "
          f"{config.flash_implementation!r}, merged (merge_attention_states)")


def _drop_empty(out: jax.Array, lse: jax.Array) -> jax.Array:
  """out [B, T, H, D] with zeros on rows that saw no key (lse [B, H, T] = -inf), whatever the
  kernel left there."""
  empty = (lse == -jnp.inf).transpose(0, 2, 1)[..., None]
  return jnp.where(empty, jnp.zeros((), out.dtype), out)


def attend(q, key_cache, value_cache, seqlens, new_key, new_value, *, info: DecodeInfo,
           config: FlashSplitConfig):
  """(out [B, Tq, H, D], lse [B, H, Tq]) of the call: q rotated, key_cache / value_cache
  contiguous [B, L, K, D] with the new tokens appended, new_key (rotated) / new_value [B, Tq,
  K, D] when the call appends (else None), seqlens as passed (before the append)."""
  t = info.q_len
  n = sequence_lengths(seqlens, q_len=t, appends=info.appends, capacity=info.capacity)
  kw = dict(scale=info.scale, logits_soft_cap=info.logits_soft_cap, return_residuals=True,
            implementation=config.flash_implementation, config=config.flash_config)
  prefix = flash_attention(q, key_cache, value_cache,
                           key_value_seq_lengths=jnp.maximum(n - t, 0), **kw)
  if info.appends:
    own = flash_attention(q, new_key, new_value, is_causal=True, **kw)
  else:
    pos = n[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, Tq]
    held = pos >= 0
    rows = (jnp.arange(info.batch)[:, None], jnp.clip(pos, 0, info.capacity - 1))
    own_k, own_v = (jnp.where(held[..., None, None], x[rows], jnp.zeros((), x.dtype))
                    for x in (key_cache, value_cache))
    kv_seg = jnp.where(held, 0, 1).astype(jnp.int32)
    own = flash_attention(q, own_k, own_v, is_causal=True,
                          query_segment_ids=jnp.zeros_like(kv_seg),
                          key_value_segment_ids=kv_seg, **kw)
  parts = (prefix, own)
  return merge.merge_attention_states([_drop_empty(o, lse) for o, lse in parts],
                                      [lse for _, lse in parts])
