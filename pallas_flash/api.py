"""The public entry point: validate -> canonicalise -> choose an implementation -> dispatch."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from pallas_flash.params import KV_PAD_SEGMENT, Q_PAD_SEGMENT, AttentionParams, CallInfo
from pallas_flash.reference import attention_reference

Implementation = Literal["mosaic", "triton", "interpret", "xla", "reference"]
IMPLEMENTATIONS: tuple[str, ...] = ("mosaic", "triton", "interpret", "xla", "reference")
# What `implementation=None` tries, fastest first.
AUTO_ORDER: tuple[str, ...] = ("mosaic", "triton", "xla")
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Backend:
  forward: Callable
  backward: Callable
  unsupported_reason: Callable[[CallInfo], str | None]
  config_type: type


def _load_backend(name: str) -> _Backend | str:
  """The backend's functions, or the reason it cannot be imported here."""
  module_name, kwargs = {
      "mosaic": ("pallas_flash.mosaic_gpu", {}),
      "triton": ("pallas_flash.triton", {"interpret": False}),
      "interpret": ("pallas_flash.triton", {"interpret": True}),
      "xla": ("pallas_flash.xla", {}),
  }[name]
  try:
    mod = importlib.import_module(module_name)
  except ImportError as e:  # e.g. a jaxlib built without the Pallas GPU lowerings
    return f"cannot import {module_name}: {e}"
  fwd, bwd = mod.forward, mod.backward
  if kwargs:
    fwd, bwd = functools.partial(fwd, **kwargs), functools.partial(bwd, **kwargs)
  reason = functools.partial(mod.unsupported_reason, **kwargs) if kwargs else mod.unsupported_reason
  return _Backend(fwd, bwd, reason, mod.CONFIG_TYPE)


# ---------------------------------------------------------------------------------------------
# Validation and canonicalisation


def _check_array(name: str, x: Any) -> None:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"`{name}` must be a jax or numpy array, got {type(x).__name__}.")
  if x.ndim != 4:
    raise ValueError(
        f"`{name}` must have rank 4 [batch, seq_len, num_heads, head_dim] (rank 3 without batch is "
        f"also accepted for all three together), got shape {tuple(x.shape)}.")


def _check_inputs(query, key, value) -> None:
  for name, x in (("query", query), ("key", key), ("value", value)):
    _check_array(name, x)
  b, t, h, d = query.shape
  if key.shape != value.shape:
    raise ValueError(f"`key` and `value` must have the same shape, got {key.shape} and "
                     f"{value.shape}.")
  if key.shape[0] != b:
    raise ValueError(f"`query` and `key` must have the same batch size, got {b} and "
                     f"{key.shape[0]}.")
  if key.shape[3] != d:
    raise ValueError(f"`query` and `key` must have the same head_dim, got {d} and {key.shape[3]}.")
  kh = key.shape[2]
  if kh == 0 or h % kh:
    raise ValueError(
        f"num_heads of `query` ({h}) must be a multiple of num_heads of `key`/`value` ({kh}) "
        "(MHA: equal; GQA: a multiple; MQA: key/value with 1 head).")
  if 0 in (b, t, h, d, key.shape[1]):
    raise ValueError(f"Empty input: query {query.shape}, key {key.shape}.")
  dtypes = {jnp.dtype(x.dtype) for x in (query, key, value)}
  if len(dtypes) != 1:
    raise TypeError(f"`query`, `key` and `value` must share one dtype, got "
                    f"{query.dtype}, {key.dtype}, {value.dtype}; cast them first.")
  if jnp.dtype(query.dtype) not in [jnp.dtype(t) for t in SUPPORTED_DTYPES]:
    raise TypeError(f"Unsupported dtype {query.dtype}: use bfloat16, float16 or float32.")


def _check_index_array(name: str, x, shape: tuple[int, ...], fix: str):
  if x is None:
    return None
  x = jnp.asarray(x)
  if x.shape != shape:
    raise ValueError(f"`{name}` must have shape {shape}, got {x.shape}. {fix}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"`{name}` must be an integer array (int32), got {x.dtype}.")
  return x.astype(jnp.int32)


def _check_lengths_range(name: str, x, upper: int) -> None:
  if x is None or isinstance(x, jax.core.Tracer):
    return  # Under jit values are unknown: out-of-range lengths clip to [0, upper].
  lo, hi = int(jnp.min(x)), int(jnp.max(x))
  if lo < 0 or hi > upper:
    raise ValueError(f"`{name}` values must lie in [0, {upper}], got range [{lo}, {hi}].")


def _fold_lengths(q_seg, kv_seg, q_lens, kv_lens, t: int, s: int):
  """Expresses right-padding lengths as segment ids: padded positions get ids nothing matches."""
  if q_seg is None and q_lens is None and kv_lens is None:
    return None, None
  b = (q_seg if q_seg is not None else q_lens if q_lens is not None else kv_lens).shape[0]
  if q_seg is None:
    q_seg, kv_seg = jnp.zeros((b, t), jnp.int32), jnp.zeros((b, s), jnp.int32)
  if q_lens is not None:
    q_seg = jnp.where(jnp.arange(t)[None] < q_lens[:, None], q_seg, Q_PAD_SEGMENT)
  if kv_lens is not None:
    kv_seg = jnp.where(jnp.arange(s)[None] < kv_lens[:, None], kv_seg, KV_PAD_SEGMENT)
  return q_seg, kv_seg


def _target_device() -> tuple[str, tuple[int, int] | None, str]:
  """(platform, compute capability, device kind) of where the call will be compiled for.

  An abstract mesh with an abstract device (as used to lower for CUDA on a CPU machine) wins over
  the default backend's first device.
  """
  abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if abstract is not None:
    platform, kind = abstract.platform, abstract.device_kind
    cc = None
    if platform == "gpu":
      from jax.experimental.pallas import triton as pltriton
      version = pltriton.gpu_info.gpu_version_from_device_kind(kind) \
          if hasattr(pltriton, "gpu_info") else None
      if version is not None:
        c = pltriton.get_gpu_info_from_version(version).compute_capability
        cc = (c // 10, c % 10)
    return platform, cc, kind
  dev = jax.devices()[0]
  cc_str = getattr(dev, "compute_capability", None)
  cc = tuple(int(p) for p in cc_str.split(".")[:2]) if cc_str else None
  return dev.platform, cc, dev.device_kind


@dataclasses.dataclass(frozen=True)
class _Call:
  q: jax.Array
  k: jax.Array
  v: jax.Array
  q_seg: jax.Array | None
  kv_seg: jax.Array | None
  info: CallInfo
  unbatched: bool


def _add_batch(x):
  return None if x is None else jnp.asarray(x)[None]


def _canonicalize(query, key, value, *, scale, is_causal, query_seq_lengths,
                  key_value_seq_lengths, query_segment_ids, key_value_segment_ids) -> _Call:
  unbatched = all(getattr(x, "ndim", None) == 3 for x in (query, key, value))
  if unbatched:
    query, key, value = (jnp.asarray(x)[None] for x in (query, key, value))
  _check_inputs(query, key, value)
  b, t, h, d = query.shape
  s = key.shape[1]
  if unbatched:
    query_seq_lengths, key_value_seq_lengths = map(_add_batch, (query_seq_lengths,
                                                                key_value_seq_lengths))
    query_segment_ids, key_value_segment_ids = map(_add_batch, (query_segment_ids,
                                                                key_value_segment_ids))
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  elif not isinstance(scale, (int, float)) or not math.isfinite(scale):
    raise TypeError(f"`scale` must be a finite Python float (it is static), got {scale!r}.")
  q_lens = _check_index_array("query_seq_lengths", query_seq_lengths, (b,),
                              "Pass one valid length per batch element.")
  kv_lens = _check_index_array("key_value_seq_lengths", key_value_seq_lengths, (b,),
                               "Pass one valid length per batch element.")
  _check_lengths_range("query_seq_lengths", q_lens, t)
  _check_lengths_range("key_value_seq_lengths", kv_lens, s)
  if key_value_segment_ids is not None and query_segment_ids is None:
    raise ValueError("`key_value_segment_ids` was given without `query_segment_ids`; pass both.")
  if query_segment_ids is not None and key_value_segment_ids is None:
    if t != s:
      raise ValueError(
          f"`key_value_segment_ids` is required when q_len ({t}) != kv_len ({s}); it defaults "
          "to `query_segment_ids` only when the lengths match.")
    key_value_segment_ids = query_segment_ids
  q_seg = _check_index_array("query_segment_ids", query_segment_ids, (b, t),
                             "Segment ids are [batch, q_len] int32.")
  kv_seg = _check_index_array("key_value_segment_ids", key_value_segment_ids, (b, s),
                              "Segment ids are [batch, kv_len] int32.")
  q_seg, kv_seg = _fold_lengths(q_seg, kv_seg, q_lens, kv_lens, t, s)
  params = AttentionParams(scale=float(scale), is_causal=bool(is_causal),
                           has_segments=q_seg is not None)
  platform, cc, kind = _target_device()
  info = CallInfo(batch=b, q_len=t, kv_len=s, num_heads=h, num_kv_heads=key.shape[2],
                  head_dim=d, dtype=jnp.dtype(query.dtype), params=params, platform=platform,
                  compute_capability=cc, device_kind=kind)
  return _Call(query, key, value, q_seg, kv_seg, info, unbatched)


# ---------------------------------------------------------------------------------------------
# Choosing an implementation


def _reason(name: str, info: CallInfo, config) -> str | None:
  if name == "reference":
    return None if config is None else "the reference takes no config"
  backend = _load_backend(name)
  if isinstance(backend, str):
    return backend
  if config is not None and not isinstance(config, backend.config_type):
    return (f"config is a {type(config).__name__}, but {name!r} takes a "
            f"{backend.config_type.__name__}")
  return backend.unsupported_reason(info)


@dataclasses.dataclass(frozen=True)
class Explanation:
  """Which implementation `implementation=None` runs, and why each other one was not chosen."""

  chosen: str | None  # None: no automatic choice can run the call
  reasons: dict[str, str | None]  # None: could run this call

  def __str__(self) -> str:
    lines = [f"implementation=None runs {self.chosen!r}" if self.chosen else
             "implementation=None cannot run this call"]
    for name, why in self.reasons.items():
      if name == self.chosen:
        continue
      lines.append(f"  {name}: " + ("can run, but " + _not_chosen(name) if why is None else why))
    return "\n".join(lines)


def _not_chosen(name: str) -> str:
  if name in ("interpret", "reference"):
    return "is never chosen automatically (testing only)"
  return "a faster implementation applies"


def _auto_choice(reasons: dict[str, str | None]) -> str | None:
  return next((name for name in AUTO_ORDER if reasons[name] is None), None)


def _choose(info: CallInfo, implementation, config) -> str:
  """The implementation to run; raises with every reason when none can."""
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"Unknown implementation {implementation!r}; choose one of "
                     f"{IMPLEMENTATIONS} or None for automatic.")
  if implementation is not None:
    reason = _reason(implementation, info, config)
    if reason is not None:
      raise NotImplementedError(
          f"implementation={implementation!r} cannot run this call: {reason}")
    return implementation
  reasons = {name: _reason(name, info, config) for name in IMPLEMENTATIONS}
  chosen = _auto_choice(reasons)
  if chosen is None:
    raise NotImplementedError("No implementation can run this call:\n" + "\n".join(
        f"  {n}: {r}" for n, r in reasons.items()))
  return chosen


def explain(query, key, value, **kwargs) -> Explanation:
  """Says which implementation `flash_attention(query, key, value, **kwargs)` would run.

  Takes the same arguments as `flash_attention`; `implementation` is ignored, `config` is honoured.
  Works on arrays or `jax.ShapeDtypeStruct`s. Print the result for a readable report.
  """
  config = kwargs.pop("config", None)
  kwargs.pop("implementation", None)
  kwargs.pop("return_residuals", None)
  call = _canonicalize(query, key, value, **_defaults(kwargs))
  reasons = {name: _reason(name, call.info, config) for name in IMPLEMENTATIONS}
  return Explanation(_auto_choice(reasons), reasons)


def _defaults(kwargs: dict) -> dict:
  names = ("scale", "is_causal", "query_seq_lengths", "key_value_seq_lengths",
           "query_segment_ids", "key_value_segment_ids")
  unknown = set(kwargs) - set(names)
  if unknown:
    raise TypeError(f"Unexpected arguments {sorted(unknown)}.")
  return {n: kwargs.get(n, False if n == "is_causal" else None) for n in names}


# ---------------------------------------------------------------------------------------------
# The differentiable core


@functools.cache
def _differentiable(name: str, params: AttentionParams, config) -> Callable:
  """A custom_vjp attention for one backend and static configuration.

  The forward saves only (q, k, v, segment ids, o, lse); the backward recomputes scores blockwise.
  """
  backend = _load_backend(name)
  fwd_kw = dict(params=params, config=config)

  @jax.custom_vjp
  def attention(q, k, v, q_seg, kv_seg):
    return backend.forward(q, k, v, q_seg, kv_seg, **fwd_kw)

  def attention_fwd(q, k, v, q_seg, kv_seg):
    o, lse = backend.forward(q, k, v, q_seg, kv_seg, **fwd_kw)
    return (o, lse), (q, k, v, q_seg, kv_seg, o, lse)

  def attention_bwd(res, cotangents):
    q, k, v, q_seg, kv_seg, o, lse = res
    do, dlse = cotangents
    # delta = rowsum(dO * O) is FA2's backward preprocessing; a cotangent on lse enters the
    # score gradient as p * dlse, which is the same as subtracting it from delta.
    delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32))
    delta = delta - dlse
    # +inf on fully masked rows makes every recomputed probability exp(s - lse) exactly 0.
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
    dq, dk, dv = backend.backward(q, k, v, q_seg, kv_seg, o, lse, do.astype(q.dtype), delta,
                                  **fwd_kw)
    return dq, dk, dv, None, None

  attention.defvjp(attention_fwd, attention_bwd)
  return attention


def flash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    query_segment_ids: jax.Array | None = None,
    key_value_segment_ids: jax.Array | None = None,
    return_residuals: bool = False,
    implementation: Implementation | None = None,
    config: Any = None,
):
  """Exact attention, computed blockwise without materialising the score matrix.

  Arguments and layout follow `jax.nn.dot_product_attention`, so switching is a rename.

  Args:
    query: [B, T, H, D] (or [T, H, D] together with key and value).
    key, value: [B, S, K, D], H % K == 0 (MHA, GQA, MQA).
    scale: softmax scale, default 1/sqrt(D). A static Python float.
    is_causal: query i attends to keys 0..i, exactly as `jax.nn.dot_product_attention`, also
      when T != S (top-left alignment: the mask is the top-left corner of a square causal mask).
    query_seq_lengths, key_value_seq_lengths: int32 [B] valid lengths of right-padded sequences.
    query_segment_ids, key_value_segment_ids: int32 [B, T] / [B, S]; a query attends only to keys
      of its own segment (packed documents). key_value_segment_ids defaults to query_segment_ids
      when T == S.
    return_residuals: also return the float32 log-sum-exp [B, H, T] (natural log, -inf for a
      query with no visible key), e.g. to merge partial attentions.
    implementation: None picks the fastest that can run the call (see `explain`); "mosaic"
      (Hopper), "triton" (GPU), "interpret" (the Triton kernels in the Pallas interpreter, any
      platform), "xla" (blockwise jnp, O(N) memory, any platform) or "reference" (materialising).
    config: a backend config (`TritonConfig`, `XlaConfig`, `MosaicConfig`) to override tuning.

  Returns:
    The output [B, T, H, D] in the input dtype; with return_residuals, (output, lse). A query that
    sees no key gets zeros (and zero gradients), never NaN.
  """
  call = _canonicalize(query, key, value, scale=scale, is_causal=is_causal,
                       query_seq_lengths=query_seq_lengths,
                       key_value_seq_lengths=key_value_seq_lengths,
                       query_segment_ids=query_segment_ids,
                       key_value_segment_ids=key_value_segment_ids)
  name = _choose(call.info, implementation, config)
  args = (call.q, call.k, call.v, call.q_seg, call.kv_seg)
  if name == "reference":
    o, lse = attention_reference(*args, params=call.info.params)
  else:
    o, lse = _differentiable(name, call.info.params, config)(*args)
  if call.unbatched:
    o, lse = o[0], lse[0]
  return (o, lse) if return_residuals else o
