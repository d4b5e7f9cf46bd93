"""The public API: validation errors, explain, dispatch, and JAX transformations."""

import contextlib
import functools
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
    ((Q, KV, KV[:, :10]), {}, ValueError, "`key` and `value` must have the same batch, length"),
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
    ((Q, KV, KV), {"query_seq_lengths": jnp.array([-1, 3])}, ValueError,
     re.escape("`query_seq_lengths` values must lie in [0, 16]")),
    ((Q, KV, KV), {"scale": jnp.float32(0.5)}, TypeError, "`scale` must be a finite Python"),
    ((Q, KV, KV), {"implementation": "cudnn"}, ValueError, "Unknown implementation"),
    ((Q, KV, KV), {"implementation": "triton"}, NotImplementedError, "needs an NVIDIA GPU"),
    ((Q, KV, KV), {"implementation": "mosaic"}, NotImplementedError,
     "cannot run this call: needs a Hopper GPU"),
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
  with pytest.raises(ValueError, match="`query_seq_lengths` values must lie in"):
    jax.jit(lambda q, k, v: pallas_flash.flash_attention(
        q, k, v, query_seq_lengths=too_long))(q, k, v)


@pytest.mark.parametrize("name", ["query_segment_ids", "key_value_segment_ids"])
@pytest.mark.parametrize("reserved", [-2**31, -2**31 + 1])
def test_reserved_segment_ids_are_rejected(name, reserved):
  """The two ids that mark padded positions inside the kernels: the blocked paths returned
  zeros for them while the reference attended."""
  ids = {"query_segment_ids": jnp.zeros((2, 16), jnp.int32),
         "key_value_segment_ids": jnp.zeros((2, 24), jnp.int32)}
  ids[name] = ids[name].at[1, 3].set(reserved)
  with pytest.raises(ValueError, match=f"`{name}` holds {reserved}, an id reserved"):
    pallas_flash.flash_attention(Q, KV, KV, implementation="xla", **ids)


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
  want = jax.jit(jax.vmap(jax.grad(ref_loss, argnums=(0, 1, 2))))
  for g, g_ref in zip(vmapped(stack(q), stack(k), stack(v)), want(stack(q), stack(k), stack(v))):
    assert_close_to_ref("grad", g, g_ref, 5e-5)


def test_lse_cotangent_is_differentiated():
  (q, k, v, _), kw = make_inputs(Case(q_len=33, kv_len=50, is_causal=True))
  for impl in ("xla", "interpret"):
    def f(impl, q, k, v):
      _, lse = pallas_flash.flash_attention(q, k, v, implementation=impl, return_residuals=True,
                                            **kw)
      return jnp.sin(lse).sum()
    got = jax.jit(jax.grad(lambda *a: f(impl, *a), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(lambda *a: f("reference", *a), argnums=(0, 1, 2)))(q, k, v)
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


@pytest.mark.parametrize("impl", ["xla", pytest.param("interpret", marks=pytest.mark.slow)])
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


@pytest.mark.parametrize("transform", ["jit_jvp", "jacfwd"])
def test_forward_mode_raises_a_clear_error_and_runs_on_the_reference(transform):
  q = jax.random.normal(jax.random.key(0), (1, 8, 2, 16))

  def f(q, implementation="xla"):
    return pallas_flash.flash_attention(q, q, q, is_causal=True, implementation=implementation)

  run = {"jvp": lambda f: jax.jvp(f, (q,), (q,))[1],
         "jit_jvp": lambda f: jax.jit(lambda q: jax.jvp(f, (q,), (q,))[1])(q),
         "jacfwd": lambda f: jax.jacfwd(lambda q: f(q).sum())(q)}[transform]
  with pytest.raises(TypeError, match="no forward-mode derivative.*implementation=\"reference\""):
    run(f)
  # The values in one program (op by op, each operation compiles on its own).
  got, want = jax.jit(lambda: (run(lambda q: f(q, "reference")),
                               run(lambda q: jax.nn.dot_product_attention(q, q, q,
                                                                          is_causal=True))))()
  assert_close_to_ref(transform, got, want, 1e-5)
  # Forward over reverse (jax.hessian's order) passes the custom_vjp.
  jax.jit(lambda q: jax.jvp(jax.grad(lambda q: f(q).sum()), (q,), (q,)))(q)


def _nnx_layer(**kw):
  from flax import nnx

  from pallas_flash.flax import FlashMultiHeadAttention
  return FlashMultiHeadAttention(4, 32, rngs=nnx.Rngs(0), **kw)


def _cached_layer():
  layer = _nnx_layer()
  layer.init_cache(1, 8)
  return layer


def _make_attention_fn(**kw):
  from pallas_flash.flax import make_attention_fn
  return make_attention_fn(**kw)


X32, X24 = jnp.ones((1, 8, 32)), jnp.ones((1, 8, 24))
SEG = jnp.zeros((1, 8), jnp.int32)


@pytest.mark.parametrize("name, error, make_error", [
    ("dropout_rng", TypeError, lambda: pallas_flash.flash_attention(
        Q, Q, Q, dropout_rate=0.1, dropout_rng=3)),
    ("is_causal", TypeError, lambda: jax.jit(
        lambda q, c: pallas_flash.flash_attention(q, q, q, is_causal=c))(Q, True)),
    ("inputs_q", ValueError, lambda: _nnx_layer()(X24)),
    ("inputs_kv", ValueError, lambda: _nnx_layer()(X32, X24)),
    ("inputs", ValueError, lambda: _cached_layer()(X24, decode=True)),
    ("kv_segment_ids", ValueError, lambda: _nnx_layer()(X32, X32[:, :6], segment_ids=SEG)),
    ("mask", ValueError, lambda: pallas_flash.flash_attention(Q, Q, Q, mask=jnp.ones((3, 16, 16),
                                                                                     bool))),
    ("local_window_size", ValueError, lambda: _nnx_layer(local_window_size=-1)),
    ("local_window_size", TypeError, lambda: _nnx_layer(local_window_size=(1, 2, 3))),
    ("logits_soft_cap", ValueError, lambda: _nnx_layer(logits_soft_cap=0.0)),
    ("implementation", ValueError, lambda: _nnx_layer(implementation="cuda")),
    ("decode_implementation", ValueError, lambda: _nnx_layer(decode_implementation="cuda")),
    ("implementation", ValueError, lambda: _make_attention_fn(implementation="cuda")),
], ids=lambda x: x if isinstance(x, str) else "")
def test_errors_name_the_argument(name, error, make_error):
  """Each bad argument fails with its own name in the message: at the call for call arguments,
  when a layer (or attention_fn) is built for the options it binds."""
  with pytest.raises(error) as info:
    make_error()
  message = str(info.value)
  assert f"`{name}`" in message or f" {name}=" in message, message
  assert "maskes" not in message


@pytest.mark.parametrize("name, value, match", [
    ("query_seq_lengths", jnp.array([16, 17]), r"`query_seq_lengths`\[1\] = 17 lies outside"),
    ("key_value_seq_lengths", jnp.array([-1, 3]),
     r"`key_value_seq_lengths`\[0\] = -1 lies outside \[0, 24\]"),
    ("query_segment_ids", jnp.zeros((2, 16), jnp.int32).at[1, 5].set(-2**31),
     r"`query_segment_ids`\[1, 5\] = -2147483648 is an id reserved"),
    ("key_value_segment_ids", jnp.zeros((2, 24), jnp.int32).at[0, 7].set(-2**31 + 1),
     r"`key_value_segment_ids`\[0, 7\] = -2147483647 is an id reserved"),
])
def test_checked_mode_reports_bad_values_under_jit(name, value, match):
  from jax.experimental import checkify
  kwargs = {"query_segment_ids": jnp.zeros((2, 16), jnp.int32),
            "key_value_segment_ids": jnp.zeros((2, 24), jnp.int32)} if "segment" in name else {}

  def f(q, k, v, x, checked=True):
    return pallas_flash.flash_attention(q, k, v, implementation="xla", checked=checked,
                                        **{**kwargs, name: x})

  good = jnp.clip(value, 0, None) if "segment" in name else jnp.clip(value, 0, 16)
  err, _ = checkify.checkify(jax.jit(f))(Q, KV, KV, good)
  err.throw()  # valid values pass
  err, out = checkify.checkify(jax.jit(f))(Q, KV, KV, value)
  with pytest.raises(ValueError, match=match):
    err.throw()
  assert out.shape == Q.shape
  jax.jit(functools.partial(f, checked=False))(Q, KV, KV, value)  # unchecked: no error


def test_explain_reports_blocks_computed_at_the_chosen_config():
  from jax.sharding import use_abstract_mesh

  from testing import H200
  q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
  fractions = set()
  for mesh in (None, H200):  # xla on this CPU, mosaic on an abstract H200
    with use_abstract_mesh(mesh) if mesh is not None else contextlib.nullcontext():
      ex = pallas_flash.explain(q, q, q, is_causal=True)
    block = (ex.config.block_q, ex.config.block_kv)
    assert ex.block_shape == block, (ex.chosen, ex.block_shape, block)
    want = pallas_flash._tiling.fraction_computed(q_len=1024, kv_len=1024, block_q=block[0],
                                                  block_kv=block[1], band=(None, 0))
    assert ex.blocks_computed == want and f"{block[0]}x{block[1]} score blocks" in str(ex)
    fractions.add(want)
  assert len(fractions) == 2  # the two backends' blocks differ
def _lse_loss_grads(attention, q, k, v, do, w):
  """Gradients of sum(o * do) + sum(lse * w), w [B, T, H], for an attention returning
  (o, lse [B, T, H]), and its outputs."""
  def loss(q, k, v):
    o, lse = attention(q, k, v)
    return (o.astype(jnp.float32) * do).sum() + (lse.astype(jnp.float32) * w).sum(), (o, lse)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)


@pytest.mark.parametrize("impl, dtype", [  # xla float32 with -m slow (suite time)
    pytest.param("xla", jnp.float32, marks=pytest.mark.slow), ("xla", jnp.bfloat16),
    ("reference", jnp.float32), ("reference", jnp.bfloat16)],
    ids=["float32-xla", "bfloat16-xla", "float32-reference", "bfloat16-reference"])
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


@pytest.mark.parametrize("name", ["return_residuals", "return_residual"])
def test_residual_flags_must_be_bools(name):
  """A string or array flag is not read by truthiness: it decides what the call returns."""
  with pytest.raises(TypeError, match=f"`{name}` must be a Python bool"):
    pallas_flash.flash_attention(Q, KV, KV, **{name: "no"})


@pytest.mark.parametrize("name", ["is_causal", "deterministic", "return_residuals",
                                  "return_residual", "checked"])
def test_static_flags_follow_one_rule(name):
  """Every static flag takes a host bool, Python's or NumPy's (np.array(True)[()]), alike; an
  array's truth is unknown when tracing, so a jnp bool is refused."""
  q, kv = (jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate((Q, KV)))
  with_numpy = pallas_flash.flash_attention(q, kv, kv, implementation="xla",
                                            **{name: np.array(True)[()]})
  with_python = pallas_flash.flash_attention(q, kv, kv, implementation="xla", **{name: True})
  for got, want in zip(jax.tree.leaves(with_numpy), jax.tree.leaves(with_python), strict=True):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(TypeError, match=f"`{name}` must be a Python bool"):
    pallas_flash.flash_attention(q, kv, kv, implementation="xla", **{name: jnp.array(True)})


def test_integer_arguments_follow_one_rule():
  """Integer arguments and config fields take a Python or NumPy integer alike (NumPy's stored
  as Python ints, so configs compare and hash equal); a bool is refused, not read as 0 or 1."""
  q, kv = (jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate((Q, KV)))
  for window in (3, (2, 1)):
    as_numpy = jax.tree.map(np.int64, window)
    np.testing.assert_array_equal(
        pallas_flash.flash_attention(q, kv, kv, implementation="xla", local_window_size=as_numpy),
        pallas_flash.flash_attention(q, kv, kv, implementation="xla", local_window_size=window))
  with pytest.raises(TypeError, match="`local_window_size` must be an int"):
    pallas_flash.flash_attention(q, kv, kv, implementation="xla", local_window_size=True)

  config = pallas_flash.TritonDecodeConfig(block_kv=np.int64(64), num_warps=np.int32(4))
  assert config == pallas_flash.TritonDecodeConfig(block_kv=64, num_warps=4)
  assert hash(config) == hash(pallas_flash.TritonDecodeConfig(block_kv=64, num_warps=4))
  assert type(config.block_kv) is int
  with pytest.raises(TypeError, match="TritonDecodeConfig.block_kv must be a Python int"):
    pallas_flash.TritonDecodeConfig(block_kv=True)

  shapes = [jax.ShapeDtypeStruct(s, t) for s, t in (((1, 1, 4, 32), jnp.float32),
                                                     ((1, 16, 2, 32), jnp.float32),
                                                     ((1,), jnp.int32))]
  plan = pallas_flash.decode_explain(shapes[0], shapes[1], shapes[1], shapes[2],
                                     num_splits=np.int64(2))
  assert plan.runs == 2 and type(plan.runs) is int  # S * B runs, B = 1
  with pytest.raises(ValueError, match="`num_splits` must be"):
    pallas_flash.decode_explain(shapes[0], shapes[1], shapes[1], shapes[2], num_splits=True)

  from pallas_flash import fp8
  with_numpy = fp8.quantize(q, kv, kv, block=np.int64(8))
  with_python = fp8.quantize(q, kv, kv, block=8)
  assert type(with_numpy[1].block) is int
  for got, want in zip(jax.tree.leaves(with_numpy), jax.tree.leaves(with_python), strict=True):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="`block` must be None"):
    fp8.quantize(q, kv, kv, block=True)


def test_explain_checks_what_the_call_checks():
  """Arguments with no influence on the choice are still checked: an explanation does not call
  runnable a call that raises."""
  with pytest.raises(ValueError, match="`sinks` must have shape"):
    pallas_flash.explain(Q, KV, KV, sinks=jnp.zeros(7))
  with pytest.raises(TypeError, match="`return_residuals` must be a Python bool"):
    pallas_flash.explain(Q, KV, KV, return_residuals="no")
  q = jax.ShapeDtypeStruct((1, 1, 4, 32), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 16, 2, 32), jnp.float32)
  lens = jax.ShapeDtypeStruct((1,), jnp.int32)
  with pytest.raises(ValueError, match="`sinks` must have shape"):
    pallas_flash.decode_explain(q, kv, kv, lens, sinks=jnp.zeros(3))
