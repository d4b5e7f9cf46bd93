"""What every test shares: one case type, one tolerance table, one comparison with the reference.

A `Case` describes one attention problem (shapes, dtype, masking and optional features);
`check_against_reference(impl, case)` runs it on an implementation and on the float32
reference from the same inputs and compares output, log-sum-exp and every gradient by relative
error against `TOLERANCES`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

import pallas_flash
from pallas_flash.mosaic_gpu import MosaicConfig, MosaicDebug

# Forward relative error max|x - ref| / max|ref| against the float32 reference computed from the
# same (possibly low-precision) inputs; gradients get twice the budget. float32 on a GPU: the
# kernels' dots run in TF32 there.
TOLERANCES = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 1.5e-2,
              jnp.dtype(jnp.float16): 3e-3, "float32 on gpu": 1e-4}
# |ref| below this counts as this much, so that references that are (nearly) zero, e.g. the
# gradient of a one-key softmax, do not turn rounding noise into a huge relative error.
REL_FLOOR = 0.05


def tolerance(dtype) -> float:
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32 and jax.default_backend() == "gpu":
    return TOLERANCES["float32 on gpu"]
  return TOLERANCES[dtype]


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem: shapes, dtype, masking and the features it turns on.

  features: names from FEATURES (window, softcap, alibi, dropout, bias, mask, ...).
  """

  batch: int = 2
  q_len: int = 128
  kv_len: int = 128
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 64
  value_head_dim: int | None = None  # None: head_dim
  dtype: type = jnp.float32
  is_causal: bool = False
  segments: bool = False
  lengths: bool = False
  features: tuple[str, ...] = ()

  @property
  def id(self) -> str:
    feats = "".join(f for f, on in (("-causal", self.is_causal), ("-seg", self.segments),
                                    ("-len", self.lengths)) if on)
    dv = "" if self.value_head_dim is None else f"v{self.value_head_dim}"
    return (f"b{self.batch}_t{self.q_len}_s{self.kv_len}_h{self.num_heads}:{self.num_kv_heads}"
            f"_d{self.head_dim}{dv}_{jnp.dtype(self.dtype).name}{feats}"
            + "".join(f"-{f}" for f in self.features))

  @property
  def seed(self) -> int:
    """A seed per case, the same in every process (str hash() is salted per process)."""
    return zlib.crc32(self.id.encode()) % 1000


def random_segments(seed, batch: int, length: int, num_docs: int = 4) -> jax.Array:
  """[batch, length] int32 non-decreasing document ids with random boundaries (seed: an int or
  a numpy Generator)."""
  starts = np.random.default_rng(seed).integers(0, max(length, 1), (batch, num_docs - 1))
  pos = np.arange(length)
  return jnp.asarray((pos[None, :, None] >= starts[:, None, :]).sum(-1), jnp.int32)


def _normal(rng: np.random.Generator, shape, dtype=jnp.float32, std: float = 1.0) -> jax.Array:
  """Normal values drawn on the host: the suite's inputs come from numpy, as each shape of
  jax.random.normal is a program of its own to compile (~0.1 s on CPU)."""
  return jnp.asarray((std * rng.standard_normal(shape, np.float32)).astype(dtype))


def to_f32(x) -> jax.Array:
  """x upcast to float32 on the host (exact), without compiling a conversion per shape."""
  return jnp.asarray(np.asarray(x, np.float32))


def _features(case: Case, rng: np.random.Generator) -> dict:
  """flash_attention's keyword arguments for the case's named features."""
  b, h, t, s = case.batch, case.num_heads, case.q_len, case.kv_len
  recipes = {
      "window": lambda: {"local_window_size": (13, 6)},
      "window_left": lambda: {"local_window_size": (24, 0)},
      "window_512": lambda: {"local_window_size": (511, 0)},
      "softcap": lambda: {"logits_soft_cap": 1.5},
      "alibi": lambda: {"alibi_slopes": jnp.asarray(2.0 ** -np.arange(1, h + 1), jnp.float32)},
      "dropout": lambda: {"dropout_rate": 0.25,
                          "dropout_rng": jax.random.key(int(rng.integers(1 << 31)))},
      "bias": lambda: {"bias": _normal(rng, (1, h, t, s))},
      "sinks": lambda: {"sinks": _normal(rng, (h,), std=2.0)},
      "bias_bcast": lambda: {"bias": _normal(rng, (b, 1, 1, s))},
      # [B, H, T, S] in the inputs' dtype: no broadcast axis, dbias in that dtype.
      "bias_full": lambda: {"bias": _normal(rng, (b, h, t, s), case.dtype)},
      # [1, H, T, S] in the inputs' dtype: a learned bias shared by the batch.
      "bias_shared": lambda: {"bias": _normal(rng, (1, h, t, s), case.dtype)},
      # Std 5: the two soft-cap orders differ by O(1) (issue 46).
      "bias_std5": lambda: {"bias": _normal(rng, (b, h, t, s), std=5.0)},
      "cap_then_bias": lambda: {"logits_soft_cap_order": "cap_then_bias"},
      "bias_then_cap": lambda: {"logits_soft_cap_order": "bias_then_cap"},
      "mask": lambda: {"mask": jnp.asarray(rng.random((b, 1, t, s)) < 0.8)},
      # Every 7th query row sees no key: o = 0 and zero gradients there.
      "mask_empty_rows": lambda: {"mask": jnp.asarray(
          (rng.random((b, 1, t, s)) < 0.8) & (np.arange(t) % 7 != 3)[None, None, :, None])},
      # Ids in no order: no key block can be skipped.
      "unsorted_segments": lambda: {
          "query_segment_ids": jnp.asarray(rng.integers(0, 3, (b, t)), jnp.int32),
          "key_value_segment_ids": jnp.asarray(rng.integers(0, 3, (b, s)), jnp.int32)},
  }
  kwargs = {}
  for name in case.features:
    kwargs.update(recipes[name]())
  return kwargs


def make_inputs(case: Case, seed: int | None = None) -> tuple[tuple[jax.Array, ...], dict]:
  """Fresh random q, k, v, a cotangent and the keyword arguments of the case's masking and
  features (seed: the case's own by default)."""
  seed = case.seed if seed is None else seed
  rngs = [np.random.default_rng([seed, i]) for i in range(9)]
  dv = case.head_dim if case.value_head_dim is None else case.value_head_dim
  b, t, s = case.batch, case.q_len, case.kv_len
  q = _normal(rngs[0], (b, t, case.num_heads, case.head_dim), case.dtype)
  k = _normal(rngs[1], (b, s, case.num_kv_heads, case.head_dim), case.dtype)
  v = _normal(rngs[2], (b, s, case.num_kv_heads, dv), case.dtype)
  do = _normal(rngs[3], (b, t, case.num_heads, dv), case.dtype)
  kwargs: dict = {"is_causal": case.is_causal}
  if case.segments:
    # Same boundaries in positions for q and kv when lengths match (self-attention packing).
    kwargs["query_segment_ids"] = random_segments(rngs[4], b, t)
    kwargs["key_value_segment_ids"] = (kwargs["query_segment_ids"] if t == s
                                       else random_segments(rngs[5], b, s))
  if case.lengths:
    kwargs["query_seq_lengths"] = jnp.asarray(rngs[6].integers(0, t + 1, (b,)), jnp.int32)
    kwargs["key_value_seq_lengths"] = jnp.asarray(rngs[7].integers(1, s + 1, (b,)), jnp.int32)
  kwargs.update(_features(case, rngs[8]))
  return (q, k, v, do), kwargs


def assert_close_to_ref(name: str, x, ref, tol: float, *, poisoned: bool = False) -> None:
  """Fails with the max error, where it is and the values there. NaN never passes, in x or in
  the reference (a NaN reference compares with nothing: NaN against NaN would pass), and x's
  infinities must be the reference's, sign included (+inf for -inf is a wrong lse).
  poisoned: the reference's NaN are poison that the call must leave as it found it (a KV
  cache's unwritten slots): x must hold NaN exactly there."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  assert x.shape == ref.shape, f"{name}: shape {x.shape} != reference {ref.shape}"
  if not poisoned:
    assert not np.isnan(ref).any(), (
        f"{name}: the reference has {np.isnan(ref).sum()} NaN elements, first at "
        f"{np.argwhere(np.isnan(ref))[0].tolist()}")
  bad_nan = np.isnan(x) != np.isnan(ref)
  assert not bad_nan.any(), (f"{name}: {bad_nan.sum()} NaN elements where the reference has "
                             f"none or none where it has poison, first at "
                             f"{np.argwhere(bad_nan)[0].tolist()}")
  finite = np.isfinite(ref)
  bad_inf = np.where(np.isinf(x), x, 0.0) != np.where(np.isinf(ref), ref, 0.0)
  assert not bad_inf.any(), (f"{name}: {bad_inf.sum()} infinities differ from the reference's, "
                             f"first at {np.argwhere(bad_inf)[0].tolist()}")
  err = np.abs(np.where(finite, x, 0.0) - np.where(finite, ref, 0.0))
  denom = max(np.abs(np.where(finite, ref, 0.0)).max(), REL_FLOOR)
  worst = np.unravel_index(np.argmax(err), err.shape)
  rel = err.max() / denom
  assert rel <= tol, (f"{name}: rel err {rel:.3g} > {tol:.3g} at {list(worst)}: "
                      f"got {x[worst]:.6g}, want {ref[worst]:.6g}")


def assert_matches_reference(result, ref, tol: float, *, names=("dq", "dk", "dv"),
                             dtype=None) -> None:
  """`run`'s ((o, lse), grads) against the reference's, by the suite's one rule: the output at
  tol, the lse at max(tol, 1e-5), each gradient (named by `names`, as many as there are) at
  2 * tol. dtype: the dtype o, dq, dk and dv must have (None: not checked)."""
  (o, lse), grads = result
  (o_ref, lse_ref), grads_ref = ref
  if dtype is not None:
    assert o.dtype == dtype, f"out dtype {o.dtype}"
  assert_close_to_ref("out", o, o_ref, tol)
  assert_close_to_ref("lse", lse, lse_ref, max(tol, 1e-5))
  assert len(grads) == len(grads_ref) == len(names), (len(grads), len(grads_ref), names)
  for name, g, g_ref in zip(names, grads, grads_ref):
    assert g.shape == g_ref.shape, f"{name}: shape {g.shape} != {g_ref.shape}"
    if dtype is not None and name in ("dq", "dk", "dv"):
      assert g.dtype == dtype, f"{name} dtype {g.dtype}"
    assert_close_to_ref(name, g, g_ref, 2 * tol)


# The key of `run`'s lse cotangent.
LSE_COTANGENT_SEED = 7
# Differentiable keyword arguments: their gradients are compared too, in this order.
DIFFERENTIABLE_KWARGS = ("bias", "sinks")


def split_arrays(kwargs: dict) -> tuple[dict, dict]:
  """(the keyword arguments that are arrays or pytrees of them, e.g. rotary tables, the rest)."""
  def is_arrays(x):
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(isinstance(leaf, jax.Array) for leaf in leaves)
  arrays = {n: x for n, x in kwargs.items() if is_arrays(x)}
  return arrays, {n: x for n, x in kwargs.items() if n not in arrays}


def jitted(fn, **static):
  """fn jit-compiled with `static` bound, array arguments traced and every other keyword static:
  one program instead of the hundreds of small ones an op-by-op call compiles (each ~30 ms on
  CPU, most of it XLA's per-compile set-up), traced once per shapes and static keywords."""
  @functools.partial(jax.jit, static_argnames="closed")
  def program(args, traced, closed):
    return fn(*args, **traced, **dict(closed), **static)

  def call(*args, **kwargs):
    traced, closed = split_arrays(kwargs)
    return program(args, traced, closed=tuple(sorted(closed.items())))

  return call


def run(impl: str, q, k, v, do, *, config=None, **kwargs):
  """(o, lse) and the gradients (dq, dk, dv[, dbias][, dsinks]) of sum(o * do) for one
  implementation."""
  extra = {n: kwargs.pop(n) for n in DIFFERENTIABLE_KWARGS if kwargs.get(n) is not None}

  def f(q, k, v, extra):
    return pallas_flash.flash_attention(q, k, v, implementation=impl, config=config,
                                        return_residuals=True, **extra, **kwargs)

  # One jit-compiled program: run op by op, each of the forward's and backward's hundreds of
  # small operations is compiled on its own, which costs more than the whole program's compile.
  @jax.jit
  def forward_and_grads(q, k, v, do, extra, dlse):
    (o, lse), vjp = jax.vjp(f, q, k, v, extra)
    return (o, lse), vjp((do, jnp.where(jnp.isfinite(lse), dlse, 0.0)))

  # A cotangent for the lse [B, H, T] too (the same for every implementation: fixed seed, zero
  # on rows that see no key), so the backward's dlse path is checked by every case. Drawn on
  # the host: jax.random's generator in the program took ~15 % of the reference's compile.
  b, t, h = q.shape[:3]
  dlse = _normal(np.random.default_rng(LSE_COTANGENT_SEED), (b, h, t))
  (o, lse), (dq, dk, dv, dextra) = forward_and_grads(q, k, v, do, extra, dlse)
  return (o, lse), (dq, dk, dv, *(dextra[n] for n in DIFFERENTIABLE_KWARGS if n in dextra))


def check_against_reference(impl: str, case: Case, *, config=None, seed: int | None = None,
                            tol: float | None = None, far_past: float | None = None):
  """Output, lse and every gradient (the bias's too) of `impl` against the float32 reference on
  fresh random inputs: the oracle sees the same low-precision inputs, upcast, so only the
  kernel's arithmetic differs. far_past: q and k through past_the_cap at that size. Returns
  `impl`'s ((o, lse), grads)."""
  (q, k, v, do), kwargs = make_inputs(case, seed)
  if far_past is not None:
    q, k = past_the_cap(q, k, far_past)
  result = run(impl, q, k, v, do, config=config, **dict(kwargs))
  up = [to_f32(x) for x in (q, k, v, do)]
  ref = run("reference", *up, **dict(kwargs))
  names = ("dq", "dk", "dv") + tuple(f"d{n}" for n in DIFFERENTIABLE_KWARGS if n in kwargs)
  assert_matches_reference(result, ref, tolerance(case.dtype) if tol is None else tol,
                           names=names, dtype=q.dtype)
  return result


def block_mask_fn(name: str, case: Case, seed: int = 0) -> pallas_flash.masks.MaskFn:
  """The mask function `name` (BLOCK_MASK_FNS) for a case's batch and lengths: document ids
  with random boundaries, a random prefix length per batch entry, a window of a quarter of
  the query length."""
  from pallas_flash import CausalMask, LocalMask, PrefixLMMask, SegmentMask
  rngs = [np.random.default_rng([seed, i]) for i in range(3)]
  b, t, s = case.batch, case.q_len, case.kv_len
  seg_q = random_segments(rngs[0], b, t, num_docs=3)
  seg_kv = seg_q if t == s else random_segments(rngs[1], b, s, num_docs=3)
  prefix = jnp.asarray(rngs[2].integers(0, s + 1, (b,)), jnp.int32)
  w = max(t // 4, 1)
  fns = {
      # The window's right side (3) lies past the causal bound: causal & local(w, 0).
      "causal_local": lambda: CausalMask() & LocalMask(w, 3),
      "causal_segment": lambda: CausalMask() & SegmentMask(seg_q, seg_kv),
      "prefix_lm": lambda: PrefixLMMask(prefix),
      "local_or_prefix": lambda: LocalMask(w, w // 2) | PrefixLMMask(prefix),
      "segment_and_prefix_or_local": lambda: SegmentMask(seg_q, seg_kv) & (
          PrefixLMMask(prefix) | LocalMask(w, 0)),
  }
  return fns[name]()


BLOCK_MASK_FNS = ("causal_local", "causal_segment", "prefix_lm", "local_or_prefix",
                  "segment_and_prefix_or_local")


def check_block_mask_against_reference(impl: str, case: Case, name: str, *, blocks=(64, 64),
                                       config=None, seed: int | None = None, **kwargs):
  """`check_against_reference` for a call with the block mask of mask function `name`
  (block_mask_fn) built at `blocks` (block_q, block_kv) and flash_attention's `kwargs`;
  returns (o, lse)."""
  from pallas_flash import BlockMask
  (q, k, v, do), _ = make_inputs(case, seed)
  bm = BlockMask.build(block_mask_fn(name, case), q_len=case.q_len, kv_len=case.kv_len,
                       block_q=blocks[0], block_kv=blocks[1])
  result = run(impl, q, k, v, do, config=config, block_mask=bm, **kwargs)
  up = [to_f32(x) for x in (q, k, v, do)]
  names = ("dq", "dk", "dv") + tuple(f"d{n}" for n in DIFFERENTIABLE_KWARGS if n in kwargs)
  assert_matches_reference(result, run("reference", *up, block_mask=bm, **kwargs),
                           tolerance(case.dtype), names=names, dtype=q.dtype)
  return result[0]


def max_abs(x) -> float:
  """max|x| in float64, NaN where x holds a NaN. In numpy: XLA's CPU max reduction skips NaNs
  in large arrays (jnp.abs(x).max() read 1.0 for a [200, 4, 128] array of ones and NaNs), so a
  check written with it would pass unwritten or NaN outputs."""
  return float(np.abs(np.asarray(x, np.float64)).max())


def max_rel_err(x, ref) -> float:
  """max|x - ref| / max|ref| (no floor); NaN, which fails every `<=` check, where x or ref
  holds a NaN (see max_abs)."""
  x, ref = (np.asarray(a, np.float64) for a in (x, ref))
  return max_abs(x - ref) / max_abs(ref)


# The Mosaic kernels in the Mosaic GPU interpreter at 64-row tiles: the two consumer warpgroups
# of a causal CTA need different block counts (the idle-step path), and short lengths give
# several steps per ring.
MOSAIC_INTERPRET = MosaicConfig(block_kv=64, block_kv_dq=64, debug=MosaicDebug(interpret=True))


def interpret_config(**kw) -> MosaicConfig:
  """MOSAIC_INTERPRET with fields replaced; `debug`: a dict of MosaicDebug fields to replace."""
  debug = kw.pop("debug", {})
  return dataclasses.replace(MOSAIC_INTERPRET, **kw,
                             debug=dataclasses.replace(MOSAIC_INTERPRET.debug, **debug))


def past_the_cap(q, k, cap: float):
  """q, k with raw logits q·kᵀ/√D about cap·(2.5, -2.5, 1, -1, 0)[row % 5] ± 0.15·cap per key:
  key column 0 set to 4 and query column 0 to the row's offset, the other columns times
  0.15·cap. Rows at ±2.5·cap have every capped score near ±cap (tanh ≈ ±0.98), so all their
  probabilities sit at the top or the bottom of the fixed row max's range."""
  d = q.shape[-1]
  offset = cap * jnp.array([2.5, -2.5, 1.0, -1.0, 0.0])[jnp.arange(q.shape[1]) % 5]
  q32 = (q.astype(jnp.float32) * (0.15 * cap)).at[..., 0].set(
      (offset * math.sqrt(d) / 4)[None, :, None])
  k32 = k.astype(jnp.float32).at[..., 0].set(4.0)
  return q32.astype(q.dtype), k32.astype(k.dtype)


def small_case(t, s, *, b=1, h=2, kh=1, d=64, dtype=jnp.bfloat16, **kw) -> Case:
  """A Case of T = t queries and S = s keys, the interpreter tests' sizes by default."""
  return Case(batch=b, q_len=t, kv_len=s, num_heads=h, num_kv_heads=kh, head_dim=d,
              dtype=dtype, **kw)

# An H200 that need not exist: lowering for CUDA on a CPU machine checks tracing, layouts and
# (for Mosaic) shared memory without a GPU.
H200 = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", num_cores=132, platform="gpu"))

# The Triton kernels' custom call, which jax.export will not serialise unless told.
TRITON_CALL = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def export_for_h200(fn, *specs) -> jax.export.Exported:
  """jax.export of jit(fn) for CUDA at the abstract `H200`."""
  with use_abstract_mesh(H200):
    return jax.export.export(jax.jit(fn), platforms=["cuda"],
                             disabled_checks=[TRITON_CALL])(*specs)


def triton_operands(module: str) -> list[tuple[tuple[int, ...], int]]:
  """(shape, bytes) of every operand of an exported module's Triton calls."""
  itemsize = {"i8": 1, "ui8": 1, "f8E4M3FN": 1, "i16": 2, "ui16": 2, "bf16": 2, "f16": 2,
              "i32": 4, "ui32": 4, "f32": 4, "i64": 8}
  out = []
  for sig in re.findall(r"custom_call @__gpu\$xla\.gpu\.triton\(.*?: \((.*?)\) ->", module):
    for dims in re.findall(r"tensor<([0-9x]*[a-zA-Z]\w*)>", sig):
      *shape, dtype = dims.split("x")
      shape = tuple(int(n) for n in shape)
      out.append((shape, math.prod(shape) * itemsize[dtype]))
  return out


def assert_offsets_fit_int32(operands):
  """Pallas-Triton addresses an operand of at most 2^32 bytes with int32 element offsets: no
  operand of triton_operands may hold more than 2^31 elements within that size (a one-byte
  operand of 2-4 GiB read the wrong rows, or faulted, on the H200)."""
  for shape, nbytes in operands:
    assert math.prod(shape) <= 2**31 or nbytes > 2**32, (shape, nbytes)


def specs(case: Case):
  """Abstract (q [B, T, H, D], kv [B, S, K, D]) of a case, for lowering without data."""
  dt = jnp.dtype(case.dtype)
  return (jax.ShapeDtypeStruct((case.batch, case.q_len, case.num_heads, case.head_dim), dt),
          jax.ShapeDtypeStruct((case.batch, case.kv_len, case.num_kv_heads, case.head_dim), dt))


def on_hopper() -> bool:
  """Whether the default device is a Hopper (sm_90) GPU, where the Mosaic kernels run."""
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


# FP8 (pallas_flash.fp8): the output of FP8 attention against the float32 attention of the
# bf16 inputs, max|x - ref| / max|ref| on N(0, 1) inputs: e4m3 rounds q, k and v by up to 2**-4
# relative (0.036-0.10 measured on tests/test_fp8.py's case over 12 seeds).
FP8_TOLERANCE = 0.15
# The Mosaic FP8 forward against the reference semantics (the float32 attention of the same
# dequantized inputs): what differs is the kernel's rounding of P to e4m3 (3 mantissa bits,
# half an ulp 2**-4 relative per probability, averaging out over keys). Measured in the Mosaic
# interpreter: 0.011-0.022 (tests/mosaic/test_interpret.py's cases).
FP8_KERNEL_TOLERANCE = 0.05
# The Mosaic FP8 forward in the interpreter (its key tiles are multiples of 128).
MOSAIC_FP8_INTERPRET = MosaicConfig(fp8_block_kv=128, debug=MosaicDebug(interpret=True))


def check_fp8_against_reference(case: Case, *, config=None, block=None, out_dtype=None,
                                seed: int | None = None) -> None:
  """The Mosaic FP8 forward on `case`'s inputs quantised by pallas_flash.fp8.quantize (scales
  per `block`): its output against the reference semantics (FP8_KERNEL_TOLERANCE) and the
  float32 attention of the unquantised inputs (FP8_TOLERANCE), its lse against the
  reference's."""
  from pallas_flash import fp8

  (q, k, v, _), kwargs = make_inputs(case, seed)
  f8, scales = fp8.quantize(q, k, v, block=block)
  deq = [fp8.dequantize(x, s, scales.block) for x, s in zip(f8, (scales.q, scales.k, scales.v))]
  run_fp8 = jax.jit(lambda f8, s: pallas_flash.flash_attention(
      *f8, descale=s, out_dtype=out_dtype, implementation="mosaic", config=config,
      return_residuals=True, **kwargs))
  o, lse = run_fp8(f8, scales)
  assert o.dtype == jnp.dtype(out_dtype or jnp.bfloat16), f"out dtype {o.dtype}"
  reference = jitted(pallas_flash.flash_attention, implementation="reference")
  o_ref, lse_ref = reference(*deq, return_residuals=True, **kwargs)
  assert_close_to_ref("fp8 out vs reference semantics", o, o_ref, FP8_KERNEL_TOLERANCE)
  assert_close_to_ref("fp8 lse", lse, lse_ref, TOLERANCES[jnp.dtype(jnp.bfloat16)])
  exact = reference(*(to_f32(x) for x in (q, k, v)), **kwargs)
  assert_close_to_ref("fp8 out vs float32", o, exact, FP8_TOLERANCE)


# pallas_flash.quantized_attention's gradients on the Mosaic path (the FP8 forward, then
# the bf16 Mosaic backward on the dequantized values rounded to bf16) against the float32
# gradient of the same dequantized attention: the bf16 backward's own budget
# (2 * TOLERANCES[bf16], gradients getting twice the forward's) plus the FP8 forward's output
# error (FP8_KERNEL_TOLERANCE), which enters the gradient only through delta = rowsum(dO∘O):
# delta is linear in O, so a relative error e in O is at most e relative in delta, and
# dS = P∘(dP - delta) is linear in delta. Measured in the interpreter (tests/mosaic/
# test_interpret.py's cases, 2 seeds): 0.004-0.034, the largest in dq and dk, where the bf16
# backward alone on the same dequantized values has 0.004.
FP8_TRAINING_TOLERANCE = 2 * TOLERANCES[jnp.dtype(jnp.bfloat16)] + FP8_KERNEL_TOLERANCE


def check_fp8_training(case: Case, *, tol: float, seed: int | None = None, **kwargs):
  """quantized_attention's gradients on `case`'s bf16 inputs, of the loss sum(o·do) +
  sum(lse·dl) (both cotangents), against the float32 reference's gradient of the dequantized
  attention (rotated back with `rotate`) within `tol`, and against the float32 attention of
  the unquantised inputs within 2 * FP8_TOLERANCE. kwargs: quantized_attention's. Returns
  the gradients (dq, dk, dv)."""
  from pallas_flash import fp8

  seed = case.seed if seed is None else seed
  (q, k, v, do), case_kwargs = make_inputs(case, seed)
  kwargs = {**case_kwargs, **kwargs}
  dl = _normal(np.random.default_rng(seed + 1), (case.batch, case.num_heads, case.q_len))

  def grads(f, *xs):
    def loss(*xs):
      o, lse = f(*xs, return_residuals=True)
      return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(lse * dl)
    return jax.grad(loss, argnums=(0, 1, 2))(*xs)

  attention = functools.partial(pallas_flash.quantized_attention, **kwargs)
  got = jax.jit(functools.partial(grads, attention))(q, k, v)
  rotate, block, key = (kwargs.pop(n, d) for n, d in (("rotate", False), ("block", None),
                                                       ("key", None)))
  ref_kwargs = {n: x for n, x in kwargs.items()
                if n not in ("implementation", "config", "deterministic", "out_dtype")}
  reference = functools.partial(pallas_flash.flash_attention, implementation="reference",
                                **ref_kwargs)
  (q8, k8, v8), scales = fp8.quantize(q, k, v, rotate=rotate, block=block, key=key)
  deq = [fp8.dequantize(x, s, scales.block)
         for x, s in zip((q8, k8, v8), (scales.q, scales.k, scales.v))]
  reference_grads = jax.jit(functools.partial(grads, reference))
  want = reference_grads(*deq)
  if rotate:  # q·R and k·R were quantised: their gradients carried back are (·)·Rᵀ
    r = fp8.hadamard_rotation(case.head_dim, key)
    want = (want[0] @ r.T, want[1] @ r.T, want[2])
  exact = reference_grads(*(to_f32(x) for x in (q, k, v)))
  for name, g, w, e in zip(("dq", "dk", "dv"), got, want, exact):
    assert g.dtype == q.dtype, f"{name} dtype {g.dtype}"
    assert_close_to_ref(f"{name} vs the dequantized attention", g, w, tol)
    assert_close_to_ref(f"{name} vs float32", g, e, 2 * FP8_TOLERANCE)
  return got
