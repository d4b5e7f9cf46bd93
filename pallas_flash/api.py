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
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from pallas_flash import block_sparse, dropout, masks
from pallas_flash.params import (KV_PAD_SEGMENT, Q_PAD_SEGMENT, AttentionParams, CallInfo,
                                 FeatureArrays)
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
  features: frozenset[str]  # SUPPORTED_FEATURES; a backend without it runs only the core
  computes_delta: bool = False  # BACKWARD_COMPUTES_DELTA (see pallas_flash.params)
  # DEFAULT_CONFIG: CallInfo -> the config a call that passes none runs (explain reports it)
  default_config: Callable[[CallInfo], Any] | None = None


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
  features = frozenset(getattr(mod, "SUPPORTED_FEATURES", ()))
  return _Backend(fwd, bwd, reason, mod.CONFIG_TYPE, features,
                  bool(getattr(mod, "BACKWARD_COMPUTES_DELTA", False)),
                  getattr(mod, "DEFAULT_CONFIG", None))


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
  # numpy, not jnp: a concrete array closed over by a jitted function would become a tracer
  # through jnp.min while that function is traced.
  values = np.asarray(x)
  lo, hi = int(values.min()), int(values.max())
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


def _abstract_compute_capability(device_kind: str) -> tuple[int, int] | None:
  """Compute capability of a GPU known by name only (an AbstractDevice), or None if unknown."""
  from jax.experimental.pallas import triton as pltriton

  # Longest names first, so that "NVIDIA A100" is not read as "NVIDIA A10".
  for version in sorted(pltriton.GpuVersion, key=lambda v: -len(v.value)):
    if version.value in device_kind:
      c = pltriton.get_gpu_info_from_version(version).compute_capability
      return c // 10, c % 10
  return None


def _target_device() -> tuple[str, tuple[int, int] | None, str]:
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
class _Call:
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


def _canonicalize(query, key, value, *, scale, is_causal, query_seq_lengths,
                  key_value_seq_lengths, query_segment_ids, key_value_segment_ids,
                  bias=None, mask=None, local_window_size=None, logits_soft_cap=None,
                  alibi_slopes=None, dropout_rate=0.0, dropout_rng=None,
                  block_mask=None, deterministic=False) -> _Call:
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
  _check_block_mask(block_mask, (b, t, s), is_causal=is_causal, q_seg=q_seg, mask=mask,
                    local_window_size=local_window_size)
  features, arrays = _canonicalize_features(
      (b, h, t, s), bias=bias, mask=mask, local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng)
  if block_mask is not None:
    features["block_mask_blocks"] = (block_mask.block_q, block_mask.block_kv)
    arrays = dataclasses.replace(arrays, block_mask=block_mask)
  if not isinstance(deterministic, bool):
    raise TypeError(f"`deterministic` must be a Python bool (static), got {deterministic!r}.")
  params = AttentionParams(scale=float(scale), is_causal=bool(is_causal),
                           has_segments=q_seg is not None, deterministic=deterministic,
                           **features)
  platform, cc, kind = _target_device()
  info = CallInfo(batch=b, q_len=t, kv_len=s, num_heads=h, num_kv_heads=key.shape[2],
                  head_dim=d, dtype=jnp.dtype(query.dtype), params=params, platform=platform,
                  compute_capability=cc, device_kind=kind)
  return _Call(query, key, value, q_seg, kv_seg, arrays, info, unbatched)


def _check_block_mask(bm, shape, *, is_causal, q_seg, mask, local_window_size) -> None:
  """A block mask must describe this call's shape and is the only structured mask."""
  if bm is None:
    return
  if not isinstance(bm, block_sparse.BlockMask):
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
  pair = (w, w) if isinstance(w, int) else tuple(w) if isinstance(w, (tuple, list)) else None
  if (pair is None or len(pair) != 2
      or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
    raise TypeError("`local_window_size` must be an int or a (left, right) pair of Python ints "
                    f"(tokens; static), got {w!r}.")
  if min(pair) < 0:
    raise ValueError(f"`local_window_size` {pair} must be >= 0 on both sides: query i sees keys "
                     "i - left .. i + right (use is_causal=True to cut the right side).")
  return int(pair[0]), int(pair[1])


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
        f"{x.shape}: each axis must be 1 or the full size. Dense {name}es cost T*S memory; "
        "prefer is_causal, local_window_size, segment ids or alibi_slopes where they fit.")
  shape = (1,) * (4 - x.ndim) + x.shape
  return jnp.broadcast_to(x.reshape(shape), shape[:2] + full[2:])


def _canonicalize_features(full, *, bias, mask, local_window_size, logits_soft_cap,
                           alibi_slopes, dropout_rate, dropout_rng):
  """Validated feature arguments: (AttentionParams fields, FeatureArrays)."""
  b, h, t, s = full
  window = _check_window(local_window_size)
  if logits_soft_cap is not None and (
      not isinstance(logits_soft_cap, (int, float)) or isinstance(logits_soft_cap, bool)
      or not math.isfinite(logits_soft_cap) or logits_soft_cap <= 0):
    raise ValueError(f"`logits_soft_cap` must be a positive finite Python float (static), got "
                     f"{logits_soft_cap!r}.")
  if not isinstance(dropout_rate, (int, float)) or not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"`dropout_rate` must be a Python float in [0, 1), got {dropout_rate!r}.")
  seed = None
  if dropout_rate > 0.0:
    if dropout_rng is None:
      raise ValueError("`dropout_rate` > 0 needs `dropout_rng`, a JAX PRNG key "
                       "(e.g. jax.random.key(0)); pass dropout_rate=0.0 for no dropout.")
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
                has_alibi=slopes is not None, dropout_rate=float(dropout_rate),
                has_bias=bias is not None, has_mask=mask is not None)
  return fields, FeatureArrays(bias=bias, mask=mask, alibi_slopes=slopes, dropout_seed=seed)


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
  missing = info.params.features - backend.features
  if missing:
    return f"{name} does not support {', '.join(sorted(missing))} yet"
  blocks = info.params.block_mask_blocks
  if info.params.deterministic and getattr(config, "fused_backward", False):
    return ("config.fused_backward=True sums dQ with float32 atomics in a varying order, "
            "which deterministic=True rules out; pass fused_backward=False (the split backward)")
  if blocks is not None and config is not None and (
      (config.block_q, config.block_kv) != blocks):
    return (f"config blocks ({config.block_q}, {config.block_kv}) differ from the block_mask's "
            f"{blocks}; build the BlockMask with the config's blocks or pass no config")
  return backend.unsupported_reason(info)


@dataclasses.dataclass(frozen=True)
class Explanation:
  """Which implementation `implementation=None` runs, and why each other one was not chosen."""

  chosen: str | None  # None: no automatic choice can run the call
  reasons: dict[str, str | None]  # None: could run this call
  # Fraction of (query block, key block) pairs the blocked kernels compute, from causal masking
  # and the local window at `block_q x block_kv` (segment ids and dense masks skip nothing).
  blocks_computed: float = 1.0
  block_shape: tuple[int, int] = (128, 128)
  # The config `chosen` runs: the one passed, else the per-call default of a backend that
  # reports it (mosaic: its tuning table and the fused-backward rules); None otherwise. To
  # change one knob of the default: dataclasses.replace(explanation.config, ...).
  config: Any = None

  def __str__(self) -> str:
    lines = [f"implementation=None runs {self.chosen!r}" if self.chosen else
             "implementation=None cannot run this call"]
    if self.config is not None:
      lines.append(f"  config: {_config_summary(self.config)}")
    lines.append(f"  blocks computed: {self.blocks_computed:.1%} of "
                 f"{self.block_shape[0]}x{self.block_shape[1]} score blocks")
    for name, why in self.reasons.items():
      if name == self.chosen:
        continue
      lines.append(f"  {name}: " + ("can run, but " + _not_chosen(name) if why is None else why))
    return "\n".join(lines)


def _config_summary(config) -> str:
  """`Name(field=value, ...)` with only the fields that differ from the class's defaults."""
  if not dataclasses.is_dataclass(config):
    return repr(config)
  base = type(config)()
  changed = (f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
             if getattr(config, f.name) != getattr(base, f.name))
  return f"{type(config).__name__}({', '.join(changed)})"


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


def explain(query, key, value, bias=None, mask=None, **kwargs) -> Explanation:
  """Says which implementation `flash_attention(query, key, value, ...)` would run.

  Takes the same arguments as `flash_attention`; `implementation` is ignored, `config` is honoured.
  Works on arrays or `jax.ShapeDtypeStruct`s. Also reports the fraction of score blocks the
  blocked kernels compute under causal masking and the local window, or under `block_mask`
  (whose tables must then be concrete). Print the result for a readable report.
  """
  kwargs.update(bias=bias, mask=mask)
  config = kwargs.pop("config", None)
  kwargs.pop("implementation", None)
  kwargs.pop("return_residuals", None)
  info = _abstract_call_info(query, key, value, _defaults(kwargs))
  reasons = {name: _reason(name, info, config) for name in IMPLEMENTATIONS}
  bm = kwargs.get("block_mask")
  if bm is not None:
    block, fraction = (bm.block_q, bm.block_kv), bm.fraction_computed()
  else:
    block = (getattr(config, "block_q", 128), getattr(config, "block_kv", 128))
    fraction = masks.fraction_computed(q_len=info.q_len, kv_len=info.kv_len, block_q=block[0],
                                       block_kv=block[1], band=info.params.band)
  chosen = _auto_choice(reasons)
  return Explanation(chosen, reasons, fraction, block, _config_used(chosen, info, config))


def _config_used(name: str | None, info: CallInfo, config):
  """The config `name` runs `info` with: `config`, else the backend's reported default."""
  if name is None:
    return None
  if config is not None or name == "reference":
    return config
  backend = _load_backend(name)
  hook = None if isinstance(backend, str) else backend.default_config
  return None if hook is None else hook(info)


def _abstract_call_info(query, key, value, kwargs: dict) -> CallInfo:
  """Validates and describes a call without computing anything, so shapes suffice."""
  arrays = {n: x for n, x in kwargs.items() if hasattr(x, "shape") and hasattr(x, "dtype")}
  statics = {n: x for n, x in kwargs.items() if n not in arrays}
  infos = []

  def trace(q, k, v, arrays):
    infos.append(_canonicalize(q, k, v, **statics, **arrays).info)
    return jnp.zeros(())

  jax.eval_shape(trace, query, key, value, arrays)
  return infos[0]


_DEFAULTS = {"scale": None, "is_causal": False, "query_seq_lengths": None,
             "key_value_seq_lengths": None, "query_segment_ids": None,
             "key_value_segment_ids": None, "bias": None, "mask": None,
             "local_window_size": None, "logits_soft_cap": None, "alibi_slopes": None,
             "dropout_rate": 0.0, "dropout_rng": None, "block_mask": None,
             "deterministic": False}


def _defaults(kwargs: dict) -> dict:
  unknown = set(kwargs) - set(_DEFAULTS)
  if unknown:
    raise TypeError(f"Unexpected arguments {sorted(unknown)}.")
  return {n: kwargs.get(n, default) for n, default in _DEFAULTS.items()}


# ---------------------------------------------------------------------------------------------
# The differentiable core

# The name (jax.ad_checkpoint.checkpoint_name) of the forward's o and lse, the residuals the
# backward needs besides the inputs: `jax.checkpoint(f, policy=
# jax.checkpoint_policies.save_only_these_names(CHECKPOINT_NAME))` keeps them, so that a
# rematerialised block recomputes its projections but not its attention forward.
CHECKPOINT_NAME = "pallas_flash.attention"


@functools.cache
def _differentiable(name: str, params: AttentionParams, config) -> Callable:
  """A custom_vjp attention for one backend and static configuration.

  The forward saves only (q, k, v, segment ids, feature arrays, o, lse); the backward recomputes
  scores (and the dropout mask) blockwise. Feature arrays reach the backend only when the call
  uses a feature, so core-only backends keep the plain contract.
  """
  backend = _load_backend(name)
  uses_features = bool(params.features)

  def kw(arrays):
    return dict(params=params, config=config, **({"arrays": arrays} if uses_features else {}))

  @jax.custom_vjp
  def attention(q, k, v, q_seg, kv_seg, arrays):
    return backend.forward(q, k, v, q_seg, kv_seg, **kw(arrays))

  def attention_fwd(*primals):
    # symbolic_zeros: each leaf comes as CustomVJPPrimal(value, perturbed).
    q, k, v, q_seg, kv_seg, arrays = custom_vjp_primal_tree_values(primals)
    o, lse = checkpoint_name(backend.forward(q, k, v, q_seg, kv_seg, **kw(arrays)),
                             CHECKPOINT_NAME)
    return (o, lse), (q, k, v, q_seg, kv_seg, arrays, o, lse)

  def attention_bwd(res, cotangents):
    q, k, v, q_seg, kv_seg, arrays, o, lse = res
    do, dlse = cotangents
    if isinstance(do, SymbolicZero):  # only lse is differentiated
      do = jnp.zeros(o.shape, q.dtype)
    # None when lse is unused (symbolic zeros), so that no zero array is materialised.
    dlse = None if isinstance(dlse, SymbolicZero) else dlse
    # delta = rowsum(dO * O) is FA2's backward preprocessing; a cotangent on lse enters the
    # score gradient as p * dlse, which is the same as subtracting it from delta.
    if backend.computes_delta:
      delta = None if dlse is None else -dlse
    else:
      delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32))
      if dlse is not None:
        delta = delta - dlse
      # +inf on fully masked rows makes every recomputed probability exp(s - lse) exactly 0.
      lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
    grads = backend.backward(q, k, v, q_seg, kv_seg, o, lse, do.astype(q.dtype), delta,
                             **kw(arrays))
    dbias = grads[3].astype(arrays.bias.dtype) if params.has_bias else None
    return (*grads[:3], None, None, FeatureArrays(bias=dbias))

  attention.defvjp(attention_fwd, attention_bwd, symbolic_zeros=True)
  return attention


def flash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    query_segment_ids: jax.Array | None = None,
    key_value_segment_ids: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    block_mask: block_sparse.BlockMask | None = None,
    deterministic: bool = False,
    return_residuals: bool = False,
    implementation: Implementation | None = None,
    config: Any = None,
):
  """Exact attention, computed blockwise without materialising the score matrix.

  Arguments and layout follow `jax.nn.dot_product_attention`, so switching is a rename.

  Args:
    query: [B, T, H, D] (or [T, H, D] together with key and value).
    key, value: [B, S, K, D], H % K == 0 (MHA, GQA, MQA).
    bias: additive logits bias broadcastable to [B, H, T, S] (each axis 1 or full, rank <= 4, as
      in jax.nn), differentiable (its gradient is summed over broadcast axes). Dense: it costs
      T*S memory and reads; prefer the structured arguments below where they apply.
    mask: boolean, broadcastable like `bias`; True where a query may attend. Dense as well.
    scale: softmax scale, default 1/sqrt(D). A static Python float.
    is_causal: query i attends to keys 0..i, exactly as `jax.nn.dot_product_attention`, also
      when T != S (top-left alignment: the mask is the top-left corner of a square causal mask).
    query_seq_lengths, key_value_seq_lengths: int32 [B] valid lengths of right-padded sequences.
    query_segment_ids, key_value_segment_ids: int32 [B, T] / [B, S]; a query attends only to keys
      of its own segment (packed documents). key_value_segment_ids defaults to query_segment_ids
      when T == S.
    local_window_size: sliding-window attention as in jax.nn: an int w (= (w, w)) or (left,
      right); query i sees keys i - left .. i + right. Combines with is_causal and segment ids.
      Key blocks outside the band are skipped: cost grows with T * window, not T * S.
    logits_soft_cap: c > 0 replaces each scaled logit s by c * tanh(s / c) (Gemma 2, Grok).
    alibi_slopes: float [H]: adds -slope[h] * |i - j| to the logits (ALiBi), computed in the
      kernels so no [T, S] bias exists. Slopes get no gradient.
    dropout_rate, dropout_rng: dropout on the attention probabilities with a JAX PRNG key. The
      mask is a hash of (key, batch, head, row, column), regenerated by the backward and the
      same on every implementation and block size (`pallas_flash.dropout.keep_mask`).
    block_mask: a `pallas_flash.BlockMask` built from mask functions (CausalMask, LocalMask,
      SegmentMask, PrefixLMMask and their & / | combinations): kernels visit only its active
      blocks and apply the element mask on partial ones only. Replaces is_causal,
      local_window_size, segment ids, lengths and `mask` (combining them raises); its block
      sizes are the kernels' (see docs/features.md). Not supported by "mosaic".
    deterministic: True guarantees bitwise-identical gradients run to run. Every default path
      gives them but one: the Mosaic backward of long head-dim-128 calls (causal: at least 8K
      keys and at most 8 batch entries; non-causal: at least 2K keys, a multiple of 128, at
      most 16 entries; no segment ids, window or soft cap) is the single fused kernel, which
      sums dQ with float32 atomics in a varying order, as cuDNN's backward does; True runs the
      split backward there instead, and rejects a config with `fused_backward=True`.
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
                       key_value_segment_ids=key_value_segment_ids, bias=bias, mask=mask,
                       local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
                       alibi_slopes=alibi_slopes, dropout_rate=dropout_rate,
                       dropout_rng=dropout_rng, block_mask=block_mask,
                       deterministic=deterministic)
  name = _choose(call.info, implementation, config)
  args = (call.q, call.k, call.v, call.q_seg, call.kv_seg)
  if name == "reference":
    o, lse = attention_reference(*args, params=call.info.params, arrays=call.arrays)
  else:
    o, lse = _differentiable(name, call.info.params, config)(*args, call.arrays)
  if call.unbatched:
    o, lse = o[0], lse[0]
  return (o, lse) if return_residuals else o
