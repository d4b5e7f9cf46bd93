"""CPU-side lowering of the Triton kernels for an abstract H200: tracing and lowering errors."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import use_abstract_mesh

import pallas_flash
from testing import H200, assert_offsets_fit_int32, export_for_h200, triton_operands


def _export(fn, *specs):
  return export_for_h200(fn, *specs).mlir_module()


# float16 and float32 non-causal run with -m slow (suite time): their tiles are the causal
# calls', and bfloat16 lowers both.
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype, causal", [
    pytest.param(dt, c, marks=pytest.mark.slow if dt != jnp.bfloat16 and not c else ())
    for dt in (jnp.bfloat16, jnp.float16, jnp.float32) for c in (False, True)])
def test_triton_lowers_for_h200(head_dim, causal, dtype):
  q = jax.ShapeDtypeStruct((2, 1000, 8, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, head_dim), dtype)
  seg = jax.ShapeDtypeStruct((2, 1000), jnp.int32)

  def f(q, k, v, seg):
    return pallas_flash.flash_attention(q, k, v, is_causal=causal, query_segment_ids=seg,
                                        implementation="triton")

  def g(q, k, v, seg):
    return jax.grad(lambda *a: f(*a, seg).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

  assert _export(f, q, kv, kv, seg).count("xla.gpu.triton") == 1
  assert _export(g, q, kv, kv, seg).count("xla.gpu.triton") == 3  # fwd, dK/dV, dQ


def test_default_on_h200_is_a_gpu_kernel():
  q = jax.ShapeDtypeStruct((1, 4096, 16, 128), jnp.bfloat16)
  with use_abstract_mesh(H200):
    ex = pallas_flash.explain(q, q, q, is_causal=True)
  assert ex.chosen in ("mosaic", "triton")
  assert ex.reasons["xla"] is None


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])  # approx tanh only for 16-bit
def test_triton_features_lower_for_h200(dtype):
  q = jax.ShapeDtypeStruct((1, 700, 4, 128), dtype)
  seg = jax.ShapeDtypeStruct((1, 700), jnp.int32)
  slopes = jax.ShapeDtypeStruct((4,), jnp.float32)

  def f(q, k, v, seg, slopes):
    return pallas_flash.flash_attention(
        q, k, v, is_causal=True, query_segment_ids=seg, local_window_size=(256, 0),
        logits_soft_cap=30.0, alibi_slopes=slopes, dropout_rate=0.1,
        dropout_rng=jax.random.key(0), implementation="triton")

  def g(*args):
    return jax.grad(lambda *a: f(*a, *args[3:]).astype(jnp.float32).sum(),
                    argnums=(0, 1, 2))(*args[:3])

  assert _export(f, q, q, q, seg, slopes).count("xla.gpu.triton") == 1
  module = _export(g, q, q, q, seg, slopes)
  assert module.count("xla.gpu.triton") == 3
  assert ("tanh.approx" in module) == (dtype == jnp.bfloat16)


def test_a_dense_mask_of_2_to_4_gib_is_addressed_with_int64_offsets():
  """A [B, 1, T, S] bool mask of 2^31 .. 2^32 entries (8 x 16400 x 16400) reaches the kernels as
  int8: grown past 4 GiB along rows no kernel reads, so that Pallas-Triton's offsets are int64
  (at most 4 GiB, they would be int32 and overflow), forward and backward."""
  q = jax.ShapeDtypeStruct((8, 16400, 4, 64), jnp.bfloat16)
  mask = jax.ShapeDtypeStruct((8, 1, 16400, 16400), jnp.bool_)

  def f(q, k, v, mask):
    return pallas_flash.flash_attention(q, k, v, mask=mask, implementation="triton")

  def g(q, k, v, mask):
    return jax.grad(lambda *a: f(*a, mask).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

  for fn in (f, g):
    operands = triton_operands(_export(fn, q, q, q, mask))
    assert any(nbytes > 2**32 and shape[1] == 1 for shape, nbytes in operands), operands
    assert_offsets_fit_int32(operands)


def _block_mask_info(head_dim, blocks=(128, 128), cc=(9, 0), **params):
  from pallas_flash.call import AttentionParams, CallInfo
  params = AttentionParams(scale=1.0, is_causal=False, has_segments=False,
                           block_mask_blocks=blocks, **params)
  return CallInfo(batch=1, q_len=4096, kv_len=4096, num_heads=4, num_kv_heads=4,
                  head_dim=head_dim, value_head_dim=head_dim, dtype=jnp.dtype(jnp.bfloat16),
                  params=params, platform="gpu", compute_capability=cc, device_kind="GPU",
                  bias_dtype=jnp.dtype(jnp.bfloat16) if params.has_bias else None)


@pytest.mark.parametrize("head_dim,params,cc,stages,fits", [
    # Triton asked one H100 (2026-12-06) for 320 KiB (forward) and 256 KiB (backward) here
    # with the tuned stages; the fitted ones are below 227 KiB or the call is refused.
    (256, {}, (9, 0), (1, 1), False),
    (128, dict(has_bias=True), (9, 0), (2, 1), True),
    (128, {}, (9, 0), (3, 2), True),
    (128, {}, (8, 0), (2, 1), True),  # A100: 163 KiB
    (128, dict(has_bias=True, has_mask=True), (8, 6), (1, 1), False),  # 99 KiB
], ids=["hd256", "bias", "plain", "a100", "sm86_bias_mask"])
def test_block_mask_stages_fit_shared_memory(head_dim, params, cc, stages, fits):
  from pallas_flash.triton import common, default_config
  info = _block_mask_info(head_dim, cc=cc, **params)
  tuned = common.call_config(head_dim, info.dtype, info.params)
  if cc == (9, 0) and head_dim == 256:
    assert common.shared_memory(info, tuned)[0] == 320 << 10
  if cc == (9, 0) and params:
    assert common.shared_memory(info, tuned)[1] == 256 << 10
  config = default_config(info)
  assert (config.num_stages, config.num_stages_bwd) == stages
  why = common.unsupported_reason(info, None, interpret=False)
  assert (why is None) == fits, why
  if not fits:
    assert "shared memory" in why and "smaller blocks" in why
  if cc == (9, 0):  # the tuned stages fit at 64-row blocks
    small = _block_mask_info(head_dim, blocks=(64, 64), cc=cc, **params)
    assert default_config(small) == tuned
