"""Test helpers: random inputs, segment ids, tolerances and a comparison that says where it fails."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

import pallas_flash
from pallas_flash.mosaic_gpu import MosaicConfig, MosaicDebug

# Relative error max|x - ref| / max|ref| against the float32 reference computed from the same
# (possibly low-precision) inputs. Gradients get twice the forward budget.
FWD_TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2, jnp.float16: 3e-3}
GPU_FWD_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1.5e-2, jnp.float16: 3e-3}


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem: shapes, dtype and features."""

  batch: int = 2
  q_len: int = 128
  kv_len: int = 128
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 64
  dtype: type = jnp.float32
  is_causal: bool = False
  segments: bool = False
  lengths: bool = False

  @property
  def id(self) -> str:
    feats = "".join(f for f, on in (("-causal", self.is_causal), ("-seg", self.segments),
                                    ("-len", self.lengths)) if on)
    return (f"b{self.batch}_t{self.q_len}_s{self.kv_len}_h{self.num_heads}:{self.num_kv_heads}"
            f"_d{self.head_dim}_{jnp.dtype(self.dtype).name}{feats}")


def case_seed(case: Case) -> int:
  """A seed per case that is the same in every process (str hash() is salted per process)."""
  return zlib.crc32(case.id.encode()) % 1000


def random_segments(key, batch: int, length: int, num_docs: int = 4) -> jax.Array:
  """[batch, length] int32 non-decreasing document ids with random boundaries."""
  starts = jax.random.randint(key, (batch, num_docs - 1), 0, max(length, 1))
  pos = jnp.arange(length)
  return (pos[None, :, None] >= starts[:, None, :]).sum(-1).astype(jnp.int32)


def make_inputs(case: Case, seed: int = 0) -> tuple[tuple[jax.Array, ...], dict]:
  """Fresh random q, k, v, a cotangent and the keyword arguments of the case's features."""
  keys = jax.random.split(jax.random.key(seed), 8)
  q = jax.random.normal(keys[0], (case.batch, case.q_len, case.num_heads, case.head_dim))
  k = jax.random.normal(keys[1], (case.batch, case.kv_len, case.num_kv_heads, case.head_dim))
  v = jax.random.normal(keys[2], (case.batch, case.kv_len, case.num_kv_heads, case.head_dim))
  do = jax.random.normal(keys[3], q.shape)
  q, k, v, do = (x.astype(case.dtype) for x in (q, k, v, do))
  kwargs: dict = {"is_causal": case.is_causal}
  if case.segments:
    # Same boundaries in positions for q and kv when lengths match (self-attention packing).
    kwargs["query_segment_ids"] = random_segments(keys[4], case.batch, case.q_len)
    kwargs["key_value_segment_ids"] = (kwargs["query_segment_ids"] if case.q_len == case.kv_len
                                       else random_segments(keys[5], case.batch, case.kv_len))
  if case.lengths:
    kwargs["query_seq_lengths"] = jax.random.randint(keys[6], (case.batch,), 0, case.q_len + 1)
    kwargs["key_value_seq_lengths"] = jax.random.randint(keys[7], (case.batch,), 1,
                                                         case.kv_len + 1)
  return (q, k, v, do), kwargs


REL_FLOOR = 0.05


def rel_err(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  denom = max(np.abs(ref).max(), REL_FLOOR)
  return float(np.abs(x - ref).max() / denom)


def assert_close_to_ref(name: str, x, ref, tol: float) -> None:
  """Fails with the max error, where it is and the values there; NaN never passes."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  assert x.shape == ref.shape, f"{name}: shape {x.shape} != reference {ref.shape}"
  bad_nan = np.isnan(x) & ~np.isnan(ref)
  assert not bad_nan.any(), (f"{name}: {bad_nan.sum()} NaN elements (unwritten or leaked), "
                             f"first at {np.argwhere(bad_nan)[0].tolist()}")
  finite = np.isfinite(ref)
  assert (np.isinf(x) == np.isinf(ref)).all(), f"{name}: infinities differ from the reference"
  err = np.abs(np.where(finite, x, 0.0) - np.where(finite, ref, 0.0))
  # The floor keeps references that are exactly zero (with one key the softmax has no gradient)
  # from turning rounding noise into a huge relative error; unit-scale inputs keep |ref| ~ 1.
  denom = max(np.abs(np.where(finite, ref, 0.0)).max(), REL_FLOOR)
  worst = np.unravel_index(np.argmax(err), err.shape)
  rel = err.max() / denom
  assert rel <= tol, (f"{name}: rel err {rel:.3g} > {tol:.3g} at {list(worst)}: "
                      f"got {x[worst]:.6g}, want {ref[worst]:.6g}")


def outputs_and_grads(impl: str, q, k, v, do, *, config=None, **kwargs):
  """(o, lse) and (dq, dk, dv) of sum(o * do) for one implementation."""
  def f(q, k, v):
    o, lse = pallas_flash.flash_attention(q, k, v, implementation=impl, config=config,
                                          return_residuals=True, **kwargs)
    return o, lse

  (o, lse), vjp = jax.vjp(f, q, k, v)
  grads = vjp((do, jnp.zeros_like(lse)))
  return (o, lse), grads


def check_against_reference(impl: str, case: Case, *, seed: int = 0, config=None,
                            tol_table=FWD_TOL) -> None:
  """Forward, lse and gradients of `impl` against the reference on fresh random inputs."""
  (q, k, v, do), kwargs = make_inputs(case, seed)
  (o, lse), grads = outputs_and_grads(impl, q, k, v, do, config=config, **kwargs)
  # The oracle sees the same low-precision inputs, upcast: only the kernel's arithmetic differs.
  up = [x.astype(jnp.float32) for x in (q, k, v, do)]
  (o_ref, lse_ref), grads_ref = outputs_and_grads("reference", *up, **kwargs)
  tol = tol_table[case.dtype]
  assert o.dtype == q.dtype
  assert_close_to_ref("out", o, o_ref, tol)
  assert_close_to_ref("lse", lse, lse_ref, max(tol, 1e-5))
  for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
    assert g.dtype == q.dtype, f"{name} dtype {g.dtype}"
    assert_close_to_ref(name, g, g_ref, 2 * tol)


# The Mosaic kernels in the Mosaic GPU interpreter at 64-row tiles: the two consumer warpgroups
# of a causal CTA need different block counts (the idle-step path), and small lengths give
# several steps per ring.
MOSAIC_INTERPRET_SMALL = MosaicConfig(block_q=64, block_kv=64, block_q_dq=64, block_kv_dq=64,
                                      block_q_dkv=64, block_kv_dkv=64, num_stages=2,
                                      bwd_stages=2, debug=MosaicDebug(interpret=True))


def max_abs(x) -> float:
  """max|x| in float64, NaN where x holds a NaN. In numpy: XLA's CPU max reduction skips NaNs
  in large arrays (jnp.abs(x).max() read 1.0 for a [200, 4, 128] array of ones and NaNs), so a
  check written with it would pass unwritten or NaN outputs."""
  return float(np.abs(np.asarray(jnp.asarray(x, jnp.float32), np.float64)).max())


def max_rel_err(x, ref) -> float:
  """max|x - ref| / max|ref| (no floor: for references that are not all zero); NaN, which
  fails every `<=` check, where x or ref holds a NaN (see max_abs)."""
  x, ref = (jnp.asarray(a, jnp.float32) for a in (x, ref))
  return max_abs(x - ref) / max_abs(ref)


# An H200 that need not exist: lowering for CUDA on a CPU machine checks tracing, layouts and
# (for Mosaic) shared memory without a GPU.
H200 = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", num_cores=132, platform="gpu"))


# The Triton kernels' custom call, which jax.export will not serialise unless told: exports of
# Triton calls (and of the Mosaic backend at head dim 256, whose backward is Triton's) pass it.
TRITON_CALL = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def export_for_h200(fn, *specs, disabled_checks=()) -> jax.export.Exported:
  """jax.export of jit(fn) for CUDA at the abstract `H200`."""
  with use_abstract_mesh(H200):
    return jax.export.export(jax.jit(fn), platforms=["cuda"],
                             disabled_checks=list(disabled_checks))(*specs)


def kernel_specs(b, t, s, h, kh, d, dtype=jnp.bfloat16):
  """Abstract (q [B, T, H, D], kv [B, S, K, D]) of a kernel case, for lowering without data."""
  return (jax.ShapeDtypeStruct((b, t, h, d), dtype), jax.ShapeDtypeStruct((b, s, kh, d), dtype))


def kernel_inputs(b, t, s, h, kh, d, dtype, seed=0):
  """Fresh random (q [B, T, H, D], k, v [B, S, K, D], do [B, T, H, D]) in dtype, for the
  tuple-described kernel cases (B, T, S, H, K, D, ...)."""
  ks = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(ks[0], (b, t, h, d), dtype),
          jax.random.normal(ks[1], (b, s, kh, d), dtype),
          jax.random.normal(ks[2], (b, s, kh, d), dtype),
          jax.random.normal(ks[3], (b, t, h, d), dtype))


def on_hopper() -> bool:
  """Whether the default device is a Hopper (sm_90) GPU, where the Mosaic kernels run."""
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def kernel_case_id(case) -> str:
  """pytest id of a kernel case (B, T, S, H, K, D, causal[, dtype]), e.g.
  b1_t1000_s1100_h8:2_d64_causal_bfloat16."""
  out = "b{}_t{}_s{}_h{}:{}_d{}".format(*case[:6]) + ("_causal" if case[6] else "")
  return out + ("_" + jnp.dtype(case[7]).name if len(case) > 7 else "")
