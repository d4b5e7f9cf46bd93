"""Validation and canonicalisation: the arguments of a call checked, completed and described.

`canonicalize` turns what a user passed into arrays of one layout ([B, T, H, D] q, [B, S, K, D]
k/v, int32 [B, T] / [B, S] segment ids with lengths folded in) and a static `CallInfo`;
every bad argument raises a ValueError or TypeError here, naming it and the fix, before any
backend sees the call.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.interpreters.ad import JVPTracer, Zero

from pallas_flash import dropout, masks
from pallas_flash._checks import check_positive_int, is_int  # noqa: F401 (this module's API)
from pallas_flash.backends import check_implementation
from pallas_flash.call import (KV_PAD_SEGMENT, Q_PAD_SEGMENT, AttentionParams, CallInfo,
                               FeatureArrays)

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


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
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(f"`key` and `value` must have the same batch, length and heads (the head "
                     f"dims may differ), got shapes {key.shape} and {value.shape}.")
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


def check_dropout_rate(dropout_rate) -> None:
  """ValueError unless `dropout_rate` is a static Python number in [0, 1) (not a bool; a
  negative rate would otherwise pass for "no dropout")."""
  if (not isinstance(dropout_rate, (int, float)) or isinstance(dropout_rate, bool)
      or not 0.0 <= dropout_rate < 1.0):
    raise ValueError(f"`dropout_rate` must be a Python float in [0, 1), got {dropout_rate!r}.")


def is_static_bool(value) -> bool:
  """A static flag is a host bool: Python's or NumPy's (config files and np.array(...)[()]
  give the latter); never an array or a tracer, whose truth is not known when tracing."""
  return isinstance(value, (bool, np.bool_))


def check_bool(name: str, value) -> None:
  """TypeError unless `value` is a host bool (is_static_bool): a flag is not read by truthiness."""
  if not is_static_bool(value):
    raise TypeError(f"`{name}` must be a Python bool, got {value!r}.")


def check_residual_flags(return_residuals, return_residual, lse_dtype: str) -> None:
  """A call asks for at most one of the two lse conventions; lse_dtype names return_residual's
  dtype ("input" or, for FP8 inputs, "output")."""
  check_bool("return_residuals", return_residuals)  # static: they decide what the call returns
  check_bool("return_residual", return_residual)
  if return_residuals and return_residual:
    raise ValueError("Pass one of `return_residuals` (float32 [B, H, T], differentiable) and "
                     f"`return_residual` (jax.nn's: [B, T, H] in the {lse_dtype} dtype, "
                     "stop_gradient), not both.")


def check_reverse_mode(implementation, **arrays) -> None:
  """Forward mode (jax.jvp, jax.jacfwd) cannot pass the custom_vjp; say so before JAX's
  TypeError, which names neither the function nor a way out. Only the reference has a JVP."""
  if implementation == "reference":
    return
  for name, x in arrays.items():
    if isinstance(x, JVPTracer) and not isinstance(x.tangent, Zero):
      raise TypeError(
          f"flash_attention has no forward-mode derivative (jax.jvp, jax.jacfwd; `{name}` "
          "carries a tangent): its custom_vjp backward recomputes scores blockwise. Use "
          "reverse mode (jax.grad, jax.vjp, jax.jacrev), or implementation=\"reference\", "
          "which supports forward mode but materialises the [T, S] scores.")


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
    return  # Under jit values are unknown: clipped to [0, upper], checked with checked=True.
  # numpy, not jnp: a concrete array closed over by a jitted function would become a tracer
  # through jnp.min while that function is traced.
  values = np.asarray(x)
  lo, hi = int(values.min()), int(values.max())
  if lo < 0 or hi > upper:
    raise ValueError(f"`{name}` values must lie in [0, {upper}], got range [{lo}, {hi}].")


# The smallest segment id a user may pass: the two below mark padded positions (call.py).
MIN_SEGMENT_ID = max(Q_PAD_SEGMENT, KV_PAD_SEGMENT) + 1


def _check_segment_ids_range(name: str, x) -> None:
  if x is None or isinstance(x, jax.core.Tracer):
    return  # Under jit values are unknown: checked with checked=True (_runtime_checks).
  lo = int(np.asarray(x).min())
  if lo < MIN_SEGMENT_ID:
    raise ValueError(f"`{name}` holds {lo}, an id reserved for padded positions (ids below "
                     f"{MIN_SEGMENT_ID} = -2**31 + 2); use ids >= {MIN_SEGMENT_ID}, e.g. "
                     "non-negative ones.")


def _runtime_checks(q_lens, kv_lens, q_seg, kv_seg, t: int, s: int) -> None:
  """The value checks of concrete calls as `jax.experimental.checkify` checks (checked=True):
  they hold under jit, and the caller reads them with `checkify.checkify(f)(...)` then
  `err.throw()`. Each names the argument and the first offending index."""
  for name, lens, upper in (("query_seq_lengths", q_lens, t),
                            ("key_value_seq_lengths", kv_lens, s)):
    if lens is not None:
      bad = (lens < 0) | (lens > upper)
      b = jnp.argmax(bad)
      checkify.check(~bad.any(), f"`{name}`[{{b}}] = {{n}} lies outside [0, {upper}]; "
                     "unchecked calls clip it", b=b, n=lens[b])
  for name, seg in (("query_segment_ids", q_seg), ("key_value_segment_ids", kv_seg)):
    if seg is not None:
      bad = seg < MIN_SEGMENT_ID
      b, i = jnp.unravel_index(jnp.argmax(bad), seg.shape)
      checkify.check(~bad.any(), f"`{name}`[{{b}}, {{i}}] = {{v}} is an id reserved for "
                     f"padded positions; use ids >= {MIN_SEGMENT_ID}", b=b, i=i, v=seg[b, i])


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


def _abstract_compute_capability(device_kind: str) -> tuple[int, int] | None:
  """Compute capability of a GPU known by name only (an AbstractDevice), or None if unknown."""
  from jax.experimental.pallas import triton as pltriton

  # Longest names first, so that "NVIDIA A100" is not read as "NVIDIA A10".
  for version in sorted(pltriton.GpuVersion, key=lambda v: -len(v.value)):
    if version.value in device_kind:
      c = pltriton.get_gpu_info_from_version(version).compute_capability
      return c // 10, c % 10
  return None


def target_device() -> tuple[str, tuple[int, int] | None, str]:
  """(platform, compute capability, device kind) of where the call will be compiled for.

  An abstract mesh with an abstract device (as used to lower for CUDA on a CPU machine) wins over
  the default backend's first device.
  """
  abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if abstract is not None:
    platform, kind = abstract.platform, abstract.device_kind
    return platform, _abstract_compute_capability(kind) if platform == "gpu" else None, kind
  dev = jax.devices()[0]
  cc_str = getattr(dev, "compute_capability", None)
  cc = tuple(int(p) for p in cc_str.split(".")[:2]) if cc_str else None
  return dev.platform, cc, dev.device_kind


@dataclasses.dataclass(frozen=True)
class Call:
  """A canonical call: q [B, T, H, D], k/v [B, S, K, D], segment ids [B, T] / [B, S] int32 (or
  None; sequence lengths folded in), the features' arrays and the static description.
  `unbatched`: the user passed rank-3 arrays, so the results lose their batch axis again."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  q_seg: jax.Array | None
  kv_seg: jax.Array | None
  arrays: FeatureArrays
  info: CallInfo
  unbatched: bool


def _add_batch(x):
  return None if x is None else jnp.asarray(x)[None]


def canonicalize(query, key, value, *, scale, is_causal, query_seq_lengths,
                  key_value_seq_lengths, query_segment_ids, key_value_segment_ids,
                  bias=None, mask=None, local_window_size=None, logits_soft_cap=None,
                  logits_soft_cap_order="cap_then_bias", alibi_slopes=None, dropout_rate=0.0,
                  dropout_rng=None, block_mask=None, deterministic=False, checked=False) -> Call:
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
  if not is_static_bool(is_causal):
    raise TypeError(f"`is_causal` must be a Python bool (static: it picks the blocks to compute), "
                    f"got {type(is_causal).__name__}; under jit pass it as a static argument "
                    "(static_argnames) or close over it.")
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
  _check_segment_ids_range("query_segment_ids", q_seg)
  _check_segment_ids_range("key_value_segment_ids", kv_seg)
  check_bool("checked", checked)
  if checked:
    _runtime_checks(q_lens, kv_lens, q_seg, kv_seg, t, s)
  q_seg, kv_seg = _fold_lengths(q_seg, kv_seg, q_lens, kv_lens, t, s)
  _check_block_mask(block_mask, (b, t, s), is_causal=is_causal, q_seg=q_seg, mask=mask,
                    local_window_size=local_window_size)
  features, arrays = _canonicalize_features(
      (b, h, t, s), bias=bias, mask=mask, local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap, logits_soft_cap_order=logits_soft_cap_order,
      alibi_slopes=alibi_slopes, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng)
  if block_mask is not None:
    features["block_mask_blocks"] = (block_mask.block_q, block_mask.block_kv)
    features["block_mask_fn_types"] = masks.node_types(block_mask.mask_fn)
    arrays = dataclasses.replace(arrays, block_mask=block_mask)
  check_bool("deterministic", deterministic)
  params = AttentionParams(scale=float(scale), is_causal=bool(is_causal),
                           has_segments=q_seg is not None, deterministic=bool(deterministic),
                           **features)
  platform, cc, kind = target_device()
  info = CallInfo(batch=b, q_len=t, kv_len=s, num_heads=h, num_kv_heads=key.shape[2],
                  head_dim=d, value_head_dim=value.shape[3], dtype=jnp.dtype(query.dtype),
                  params=params, platform=platform, compute_capability=cc, device_kind=kind,
                  bias_dtype=None if bias is None else jnp.dtype(bias.dtype))
  return Call(query, key, value, q_seg, kv_seg, arrays, info, unbatched)


def _check_block_mask(bm, shape, *, is_causal, q_seg, mask, local_window_size) -> None:
  """A block mask must describe this call's shape and is the only structured mask."""
  if bm is None:
    return
  if not isinstance(bm, masks.BlockMask):
    raise TypeError(f"`block_mask` must be a pallas_flash.BlockMask (BlockMask.build(mask_fn, "
                    f"...)), got {type(bm).__name__}.")
  b, t, s = shape
  if (bm.q_len, bm.kv_len) != (t, s) or bm.batch not in (1, b):
    raise ValueError(f"`block_mask` was built for batch {bm.batch}, q_len {bm.q_len}, kv_len "
                     f"{bm.kv_len}, but the call has batch {b}, q_len {t}, kv_len {s}.")
  others = [name for name, on in (("is_causal", is_causal),
                                  ("local_window_size", local_window_size is not None),
                                  ("segment ids / sequence lengths", q_seg is not None),
                                  ("mask", mask is not None)) if on]
  if others:
    raise ValueError(
        f"`block_mask` cannot be combined with {', '.join(others)}: put every structured mask "
        "into its mask function (CausalMask(), LocalMask(left, right), SegmentMask(q_ids, "
        "kv_ids), combined with & and |).")


def _check_window(w) -> tuple[int, int] | None:
  if w is None:
    return None
  pair = (w, w) if is_int(w) else tuple(w) if isinstance(w, (tuple, list)) else None
  if pair is None or len(pair) != 2 or not all(is_int(x) for x in pair):
    raise TypeError("`local_window_size` must be an int or a (left, right) pair of Python ints "
                    f"(tokens; static), got {w!r}.")
  if min(pair) < 0:
    raise ValueError(f"`local_window_size` {pair} must be >= 0 on both sides: query i sees keys "
                     "i - left .. i + right (use is_causal=True to cut the right side).")
  return int(pair[0]), int(pair[1])


def _check_soft_cap(c) -> None:
  if c is not None and (not isinstance(c, (int, float)) or isinstance(c, bool)
                        or not math.isfinite(c) or c <= 0):
    raise ValueError(f"`logits_soft_cap` must be a positive finite Python float (static), got "
                     f"{c!r}.")


def check_layer_options(*, local_window_size=None, logits_soft_cap=None,
                        implementation=None) -> None:
  """The static options a layer binds, checked when it is built rather than at its first call."""
  _check_window(local_window_size)
  _check_soft_cap(logits_soft_cap)
  check_implementation(implementation)


def _check_dense(name: str, x, full: tuple[int, int, int, int]):
  """Bias / mask as jax.nn takes them: rank <= 4, broadcastable to [B, H, T, S].

  The T and S axes are broadcast here (differentiably); B and H stay 1 or full so that the
  kernels read one copy for every batch element / head.
  """
  if x is None:
    return None
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"`{name}` must be an array, got {type(x).__name__}.")
  x = jnp.asarray(x)
  if x.ndim > 4 or any(n not in (1, f) for n, f in zip((1,) * (4 - x.ndim) + x.shape, full)):
    raise ValueError(
        f"`{name}` must broadcast to [batch, num_heads, q_len, kv_len] = {full}, got shape "
        f"{x.shape}: each axis must be 1 or the full size. A dense {name} costs T*S memory; "
        "prefer is_causal, local_window_size, segment ids or alibi_slopes where they fit.")
  shape = (1,) * (4 - x.ndim) + x.shape
  return jnp.broadcast_to(x.reshape(shape), shape[:2] + full[2:])


SOFT_CAP_ORDERS = ("cap_then_bias", "bias_then_cap")


def _canonicalize_features(full, *, bias, mask, local_window_size, logits_soft_cap,
                           logits_soft_cap_order, alibi_slopes, dropout_rate, dropout_rng):
  """Validated feature arguments: (AttentionParams fields, FeatureArrays)."""
  b, h, t, s = full
  window = _check_window(local_window_size)
  _check_soft_cap(logits_soft_cap)
  if logits_soft_cap_order not in SOFT_CAP_ORDERS:
    raise ValueError(f"`logits_soft_cap_order` must be one of {SOFT_CAP_ORDERS}, got "
                     f"{logits_soft_cap_order!r}: \"cap_then_bias\" computes c*tanh(s/c) + bias, "
                     "\"bias_then_cap\" c*tanh((s + bias)/c).")
  check_dropout_rate(dropout_rate)
  seed = None
  if dropout_rate > 0.0:
    if dropout_rng is None:
      raise ValueError("`dropout_rate` > 0 needs `dropout_rng`, a JAX PRNG key "
                       "(e.g. jax.random.key(0)); pass dropout_rate=0.0 for no dropout.")
    _check_rng(dropout_rng)
    seed = dropout.seed_from_rng(dropout_rng)
  slopes = None
  if alibi_slopes is not None:
    slopes = jnp.asarray(alibi_slopes)
    if slopes.shape != (h,) or not jnp.issubdtype(slopes.dtype, jnp.floating):
      raise ValueError(f"`alibi_slopes` must be a float array of shape (num_heads,) = ({h},), "
                       f"got {slopes.dtype}{list(slopes.shape)}.")
    # A fixed schedule, not trained: no implementation gives the slopes a gradient.
    slopes = jax.lax.stop_gradient(slopes.astype(jnp.float32))
  bias = _check_dense("bias", bias, full)
  if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
    raise TypeError(f"`bias` must be a float array, got {bias.dtype}.")
  if mask is not None and getattr(mask, "dtype", None) != jnp.bool_:
    raise TypeError("`mask` must be a boolean array (True where a query may attend), got "
                    f"{getattr(mask, 'dtype', type(mask).__name__)}; pass additive masks as "
                    "`bias`.")
  mask = _check_dense("mask", mask, full)
  fields = dict(local_window=window,
                logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
                bias_in_cap=(logits_soft_cap_order == "bias_then_cap" and logits_soft_cap
                             is not None and (bias is not None or slopes is not None)),
                has_alibi=slopes is not None, dropout_rate=float(dropout_rate),
                has_bias=bias is not None, has_mask=mask is not None)
  return fields, FeatureArrays(bias=bias, mask=mask, alibi_slopes=slopes, dropout_seed=seed)


def _check_rng(rng) -> None:
  dtype = getattr(rng, "dtype", None)
  is_key = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
  raw_key = dtype == jnp.uint32 and getattr(rng, "shape", None) == (2,)
  if not (is_key or raw_key):
    raise TypeError(f"`dropout_rng` must be a JAX PRNG key (jax.random.key(seed), or a raw "
                    f"uint32[2] jax.random.PRNGKey), got {type(rng).__name__} "
                    f"{getattr(rng, 'dtype', rng)!s}.")


def abstract_call_info(query, key, value, kwargs: dict) -> CallInfo:
  """Validates and describes a call without computing anything, so shapes suffice."""
  arrays = {n: x for n, x in kwargs.items() if hasattr(x, "shape") and hasattr(x, "dtype")}
  statics = {n: x for n, x in kwargs.items() if n not in arrays}
  infos = []

  def trace(q, k, v, arrays):
    infos.append(canonicalize(q, k, v, **statics, **arrays).info)
    return jnp.zeros(())

  jax.eval_shape(trace, query, key, value, arrays)
  return infos[0]


# flash_attention's keyword arguments that describe the call, with their defaults.
DEFAULTS = {"scale": None, "is_causal": False, "query_seq_lengths": None,
            "key_value_seq_lengths": None, "query_segment_ids": None,
            "key_value_segment_ids": None, "bias": None, "mask": None,
            "local_window_size": None, "logits_soft_cap": None,
            "logits_soft_cap_order": "cap_then_bias", "alibi_slopes": None,
            "dropout_rate": 0.0, "dropout_rng": None, "block_mask": None,
            "deterministic": False}


def with_defaults(kwargs: dict) -> dict:
  """`kwargs` completed with DEFAULTS; unknown names raise a TypeError."""
  unknown = set(kwargs) - set(DEFAULTS)
  if unknown:
    raise TypeError(f"Unexpected arguments {sorted(unknown)}.")
  return {n: kwargs.get(n, default) for n, default in DEFAULTS.items()}


def check_sinks(sinks, num_heads: int) -> jax.Array:
  """`sinks` as a float array [num_heads] (one logit per query head), or a clear error."""
  if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
    raise TypeError(f"`sinks` must be a float array of shape (num_heads,), got "
                    f"{type(sinks).__name__}.")
  if sinks.shape != (num_heads,):
    raise ValueError(f"`sinks` must have shape (num_heads,) = ({num_heads},): one logit per "
                     f"query head, got {tuple(sinks.shape)}.")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise TypeError(f"`sinks` must be a float array, got {sinks.dtype}.")
  return sinks
