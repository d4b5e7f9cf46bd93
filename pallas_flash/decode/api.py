"""decode_attention: attention of new query tokens against a KV cache, with the cache append.

validate (decode.validation) -> choose the implementation, resolve its config and the split
count once (`_plan`, also what `decode_explain` reports) -> append the new tokens and rotate
(decode.cache) -> the backend's split-KV attention, which merges its splits itself.

Implementations follow one contract (decode.call): "triton" (Triton-lowered Pallas kernel, any
NVIDIA GPU from Ampere), "interpret" (that kernel in the Pallas interpreter, any platform),
"xla" (the same plan in lax loops, any platform), "reference" (materialising, for tests).
"mosaic" (decode.mosaic: a Mosaic GPU kernel for Hopper, TMA-fed K/V ring and wgmma; by name
only, BY_NAME_ONLY: on the H200 it ran level with the Triton kernel). "flash" is the
chunked-prefill route (decode.flash_split): the cached prefix and the new tokens as two
`flash_attention` calls, merged; chosen first where it pays (long chunks whose pieces
flash_attention runs on its Mosaic kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from pallas_flash import backends, merge
from pallas_flash import validation as attention_validation
from pallas_flash.decode import cache, flash_split, validation
from pallas_flash.decode import config as decode_config
from pallas_flash.decode.call import DecodeInfo, DecodeParams, sequence_lengths
from pallas_flash.decode.reference import decode_reference

__all__ = ["IMPLEMENTATIONS", "DecodeExplanation", "decode_attention", "decode_explain"]

Implementation = Literal["flash", "mosaic", "triton", "interpret", "xla", "reference"]
IMPLEMENTATIONS: tuple[str, ...] = ("flash", "mosaic", "triton", "interpret", "xla", "reference")
AUTO_ORDER: tuple[str, ...] = ("flash", "mosaic", "triton", "xla")  # fastest first

# Implementations that run only when asked for by name (or by passing their config type),
# with why: on the H200 the Mosaic kernel ran level with the Triton kernel (0.72-1.09x its
# speed over the decode grid, docs/decode.md), so the automatic choice keeps the Triton kernel.
BY_NAME_ONLY = {"mosaic": "runs by name only (implementation='mosaic'): on the H200 it ran "
                          "0.72-1.09x the Triton kernel's speed, so the automatic choice keeps "
                          "'triton'"}

_MODULES = {
    "triton": ("pallas_flash.decode.triton", {"interpret": False}),
    "interpret": ("pallas_flash.decode.triton", {"interpret": True}),
    "xla": ("pallas_flash.decode.xla", {}),
    "mosaic": ("pallas_flash.decode.mosaic", {}),
}


@dataclasses.dataclass(frozen=True)
class _Backend:
  name: str
  attend: Callable
  unsupported_reason: Callable[[DecodeInfo, Any], str | None]
  config_for: Callable[[DecodeInfo, Any], Any]
  tiles: Callable[[Any], tuple[int, int]]
  programs_per_sm: Callable[[DecodeInfo, Any], int]
  config_type: type


@functools.cache
def _load(name: str) -> _Backend | str:
  """The backend `name`, or the reason it cannot run here."""
  module_name, kwargs = _MODULES[name]
  try:
    mod = importlib.import_module(module_name)
  except ImportError as e:
    return f"cannot import {module_name}: {e}"
  bind = (lambda f: functools.partial(f, **kwargs)) if kwargs else (lambda f: f)
  return _Backend(name, bind(mod.attend), bind(mod.unsupported_reason), mod.config_for,
                  mod.tiles, mod.programs_per_sm, mod.CONFIG_TYPE)


def _reason(name: str, info: DecodeInfo, config, num_splits=None, *,
            auto: bool = False) -> str | None:
  """Why `name` cannot run the call (auto: or is not chosen for it automatically)."""
  if name == flash_split.NAME:
    return flash_split.reason(info, config, num_splits, auto=auto)
  if name == "reference":
    return None if config is None else "the reference takes no config"
  backend = _load(name)
  if isinstance(backend, str):
    return backend
  if (why := backends.config_type_reason(name, backend.config_type, config)) is not None:
    return why
  if (why := backend.unsupported_reason(info, config)) is not None:
    return why
  if auto and name in BY_NAME_ONLY and config is None:  # its config type names it too
    return BY_NAME_ONLY[name]
  return None


@dataclasses.dataclass(frozen=True)
class DecodeExplanation:
  """What `decode_attention` runs for a call: the implementation, its config, how the keys are
  split (`runs`) and why; and why each other implementation was not chosen. `route` says which
  path runs: the split-KV kernel of `chosen`, or (chosen "flash") the chunked-prefill route."""

  chosen: str | None  # None: nothing can run the call
  reasons: dict[str, str | None]  # None: could run it
  config: Any = None  # the resolved config `chosen` runs
  # Balanced runs of the batch's key blocks per kv head and row tile, merged afterwards
  # (decode/config.py); None: one program per sequence, no merge.
  runs: int | None = None
  splits_reason: str = ""
  block_m: int | None = None  # query rows per program
  block_kv: int | None = None  # keys per step
  programs: int | None = None  # programs of the kernel's grid
  route: str = ""

  def __str__(self) -> str:
    if self.chosen is None:
      lines = ["decode_attention cannot run this call"]
    elif self.chosen == flash_split.NAME:
      lines = [f"decode_attention runs {self.chosen!r}: {self.route}",
               f"  config: {self.config}"]
    else:
      split = ("one program per sequence" if self.runs is None
               else f"{self.runs} balanced runs per kv head")
      lines = [f"decode_attention runs {self.chosen!r} with {split} ({self.splits_reason})"]
      if self.config is not None:
        lines.append(f"  config: {self.config}")
      if self.programs is not None:
        lines.append(f"  {self.programs} programs of {self.block_m} query rows, "
                     f"{self.block_kv} keys per step")
    for name, why in self.reasons.items():
      if name == self.chosen:
        continue
      if why is None:
        why = "can run, but " + ("is never chosen automatically (testing only)"
                                 if name in ("interpret", "reference")
                                 else "a faster implementation applies")
      lines.append(f"  {name}: {why}")
    return "\n".join(lines)


def _plan(info: DecodeInfo, implementation, config, num_splits) -> DecodeExplanation:
  """The implementation, resolved config and runs of a call (raises if none can run)."""
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"Unknown implementation {implementation!r}; choose one of "
                     f"{IMPLEMENTATIONS} or None for automatic.")
  attention_validation.check_positive_int("num_splits", num_splits, none="chosen from the shapes")
  num_splits = None if num_splits is None else int(num_splits)
  reasons = {name: _reason(name, info, config, num_splits, auto=True) for name in IMPLEMENTATIONS}
  if implementation is not None:
    # Asked for by name: only whether it can run counts (the route's threshold does not).
    reasons[implementation] = _reason(implementation, info, config, num_splits)
    if reasons[implementation] is not None:
      raise NotImplementedError(f"implementation={implementation!r} cannot run this call: "
                                f"{reasons[implementation]}")
    chosen = implementation
  else:
    chosen = next((n for n in AUTO_ORDER if reasons[n] is None), None)
    if chosen is None:
      raise NotImplementedError("No implementation can run this call:\n" + "\n".join(
          f"  {n}: {r}" for n, r in reasons.items()))
  if chosen == "reference":
    return DecodeExplanation(chosen, reasons, None, None, "the reference scores every key at once")
  if chosen == flash_split.NAME:
    resolved = flash_split.config_for(info, config)
    why = ("implementation='flash' was passed" if implementation is not None else
           "config is a FlashSplitConfig" if config is not None else
           f"Tq={info.q_len} >= FLASH_SPLIT_MIN_Q_LEN={decode_config.FLASH_SPLIT_MIN_Q_LEN} "
           f"on flash_attention's {resolved.flash_implementation!r} kernels")
    return DecodeExplanation(chosen, reasons, resolved, None, "flash_attention splits no keys",
                             route=f"{flash_split.describe(info, resolved)}; {why}")
  backend = _load(chosen)
  resolved = backend.config_for(info, config)
  block_m, block_kv = backend.tiles(resolved)
  block_m = block_m or info.rows
  if num_splits is None:
    runs, why = decode_config.choose_runs(info, block_m=block_m, block_kv=block_kv,
                                          per_sm=backend.programs_per_sm(info, resolved))
  else:
    runs = decode_config.runs_of_splits(num_splits, info.batch)
    why = f"num_splits={num_splits} was passed"
  programs = info.num_kv_heads * -(-info.rows // block_m) * (runs or info.batch)
  return DecodeExplanation(chosen, reasons, resolved, runs, why, block_m, block_kv, programs,
                           route=f"the split-KV kernel of {chosen!r}")


def _check_outputs_and_sinks(query, return_residuals, checked, sinks):
  """The arguments that do not describe the call (decode_attention's and decode_explain's
  alike), checked; returns `sinks`."""
  attention_validation.check_bool("return_residuals", return_residuals)
  attention_validation.check_bool("checked", checked)
  return None if sinks is None else attention_validation.check_sinks(sinks, query.shape[2])


def decode_explain(query, key_cache, value_cache, cache_seqlens, **kwargs) -> DecodeExplanation:
  """Says what `decode_attention(query, key_cache, value_cache, cache_seqlens, **kwargs)` runs.

  Takes decode_attention's arguments (arrays or `jax.ShapeDtypeStruct`s; `implementation`
  explains that one instead of the automatic choice, `config` and `num_splits` are honoured)
  and computes nothing. Print the result for a readable report: the implementation, its
  config, its runs and why, and why each other implementation was not chosen.
  """
  implementation = kwargs.pop("implementation", None)
  config = kwargs.pop("config", None)
  num_splits = kwargs.pop("num_splits", None)
  # No influence on the plan, but checked as the call checks them.
  _check_outputs_and_sinks(query, kwargs.pop("return_residuals", False),
                           kwargs.pop("checked", False), kwargs.pop("sinks", None))
  info = validation.abstract_info(query, key_cache, value_cache, cache_seqlens,
                                  validation.with_defaults(kwargs))
  return _plan(info, implementation, config, num_splits)


def decode_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    cache_seqlens: jax.Array,
    *,
    page_table: jax.Array | None = None,
    new_key: jax.Array | None = None,
    new_value: jax.Array | None = None,
    rotary: float | tuple[jax.Array, jax.Array] | None = None,
    scale: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    kv_descale: tuple[Any, Any] | None = None,
    return_residuals: bool = False,
    num_splits: int | None = None,
    implementation: Implementation | None = None,
    config: Any = None,
    checked: bool = False,
):
  """Attention of Tq >= 1 new query tokens per sequence against a KV cache (forward only).

  Causality is aligned to the END of each sequence (bottom-right, as FlashAttention's
  `flash_attn_with_kvcache`), unlike `flash_attention`'s top-left `is_causal`: with n_b the
  tokens sequence b holds after this call (cache_seqlens[b] + Tq when new tokens are appended,
  else cache_seqlens[b], whose last Tq tokens are then the queries' own), query token i sits at
  position n_b - Tq + i and sees keys 0 .. n_b - Tq + i. A query with no visible key (n_b <
  Tq - i without an append) gets zeros and lse -inf.

  Everything static comes from shapes, so the call works inside `jit`, `lax.scan` and
  `lax.while_loop` generation loops with no host planning and no device-to-host copy.

  Args:
    query: [B, Tq, H, D], bfloat16, float16 or float32: the caches' dtype, unless they are FP8.
    key_cache, value_cache: contiguous [B, L_max, K, D], or a page pool [num_pages, page_size,
      K, D] with `page_table`. H % K == 0 (MHA, GQA, MQA). Positions at or past a sequence's
      length are never read into the result, whatever they hold (stale tokens, NaN). Both in
      the query's dtype, or both float8_e4m3fn with `kv_descale` (an FP8 cache: half the
      bytes of bf16 to store and to read).
    cache_seqlens: int32 [B], tokens in each sequence's cache before this call, in [0, L].
    page_table: int32 [B, max_pages_per_seq]: entry p of row b is the pool page holding
      positions p * page_size .. (p + 1) * page_size - 1 of sequence b (any order, any page
      size; entries past the pages a sequence uses are ignored). L = max_pages * page_size.
    new_key, new_value: [B, Tq, K, D] tokens written at positions cache_seqlens ..
      cache_seqlens + Tq - 1 before attending; the updated caches are returned. The write is a
      scatter of the new tokens only: in place (no cache copy) when the cache buffers are
      donated to the enclosing `jit` (`donate_argnums`) or carried by `scan` / `while_loop`.
    rotary: rotary embedding of the query and the new keys (rotate-half layout, as
      `flax.nnx.RoPE` and Llama) at their positions n_b - Tq + i: a base period (e.g. 10000.0)
      or (cos, sin) tables [max_position >= L, R / 2] rotating the first R features (any
      scaling scheme). Keys already in the cache must have been rotated when written.
    scale: softmax scale, default 1 / sqrt(D). A static Python float.
    local_window_size: sliding window as in `flash_attention`: an int w or (left, right); the
      query at position p sees keys p - left .. p (causality cuts the right side).
    logits_soft_cap: c > 0 replaces each scaled logit s by c * tanh(s / c).
    sinks: float [H] attention sinks, as in `flash_attention` (applied to the output after
      the kernels; lse then includes the sink).
    kv_descale: with float8_e4m3fn caches, (key_descale, value_descale): float32 factors of
      shape [] (per tensor) or [K] (per kv head), a cached entry's real value being
      float32(x8) * descale (e.g. max |k| / 448 over calibration data). The new tokens
      (`new_key` / `new_value`, in the query's dtype) are quantised with them on the append:
      e4m3 of x / descale, rounded to nearest and clipped to +-448 (`fp8.to_e4m3`); the
      attention reads them back quantised, like the rest of the cache. Scores and the output
      accumulate in float32.
    return_residuals: also return the float32 log-sum-exp [B, H, Tq] (natural log), e.g. to
      merge with attention over other keys (`merge_attention_states`).
    num_splits: S, the split-KV factor: the batch's key blocks are dealt into S·B balanced
      runs per kv head (one per sequence and split when the lengths are equal; S = 1: one
      program per sequence, no merge); None chooses from the shapes: one wave of runs on the
      GPU's SMs, fewer than B at large batches, or one program per sequence where those fill
      two waves (`decode_explain` says which). The runs are computed on device from the
      lengths.
    implementation: None picks the fastest that can run the call: "flash" for chunked prefill
      on Hopper (Tq >= decode.config.FLASH_SPLIT_MIN_Q_LEN, a contiguous cache in the query's
      dtype, no window, num_splits None), else "triton" on GPU and "xla" elsewhere
      (`decode_explain` says which and why); or one
      of "flash", "mosaic", "triton", "interpret", "xla", "reference". "flash" runs the
      cached prefix and the new tokens as two `flash_attention` calls and merges them
      (docs/decode.md); by name it runs on any platform. "mosaic" is the Hopper kernel
      (Tq * G <= 64 rows per kv head, D 64 or 128, bf16 / f16 caches, not FP8, a capacity
      that is a multiple of its key tiles, page sizes multiples of 8), run only when named or
      given a `MosaicDecodeConfig` (level with "triton" on the H200, docs/decode.md).
    config: a `TritonDecodeConfig`, `MosaicDecodeConfig` or `XlaDecodeConfig` overriding the
      backend's tiles, or a `FlashSplitConfig` (flash_attention's implementation and config
      for the "flash" route).
    checked: add `jax.experimental.checkify` checks of the values (lengths within the cache,
      the append fitting, used pages inside the pool); run the caller under
      `checkify.checkify` to get them as errors. Without it, eager calls (concrete values)
      are checked and raise a ValueError, while under `jit` bad values are not detected:
      lengths are clipped to [0, L], appended tokens that do not fit (or land on a page index
      outside the pool) are dropped, page indices are clamped into the pool when read, so no
      memory outside the caches is ever read or written, and the affected sequences' outputs
      are meaningless.

  Returns:
    out [B, Tq, H, D] in query.dtype; with return_residuals (out, lse); with new_key/new_value
    the updated caches follow: (out, key_cache, value_cache) or
    (out, lse, key_cache, value_cache).
  """
  call = validation.canonicalize(query, key_cache, value_cache, cache_seqlens,
                                 page_table=page_table, new_key=new_key, new_value=new_value,
                                 rotary=rotary, scale=scale, local_window_size=local_window_size,
                                 logits_soft_cap=logits_soft_cap, kv_descale=kv_descale)
  sinks = _check_outputs_and_sinks(query, return_residuals, checked, sinks)
  info = call.info
  plan = _plan(info, implementation, config, num_splits)
  if checked:
    validation.runtime_checks(call)
  if plan.chosen == "reference":
    rot = (call.rotary_cos, call.rotary_sin) if call.rotary_cos is not None else call.rotary_theta
    out, lse, k_cache, v_cache = decode_reference(
        call.q, call.key_cache, call.value_cache, jnp.clip(call.seqlens, 0, info.capacity),
        page_table=call.page_table, new_key=call.new_key, new_value=call.new_value, rotary=rot,
        scale=info.scale, local_window_size=info.window, logits_soft_cap=info.logits_soft_cap,
        kv_descale=call.kv_descale)
  else:
    out, lse, k_cache, v_cache = _run(call, plan)
  if sinks is not None:
    out, lse = merge.add_sinks(out, lse, sinks)
  results = (out, lse) if return_residuals else (out,)
  if info.appends:
    results += (k_cache, v_cache)
  return results[0] if len(results) == 1 else results


def _run(call: validation.DecodeCall, plan: DecodeExplanation):
  """Append, rotate, attend with the planned backend."""
  info = call.info
  rot = dict(theta=call.rotary_theta, cos=call.rotary_cos, sin=call.rotary_sin)
  k_cache, v_cache = call.key_cache, call.value_cache
  new_key = None
  if info.appends:
    new_key = call.new_key
    if info.rotary:
      pos = jnp.clip(call.seqlens, 0, info.capacity)[:, None] + jnp.arange(info.q_len)[None, :]
      # Into an FP8 cache the rotated keys go from float32: one rounding, to e4m3.
      new_key = cache.rotate(new_key.astype(jnp.float32) if info.fp8_cache else new_key, pos,
                             **rot)
    k_cache, v_cache = cache.append(info, k_cache, v_cache, new_key, call.new_value,
                                    call.seqlens, call.page_table, call.kv_descale)
  q = call.q
  if info.rotary:
    lengths = sequence_lengths(call.seqlens, q_len=info.q_len, appends=info.appends,
                               capacity=info.capacity)
    q = cache.rotate(q, jnp.maximum(cache.query_positions(info, lengths), 0), **rot)
  if plan.chosen == flash_split.NAME:
    out, lse = flash_split.attend(q, k_cache, v_cache, call.seqlens, new_key, call.new_value,
                                  info=info, config=plan.config)
    return out, lse, k_cache, v_cache
  params = DecodeParams.create(info, plan.runs)
  # The backends derive each sequence's length from cache_seqlens themselves (no XLA op).
  out, lse = _load(plan.chosen).attend(q, k_cache, v_cache, call.seqlens, call.page_table,
                                       params=params, config=plan.config,
                                       kv_descale=call.kv_descale)
  return out, lse, k_cache, v_cache
