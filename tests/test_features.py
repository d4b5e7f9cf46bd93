"""Sliding windows, soft cap, ALiBi, dropout and dense bias / mask on every CPU implementation."""

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash
from pallas_flash import dropout
from pallas_flash.triton import TritonConfig
from pallas_flash.xla import XlaConfig
from testing import (Case, assert_close_to_ref, assert_matches_reference, check_against_reference,
                     interpret_config, jitted, make_inputs, max_abs, run, tolerance)

CPU_IMPLS = ("interpret", "xla")
SMALL = {"interpret": TritonConfig(block_q=32, block_kv=16, block_q_dkv=16, block_kv_dkv=32,
                                   block_q_dq=32, block_kv_dq=16),
         "xla": XlaConfig(block_q=16, block_kv=32)}
# Odd lengths spanning several blocks of SMALL, with GQA.
CASE = Case(batch=2, q_len=70, kv_len=90, num_heads=4, num_kv_heads=2, head_dim=32)

SINGLE = [("window",), ("window_left",), ("softcap",), ("alibi",), ("dropout",), ("bias",),
          ("bias_bcast",), ("mask",), ("sinks",)]


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("names", SINGLE, ids="+".join)
def test_each_feature_alone(impl, names):
  check_against_reference(impl, dataclasses.replace(CASE, features=names), config=SMALL[impl])


COMBINED = [
    (Case(q_len=77, kv_len=77, is_causal=True, segments=True, head_dim=32),
     ("window", "softcap", "dropout")),
    (Case(q_len=77, kv_len=77, is_causal=True, segments=True, head_dim=32, dtype=jnp.bfloat16),
     ("window_left", "softcap", "alibi", "dropout")),
    (Case(q_len=50, kv_len=83, lengths=True, head_dim=32, num_heads=6, num_kv_heads=2),
     ("window", "alibi", "bias_bcast", "mask")),
    (Case(q_len=40, kv_len=40, is_causal=True, head_dim=32, num_heads=2, num_kv_heads=1),
     ("softcap", "bias", "mask", "dropout")),
    # Lengths leave whole rows without a key: their lse is the sink's.
    (Case(q_len=50, kv_len=83, lengths=True, head_dim=32, dtype=jnp.bfloat16),
     ("window", "softcap", "bias", "sinks")),
]


# The xla path runs every combination, the interpreted Triton kernels the first two (each
# feature's kernel code is covered alone above).
# The Triton interpreter runs the first two; xla runs them too with -m slow (suite time).
COMBINED_RUNS = ([pytest.param("xla", c, n, id=f"xla-{c.id}-{'+'.join(n)}",
                               marks=[pytest.mark.slow] if i < 2 else [])
                  for i, (c, n) in enumerate(COMBINED)]
                 + [pytest.param("interpret", c, n, id=f"interpret-{c.id}-{'+'.join(n)}")
                    for c, n in COMBINED[:2]])


@pytest.mark.parametrize("impl, case, names", COMBINED_RUNS)
def test_features_combined(impl, case, names):
  check_against_reference(impl, dataclasses.replace(case, features=names), config=SMALL[impl])


# A value head dim other than the query/key one (MLA trains 192 / 128), both ways round.
VALUE_DIMS = [(Case(q_len=70, kv_len=90, head_dim=48, value_head_dim=32, is_causal=True,
                    segments=True), ("softcap", "bias")),
              (Case(q_len=77, kv_len=77, head_dim=32, value_head_dim=64, dtype=jnp.bfloat16),
               ("window", "dropout", "sinks"))]


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("case, names", VALUE_DIMS, ids=[c.id for c, _ in VALUE_DIMS])
def test_value_head_dim_differs(impl, case, names):
  check_against_reference(impl, dataclasses.replace(case, features=names), config=SMALL[impl])


def test_value_head_dim_matches_jax_nn_on_zero_padded_values():
  # Zero columns appended to V change no other column: jax.nn (one head dim) is the oracle.
  (q, k, v, _), _ = make_inputs(Case(q_len=20, kv_len=30, head_dim=32, value_head_dim=16))
  want = jitted(jax.nn.dot_product_attention, is_causal=True)(
      q, k, jnp.pad(v, ((0, 0),) * 3 + ((0, 16),)))[..., :16]
  for impl in ("reference", "xla"):
    got = jitted(pallas_flash.flash_attention, is_causal=True, implementation=impl)(q, k, v)
    assert_close_to_ref(impl, got, want, 2e-5)


def test_a_mask_grown_for_int64_offsets_gives_the_same_attention(monkeypatch):
  """A 2-4 GiB mask reaches the Triton kernels grown along rows they never read
  (triton.common._int32_offsets_safe); with the size limit lowered to this case's mask, the
  grown mask's forward and gradients still match the reference in the interpreter."""
  from pallas_flash.triton import common
  grown, original = [], common._int32_offsets_safe

  def grow(mask):
    monkeypatch.setattr(common, "INT32_OFFSET_BYTES", mask.size)
    out = original(mask)
    grown.append(out.shape[2] > mask.shape[2])
    return out

  monkeypatch.setattr(common, "_int32_offsets_safe", grow)
  check_against_reference("interpret", dataclasses.replace(CASE, features=("mask",)),
                          config=SMALL["interpret"])
  assert grown and all(grown), grown


@pytest.mark.slow
@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_all_features_longer(impl, dtype):
  case = Case(batch=1, q_len=300, kv_len=300, num_heads=4, num_kv_heads=1, dtype=dtype,
              is_causal=True, segments=True)
  case = dataclasses.replace(case, features=("window", "softcap", "alibi", "dropout", "bias",
                                             "mask"))
  check_against_reference(impl, case, config=SMALL[impl])


# ---------------------------------------------------------------------------------------------
# Semantics: the reference against jax.nn where jax.nn has the argument


@pytest.mark.parametrize("window", [3, (5, 0), (0, 4), (2, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_window_matches_jax_nn(window, causal):
  (q, k, v, _), _ = make_inputs(Case(q_len=33, kv_len=33, num_heads=2, num_kv_heads=2))
  kw = dict(is_causal=causal, local_window_size=window)
  got = jitted(pallas_flash.flash_attention, implementation="reference", **kw)(q, k, v)
  want = jitted(jax.nn.dot_product_attention, **kw)(q, k, v)
  assert_close_to_ref("out", got, want, 1e-5)


def test_bias_and_mask_match_jax_nn():
  (q, k, v, _), _ = make_inputs(Case(q_len=20, kv_len=30, num_heads=4, num_kv_heads=4))
  bias = jax.random.normal(jax.random.key(1), (2, 1, 20, 30))
  mask = jax.random.bernoulli(jax.random.key(2), 0.9, (1, 4, 1, 30)).at[..., 0].set(True)
  want = jitted(jax.nn.dot_product_attention)(q, k, v, bias, mask)
  for impl in ("reference", "xla"):
    got = jitted(pallas_flash.flash_attention, implementation=impl)(q, k, v, bias, mask)
    assert_close_to_ref(impl, got, want, 2e-5)


def test_sinks_match_an_extra_key_in_jax_nn():
  # A sink is a key with logit `sink` and value 0: jax.nn with one zero key (logit 0) whose
  # bias is the sink computes the same softmax.
  (q, k, v, _), _ = make_inputs(Case(q_len=20, kv_len=30, num_heads=4, num_kv_heads=4))
  sinks = jnp.array([-1.0, 0.5, 3.0, -30.0])
  zero = jnp.zeros((2, 1, 4, 64))
  bias = jnp.zeros((1, 4, 1, 31)).at[..., 30].set(sinks[:, None])
  want = jax.nn.dot_product_attention(q, jnp.concatenate([k, zero], 1),
                                      jnp.concatenate([v, zero], 1), bias, is_causal=False)
  for impl in ("reference", "xla"):
    got = pallas_flash.flash_attention(q, k, v, sinks=sinks, implementation=impl)
    assert_close_to_ref(impl, got, want, 2e-5)


def test_dbias_is_reduced_over_broadcast_axes():
  (q, k, v, do), _ = make_inputs(Case(q_len=16, kv_len=16, num_heads=2, num_kv_heads=2))
  # (A bias constant along the key axis has a zero gradient: softmax ignores row shifts.)
  for shape in [(16, 16), (1, 1, 1, 16), (2, 1, 1, 16), (1, 2, 16, 16)]:
    bias = jax.random.normal(jax.random.key(3), shape)
    # The interpreted Triton kernels reduce over a broadcast batch and head axis once each.
    for impl in ("interpret", "xla") if shape in ((2, 1, 1, 16), (1, 2, 16, 16)) else ("xla",):
      _, grads = run(impl, q, k, v, do, bias=bias)
      _, grads_ref = run("reference", q, k, v, do, bias=bias)
      assert grads[3].shape == shape
      assert_close_to_ref(f"{impl} dbias {shape}", grads[3], grads_ref[3], 5e-5)


def _kernel_outputs(jaxpr) -> list[tuple[int, ...]]:
  """The output shapes of every kernel in a jaxpr (a pallas_call; the Mosaic interpreter's
  kernels are mpmd_maps), its sub-jaxprs included."""
  shapes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("pallas_call", "mpmd_map"):
      shapes += [tuple(x.aval.shape) for x in eqn.outvars]
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      shapes += _kernel_outputs(sub)
  return shapes


# The Mosaic kernels in the interpreter: their dQ kernel's dbias output is the one to skip.
BIAS_GRAD_IMPLS = [("interpret", SMALL["interpret"]), ("xla", SMALL["xla"]),
                   ("mosaic", interpret_config())]


@pytest.mark.parametrize("impl, config", BIAS_GRAD_IMPLS, ids=[i for i, _ in BIAS_GRAD_IMPLS])
def test_a_bias_nothing_differentiates_costs_no_dbias(impl, config):
  """A bias under stop_gradient (or a constant): dq, dk, dv match the reference and the
  backward returns no dbias, so its kernels write no [B, H, T, S] dS (the kernels' outputs are
  the differentiated call's less that buffer)."""
  case = Case(batch=2, q_len=40, kv_len=70, num_heads=2, num_kv_heads=1, head_dim=64,
              dtype=jnp.bfloat16, features=("bias",))
  (q, k, v, do), kwargs = make_inputs(case)
  bias = kwargs.pop("bias")

  def grads(impl, config, differentiated: bool):
    def loss(q, k, v, bias):
      bias = bias if differentiated else jax.lax.stop_gradient(bias)
      o = pallas_flash.flash_attention(q, k, v, bias=bias, implementation=impl, config=config,
                                       **kwargs)
      return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

  got = grads(impl, config, False)(q, k, v, bias)
  up = [x.astype(jnp.float32) for x in (q, k, v)]
  want = grads("reference", None, True)(*up, bias)
  assert not np.any(got[3]), "a bias under stop_gradient has a zero gradient"
  for name, x, ref in zip(("dq", "dk", "dv"), got[:3], want[:3]):
    assert_close_to_ref(f"{impl} {name}", x, ref, tolerance(q.dtype))
  if impl == "xla":  # no kernels: the XLA ops of dbias are simply not built
    return
  with_dbias, without = (_kernel_outputs(jax.make_jaxpr(grads(impl, config, d))(
      q, k, v, bias).jaxpr) for d in (True, False))
  for shape in without:
    with_dbias.remove(shape)
  (dbias,) = with_dbias
  assert dbias[:2] == (case.batch, case.num_heads) and dbias[2] >= case.q_len, dbias


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_rows_that_see_nothing_give_zeros_and_zero_gradients(impl):
  # Queries past kv_len + window see no key at all; the mask also blanks two whole rows.
  case = Case(q_len=64, kv_len=20, num_heads=2, num_kv_heads=1, head_dim=16, is_causal=True)
  (q, k, v, do), kw = make_inputs(case)
  mask = jnp.ones((1, 1, 64, 20), bool).at[:, :, 3:5].set(False)
  features = dict(local_window_size=(6, 0), mask=mask, logits_soft_cap=2.0, **kw)
  result = run(impl, q, k, v, do, config=SMALL[impl], **features)
  (o, _), grads = result
  assert np.all(np.asarray(o)[:, 26:] == 0) and np.all(np.asarray(o)[:, 3:5] == 0)
  assert np.all(np.asarray(grads[0])[:, 26:] == 0)
  # dK / dV too (other kernels than dQ's): an empty row must add nothing to them.
  assert_matches_reference(result, run("reference", q, k, v, do, **features),
                           tolerance(case.dtype))


@pytest.mark.parametrize("impl", ("xla", "reference"))
def test_rows_that_see_nothing_with_sinks(impl):
  case = Case(q_len=32, kv_len=20, num_heads=2, num_kv_heads=1, head_dim=16, is_causal=True)
  (q, k, v, do), kw = make_inputs(case)
  sinks = jnp.array([0.5, -2.0])
  (o, lse), (dq, dk, dv, dsinks) = run(impl, q, k, v, do, local_window_size=(6, 0),
                                       sinks=sinks, **kw)
  assert np.all(np.asarray(o)[:, 26:] == 0) and np.all(np.asarray(dq)[:, 26:] == 0)
  assert np.all(np.asarray(lse)[:, :, 26:] == np.asarray(sinks)[None, :, None])
  assert all(np.isfinite(np.asarray(g)).all() for g in (dq, dk, dv, dsinks))


# merge.add_sinks serves both; the interpreter's run only adds the suite's time.
@pytest.mark.parametrize("impl", ["xla", pytest.param("interpret", marks=pytest.mark.slow)])
def test_a_sink_of_minus_inf_is_no_sink(impl):
  """sinks[h] = -inf: head h as without sinks (lse too), on rows that see keys and on rows that
  see none (zeros, lse -inf), with finite gradients; the other head keeps its sink."""
  case = Case(q_len=32, kv_len=20, num_heads=2, num_kv_heads=1, head_dim=16, is_causal=True)
  (q, k, v, do), kw = make_inputs(case)
  sinks = jnp.array([-jnp.inf, 0.5])
  features = dict(local_window_size=(6, 0), **kw)
  (o, lse), grads = run(impl, q, k, v, do, sinks=sinks, **features)
  (o_ref, lse_ref), grads_ref = run("reference", q, k, v, do, sinks=sinks, **features)
  (o_none, lse_none), _ = run("reference", q[:, :, :1], k, v, do[:, :, :1], **features)
  assert_close_to_ref("out", o, o_ref, 1e-5)
  assert_close_to_ref("lse", lse, lse_ref, 1e-5)
  assert_close_to_ref("out of the -inf head", o[:, :, :1], o_none, 1e-5)
  assert_close_to_ref("lse of the -inf head", lse[:, :1], lse_none, 1e-5)
  for name, g, g_ref in zip(("dq", "dk", "dv", "dsinks"), grads, grads_ref):
    assert np.isfinite(np.asarray(g)).all(), name
    assert_close_to_ref(name, g, g_ref, 1e-4)


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("cap", [50.0, 70.0])  # under / over triton's FIXED_MAX_SOFTCAP
def test_softcap_saturated_rows(impl, cap):
  # Scores far beyond ±cap: rows whose every logit saturates near -cap (the fixed-max forward's
  # smallest probabilities, 2**-72 at cap 50) next to rows saturating near +cap, and rows of
  # no offset whose logits only partly saturate, so that dq and dk are not all zero (a fully
  # saturated cap has slope 0: a wrong factor on dq or dk would multiply nothing).
  case = Case(batch=1, q_len=48, kv_len=40, num_heads=2, num_kv_heads=2, head_dim=16)
  (q, k, v, do), _ = make_inputs(case)
  direction = jax.random.normal(jax.random.key(5), (16,))
  k = k + 40.0 * direction
  offset = jnp.array([1.0, -1.0, 0.0, 0.0])[jnp.arange(48) % 4]
  q = q + 40.0 * direction * offset[None, :, None, None]
  result = run(impl, q, k, v, do, config=SMALL[impl], logits_soft_cap=cap)
  ref = run("reference", q, k, v, do, logits_soft_cap=cap)
  grads_ref = ref[1]
  assert max_abs(grads_ref[0]) > 1e-3 * max_abs(grads_ref[2])  # dq is exercised
  assert_matches_reference(result, ref, tolerance(case.dtype))


# ---------------------------------------------------------------------------------------------
# Dropout: statistics of the hash, reproducibility, independence of block sizes


def _correlation(a, b) -> float:
  a, b = a - a.mean(), b - b.mean()
  return float((a * b).mean() / np.sqrt((a * a).mean() * (b * b).mean()))


def test_dropout_mask_statistics():
  seed = dropout.seed_from_rng(jax.random.key(0))
  for rate in (0.1, 0.5):
    keep = np.asarray(dropout.keep_mask(seed, 2, 4, 256, 256, rate))
    assert abs(keep.mean() - (1 - rate)) < 5e-3, keep.mean()
    # No structure along rows, columns or heads: every slice keeps about the same fraction.
    for axis in (1, 2, 3):
      fractions = keep.mean(axis=tuple(a for a in range(4) if a != axis))
      assert np.abs(fractions - (1 - rate)).max() < 0.05, (axis, fractions)
    # Neighbours (next / 64th / 128th column, next row, next head) are uncorrelated: 2**19
    # pairs put the noise near 1.5e-3.
    x = keep.astype(np.float64)
    pairs = {f"col+{d}": (x[..., :-d], x[..., d:]) for d in (1, 64, 128)}
    pairs.update({"row+1": (x[:, :, :-1], x[:, :, 1:]), "head+1": (x[:, :-1], x[:, 1:])})
    for name, (a, b) in pairs.items():
      assert abs(_correlation(a, b)) < 1e-2, (rate, name, _correlation(a, b))
    # 2x2 rectangles: the keys enter algebraically (a product), so check that the parity of
    # four corners is what independent coin flips give, 1/2 (1 - (1 - 2 rate)^4).
    parity = (keep[..., ::2, ::2] ^ keep[..., 1::2, ::2] ^ keep[..., ::2, 1::2]
              ^ keep[..., 1::2, 1::2]).mean()
    assert abs(parity - (1 - (1 - 2 * rate) ** 4) / 2) < 1e-2, (rate, parity)
  same = dropout.keep_mask(dropout.seed_from_rng(jax.random.key(0)), 1, 2, 64, 64, 0.5)
  other = dropout.keep_mask(dropout.seed_from_rng(jax.random.key(1)), 1, 2, 64, 64, 0.5)
  np.testing.assert_array_equal(np.asarray(same), np.asarray(keep[:1, :2, :64, :64]))
  assert 0.4 < float((same == other).mean()) < 0.6  # independent masks agree half the time


def test_dropout_same_key_same_output_other_key_differs():
  (q, k, v, _), _ = make_inputs(Case(q_len=40, kv_len=40))
  f = jax.jit(lambda key: pallas_flash.flash_attention(q, k, v, dropout_rate=0.3,
                                                       dropout_rng=key, implementation="xla"))
  a, b, c = f(jax.random.key(0)), f(jax.random.key(0)), f(jax.random.key(1))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert max_abs(a - c) > 1e-2
  plain = pallas_flash.flash_attention(q, k, v, implementation="xla")
  zero_rate = pallas_flash.flash_attention(q, k, v, dropout_rate=0.0, dropout_rng=jax.random.key(0),
                                           implementation="xla")
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(zero_rate))


def test_dropout_is_independent_of_block_sizes():
  (q, k, v, _), _ = make_inputs(Case(q_len=48, kv_len=64, num_heads=2, num_kv_heads=1))
  kw = dict(dropout_rate=0.4, dropout_rng=jax.random.key(3))
  outs = [pallas_flash.flash_attention(q, k, v, implementation=impl, config=cfg, **kw)
          for impl, cfg in (("xla", XlaConfig(block_q=16, block_kv=64)),
                            ("xla", XlaConfig(block_q=48, block_kv=8)),
                            ("interpret", TritonConfig(block_q=16, block_kv=32)))]
  for o in outs[1:]:
    assert_close_to_ref("blocks", o, outs[0], 1e-5)


# ---------------------------------------------------------------------------------------------
# API: validation, explain, capability declarations


Q = jnp.ones((2, 16, 4, 32), jnp.float32)
KV = jnp.ones((2, 24, 2, 32), jnp.float32)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"local_window_size": (3,)}, TypeError, "`local_window_size` must be an int or a"),
    ({"local_window_size": 2.5}, TypeError, "`local_window_size` must be an int"),
    ({"local_window_size": (-1, 2)}, ValueError, "must be >= 0 on both sides"),
    ({"logits_soft_cap": 0.0}, ValueError, "`logits_soft_cap` must be a positive"),
    ({"logits_soft_cap": jnp.float32(30)}, ValueError, "`logits_soft_cap` must be"),
    ({"alibi_slopes": jnp.ones(3)}, ValueError, r"`alibi_slopes` must be a float array of shape"),
    ({"dropout_rate": 1.0}, ValueError, r"`dropout_rate` must be a Python float in \[0, 1\)"),
    ({"dropout_rate": False}, ValueError, r"`dropout_rate` must be a Python float in \[0, 1\)"),
    ({"dropout_rate": 0.1}, ValueError, "needs `dropout_rng`"),
    ({"bias": jnp.ones((2, 3, 16, 24))}, ValueError, "`bias` must broadcast to"),
    ({"bias": jnp.ones((16, 23))}, ValueError, "each axis must be 1 or the full size"),
    ({"bias": jnp.ones((16, 24), jnp.int32)}, TypeError, "`bias` must be a float array"),
    ({"mask": jnp.ones((16, 24))}, TypeError, "`mask` must be a boolean array"),
    ({"sinks": jnp.ones(2)}, ValueError, r"`sinks` must have shape \(num_heads,\) = \(4,\)"),
    ({"sinks": jnp.ones(4, jnp.int32)}, TypeError, "`sinks` must be a float array"),
    ({"sinks": 1.0}, TypeError, "`sinks` must be a float array of shape"),
])
def test_bad_feature_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    pallas_flash.flash_attention(Q, KV, KV, **kwargs)


def test_backend_without_a_feature_is_skipped_with_a_reason(monkeypatch):
  from pallas_flash import backends
  monkeypatch.setattr(pallas_flash.xla, "SUPPORTED_FEATURES", frozenset({"logits_soft_cap"}))
  # A fresh cache of backend records for this test (they are read once per process).
  monkeypatch.setattr(backends, "load", functools.cache(backends.load.__wrapped__))
  ex = pallas_flash.explain(Q, KV, KV, local_window_size=4, logits_soft_cap=5.0)
  assert ex.reasons["xla"] == "xla does not support local_window_size yet"
  assert ex.chosen is None and ex.reasons["reference"] is None
  with pytest.raises(NotImplementedError, match="xla does not support local_window_size"):
    pallas_flash.flash_attention(Q, KV, KV, local_window_size=4, implementation="xla")


def test_explain_reports_blocks_computed():
  q = jax.ShapeDtypeStruct((1, 4096, 4, 64), jnp.bfloat16)
  assert pallas_flash.explain(q, q, q).blocks_computed == 1.0
  causal = pallas_flash.explain(q, q, q, is_causal=True)
  n = 4096 // causal.block_shape[0]  # the chosen xla config's square blocks
  assert causal.blocks_computed == pytest.approx((n * (n + 1) / 2) / n**2)
  window = pallas_flash.explain(q, q, q, is_causal=True, local_window_size=(511, 0))
  assert window.blocks_computed < 0.2 and "blocks computed" in str(window)


def test_unbatched_inputs_with_bias_and_dropout():
  (q, k, v, _), kw = make_inputs(Case(batch=1, q_len=24, kv_len=24,
                                      features=("bias", "dropout", "window")))
  bias = kw.pop("bias")
  o3 = pallas_flash.flash_attention(q[0], k[0], v[0], bias[0], **kw)
  o4 = pallas_flash.flash_attention(q, k, v, bias, **kw)
  np.testing.assert_array_equal(np.asarray(o3), np.asarray(o4[0]))


def test_features_under_jit_vmap_and_grad():
  (q, k, v, do), _ = make_inputs(Case(batch=1, q_len=32, kv_len=32, is_causal=True))
  kw = dict(is_causal=True, local_window_size=(8, 0), logits_soft_cap=3.0, dropout_rate=0.2)

  def loss(impl, q, key):
    o = pallas_flash.flash_attention(q, k, v, implementation=impl, dropout_rng=key, **kw)
    return (o * do).sum()

  keys = jax.random.split(jax.random.key(0), 2)
  qs = jnp.stack([q, 2 * q])
  got = jax.jit(jax.vmap(jax.grad(lambda q, key: loss("xla", q, key))))(qs, keys)
  want = jax.jit(jax.vmap(jax.grad(lambda q, key: loss("reference", q, key))))(qs, keys)
  assert_close_to_ref("dq", got, want, 5e-5)


def test_every_feature_lowers_to_triton_for_h200():
  from testing import export_for_h200

  q = jax.ShapeDtypeStruct((2, 1000, 8, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, 64), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 8, 1000, 1000), jnp.float32)
  mask = jax.ShapeDtypeStruct((2, 1, 1, 1000), jnp.bool_)
  seg = jax.ShapeDtypeStruct((2, 1000), jnp.int32)

  def f(q, k, v, bias, mask, seg):
    return pallas_flash.flash_attention(
        q, k, v, bias, mask, is_causal=True, local_window_size=(256, 0), logits_soft_cap=30.0,
        alibi_slopes=jnp.linspace(0.1, 1.0, 8), dropout_rate=0.1, dropout_rng=jax.random.key(0),
        query_segment_ids=seg, implementation="triton")

  def g(q, k, v, bias, mask, seg):
    return jax.grad(lambda *a: f(*a, mask, seg).astype(jnp.float32).sum(),
                    argnums=(0, 1, 2, 3))(q, k, v, bias)

  for fn, kernels in ((f, 1), (g, 3)):
    module = export_for_h200(fn, q, kv, kv, bias, mask, seg).mlir_module()
    assert module.count("xla.gpu.triton") == kernels


def test_explain_takes_shapes_for_every_argument():
  q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
  ex = pallas_flash.explain(
      q, q, q, jax.ShapeDtypeStruct((1, 4, 256, 256), jnp.float32),
      jax.ShapeDtypeStruct((2, 1, 1, 256), jnp.bool_), local_window_size=(64, 0),
      alibi_slopes=jax.ShapeDtypeStruct((4,), jnp.float32), dropout_rate=0.1,
      dropout_rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
  assert ex.chosen == "xla"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_bias_and_mask_tiles_fit_shared_memory(head_dim, causal):
  # Triton buffers every pipelined load num_stages times; with a float32 bias and an int8 mask
  # tile next to K and V the forward's default tiles overflowed the H200's 227 KiB at hd128.
  from pallas_flash.call import AttentionParams
  from pallas_flash.triton import common as triton_common
  params = AttentionParams(scale=1.0, is_causal=causal, has_segments=False, has_bias=True,
                           has_mask=True)
  assert triton_common.tuned_feature(params) == "dense"
  cfg = triton_common.call_config(head_dim, jnp.bfloat16, params)
  per_stage = (2 * cfg.block_kv * head_dim * 2  # K and V, bf16
               + cfg.block_q * cfg.block_kv * (4 + 1))  # float32 bias, int8 mask
  assert cfg.num_stages * per_stage + cfg.block_q * head_dim * 2 <= 200 * 1024, cfg


SOFT_CAP_ORDER_CASES = [
    Case(batch=1, q_len=128, kv_len=128, num_heads=2, num_kv_heads=1, features=f)
    for f in [("softcap", "bias_std5", order) for order in ("cap_then_bias", "bias_then_cap")]
    + [("softcap", "alibi", "bias_std5", "bias_then_cap")]]


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("case", SOFT_CAP_ORDER_CASES, ids=lambda c: c.id)
def test_soft_cap_order_with_a_bias(impl, case):
  """Output, lse and dq/dk/dv/dbias of both soft-cap orders (bias std 5) against the reference."""
  check_against_reference(impl, case, config=SMALL[impl])


@pytest.mark.parametrize("order", ["cap_then_bias", "bias_then_cap"])
def test_reference_soft_cap_order_is_the_formula(order):
  """The reference computes c*tanh(s/c) + bias or c*tanh((s + bias)/c), ALiBi counted as bias."""
  case = Case(batch=1, q_len=64, kv_len=64, num_heads=2, num_kv_heads=2,
              features=("softcap", "alibi", "bias_std5", order))
  (q, k, v, _), kw = make_inputs(case)
  c = kw["logits_soft_cap"]
  s = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") / np.sqrt(case.head_dim)
  pos = jnp.arange(case.q_len)
  bias = kw["bias"] - kw["alibi_slopes"][:, None, None] * jnp.abs(pos[:, None] - pos[None, :])
  by_order = {"cap_then_bias": c * jnp.tanh(s / c) + bias,
              "bias_then_cap": c * jnp.tanh((s + bias) / c)}
  want, other = (jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(by_order[o], -1), v,
                            precision="highest") for o in (order, *set(by_order) - {order}))
  got = jitted(pallas_flash.flash_attention, implementation="reference")(q, k, v, **kw)
  assert_close_to_ref("out", got, want, 1e-5)
  assert max_abs(want - other) > 0.1  # the orders differ far beyond the tolerance here


def test_soft_cap_order_is_checked_and_mosaic_takes_bias_then_cap():
  from jax.sharding import use_abstract_mesh
  from testing import H200

  q = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="`logits_soft_cap_order` must be one of"):
    pallas_flash.flash_attention(q, q, q, logits_soft_cap=5.0, logits_soft_cap_order="before")
  bias = jax.ShapeDtypeStruct((16, 16), jnp.float32)
  with use_abstract_mesh(H200):
    why = {order: pallas_flash.explain(q, q, q, bias, logits_soft_cap=5.0,
                                       logits_soft_cap_order=order).reasons_when_named["mosaic"]
           for order in ("bias_then_cap", "cap_then_bias")}
  # A dense bias inside the cap runs on the Mosaic kernels when named, as in the default order.
  assert why == {"bias_then_cap": None, "cap_then_bias": None}, why
  # ALiBi alone goes inside the cap in the kernels: chosen automatically on an H200.
  slopes = jax.ShapeDtypeStruct((2,), jnp.float32)
  with use_abstract_mesh(H200):
    ex = pallas_flash.explain(q, q, q, logits_soft_cap=5.0, logits_soft_cap_order="bias_then_cap",
                              alibi_slopes=slopes)
  assert ex.chosen == "mosaic", ex


def test_bias_then_cap_lowers_to_triton_for_h200():
  """The bfloat16 path (tanh.approx inside the cap) lowers, forward and backward."""
  from testing import export_for_h200

  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 2, 256, 256), jnp.float32)

  def g(q, k, v, bias):
    return jax.grad(lambda *a: pallas_flash.flash_attention(
        *a, logits_soft_cap=30.0, logits_soft_cap_order="bias_then_cap",
        implementation="triton").astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))(q, k, v, bias)

  assert export_for_h200(g, q, q, q, bias).mlir_module().count("xla.gpu.triton") == 3
