"""The Flax attention_fn: equal to Flax's own attention on the kernels (dense bias and mask,
unbroadcast dropout included), dense fallback with a warning for the rest."""

import functools
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
  as_64 = np.complex128 if np.iscomplexobj(x) or np.iscomplexobj(ref) else np.float64
  x, ref = np.asarray(x, as_64), np.asarray(ref, as_64)
  return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), floor))


def assert_close(x, ref, tol=TOL, what="", floor: float = 1e-30):
  err = rel_err(x, ref, floor)
  assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def assert_trees_close(tree, ref, tol=TOL):
  """Leaf-wise relative error; a leaf's scale is at least 10% of the tree's largest gradient.

  The floor matters for gradients that are analytically zero (the key-projection bias adds the
  same logit to every key, which softmax ignores): there both sides are rounding noise, which
  reached 2.1e-5 of a 1% floor in CI (1.7e-5 at most over 40 seeds), so the floor is 10%.
  """
  floor = 1e-1 * max(float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(ref))
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
  """The layer's output and its gradients of sum(out * cot), as one jit-compiled program (op by
  op, each small operation compiles on its own)."""
  @nnx.jit
  def run(layer, x, cot):
    return layer(x, **call_kw), nnx.grad(lambda m: jnp.sum(m(x, **call_kw) * cot))(layer)

  return run(layer, x, cot)


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
  cot = jax.random.normal(jax.random.key(seed + 1), x.shape)  # the output's shape

  @functools.partial(jax.jit, static_argnums=0)  # one program: op by op, each op compiles
  def out_and_grads(apply, params):
    out, vjp = jax.vjp(apply, params)
    return out, vjp(cot)

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out, grads = out_and_grads(lambda p: ours.apply(p, x), params)
  ref, ref_grads = out_and_grads(lambda p: theirs.apply(p, x, mask=mask), params)
  assert_close(out, ref, what="output")
  assert_trees_close(grads, ref_grads)


def _qkv(seed, b=2, t=20, h=4, k=2, d=8):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (b, t, h, d)), jax.random.normal(keys[1], (b, t, k, d)),
          jax.random.normal(keys[2], (b, t, k, d)))


def _assert_matches_flax(fn, ref_fn, args, what, argnums):
  """Outputs and the gradients of a random projection of them, relative to the reference's."""
  cot_key = jax.random.key(np.random.randint(1 << 30))

  @functools.partial(jax.jit, static_argnums=0)
  def out_and_grads(fn, args):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(jax.random.normal(cot_key, out.shape))

  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the kernels path must not warn
    out, grads = out_and_grads(fn, args)
  ref, ref_grads = out_and_grads(ref_fn, args)
  assert out.shape == ref.shape
  assert_close(out, ref, what=f"{what} output")
  for i in argnums:
    assert_close(grads[i], ref_grads[i], what=f"{what} grad {i}")


def _mask(seed, shape):
  """A random boolean mask in which every query sees at least one key (key 0), as Flax's dense
  attention gives a fully masked row the mean of all values where the kernels give zeros."""
  return jax.random.bernoulli(jax.random.key(seed), 0.7, shape).at[..., 0].set(True)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 1, 20, 20), (2, 4, 20, 20), (20, 20), (1, 4, 1, 20)],
                         ids=["b1ts", "bhts", "ts", "1h1s"])
def test_dense_mask_runs_kernels_and_matches_flax(shape, is_causal):
  seed = np.random.randint(1 << 30)
  q, k, v = _qkv(seed)
  mask = _mask(seed + 1, shape)
  fn = lambda q, k, v: flash_attention_fn(q, k, v, mask=mask, is_causal=is_causal,  # noqa: E731
                                          implementation="xla")
  ref_fn = lambda q, k, v: nnx.dot_product_attention(  # noqa: E731
      q, k, v, mask=jnp.broadcast_to(mask, (2, 4, 20, 20)), is_causal=is_causal)
  _assert_matches_flax(fn, ref_fn, (q, k, v), f"mask{shape}", argnums=(0, 1, 2))


@pytest.mark.parametrize("shape", [(2, 4, 20, 20), (1, 4, 20, 20), (2, 1, 1, 20), (20, 20)],
                         ids=["bhts", "1hts", "b11s", "ts"])
def test_dense_bias_runs_kernels_and_matches_flax(shape):
  seed = np.random.randint(1 << 30)
  q, k, v = _qkv(seed)
  bias = jax.random.normal(jax.random.key(seed + 1), shape)
  mask = _mask(seed + 2, (2, 1, 20, 20))
  fn = lambda q, k, v, bias: flash_attention_fn(q, k, v, bias, mask,  # noqa: E731
                                                implementation="xla")
  ref_fn = lambda q, k, v, bias: nnx.dot_product_attention(q, k, v, bias, mask)  # noqa: E731
  _assert_matches_flax(fn, ref_fn, (q, k, v, bias), f"bias{shape}", argnums=(0, 1, 2, 3))


def test_bias_and_mask_with_extra_batch_dims():
  """[2, 3] batch dims flatten alike for q/k/v, a partly broadcast mask and a broadcast bias."""
  seed = np.random.randint(1 << 30)
  q, k, v = (x.reshape(2, 3, *x.shape[1:]) for x in _qkv(seed, b=6))  # [2, 3, T, H, D]
  mask = _mask(seed + 1, (2, 1, 1, 20, 20))  # per first batch axis, shared by the second
  bias = jax.random.normal(jax.random.key(seed + 2), (3, 4, 20, 20))  # per second batch axis
  fn = lambda q, k, v, bias: flash_attention_fn(q, k, v, bias, mask,  # noqa: E731
                                                implementation="xla")
  full = (2, 3, 4, 20, 20)  # Flax hands several batch axes to jax.nn, which needs them full
  ref_fn = lambda q, k, v, bias: nnx.dot_product_attention(  # noqa: E731
      q, k, v, jnp.broadcast_to(bias, full), jnp.broadcast_to(mask, full))
  _assert_matches_flax(fn, ref_fn, (q, k, v, bias), "batch dims", argnums=(0, 1, 2, 3))


def test_nnx_layer_with_padding_mask_runs_kernels():
  """nnx.MultiHeadAttention with a float make_attention_mask padding mask, plus is_causal."""
  seed = np.random.randint(1 << 30)
  ours, theirs = _nnx_pair(seed, make_attention_fn(implementation="xla"))
  x = jax.random.normal(jax.random.key(seed), (2, 40, 32))
  cot = jax.random.normal(jax.random.key(seed + 1), (2, 40, 32))
  valid = jnp.arange(40)[None] < jnp.array([[40], [27]])
  mask = nnx.make_attention_mask(valid, valid)  # float32 [2, 1, 40, 40]
  mask = jnp.maximum(mask, jnp.eye(40))  # padded queries see themselves (no empty rows)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out, grads = _nnx_loss_and_grads(ours, x, cot, mask=mask, is_causal=True)
  ref, ref_grads = _nnx_loss_and_grads(theirs, x, cot, mask=mask, is_causal=True)
  assert_close(out, ref, what="output")
  assert_trees_close(nnx.state(grads, nnx.Param), nnx.state(ref_grads, nnx.Param))


def _dense_with_keep_mask(q, k, v, mask, keep, rate):
  """Flax's dense attention (GQA by repeating k/v heads) with a given dropout keep mask."""
  rep = q.shape[-2] // k.shape[-2]
  k, v = (jnp.repeat(x, rep, axis=-2) for x in (k, v))
  logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
  p = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(logits.dtype).min), axis=-1)
  return jnp.einsum("bhts,bshd->bthd", p * keep / (1.0 - rate), v)


def test_dropout_without_broadcast_runs_kernels():
  """broadcast_dropout=False: an independent mask per (b, h, i, j), which is the kernels' hash."""
  from pallas_flash import dropout

  seed = np.random.randint(1 << 30)
  q, k, v = _qkv(seed)
  rate, rng = 0.3, jax.random.key(seed + 1)
  mask = _mask(seed + 2, (2, 1, 20, 20))
  fn = lambda q, k, v: flash_attention_fn(  # noqa: E731
      q, k, v, mask=mask, dropout_rng=rng, dropout_rate=rate, broadcast_dropout=False,
      implementation="xla")
  keep = dropout.keep_mask(dropout.seed_from_rng(rng), 2, 4, 20, 20, rate)
  assert 0.5 < float(jnp.mean(keep)) < 0.9
  ref_fn = lambda q, k, v: _dense_with_keep_mask(q, k, v, mask, keep, rate)  # noqa: E731
  _assert_matches_flax(fn, ref_fn, (q, k, v), "dropout", argnums=(0, 1, 2))
  # deterministic=True switches dropout off, as in Flax
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    off = flash_attention_fn(q, k, v, mask=mask, dropout_rng=rng, dropout_rate=rate,
                             broadcast_dropout=False, deterministic=True, implementation="xla")
  assert_close(off, nnx.dot_product_attention(q, k, v, mask=mask), what="deterministic")


def test_nnx_layer_dropout_without_broadcast_runs_kernels():
  seed = np.random.randint(1 << 30)
  layer = nnx.MultiHeadAttention(
      num_heads=4, in_features=32, num_kv_heads=2, decode=False, dropout_rate=0.2,
      broadcast_dropout=False, attention_fn=make_attention_fn(implementation="xla"),
      rngs=nnx.Rngs(seed))
  x = jax.random.normal(jax.random.key(seed), (2, 24, 32))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    a = layer(x, deterministic=False, is_causal=True)
    b = layer(x, deterministic=False, is_causal=True)  # the next dropout key
    c = layer(x, deterministic=True, is_causal=True)
  assert np.all(np.isfinite(np.asarray(a)))
  assert np.max(np.abs(np.asarray(a - b))) > 1e-3 and np.max(np.abs(np.asarray(a - c))) > 1e-3


def test_broadcast_dropout_falls_back_with_one_warning():
  """Flax's default broadcast_dropout=True shares one mask over batch and heads: dense path."""
  q, k, v = _qkv(np.random.randint(1 << 30))
  kw = dict(dropout_rate=0.5, deterministic=False, dropout_rng=jax.random.key(1),
            bias=jax.random.normal(jax.random.key(0), (2, 4, 20, 20)))
  with pytest.warns(UserWarning, match="broadcast_dropout") as record:
    out = flash_attention_fn(q, k, v, **kw)
    flash_attention_fn(q, k, v, **kw)
  assert len([w for w in record if "falls back" in str(w.message)]) == 1
  assert_close(out, nnx.dot_product_attention(q, k, v, **kw), what="broadcast dropout")


@pytest.mark.filterwarnings(r"ignore:Using 'Module.sow\(\)' outside:DeprecationWarning")
def test_sow_weights_falls_back_to_flax():
  seed = np.random.randint(1 << 30)
  ours, theirs = _nnx_pair(seed, make_attention_fn(implementation="xla"))
  x = jax.random.normal(jax.random.key(seed), (2, 16, 32))
  with pytest.warns(UserWarning, match="sow_weights"):
    out = ours(x, sow_weights=True)
  assert_close(out, theirs(x, sow_weights=True), what="sown")
  assert nnx.state(ours, nnx.Intermediate)  # the weights were sown


def test_custom_einsum_falls_back_to_flax():
  q, k, v = _qkv(np.random.randint(1 << 30), k=4)
  einsum = lambda *a, **kw: jnp.einsum(*a, **kw)  # noqa: E731
  with pytest.warns(UserWarning, match="einsum"):
    out = flash_attention_fn(q, k, v, qk_attn_weights_einsum=einsum,
                             attn_weights_value_einsum=einsum)
  ref = linen.dot_product_attention(q, k, v, qk_attn_weights_einsum=einsum,
                                    attn_weights_value_einsum=einsum)
  assert_close(out, ref, what="einsum")


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


def test_rank_two_inputs_are_an_error():
  q, k, v = _qkv(0)
  with pytest.raises(ValueError, match=r"`query` must be \[batch..., length, num_heads"):
    flash_attention_fn(q[0, :, 0], k, v)


@pytest.mark.parametrize("rate", [-0.5, 1.0])
def test_dropout_rate_outside_zero_one_is_an_error(rate):
  q, k, v = _qkv(0)
  with pytest.raises(ValueError, match=r"`dropout_rate` must be a Python float in \[0, 1\)"):
    flash_attention_fn(q, k, v, dropout_rate=rate, deterministic=False,
                       dropout_rng=jax.random.key(0))


# ---------------------------------------------------------------------------------------------
# Cached decoding (decode=True): one query against the cache, on decode_attention


def _decode_steps(apply_step, cache, x):
  """Outputs [B, T, F] of feeding x one token at a time through a cached layer."""
  outs = []
  for t in range(x.shape[1]):
    y, cache = apply_step(cache, x[:, t:t + 1])
    outs.append(y)
  return jnp.concatenate(outs, axis=1)


def test_linen_decode_with_bound_causal_equals_the_full_causal_forward():
  """The reported bug: make_attention_fn(is_causal=True) decoded with max error 3.1 (each
  1-token query saw key 0 only, top-left); cache steps now run decode_attention."""
  x = jax.random.normal(jax.random.key(0), (2, 12, 32))
  make = functools.partial(linen.MultiHeadDotProductAttention, num_heads=4, qkv_features=32)
  ours = make(decode=True, attention_fn=make_attention_fn(is_causal=True, implementation="xla"))
  variables = ours.init(jax.random.key(1), x)
  full = make().apply({"params": variables["params"]}, x,
                      mask=linen.make_causal_mask(jnp.ones((2, 12))))

  @jax.jit
  def step(cache, xt):
    y, upd = ours.apply({"params": variables["params"], "cache": cache}, xt, mutable=["cache"])
    return y, upd["cache"]

  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the kernels path must not warn
    got = _decode_steps(step, variables["cache"], x)
  assert_close(got, full, what="decoded")


@pytest.mark.parametrize("cache_steps", [True, False])
def test_linen_decode_with_bound_causal_equals_flax_decode(cache_steps):
  """Issue 41's case against Flax's own attention over the same cache (its mask gives the
  causality): a bound is_causal=True must not apply top-left causality to the one-query steps,
  on decode_attention or (cache_steps=False) on flash_attention with the dense mask."""
  x = jax.random.normal(jax.random.key(2), (2, 6, 32))
  make = functools.partial(linen.MultiHeadDotProductAttention, num_heads=4, qkv_features=32,
                           decode=True)
  ours = make(attention_fn=make_attention_fn(is_causal=True, implementation="xla",
                                             cache_steps=cache_steps))
  variables = ours.init(jax.random.key(3), x)

  def decoded(layer):
    @jax.jit
    def step(cache, xt):
      y, upd = layer.apply({"params": variables["params"], "cache": cache}, xt,
                           mutable=["cache"])
      return y, upd["cache"]
    return _decode_steps(step, variables["cache"], x)

  assert_close(decoded(ours), decoded(make()), what="decoded")


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_nnx_decode_runs_cache_steps_on_decode_attention(impl, monkeypatch):
  calls = []
  real = attention_fn_lib.decode_attention
  monkeypatch.setattr(attention_fn_lib, "decode_attention",
                      lambda *a, **kw: calls.append(kw) or real(*a, **kw))
  ours, theirs = _nnx_pair(3, make_attention_fn(implementation=impl))
  x = jax.random.normal(jax.random.key(4), (2, 6, 32))
  full = theirs(x, mask=nnx.make_causal_mask(jnp.ones((2, 6))), decode=False)
  ours.init_cache((2, 6, 32))

  @nnx.jit
  def run(layer, xt):
    return layer(xt, decode=True)

  def step(cache, xt):
    return run(ours, xt), cache

  got = _decode_steps(step, None, x)
  assert_close(got, full, tol=1e-5, what="decoded")
  assert calls and calls[0]["implementation"] == impl  # traced once: every step runs it


def test_cache_step_mask_with_holes_is_nan_not_wrong():
  q, k, v = _qkv(5)
  q = q[:, :1]
  left_padded = (jnp.arange(20) >= 3)[None, None, None]  # keys 0-2 hidden, then visible
  out = jax.jit(functools.partial(flash_attention_fn, implementation="xla"))(
      q, k, v, mask=left_padded)
  assert np.isnan(np.asarray(out)).all()
  dense = jax.jit(make_attention_fn(implementation="xla", cache_steps=False))(
      q, k, v, mask=left_padded)
  ref = nnx.dot_product_attention(q, k, v, mask=jnp.broadcast_to(left_padded, (2, 4, 1, 20)))
  assert_close(dense, ref, what="cache_steps=False")


def test_cache_step_gradients_are_flash_attention_s():
  q, k, v = _qkv(6)
  q = q[:, :1]
  prefix = (jnp.arange(20) < jnp.array([[7], [20]]))[:, None, None]  # [2, 1, 1, 20]
  fn = lambda q, k, v: flash_attention_fn(q, k, v, mask=prefix, implementation="xla")  # noqa: E731
  ref_fn = lambda q, k, v: nnx.dot_product_attention(  # noqa: E731
      q, k, v, mask=jnp.broadcast_to(prefix, (2, 4, 1, 20)))
  _assert_matches_flax(fn, ref_fn, (q, k, v), "cache step", argnums=(0, 1, 2))


# Flax's own dense attention in these dtypes: linen's computes in float64 throughout, nnx's
# (what a call from outside linen falls back to) reaches float64 at about 1e-7.
X64_TOL = {"float64": 1e-12, "complex64": TOL}


@pytest.mark.parametrize("dtype", ["float64", "complex64"])
def test_dtypes_the_kernels_lack_fall_back_to_flax(dtype):
  """float64 / complex64 inputs from outside linen run on nnx's dense attention, with a warning:
  values and gradients equal to it."""
  with jax.enable_x64(dtype == "float64"):
    q, k, v = (x.astype(dtype) for x in _qkv(np.random.randint(1 << 30), k=4))
    if dtype == "complex64":
      q, k, v = (x * jnp.exp(0.3j * x) for x in (q, k, v))
    mask = _mask(0, (2, 1, 20, 20))
    with pytest.warns(UserWarning, match=f"dtype is {dtype}"):
      out, vjp = jax.vjp(lambda q, k, v: flash_attention_fn(q, k, v, mask=mask), q, k, v)
    ref, ref_vjp = jax.vjp(lambda q, k, v: nnx.dot_product_attention(q, k, v, mask=mask),
                           q, k, v)
    assert out.dtype == ref.dtype == dtype
    assert_close(out, ref, tol=X64_TOL[dtype], what="output")
    cot = jax.random.normal(jax.random.key(1), out.shape).astype(dtype)
    for i, (g, g_ref) in enumerate(zip(vjp(cot), ref_vjp(cot))):
      assert_close(g, g_ref, tol=X64_TOL[dtype], what=f"grad {i}")


@pytest.mark.parametrize("dtype", ["float64", "complex64"])
def test_linen_layer_in_a_dtype_the_kernels_lack_runs_as_flaxs(dtype):
  """A linen layer in float64 / complex64 gives what it gives with linen.dot_product_attention."""
  with jax.enable_x64(dtype == "float64"):
    layer = linen.MultiHeadDotProductAttention(
        num_heads=4, qkv_features=32, dtype=dtype, param_dtype=dtype,
        attention_fn=make_attention_fn(implementation="xla"))
    flax_layer = layer.clone(attention_fn=linen.dot_product_attention)
    x = jax.random.normal(jax.random.key(0), (2, 12, 32)).astype(dtype)
    with pytest.warns(UserWarning, match=f"dtype is {dtype}"):
      params = layer.init(jax.random.key(1), x)
      out = layer.apply(params, x)
    assert out.dtype == dtype
    ref = flax_layer.apply(params, x)
    assert_close(out, ref, tol=X64_TOL[dtype], what=f"{dtype} layer")
