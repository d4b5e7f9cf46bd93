"""FP8 (float8_e4m3fn) attention: descale factors, quantisation, the Hadamard rotation, and
how FP8 calls run (`pallas_flash.api` routes `flash_attention`'s FP8 calls and
`quantized_attention` here).

`flash_attention(q8, k8, v8, descale=Fp8Scales(...))` takes e4m3 query/key/value whose real
values are `float32(x8) * scale`. On a Hopper GPU, causal or full attention at head dim 64,
128 or 256 (one head dim for q, k and v) with per-tensor or per-(batch, head) scales runs the
Mosaic FP8 forward (`pallas_flash.mosaic_gpu`, sm90/fp8_forward.py: both matmuls as FP8
wgmma, P rounded to e4m3), chosen automatically or with implementation="mosaic"; named, it
also runs soft caps, windows and segment ids / lengths (not yet measured on the GPU, so
implementation=None leaves those to the reference semantics). Every other FP8 call (other
implementations, per-block scales, bias, masks, dropout, sinks, other head dims, other GPUs)
runs the reference semantics: the inputs dequantized to float32 and the float32 attention on
them (`triton` on a GPU, `xla` on CPU), the output cast to `out_dtype` (bfloat16 by default);
`explain` says which and why.

Scales, per input x [B, N, heads, D] (drop B for rank-3 inputs), float32:
  []                    one per tensor
  [B, heads]            one per (batch, head)
  [B, ceil(N/block), heads]  one per `block` positions of each head (Fp8Scales.block)
The Mosaic kernel folds the q and k scales into the softmax scale per (batch, head) and
applies the v scale to the output; per-block scales run the reference semantics.

Gradients: `flash_attention` refuses to differentiate FP8 inputs or their scales (an e4m3
cotangent flushes everything below 2**-9 to zero, and an FP8 array is a quantised copy, not a
parameter). Training goes through `pallas_flash.quantized_attention(q, k, v, ...)`: it takes
the bf16 activations, quantises them (`quantize`) and differentiates straight through the
quantiser: its gradient is the attention's gradient at the dequantized values, carried to q, k,
v as if quantisation were the identity (through the rotation when `rotate=True`). On a Hopper
GPU (causal or full attention, head dim 64, 128 or 256, per-tensor or per-(batch, head)
scales) its forward is the Mosaic FP8 forward and its backward our bf16 Mosaic backward on the
dequantized values in bf16, recomputing from the FP8 forward's output and lse; elsewhere a
backend's float32 forward and backward on the dequantized values (`_training_plan`,
docs/fp8.md "Training").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import custom_vjp_primal_tree_values

from pallas_flash import _tiling, backends, core, validation
from pallas_flash.call import FeatureArrays
from pallas_flash.context_parallel import sharding as _cp_sharding

__all__ = ["E4M3_MAX", "Fp8Scales", "dequantize", "hadamard_rotation", "quantize"]

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448: quantize maps each scale group's max here
LOG2E = math.log2(math.e)
_OUT_DTYPES = tuple(jnp.dtype(t) for t in (jnp.bfloat16, jnp.float16, jnp.float32))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "k", "v"],
                   meta_fields=["block"])
@dataclasses.dataclass(frozen=True)
class Fp8Scales:
  """Descale factors of FP8 query/key/value: the real value of an entry is float(x8) * scale.

  q: [] | [B, H] | [B, ceil(T/block), H]; k, v: [] | [B, K] | [B, ceil(S/block), K]
  (float32; see the module docstring). block: positions per scale of the per-block layout
  (static), None when no scale is per block. `descale=(q, k, v)` is the same with block=None.
  """

  q: Any
  k: Any
  v: Any
  block: int | None = None


# ---------------------------------------------------------------------------------------------
# Scales and quantisation


def _scale_layout(scale_ndim: int, x_ndim: int) -> str:
  return {0: "tensor", x_ndim - 2: "head", x_ndim - 1: "block"}.get(scale_ndim, "bad")


def _broadcast_scale(scale, shape: tuple[int, ...], block: int | None):
  """`scale` broadcastable against x of `shape` [*B, N, heads, D] (float32)."""
  scale = jnp.asarray(scale, jnp.float32)
  layout = _scale_layout(scale.ndim, len(shape))
  if layout == "tensor":
    return scale
  if layout == "head":  # [*B, heads]
    return scale[..., None, :, None]
  return jnp.repeat(scale, block, axis=-2)[..., :shape[-3], :, None]  # [*B, N, heads, 1]


def dequantize(x8, scale, block: int | None = None) -> jax.Array:
  """float32(x8) * scale, with `scale` in one of the layouts of the module docstring."""
  # The barrier keeps the e4m3 rounding: with excess precision allowed (XLA's GPU default),
  # a convert pair f32 -> e4m3 -> f32 in one computation may be folded away.
  x8 = jax.lax.optimization_barrier(x8)
  return x8.astype(jnp.float32) * _broadcast_scale(scale, x8.shape, block)


def _quantize_one(x, block) -> tuple[jax.Array, jax.Array]:
  """(e4m3 x / scale, scale) with each group's max |x| mapped to E4M3_MAX."""
  x = x.astype(jnp.float32)
  if block is None:
    amax = jnp.max(jnp.abs(x))
  elif block == "head":
    amax = jnp.max(jnp.abs(x), axis=(-3, -1))  # [*B, heads]
  else:
    n = x.shape[-3]
    blocks = -(-n // block)
    pad = [(0, 0)] * (x.ndim - 3) + [(0, blocks * block - n), (0, 0), (0, 0)]
    xb = jnp.pad(jnp.abs(x), pad).reshape(*x.shape[:-3], blocks, block, *x.shape[-2:])
    amax = jnp.max(xb, axis=(-3, -1))  # [*B, blocks, heads]
  scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
  return to_e4m3(x, _broadcast_scale(scale, x.shape, block if block != "head" else None)), scale


def to_e4m3(x, scale) -> jax.Array:
  """e4m3 of float32(x) / scale (broadcasting), rounded to nearest and clipped to ±E4M3_MAX:
  e4m3fn has no infinity, and a quotient rounding just above 448 would become NaN. The inverse
  of `dequantize` up to e4m3's rounding."""
  return jnp.clip(x.astype(jnp.float32) / scale, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def hadamard_rotation(head_dim: int, key: jax.Array | None = None) -> jax.Array:
  """A random orthogonal [D, D] float32 matrix diag(signs) @ H / sqrt(D), H the Sylvester
  Hadamard matrix and signs random ±1 (FA3's incoherent processing). The same rotation on Q
  and K leaves Q·Kᵀ unchanged and spreads an outlier over all D entries of its row.
  key: a JAX PRNG key for the signs; None uses jax.random.key(0)."""
  return _signed_hadamard(head_dim, key) / math.sqrt(head_dim)


def _signed_hadamard(head_dim: int, key: jax.Array | None) -> jax.Array:
  """diag(signs) @ H, [D, D] float32 of ±1: hadamard_rotation times sqrt(D)."""
  if head_dim < 1 or head_dim & (head_dim - 1):
    raise ValueError(f"the Hadamard rotation needs a power-of-two `head_dim` (64, 128, 256), "
                     f"got {head_dim}; quantize with rotate=False.")
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < head_dim:
    h = np.block([[h, h], [h, -h]])
  key = jax.random.key(0) if key is None else key
  signs = jax.random.rademacher(key, (head_dim,), jnp.float32)
  return signs[:, None] * jnp.asarray(h)


def _rotate(x, signed) -> jax.Array:
  """x [..., D] @ hadamard_rotation(D, key), float32, given signed = _signed_hadamard(D, key).
  A 16-bit x multiplies the ±1 entries in its own dtype (exact products, float32 sums: a
  tensor-core matmul on a GPU, where a float32 product at HIGHEST precision is not) and
  divides by sqrt(D) after; a float32 x takes the float32 product."""
  d = x.shape[-1]
  if x.dtype in (jnp.bfloat16, jnp.float16):
    return jnp.einsum("...d,de->...e", x, signed.astype(x.dtype),
                      preferred_element_type=jnp.float32) / math.sqrt(d)
  return jnp.einsum("...d,de->...e", x.astype(jnp.float32), signed / math.sqrt(d),
                    precision=jax.lax.Precision.HIGHEST)


def _check_block_option(block) -> None:
  if block is None or block == "head":
    return
  if not validation.is_int(block) or block < 1:
    raise ValueError(f"`block` must be None (one scale per tensor), \"head\" (per batch and "
                     f"head) or a positive int (per that many positions of each head), got "
                     f"{block!r}.")


def quantize(q, k, v, *, rotate: bool = False, block: int | str | None = None,
             key: jax.Array | None = None) -> tuple[tuple[jax.Array, ...], Fp8Scales]:
  """bf16 (or any float) q, k, v -> ((q8, k8, v8) in float8_e4m3fn, Fp8Scales).

  Each scale group's max |x| maps to 448, e4m3's max; `flash_attention(*fp8, descale=scales)`
  then attends on them. Args:
    q, k, v: [B, T, H, D], [B, S, K, D], [B, S, K, Dv] (or rank 3 without B).
    rotate: multiply q and k by one random orthogonal Hadamard rotation along head_dim first
      (`hadamard_rotation`; power-of-two D). Q·Kᵀ, and so the attention, is unchanged, while
      outliers spread over their rows and quantise more finely. v is not rotated.
    block: None: one scale per tensor; "head": per (batch, head); an int n: per n sequence
      positions of each head (FA3's block quantisation; match the kernel's blocks, e.g. 128).
    key: PRNG key of the rotation's signs (None: jax.random.key(0)).
  """
  _check_block_option(block)
  _check_float_inputs(q, k, v)
  if rotate:
    signed = _signed_hadamard(q.shape[-1], key)
    q, k = _rotate(q, signed), _rotate(k, signed)
  (q8, sq), (k8, sk), (v8, sv) = (_quantize_one(x, block) for x in (q, k, v))
  return (q8, k8, v8), Fp8Scales(sq, sk, sv, int(block) if validation.is_int(block) else None)


# ---------------------------------------------------------------------------------------------
# Checks


def _check_float_inputs(q, k, v) -> None:
  """`quantize`'s inputs: float arrays of rank 3 or 4, one rank for all three, none empty (a
  max over nothing has no scale). Their dtypes may differ: each becomes e4m3."""
  for name, x in zip(_NAMES, (q, k, v)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"`{name}` must be a jax or numpy array, got {type(x).__name__}.")
    if x.ndim not in (3, 4):
      raise ValueError(f"`{name}` must have rank 4 [batch, length, heads, head_dim] (or 3 "
                       f"without batch), got shape {tuple(x.shape)}.")
    if not jnp.issubdtype(x.dtype, jnp.floating) or _is_fp8(x):
      raise TypeError(f"`{name}` must be a bf16, f16 or f32 array to quantise, got {x.dtype}.")
    if x.size == 0:
      raise ValueError(f"`{name}` is empty (shape {tuple(x.shape)}): nothing to quantise.")
  if len({x.ndim for x in (q, k, v)}) > 1:
    raise ValueError(f"`query`, `key` and `value` must share one rank (all batched or none), "
                     f"got shapes {[tuple(x.shape) for x in (q, k, v)]}.")


def _is_fp8(x) -> bool:
  dtype = getattr(x, "dtype", None)
  return (dtype is not None and jnp.issubdtype(dtype, jnp.floating)
          and jnp.dtype(dtype).itemsize == 1)


def is_fp8_call(query, key, value, descale, out_dtype) -> bool:
  """Whether flash_attention hands the call to this module."""
  return (descale is not None or out_dtype is not None
          or any(_is_fp8(x) for x in (query, key, value)))


_NAMES = ("query", "key", "value")


def _check_scale(name: str, scale, x, block, heads_name: str):
  if not hasattr(scale, "shape") or not hasattr(scale, "dtype"):
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
      scale = np.float32(scale)
    else:
      raise TypeError(f"`{name}` must be a float32 scalar or array, got "
                      f"{type(scale).__name__}.")
  if not jnp.issubdtype(scale.dtype, jnp.floating):
    raise TypeError(f"`{name}` must be a float array (float32), got {scale.dtype}.")
  *b, n, h, _ = x.shape
  layouts = {"tensor": (), "head": (*b, h)}
  if block is not None:
    layouts["block"] = (*b, -(-n // block), h)
  if tuple(scale.shape) not in layouts.values():
    per_block = (f"[{', '.join(map(str, (*b, f'ceil({n}/block)', h)))}] per block with "
                 "Fp8Scales(..., block=n)" if block is None else
                 f"{layouts['block']} per block of {block}")
    raise ValueError(
        f"`{name}` has shape {tuple(scale.shape)}; for an input of shape {tuple(x.shape)} a "
        f"scale is [] per tensor, {layouts['head']} per (batch, {heads_name}), or "
        f"{per_block}.")
  if not isinstance(scale, jax.core.Tracer) and not isinstance(scale, jax.ShapeDtypeStruct):
    values = np.asarray(scale, np.float32)
    if not (np.isfinite(values).all() and (values > 0).all()):
      raise ValueError(f"`{name}` must be finite and positive (a descale factor multiplies "
                       f"the FP8 values), got values in [{values.min()}, {values.max()}].")
  return scale


def check_call(query, key, value, descale, out_dtype) -> tuple[Fp8Scales, Any]:
  """The FP8 call's arguments checked: (scales, out dtype); each error names the argument."""
  arrays = dict(zip(_NAMES, (query, key, value)))
  fp8 = [n for n, x in arrays.items() if _is_fp8(x)]
  if not fp8:
    which = "`descale`" if descale is not None else "`out_dtype`"
    raise ValueError(
        f"{which} applies to float8_e4m3fn inputs only, but query/key/value are "
        f"{getattr(query, 'dtype', type(query).__name__)}: drop it (cast the output yourself), "
        "or quantise them with pallas_flash.fp8.quantize(q, k, v).")
  for name, x in arrays.items():
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"`{name}` must be a jax or numpy array, got {type(x).__name__}.")
    if len(x.shape) not in (3, 4):
      raise ValueError(f"`{name}` must have rank 4 [batch, seq_len, num_heads, head_dim] (or "
                       f"rank 3 without batch), got shape {tuple(x.shape)}.")
    if name not in fp8:
      raise TypeError(
          f"`{name}` is {x.dtype} while {', '.join(f'`{n}`' for n in fp8)} "
          f"{'is' if len(fp8) == 1 else 'are'} FP8: FP8 attention takes query, key and value "
          "all in float8_e4m3fn; quantise all three with pallas_flash.fp8.quantize(q, k, v).")
    if jnp.dtype(x.dtype) != E4M3:
      raise TypeError(
          f"`{name}` is {x.dtype}, but FP8 attention takes float8_e4m3fn (3 mantissa bits; "
          "e5m2 and the other float8 formats are for gradients or other hardware); quantise "
          "with pallas_flash.fp8.quantize(q, k, v).")
  if descale is None:
    raise ValueError("float8 query/key/value need `descale`: "
                     "descale=(q_scale, k_scale, v_scale) or a pallas_flash.fp8.Fp8Scales, as "
                     "returned by pallas_flash.fp8.quantize (use (1.0, 1.0, 1.0) for values "
                     "already at scale).")
  if isinstance(descale, (tuple, list)):
    if len(descale) != 3:
      raise ValueError(f"`descale` must be (q_scale, k_scale, v_scale), got {len(descale)} "
                       "entries.")
    descale = Fp8Scales(*descale)
  if not isinstance(descale, Fp8Scales):
    raise TypeError(f"`descale` must be a (q_scale, k_scale, v_scale) tuple or a "
                    f"pallas_flash.fp8.Fp8Scales, got {type(descale).__name__}.")
  block = descale.block
  validation.check_positive_int("descale.block", block, none="one scale per tensor")
  block = None if block is None else int(block)
  scales = [_check_scale(f"descale.{f}", getattr(descale, f), x, block, heads)
            for f, x, heads in (("q", query, "query head"), ("k", key, "kv head"),
                                ("v", value, "kv head"))]
  out = jnp.bfloat16 if out_dtype is None else out_dtype
  try:
    out = jnp.dtype(out)
  except TypeError:
    out = None
  if out not in _OUT_DTYPES:
    raise TypeError(f"`out_dtype` must be bfloat16, float16 or float32, got {out_dtype!r}.")
  return Fp8Scales(*scales, block), out


# ---------------------------------------------------------------------------------------------
# flash_attention and explain on FP8 inputs (pallas_flash.api hands FP8 calls here)

_NO_GRAD = (
    "flash_attention has no gradient with respect to float8 inputs or their descale factors: "
    "an e4m3 cotangent would flush every gradient below 2**-9 to zero, and an FP8 array is a "
    "quantised copy, not a parameter. To train through FP8 attention, differentiate the bf16 "
    "activations with pallas_flash.quantized_attention(q, k, v, ...): its backward is "
    "straight-through (the attention's gradient at the dequantized values).")


@jax.custom_vjp
def dequantize_inputs(q8, k8, v8, scales: Fp8Scales):
  """(q, k, v) float32 of FP8 inputs, refusing to be differentiated (_NO_GRAD)."""
  return tuple(dequantize(x, s, scales.block)
               for x, s in ((q8, scales.q), (k8, scales.k), (v8, scales.v)))


def _dequantize_fwd(q8, k8, v8, scales):
  return dequantize_inputs(q8, k8, v8, scales), None


def _dequantize_bwd(_, cotangents):
  raise TypeError(_NO_GRAD)


dequantize_inputs.defvjp(_dequantize_fwd, _dequantize_bwd)


def _float_call_info(query, key, value, kwargs, dtype=jnp.float32):
  """CallInfo of the float32 (or `dtype`) form of an FP8 call (shapes, features, device)."""
  kw = {n: x for n, x in kwargs.items() if n in validation.DEFAULTS}
  shapes = [jax.ShapeDtypeStruct(x.shape, dtype) for x in (query, key, value)]
  return validation.abstract_call_info(*shapes, validation.with_defaults(kw))


def mosaic_reason(query, key, value, scales: Fp8Scales, out, kwargs, *, named: bool = True,
                  features: bool = True) -> str | None:
  """Why the Mosaic FP8 forward cannot run this (checked) FP8 call, or None when it can.
  named False: implementation=None, which also leaves it the calls not yet measured on the
  GPU (mosaic_gpu.fp8_unmeasured_reason: soft caps, windows, segment ids); features False:
  refuse those features (quantized_attention's training path)."""
  mosaic = backends.load("mosaic")
  if isinstance(mosaic, str):
    return mosaic
  if (_cp_sharding.sequence_sharding(query, key, value) is not None
      or _cp_sharding.batch_head_sharding(query) is not None):
    return ("inputs split over mesh axes: the FP8 kernel runs whole arrays only (sharded FP8 "
            "calls run the reference semantics per shard)")
  from pallas_flash import mosaic_gpu  # noqa: PLC0415
  info = _float_call_info(query, key, value, kwargs)
  layouts = {_scale_layout(len(getattr(s, "shape", ())), len(query.shape))
             for s in (scales.q, scales.k, scales.v)}
  why = mosaic_gpu.fp8_unsupported_reason(
      info, scale_layouts=layouts, out_dtype=out, config=kwargs.get("config"),
      sinks=kwargs.get("sinks") is not None, features=features)
  if why is None and not named:
    why = mosaic_gpu.fp8_unmeasured_reason(info)
  return why


def _per_head(scale, batch: int, heads: int, group: int, unbatched: bool):
  """A descale factor as [B, H] float32 per query head (kv-head scales repeated over their
  group of query heads)."""
  scale = jnp.asarray(scale, jnp.float32)
  if scale.ndim == 0:
    return jnp.broadcast_to(scale, (batch, heads))
  if unbatched:
    scale = scale[None]
  return jnp.repeat(scale, group, axis=-1) if group > 1 else scale


@functools.cache
def _mosaic_fn(params, out, config):
  """The Mosaic FP8 forward as a function of (q8, k8, v8, c [B, H], v_descale [B, H], q_seg,
  kv_seg) that refuses to be differentiated; params: the call's AttentionParams."""
  from pallas_flash import mosaic_gpu  # noqa: PLC0415

  @jax.custom_vjp
  def run(q8, k8, v8, c, v_descale, q_seg, kv_seg):
    return mosaic_gpu.fp8_forward(q8, k8, v8, c, v_descale, q_seg, kv_seg, params=params,
                                  out_dtype=out, config=config)

  def run_fwd(*args):
    return run(*args), None

  def run_bwd(_, cotangents):
    raise TypeError(_NO_GRAD)

  run.defvjp(run_fwd, run_bwd)
  return run


def _kernel_descales(scales: Fp8Scales, q8, k8, params, unbatched: bool):
  """(c, v_descale) [B, H] of the Mosaic FP8 forward: c = q descale · k descale · softmax
  scale · log2 e, folded into its exp2; v_descale scales its output. q8, k8 batched."""
  b, _, h, _ = q8.shape
  group = h // k8.shape[2]
  c = (_per_head(scales.q, b, h, 1, unbatched) * _per_head(scales.k, b, h, group, unbatched)
       * (params.scale * LOG2E))
  return c, _per_head(scales.v, b, h, group, unbatched)


_INDEX_ARGS = ("query_seq_lengths", "key_value_seq_lengths", "query_segment_ids",
               "key_value_segment_ids")


def _canonical_call(query, key, value, kwargs) -> validation.Call:
  """The float32 form of an FP8 call canonicalised without its arrays (shapes stand in for
  q, k, v): its AttentionParams and segment ids [B, T] / [B, S] (None without; sequence
  lengths folded in, validation._fold_lengths), as the kernels take them."""
  kw = validation.with_defaults({n: x for n, x in kwargs.items() if n in validation.DEFAULTS})
  if len(query.shape) == 3:  # the batch axis canonicalize would add to q, k, v and the ids
    kw.update({n: None if kw[n] is None else jnp.asarray(kw[n])[None] for n in _INDEX_ARGS})
  shapes = [jax.ShapeDtypeStruct((1,) * (4 - len(x.shape)) + tuple(x.shape), jnp.float32)
            for x in (query, key, value)]
  return validation.canonicalize(*shapes, **kw, checked=bool(kwargs.get("checked", False)))


def mosaic_attention(query, key, value, scales: Fp8Scales, out, kwargs):
  """flash_attention's result for an FP8 call the Mosaic FP8 forward runs (runs_on_mosaic)."""
  validation.check_residual_flags(kwargs.get("return_residuals", False),
                                  kwargs.get("return_residual", False),
                                  "output")
  call = _canonical_call(query, key, value, kwargs)
  params = call.info.params
  unbatched = len(query.shape) == 3
  q8, k8, v8 = (x[None] if unbatched else x for x in (query, key, value))
  c, v_descale = _kernel_descales(scales, q8, k8, params, unbatched)
  o, lse = _mosaic_fn(params, out, kwargs.get("config"))(
      q8, k8, v8, c, v_descale, call.q_seg, call.kv_seg)
  return _returned(o, lse, unbatched, kwargs)


def _returned(o, lse, unbatched: bool, kwargs: dict):
  """What flash_attention returns from o [B, T, H, Dv] and lse [B, H, T] (the batch axis
  dropped again for unbatched inputs), per `return_residual(s)` in kwargs."""
  if unbatched:
    o, lse = o[0], lse[0]
  if kwargs.get("return_residual") or kwargs.get("return_residuals"):
    return core.as_jax_nn((o, lse), bool(kwargs.get("return_residual")))
  return o


def float32_kwargs(kwargs: dict) -> dict:
  """The keyword arguments of the float32 call that runs the reference semantics: a
  MosaicConfig, which configures the FP8 kernel, is dropped (no float32 path takes it)."""
  from pallas_flash.mosaic_gpu import MosaicConfig  # noqa: PLC0415
  if isinstance(kwargs.get("config"), MosaicConfig):
    return {**kwargs, "config": None}
  return kwargs


def runs_on_mosaic(query, key, value, scales: Fp8Scales, out, kwargs) -> bool:
  """Whether the Mosaic FP8 forward runs this checked FP8 call (implementation None or
  "mosaic"; when named and it cannot, a NotImplementedError says why). Otherwise the call
  runs on the dequantized inputs (dequantize_inputs, float32_kwargs, cast_output)."""
  implementation = kwargs.get("implementation")
  if implementation not in (None, "mosaic"):
    return False
  why = mosaic_reason(query, key, value, scales, out, kwargs, named=implementation == "mosaic")
  if why is not None and implementation == "mosaic":
    raise NotImplementedError(f"implementation='mosaic' cannot run this call: {why}.")
  return why is None


def cast_output(result, out):
  """flash_attention's result (o, or (o, lse)) with o cast to `out`."""
  if isinstance(result, tuple):  # return_residuals: (o, lse)
    return (result[0].astype(out), *result[1:])
  return result.astype(out)


@dataclasses.dataclass(frozen=True)
class Fp8Explanation(core.Explanation):
  """An `Explanation` of an FP8 call, with a first line saying how FP8 runs today."""

  fp8: str = ""

  def __str__(self) -> str:
    return self.fp8 + "\n" + super().__str__()


def explain_fp8(query, key, value, **kwargs) -> Fp8Explanation:
  """`explain` of an FP8 call: the Mosaic FP8 forward where it applies, else that of the
  float32 call it runs (the reference semantics), with the Mosaic kernel's reason."""
  descale, out_dtype = kwargs.pop("descale", None), kwargs.pop("out_dtype", None)
  scales, out = check_call(query, key, value, descale, out_dtype)
  why = mosaic_reason(query, key, value, scales, out, kwargs, named=False)
  f32 = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (query, key, value)]
  config = kwargs.get("config")
  base = core.explain(*f32, **float32_kwargs(kwargs))
  layouts = sorted({_scale_layout(len(getattr(s, "shape", ())), len(query.shape))
                    for s in (scales.q, scales.k, scales.v)})
  head = f"FP8 (float8_e4m3fn, scales per {'/'.join(layouts)})"
  fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
  when_named = mosaic_reason(query, key, value, scales, out, kwargs)
  fields["reasons"] = {**base.reasons, "mosaic": why}
  fields["reasons_when_named"] = {**base.reasons_when_named, "mosaic": when_named}
  if why is None:
    from pallas_flash.mosaic_gpu.sm90 import fp8_forward  # noqa: PLC0415
    block = (2 * fp8_forward.BLOCK_Q, fp8_forward.block_kv(query.shape[-1], config))
    info = _float_call_info(query, key, value, kwargs)
    fields.update(chosen="mosaic", config=config, block_shape=block,
                  blocks_computed=_tiling.fraction_computed(
                      q_len=info.q_len, kv_len=info.kv_len, block_q=block[0],
                      block_kv=block[1], band=info.params.band))
    note = (f"{head}: the Mosaic FP8 forward (e4m3 wgmma for Q·Kᵀ and P·V, fp32 softmax), "
            f"output {out.name}; forward only")
  else:
    what = (f"the Mosaic FP8 forward runs it when named ({why})" if when_named is None else
            f"the Mosaic FP8 kernel cannot run it ({why})")
    note = (f"{head}: {what}; the inputs are dequantized to float32 and run as below (the "
            f"reference semantics), the output cast to {out.name}")
  return Fp8Explanation(**fields, fp8=note)


# ---------------------------------------------------------------------------------------------
# bf16 activations to FP8 attention in one differentiable call


@jax.custom_vjp
def _straight_through(x, x_hat):
  """x_hat forward; the cotangent goes to x unchanged (quantisation treated as identity)."""
  return x_hat


def _straight_through_fwd(x, x_hat):
  return x_hat, jnp.zeros((0,), x.dtype)  # residual: x's dtype only


def _straight_through_bwd(res, g):
  return g.astype(res.dtype), None


_straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)


@dataclasses.dataclass(frozen=True)
class _TrainingPlan:
  """How quantized_attention's custom_vjp runs a call (static, hashable).

  fp8_kernel True: the Mosaic FP8 forward (with `fp8_config`), then `name`'s ("mosaic")
  backward on the dequantized inputs in bfloat16 with `config`. False: `name`'s forward and
  backward on the dequantized inputs in float32 (the reference semantics)."""

  name: str
  params: Any
  config: Any
  fp8_kernel: bool
  fp8_config: Any = None

  @property
  def grad_dtype(self):
    return jnp.dtype(jnp.bfloat16 if self.fp8_kernel else jnp.float32)


def _dequantized(q8, k8, v8, scales: Fp8Scales, dtype) -> tuple[jax.Array, ...]:
  return tuple(dequantize(x, s, scales.block).astype(dtype)
               for x, s in ((q8, scales.q), (k8, scales.k), (v8, scales.v)))


@functools.cache
def _training_attention(plan: _TrainingPlan, out, block):
  """(q, k, v) [B, ...] -> (o in `out`, lse [B, H, T]): `quantize(q, k, v, block=block)`, then
  attention on the quantised values as `plan` says, under one custom_vjp whose backward is
  core.backward_from_residuals (flash_attention's) on the dequantized values, the gradients
  straight through the quantiser to q, k, v in their dtypes."""
  from pallas_flash import mosaic_gpu  # noqa: PLC0415
  backend = backends.load(plan.name)
  params = plan.params

  def forward(q, k, v):
    (q8, k8, v8), scales = quantize(q, k, v, block=block)
    if plan.fp8_kernel:
      c, v_descale = _kernel_descales(scales, q8, k8, params, unbatched=False)
      o, lse = mosaic_gpu.fp8_forward(q8, k8, v8, c, v_descale, params=params, out_dtype=out,
                                      config=plan.fp8_config)
    else:
      o, lse = backend.forward(*_dequantized(q8, k8, v8, scales, plan.grad_dtype), None, None,
                               params=params, config=plan.config)
    return o, lse, (q8, k8, v8, scales)

  @jax.custom_vjp
  def attention(q, k, v):
    o, lse, _ = forward(q, k, v)
    return o.astype(out), lse

  def attention_fwd(*primals):
    q, k, v = custom_vjp_primal_tree_values(primals)
    o, lse, quantized = forward(q, k, v)
    o, lse = checkpoint_name((o, lse), core.CHECKPOINT_NAME)
    dtypes = tuple(jnp.zeros((0,), x.dtype) for x in (q, k, v))  # the inputs' dtypes only
    return (o.astype(out), lse), (dtypes, quantized, o, lse)

  def attention_bwd(res, cotangents):
    dtypes, (q8, k8, v8, scales), o, lse = res
    deq = _dequantized(q8, k8, v8, scales, plan.grad_dtype)
    grads = core.backward_from_residuals(
        backend, params, plan.config,
        (*deq, None, None, FeatureArrays(), o.astype(plan.grad_dtype), lse), cotangents)
    return tuple(g.astype(d.dtype) for g, d in zip(grads[:3], dtypes))

  attention.defvjp(attention_fwd, attention_bwd, symbolic_zeros=True)
  return attention


def _training_plan(inputs, scales: Fp8Scales, out, kwargs) -> _TrainingPlan | None:
  """How quantized_attention runs on the (rotated) `inputs` whose quantised scales are
  `scales`: the Mosaic FP8 forward and bf16 backward where both run the call (implementation
  None or "mosaic"), else a backend's forward and backward on the float32 dequantized values
  for causal or full attention; None for the rest (features, segment ids, sinks, sharded
  inputs, implementation="reference"), which run flash_attention on the dequantized values."""
  implementation = kwargs.get("implementation")
  backends.check_implementation(implementation)
  if implementation in (None, "mosaic"):
    why = mosaic_reason(*inputs, scales, out, kwargs, features=False)
    if why is None:
      info = _float_call_info(*inputs, kwargs, jnp.bfloat16)  # the bf16 backward's call
      config = kwargs.get("config")
      why = backends.reason("mosaic", info, config)
      if why is None:
        return _TrainingPlan("mosaic", info.params,
                             backends.resolve_config("mosaic", info, config), True, config)
      why = f"the bf16 Mosaic backward cannot run the call: {why}"
    if implementation == "mosaic":
      raise NotImplementedError(f"implementation='mosaic' cannot run this call: {why}.")
  if (_cp_sharding.sequence_sharding(*inputs) is not None
      or _cp_sharding.batch_head_sharding(inputs[0]) is not None):
    return None
  kwargs = float32_kwargs(kwargs)
  info = _float_call_info(*inputs, kwargs)
  if info.params.features or info.params.has_segments or kwargs.get("sinks") is not None:
    return None
  name = backends.choose(info, implementation, kwargs.get("config"))
  if name == "reference":
    return None
  return _TrainingPlan(name, info.params,
                       backends.resolve_config(name, info, kwargs.get("config")), False)


def training_call(q, k, v, *, rotate: bool, block, key, out_dtype, kwargs: dict):
  """(inputs, plan, out) of `pallas_flash.quantized_attention`: the (rotated) inputs, the
  `_TrainingPlan` that runs them (None: the straight-through float32 call instead,
  `straight_through_inputs`) and the output dtype. Checks the arguments."""
  _check_block_option(block)
  validation.check_residual_flags(kwargs.get("return_residuals", False),
                                  kwargs.get("return_residual", False),
                                  "output")
  inputs = [q, k, v]
  if rotate:
    signed = _signed_hadamard(q.shape[-1], key)
    inputs[:2] = (_rotate(x, signed) for x in inputs[:2])
  abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
  (q8, k8, v8), scales = jax.eval_shape(functools.partial(quantize, block=block), *abstract)
  scales, out = check_call(q8, k8, v8, scales, out_dtype)
  return inputs, _training_plan(inputs, scales, out, kwargs), out


def training_attention(plan: _TrainingPlan, inputs, out, block, kwargs: dict):
  """quantized_attention's result for the (rotated) `inputs` that `plan` runs."""
  unbatched = inputs[0].ndim == 3
  o, lse = _training_attention(plan, out, block)(
      *(x[None] if unbatched else x for x in inputs))
  return _returned(o, lse, unbatched, kwargs)


def straight_through_inputs(inputs, block) -> list[jax.Array]:
  """The (rotated) `inputs` quantised and dequantized to float32, their cotangents straight
  through to `inputs`: what quantized_attention's calls outside a `_TrainingPlan` (features,
  segment ids, sinks, sharded inputs, implementation="reference") attend on."""
  (q8, k8, v8), scales = quantize(*(jax.lax.stop_gradient(x) for x in inputs), block=block)
  deq = _dequantized(q8, k8, v8, scales, jnp.float32)
  return [_straight_through(x, x_hat) for x, x_hat in zip(inputs, deq)]
