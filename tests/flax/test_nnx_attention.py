"""FlashMultiHeadAttention against nnx.MultiHeadAttention on the same weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_flash.flax import FlashMultiHeadAttention, apply_rotary

TOL = 2e-5


def assert_close(x, ref, tol=TOL, what="", floor=1e-30):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  err = float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), floor))
  assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def assert_grads_close(grads, ref):
  """Leaf-wise. The key bias's gradient is analytically zero (softmax ignores a per-query
  constant), so what remains is rounding of other gradients' size: the floor, 10% of the largest
  gradient, measures it on their scale rather than on its own ~0."""
  floor = 1e-1 * max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref)):
    assert_close(a, b, what=jax.tree_util.keystr(path), floor=floor)


def _layers(seed, *, heads=4, kv_heads=2, rope=False):
  ours = FlashMultiHeadAttention(heads, 32, num_kv_heads=kv_heads, implementation="xla",
                                 rope_theta=10_000.0 if rope else None, rngs=nnx.Rngs(seed))
  attention_fn = functools.partial(nnx.dot_product_attention_with_rope, rope=nnx.RoPE()) \
      if rope else nnx.dot_product_attention
  theirs = nnx.MultiHeadAttention(heads, 32, num_kv_heads=kv_heads, decode=False,
                                  attention_fn=attention_fn, rngs=nnx.Rngs(seed + 1))
  nnx.update(theirs, nnx.state(ours, nnx.Param))  # weights move over by name
  return ours, theirs


# One program per layer and input shapes: called op by op, each operation compiles on its own.
_call = nnx.jit(lambda layer, x, **kw: layer(x, **kw))


@nnx.jit
def _decode_step(layer, x):
  return layer(x, decode=True)


def _out_and_grads(layer, x, cot, **kw):
  """The layer's output on x and the parameters' gradients of sum(out * cot), as one
  jit-compiled program (op by op, each small operation compiles on its own)."""
  @nnx.jit
  def run(layer, x, cot):
    return layer(x, **kw), nnx.state(nnx.grad(lambda m: jnp.sum(m(x, **kw) * cot))(layer),
                                     nnx.Param)

  return run(layer, x, cot)


def test_parameters_named_and_shaped_like_nnx():
  ours, theirs = _layers(0)
  shapes = lambda m: jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(m, nnx.Param)))  # noqa
  assert shapes(ours) == shapes(theirs)


# Rotary with MHA and MQA runs with -m slow (suite time): GQA covers it.
@pytest.mark.parametrize("heads,kv_heads,rope", [
    (4, 4, False), (4, 2, False), (4, 1, False), (4, 2, True),
    pytest.param(4, 4, True, marks=pytest.mark.slow),
    pytest.param(4, 1, True, marks=pytest.mark.slow)],
    ids=["mha-plain", "gqa-plain", "mqa-plain", "gqa-rope", "mha-rope", "mqa-rope"])
def test_matches_nnx_multihead_attention(heads, kv_heads, rope):
  seed = np.random.randint(1 << 30)
  ours, theirs = _layers(seed, heads=heads, kv_heads=kv_heads, rope=rope)
  x = jax.random.normal(jax.random.key(seed), (2, 48, 32))
  cot = jax.random.normal(jax.random.key(seed + 1), (2, 48, 32))
  out, grads = _out_and_grads(ours, x, cot, is_causal=True)
  ref, ref_grads = _out_and_grads(theirs, x, cot, is_causal=True)
  assert_close(out, ref, what="output")
  assert_grads_close(grads, ref_grads)


def test_rotary_matches_nnx_rope():
  seed = np.random.randint(1 << 30)
  x = jax.random.normal(jax.random.key(seed), (2, 16, 3, 8))
  pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
  ref = jax.vmap(nnx.RoPE(), in_axes=-2, out_axes=-2)(x)
  assert_close(apply_rotary(x, pos), ref, what="rotary")


def test_packed_documents_do_not_see_each_other():
  """A packed row gives each document exactly the output it gets alone (positions restart)."""
  seed = np.random.randint(1 << 30)
  layer = FlashMultiHeadAttention(4, 32, num_kv_heads=2, is_causal=True, rope_theta=1e4,
                                  implementation="xla", rngs=nnx.Rngs(seed))
  a, b = (jax.random.normal(jax.random.key(seed + i), (1, n, 32)) for i, n in ((1, 19), (2, 13)))
  packed = jnp.concatenate([a, b], axis=1)
  seg = jnp.concatenate([jnp.zeros(19, jnp.int32), jnp.ones(13, jnp.int32)])[None]
  pos = jnp.concatenate([jnp.arange(19), jnp.arange(13)])[None]
  out = _call(layer, packed, segment_ids=seg, positions=pos)
  assert_close(out[:, :19], _call(layer, a), what="first document")
  assert_close(out[:, 19:], _call(layer, b), what="second document")
  # Without segment ids the second document sees the first.
  leaky = _call(layer, packed, positions=pos)
  assert np.max(np.abs(np.asarray(leaky[:, 19:] - out[:, 19:]))) > 1e-3


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("features", [
    dict(local_window_size=(7, 3)),
    dict(logits_soft_cap=2.0),
    dict(alibi=True),
    dict(local_window_size=5, logits_soft_cap=3.0, alibi=(0.5, 0.25, 0.125, 0.0625)),
], ids=["window", "softcap", "alibi", "all"])
def test_features_match_reference(features, is_causal):
  """Window, soft cap and ALiBi reach the kernels: xla matches the materialising reference, and
  the output differs from the same layer without them."""
  seed = np.random.randint(1 << 30)
  make = lambda impl, **kw: FlashMultiHeadAttention(  # noqa: E731
      4, 32, num_kv_heads=2, is_causal=is_causal, rope_theta=1e4, implementation=impl,
      rngs=nnx.Rngs(seed), **kw)
  ours, ref_layer, plain = make("xla", **features), make("reference", **features), make("xla")
  # large weights make logits big enough for the soft cap to matter
  x = 4.0 * jax.random.normal(jax.random.key(seed), (2, 40, 32))
  cot = jax.random.normal(jax.random.key(seed + 1), (2, 40, 32))
  out, grads = _out_and_grads(ours, x, cot)
  ref, ref_grads = _out_and_grads(ref_layer, x, cot)
  assert_close(out, ref, what="output")
  assert_grads_close(grads, ref_grads)
  assert np.max(np.abs(np.asarray(_call(plain, x) - out))) > 1e-3 * np.max(np.abs(np.asarray(ref)))


def test_alibi_slopes_schedule():
  from pallas_flash.flax import alibi_slopes

  assert alibi_slopes(8) == tuple(2.0 ** (-(h + 1)) for h in range(8))
  assert alibi_slopes(6) == alibi_slopes(4) + tuple(2.0 ** (-(2 * h + 1)) for h in range(2))
  with pytest.raises(ValueError, match="one slope per query head"):
    FlashMultiHeadAttention(4, 32, alibi=(0.5, 0.25), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads=0), "`num_heads` must be a positive Python int"),
    (dict(num_kv_heads=0), r"`num_kv_heads` must be None \(MHA\) or a positive Python int"),
    (dict(rope_theta=0.0), "`rope_theta` must be a positive base period"),
    (dict(rope_theta=-1.0), "`rope_theta` must be a positive base period"),
])
def test_bad_layer_arguments_name_themselves(kwargs, match):
  args = dict(num_heads=4, in_features=32, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=match):
    FlashMultiHeadAttention(**(args | kwargs))


# ---------------------------------------------------------------------------------------------
# KV cache: init_cache, then decode=True for the prompt and each new token


@pytest.mark.parametrize("page_size", [None, 4], ids=["contiguous", "paged"])
@pytest.mark.parametrize("features", [{}, {"local_window_size": (5, 0), "logits_soft_cap": 20.0}],
                         ids=["plain", "window_softcap"])
def test_prefill_then_steps_equal_the_full_causal_forward(page_size, features):
  layer = FlashMultiHeadAttention(4, 32, num_kv_heads=2, is_causal=True, rope_theta=1e4,
                                  implementation="xla", rngs=nnx.Rngs(0), **features)
  x = jax.random.normal(jax.random.key(1), (2, 11, 32))
  full = _call(layer, x)
  layer.init_cache(2, 16, page_size=page_size)
  outs = [_decode_step(layer, x[:, :6])] + [_decode_step(layer, x[:, t:t + 1])
                                            for t in range(6, 11)]
  assert_close(jnp.concatenate(outs, axis=1), full, tol=1e-5, what="cached decode")
  np.testing.assert_array_equal(np.asarray(layer.cache_seqlens[...]), [11, 11])
  layer.init_cache(2, 16, page_size=page_size)  # starts empty again
  assert_close(_decode_step(layer, x[:, :3]), full[:, :3], tol=1e-5, what="after re-init")


# Paged under -m slow: the FP8 append through pages is tests/test_decode.py's.
@pytest.mark.parametrize("page_size", [None, pytest.param(4, marks=pytest.mark.slow)],
                         ids=["contiguous", "paged"])
def test_fp8_cache_steps_follow_the_full_forward(page_size):
  """An e4m3 cache with per-head descales: keys and values rounded to 3 mantissa bits (outputs
  within a few % of the full forward), the cache e4m3 and the descales honoured."""
  layer = FlashMultiHeadAttention(4, 32, num_kv_heads=2, is_causal=True, rope_theta=1e4,
                                  implementation="xla", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 11, 32))
  full = _call(layer, x)
  layer.init_cache(2, 16, page_size=page_size, dtype=jnp.float8_e4m3fn,
                   kv_descale=(jnp.array([0.01, 0.02]), 0.01))
  outs = [_decode_step(layer, x[:, :6])] + [_decode_step(layer, x[:, t:t + 1])
                                            for t in range(6, 11)]
  assert layer.cached_key.dtype == jnp.float8_e4m3fn
  assert_close(jnp.concatenate(outs, axis=1), full, tol=0.05, what="FP8 cached decode")
  with pytest.raises(ValueError, match="applies to float8_e4m3fn caches only"):
    layer.init_cache(2, 16, kv_descale=(1.0, 1.0))
  with pytest.raises(ValueError, match=r"key_descale must have shape \(\) \(per tensor\) or"):
    layer.init_cache(2, 16, dtype=jnp.float8_e4m3fn, kv_descale=(jnp.ones(3), 1.0))
  # Checked here, with the values in hand: a jitted decode step could not.
  for bad, error in (((0.0, 0.05), ValueError), ((float("nan"), 1.0), ValueError),
                     (0.01, TypeError), (jnp.array([0.01, 0.02]), TypeError)):
    with pytest.raises(error, match="kv_descale"):
      layer.init_cache(2, 16, dtype=jnp.float8_e4m3fn, kv_descale=bad)


def test_decode_needs_a_cache_and_no_positions():
  layer = FlashMultiHeadAttention(4, 32, is_causal=True, rngs=nnx.Rngs(0))
  x = jnp.zeros((1, 2, 32))
  with pytest.raises(ValueError, match="init_cache"):
    layer(x, decode=True)
  layer.init_cache(1, 8)
  with pytest.raises(ValueError, match="does not take positions"):
    layer(x, decode=True, positions=jnp.zeros((1, 2), jnp.int32))
  with pytest.raises(ValueError, match="multiple of page_size"):
    layer.init_cache(1, 10, page_size=4)
  for kwargs in (dict(page_size=0), dict(batch_size=-1), dict(max_length=0)):
    with pytest.raises(ValueError, match=f"`{next(iter(kwargs))}` must be a positive Python int"):
      layer.init_cache(**(dict(batch_size=1, max_length=8) | kwargs))
