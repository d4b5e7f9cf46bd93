"""The public API: validation errors, explain, dispatch, and JAX transformations."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash
from pallas_flash.triton import TritonConfig
from testing import (TOLERANCES, Case, assert_close_to_ref, make_inputs, max_abs,
                     max_rel_err)

Q = jnp.ones((2, 16, 4, 32), jnp.float32)
KV = jnp.ones((2, 24, 2, 32), jnp.float32)


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((Q[0, :, 0], KV, KV), {}, ValueError, "`query` must have rank 4"),
    ((Q, KV[..., 0], KV[..., 0]), {}, ValueError, "`key` must have rank 4"),
    ((Q, KV, KV[:, :10]), {}, ValueError, "`key` and `value` must have the same shape"),
    ((Q, KV[:1], KV[:1]), {}, ValueError, "same batch size"),
    ((Q, KV[..., :16], KV[..., :16]), {}, ValueError, "same head_dim"),
    ((Q[:, :, :3], KV, KV), {}, ValueError, "must be a multiple of num_heads"),
    ((Q, KV.astype(jnp.bfloat16), KV), {}, TypeError, "must share one dtype"),
    ((Q.astype(jnp.int32), KV.astype(jnp.int32), KV.astype(jnp.int32)), {}, TypeError,
     "Unsupported dtype"),
    ((Q, KV, KV), {"query_segment_ids": jnp.zeros((2, 16), jnp.int32)}, ValueError,
     "`key_value_segment_ids` is required"),
    ((Q, KV, KV), {"key_value_segment_ids": jnp.zeros((2, 24), jnp.int32)}, ValueError,
     "without `query_segment_ids`"),
    ((Q, KV, KV), {"query_segment_ids": jnp.zeros((2, 15), jnp.int32),
                   "key_value_segment_ids": jnp.zeros((2, 24), jnp.int32)}, ValueError,
     re.escape("`query_segment_ids` must have shape (2, 16)")),
    ((Q, KV, KV), {"query_segment_ids": jnp.zeros((2, 16)),
                   "key_value_segment_ids": jnp.zeros((2, 24), jnp.int32)}, TypeError,
     "must be an integer array"),
    ((Q, KV, KV), {"query_seq_lengths": jnp.array([3])}, ValueError,
     re.escape("`query_seq_lengths` must have shape (2,)")),
    ((Q, KV, KV), {"key_value_seq_lengths": jnp.array([3, 25])}, ValueError,
     re.escape("values must lie in [0, 24]")),
    ((Q, KV, KV), {"query_seq_lengths": jnp.array([-1, 3])}, ValueError, "must lie in"),
    ((Q, KV, KV), {"scale": jnp.float32(0.5)}, TypeError, "`scale` must be a finite Python"),
    ((Q, KV, KV), {"implementation": "cudnn"}, ValueError, "Unknown implementation"),
    ((Q, KV, KV), {"implementation": "triton"}, NotImplementedError, "needs an NVIDIA GPU"),
    ((Q, KV, KV), {"implementation": "mosaic"}, NotImplementedError, "cannot run this call"),
    ((Q, KV, KV), {"implementation": "xla", "config": TritonConfig()}, NotImplementedError,
     "takes a XlaConfig"),
    (("q", KV, KV), {}, TypeError, "`query` must be a jax or numpy array"),
    ((Q, KV, KV), {"deterministic": 1}, TypeError, "`deterministic` must be a Python bool"),
])
def test_bad_input_is_rejected_with_a_clear_error(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    pallas_flash.flash_attention(*args, **kwargs)


def test_concrete_lengths_closed_over_by_jit():
  # Concrete lengths are range-checked on the host; a jitted function that closes over them
  # must not turn that check into a traced reduction (ConcretizationTypeError).
  lens = jnp.array([16, 5], jnp.int32)
  kv_lens = lens + 3
  f = jax.jit(lambda q, k, v: pallas_flash.flash_attention(
      q, k, v, query_seq_lengths=lens, key_value_seq_lengths=kv_lens, implementation="xla"))
  q, k, v = (jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate((Q, KV, KV)))
  got = f(q, k, v)
  want = pallas_flash.flash_attention(q, k, v, query_seq_lengths=lens,
                                      key_value_seq_lengths=lens + 3, implementation="reference")
  assert max_abs(got - want) < 1e-5
  assert bool(jnp.all(got[1, 5:] == 0))
  too_long = lens + 1
  with pytest.raises(ValueError, match="must lie in"):
    jax.jit(lambda q, k, v: pallas_flash.flash_attention(
        q, k, v, query_seq_lengths=too_long))(q, k, v)


def test_bad_config_values():
  with pytest.raises(ValueError, match="block_q must be a power of two"):
    TritonConfig(block_q=48)
  with pytest.raises(ValueError, match="block_kv must be positive"):
    pallas_flash.XlaConfig(block_kv=0)


def test_triton_default_tiles_by_head_dim_and_dtype():
  from pallas_flash.triton import config as tconfig
  swept = tconfig.default_config(256, True, jnp.bfloat16)  # the H200 sweep's D = 256 tiles
  assert (swept.block_q_dkv, swept.block_kv_dkv, swept.block_q_dq, swept.block_kv_dq) == \
      (64, 32, 32, 64)
  for d in (128, 256):  # float32: the halved tiles (the swept ones stream 64-row f32 tiles)
    assert tconfig.default_config(d, False, jnp.float32) == tconfig.WIDE_FLOAT32
  assert tconfig.default_config(128, False, jnp.float16) == tconfig.TUNED[(128, False, 2)]


def test_explain_on_cpu():
  ex = pallas_flash.explain(Q, KV, KV, is_causal=True)
  assert ex.chosen == "xla"
  assert "needs an NVIDIA GPU" in ex.reasons["triton"]
  assert ex.reasons["interpret"] is None and ex.reasons["reference"] is None
  text = str(ex)
  assert "implementation=None runs 'xla'" in text and "triton:" in text
  assert ex.config == pallas_flash.XlaConfig() and "config: XlaConfig()" in text
  # A config rules out the other backends; here nothing automatic is left on CPU.
  ex = pallas_flash.explain(Q, KV, KV, config=TritonConfig())
  assert ex.chosen is None and "takes a XlaConfig" in ex.reasons["xla"]
  assert "cannot run this call" in str(ex)


def test_explain_accepts_shape_structs():
  spec = jax.ShapeDtypeStruct(Q.shape, Q.dtype)
  kv = jax.ShapeDtypeStruct(KV.shape, KV.dtype)
  assert pallas_flash.explain(spec, kv, kv).chosen == "xla"


def test_default_scale_and_custom_scale():
  (q, k, v, _), _ = make_inputs(Case())
  ref = pallas_flash.flash_attention(q, k, v, implementation="reference")
  assert_close_to_ref("default", pallas_flash.flash_attention(q, k, v), ref, 2e-5)
  ref2 = pallas_flash.flash_attention(q, k, v, scale=0.3, implementation="reference")
  assert_close_to_ref("scale", pallas_flash.flash_attention(q, k, v, scale=0.3), ref2, 2e-5)
  assert max_rel_err(ref, ref2) > 1e-2  # the scale is really used


def test_rank3_inputs_without_batch():
  (q, k, v, _), kw = make_inputs(Case(batch=1, segments=True, is_causal=True))
  kw3 = {n: (x[0] if hasattr(x, "shape") else x) for n, x in kw.items()}
  o3 = pallas_flash.flash_attention(q[0], k[0], v[0], **kw3)
  o4 = pallas_flash.flash_attention(q, k, v, **kw)
  assert o3.shape == q.shape[1:]
  np.testing.assert_array_equal(np.asarray(o3), np.asarray(o4[0]))


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_jit_vmap_grad_checkpoint(impl):
  (q, k, v, do), kw = make_inputs(Case(batch=1, q_len=40, kv_len=40, is_causal=True))
  stack = lambda x: jnp.stack([x, 2 * x])  # noqa: E731

  def loss(q, k, v):
    o = pallas_flash.flash_attention(q, k, v, implementation=impl, **kw)
    return (o * do).sum()

  def ref_loss(q, k, v):
    o = pallas_flash.flash_attention(q, k, v, implementation="reference", **kw)
    return (o * do).sum()

  vmapped = jax.jit(jax.vmap(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2))))
  want = jax.vmap(jax.grad(ref_loss, argnums=(0, 1, 2)))
  for g, g_ref in zip(vmapped(stack(q), stack(k), stack(v)), want(stack(q), stack(k), stack(v))):
    assert_close_to_ref("grad", g, g_ref, 5e-5)


def test_lse_cotangent_is_differentiated():
  (q, k, v, _), kw = make_inputs(Case(q_len=33, kv_len=50, is_causal=True))
  for impl in ("xla", "interpret"):
    def f(impl, q, k, v):
      _, lse = pallas_flash.flash_attention(q, k, v, implementation=impl, return_residuals=True,
                                            **kw)
      return jnp.sin(lse).sum()
    got = jax.grad(lambda *a: f(impl, *a), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: f("reference", *a), argnums=(0, 1, 2))(q, k, v)
    for g, g_ref in zip(got, want):
      assert_close_to_ref(impl, g, g_ref, 5e-5)


@pytest.mark.parametrize("deterministic", [False, True])
def test_second_run_is_bitwise_identical(deterministic):
  (q, k, v, do), kw = make_inputs(Case(is_causal=True, segments=True))
  kw["deterministic"] = deterministic
  f = jax.jit(jax.grad(lambda q, k, v: (pallas_flash.flash_attention(
      q, k, v, implementation="interpret", **kw) * do).sum(), argnums=(0, 1, 2)))
  for a, b in zip(f(q, k, v), f(q, k, v)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_checkpoint_name_lets_remat_keep_o_and_lse(impl, capsys):
  import jax.ad_checkpoint

  keys = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 2)
  x = jax.random.normal(keys[0], (1, 64, 2, 32), jnp.float32)
  w = jax.random.normal(keys[1], (32, 32), jnp.float32) / 6

  def f(w):
    q = x @ w
    o = pallas_flash.flash_attention(q, x, x, is_causal=True, implementation=impl)
    return jnp.sum(jnp.sin(o))

  policy = jax.checkpoint_policies.save_only_these_names(pallas_flash.CHECKPOINT_NAME)
  kept = jax.checkpoint(f, policy=policy)
  jax.ad_checkpoint.print_saved_residuals(kept, w)
  saved = capsys.readouterr().out
  assert saved.count(f"named '{pallas_flash.CHECKPOINT_NAME}'") == 2, saved  # o and lse
  np.testing.assert_allclose(jax.grad(kept)(w), jax.grad(f)(w), rtol=1e-5, atol=1e-6)


def _lse_loss_grads(attention, q, k, v, do, w):
  """Gradients of sum(o * do) + sum(lse * w), w [B, T, H], for an attention returning
  (o, lse [B, T, H]), and its outputs."""
  def loss(q, k, v):
    o, lse = attention(q, k, v)
    return (o.astype(jnp.float32) * do).sum() + (lse.astype(jnp.float32) * w).sum(), (o, lse)
  return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_return_residual_is_jax_nns(impl, dtype):
  """jax.nn's `return_residual`: lse [B, T, H] in the input dtype under stop_gradient, so the
  value and every gradient of a loss that uses it match jax.nn.dot_product_attention's."""
  (q, k, v, do), _ = make_inputs(Case(q_len=64, kv_len=48, num_kv_heads=4, dtype=dtype))
  w = jax.random.normal(jax.random.key(1), q.shape[:3])
  grads, (o, lse) = _lse_loss_grads(lambda *a: pallas_flash.flash_attention(
      *a, is_causal=True, implementation=impl, return_residual=True), q, k, v, do, w)
  grads_nn, (o_nn, lse_nn) = _lse_loss_grads(lambda *a: jax.nn.dot_product_attention(
      *a, is_causal=True, implementation="xla", return_residual=True), q, k, v, do, w)
  assert lse.shape == lse_nn.shape == q.shape[:3] and lse.dtype == lse_nn.dtype == dtype
  tol = 2 * TOLERANCES[jnp.dtype(dtype)]
  for name, x, ref in zip(("out", "lse", "dq", "dk", "dv"), (o, lse, *grads),
                          (o_nn, lse_nn, *grads_nn)):
    assert_close_to_ref(name, x, ref, tol)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_return_residuals_gradient_is_exact(impl):
  """`return_residuals`: lse [B, H, T] float32 with its gradient: jax.nn's gradient of the
  output term plus the exact gradient of the lse term, which jax.nn's stop_gradient drops."""
  (q, k, v, do), _ = make_inputs(Case(q_len=64, kv_len=48, num_kv_heads=4))
  w = jax.random.normal(jax.random.key(1), q.shape[:3])

  def ours(q, k, v):
    o, lse = pallas_flash.flash_attention(q, k, v, implementation=impl, return_residuals=True)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == jnp.float32
    return o, jnp.swapaxes(lse, 1, 2)

  grads, (o, lse) = _lse_loss_grads(ours, q, k, v, do, w)
  grads_nn, (o_nn, lse_nn) = _lse_loss_grads(lambda *a: jax.nn.dot_product_attention(
      *a, implementation="xla", return_residual=True), q, k, v, do, w)

  def lse_term(q, k):  # the exact lse, differentiable, in plain jnp
    logits = jnp.einsum("bthd,bshd->bths", q, k, precision="highest") / np.sqrt(q.shape[-1])
    return (jax.nn.logsumexp(logits, axis=-1) * w).sum()

  d_lse = jax.grad(lse_term, argnums=(0, 1))(q, k)
  tol = 2 * TOLERANCES[jnp.dtype(jnp.float32)]
  assert_close_to_ref("out", o, o_nn, tol)
  assert_close_to_ref("lse", lse, lse_nn, tol)
  assert_close_to_ref("dq", grads[0], grads_nn[0] + d_lse[0], tol)
  assert_close_to_ref("dk", grads[1], grads_nn[1] + d_lse[1], tol)
  assert_close_to_ref("dv", grads[2], grads_nn[2], tol)
  # The two conventions' dQ differ far beyond the tolerance: the test tells them apart.
  assert max_rel_err(grads_nn[0] + d_lse[0], grads_nn[0]) > 10 * tol


def test_return_residual_and_residuals_together_are_rejected():
  with pytest.raises(ValueError, match="`return_residuals`.*`return_residual`.*not both"):
    pallas_flash.flash_attention(Q, KV, KV, return_residuals=True, return_residual=True)
