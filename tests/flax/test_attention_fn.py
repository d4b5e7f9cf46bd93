"""The Flax attention_fn: equal to Flax's own attention where it maps, dense fallback otherwise."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

from pallas_flash.flax import attention_fn as attention_fn_lib
from pallas_flash.flax import flash_attention_fn, make_attention_fn

TOL = 2e-5  # float32 on CPU: relative to the largest reference magnitude


def rel_err(x, ref, floor: float = 1e-30) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), floor))


def assert_close(x, ref, tol=TOL, what="", floor: float = 1e-30):
  err = rel_err(x, ref, floor)
  assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def assert_trees_close(tree, ref, tol=TOL):
  """Leaf-wise relative error; a leaf's scale is at least 1% of the tree's largest gradient.

  The floor matters for gradients that are analytically zero (the key-projection bias adds the
  same logit to every key, which softmax ignores): there both sides are rounding noise.
  """
  floor = 1e-2 * max(float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(ref))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(ref)):
    assert_close(a, b, tol, jax.tree_util.keystr(path), floor)


@pytest.fixture(autouse=True)
def _fresh_warnings():
  attention_fn_lib._warn_once.cache_clear()
  yield


def _nnx_pair(seed, attention_fn, **kw):
  make = lambda fn: nnx.MultiHeadAttention(  # noqa: E731
      num_heads=4, in_features=32, qkv_features=32, num_kv_heads=2, decode=False,
      attention_fn=fn, rngs=nnx.Rngs(seed), **kw)
  return make(attention_fn), make(nnx.dot_product_attention)


def _nnx_loss_and_grads(layer, x, cot, **call_kw):
  def loss(m):
    return jnp.sum(m(x, **call_kw) * cot)
  out = layer(x, **call_kw)
  return out, nnx.grad(loss)(layer)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_nnx_multihead_attention_matches_flax(is_causal):
  seed = np.random.randint(1 << 30)
  ours, theirs = _nnx_pair(seed, make_attention_fn(implementation="xla"))
  x = jax.random.normal(jax.random.key(seed), (2, 40, 32))
  cot = jax.random.normal(jax.random.key(seed + 1), (2, 40, 32))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the flash path must not warn
    out, grads = _nnx_loss_and_grads(ours, x, cot, is_causal=is_causal)
  ref, ref_grads = _nnx_loss_and_grads(theirs, x, cot, is_causal=is_causal)
  assert_close(out, ref, what="output")
  assert_trees_close(nnx.state(grads, nnx.Param), nnx.state(ref_grads, nnx.Param))


def test_linen_multihead_attention_matches_flax_causal_mask():
  seed = np.random.randint(1 << 30)
  x = jax.random.normal(jax.random.key(seed), (2, 24, 16))
  make = lambda fn: linen.MultiHeadDotProductAttention(  # noqa: E731
      num_heads=2, qkv_features=16, attention_fn=fn, deterministic=True)
  ours, theirs = make(make_attention_fn(is_causal=True, implementation="xla")), \
      make(linen.dot_product_attention)
  params = theirs.init(jax.random.key(seed), x, mask=linen.make_causal_mask(x[..., 0]))
  mask = linen.make_causal_mask(x[..., 0])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out, vjp = jax.vjp(lambda p: ours.apply(p, x), params)
  ref, ref_vjp = jax.vjp(lambda p: theirs.apply(p, x, mask=mask), params)
  assert_close(out, ref, what="output")
  cot = jax.random.normal(jax.random.key(seed + 1), out.shape)
  assert_trees_close(vjp(cot), ref_vjp(cot))


def _qkv(seed, b=2, t=20, h=4, k=2, d=8):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (b, t, h, d)), jax.random.normal(keys[1], (b, t, k, d)),
          jax.random.normal(keys[2], (b, t, k, d)))


def test_dense_mask_falls_back_with_one_warning():
  q, k, v = _qkv(np.random.randint(1 << 30))
  mask = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 1, 20, 20)).at[..., 0].set(True)
  with pytest.warns(UserWarning, match="dense `mask`") as record:
    out = flash_attention_fn(q, k, v, mask=mask)
    flash_attention_fn(q, k, v, mask=mask)
  assert len([w for w in record if "falls back" in str(w.message)]) == 1
  assert_close(out, nnx.dot_product_attention(q, k, v, mask=mask), what="masked output")


@pytest.mark.parametrize("reason,kwargs", [
    ("bias", lambda: dict(bias=jax.random.normal(jax.random.key(0), (2, 4, 20, 20)))),
    ("dropout", lambda: dict(dropout_rate=0.5, deterministic=False,
                             dropout_rng=jax.random.key(1))),
], ids=["bias", "dropout"])
def test_bias_and_dropout_fall_back_to_flax(reason, kwargs):
  q, k, v = _qkv(np.random.randint(1 << 30))
  kw = kwargs()
  with pytest.warns(UserWarning, match=reason):
    out = flash_attention_fn(q, k, v, **kw)
  assert_close(out, nnx.dot_product_attention(q, k, v, **kw), what=reason)


def test_segment_ids_and_batch_dims_match_dense_mask():
  seed = np.random.randint(1 << 30)
  q, k, v = (x.reshape(2, 1, *x.shape[1:]) for x in _qkv(seed))  # [2, 1, T, H, D]
  seg = jnp.cumsum(jax.random.bernoulli(jax.random.key(seed), 0.15, (2, 1, 20)), -1)
  out = flash_attention_fn(q, k, v, is_causal=True, implementation="xla",
                           query_segment_ids=seg.astype(jnp.int32))
  mask = (seg[..., :, None] == seg[..., None, :])[..., None, :, :]
  ref = nnx.dot_product_attention(q, k, v, mask=mask, is_causal=True)
  assert out.shape == q.shape
  assert_close(out, ref, what="segments")


def test_unknown_keyword_is_an_error():
  q, k, v = _qkv(0)
  with pytest.raises(TypeError):
    flash_attention_fn(q, k, v, input_positions=jnp.arange(20))
