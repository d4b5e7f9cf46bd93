"""merge_attention_states against one attention over all keys, forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash
from testing import assert_close_to_ref


def _parts(seed=0, splits=(0, 40, 41, 100, 128), causal=False):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (2, 64, 4, 32))
  k = jax.random.normal(keys[1], (2, 128, 2, 32))
  v = jax.random.normal(keys[2], (2, 128, 2, 32))
  return q, k, v, list(zip(splits[:-1], splits[1:]))


def _partial(q, k, v, lo, hi, **kw):
  return pallas_flash.flash_attention(q, k[:, lo:hi], v[:, lo:hi], return_residuals=True,
                                      implementation="reference", **kw)


def test_merge_equals_attention_over_all_keys():
  q, k, v, parts = _parts()

  @jax.jit  # one program: op by op, each operation compiles on its own
  def merged_and_whole(q, k, v):
    outs, lses = zip(*(_partial(q, k, v, lo, hi) for lo, hi in parts))
    return (pallas_flash.merge_attention_states(outs, lses),
            pallas_flash.flash_attention(q, k, v, return_residuals=True,
                                         implementation="reference"))

  (o, lse), (o_ref, lse_ref) = merged_and_whole(q, k, v)
  assert_close_to_ref("out", o, o_ref, 2e-6)
  assert_close_to_ref("lse", lse, lse_ref, 2e-6)


def test_empty_parts_give_zeros_and_minus_inf():
  q, k, v, _ = _parts()
  seg = jnp.zeros((2, 64), jnp.int32)
  far = jnp.ones((2, 128), jnp.int32)  # no key shares the queries' segment
  o1, l1 = pallas_flash.flash_attention(q, k, v, return_residuals=True, query_segment_ids=seg,
                                        key_value_segment_ids=far, implementation="reference")
  o, lse = pallas_flash.merge_attention_states(jnp.stack([o1, o1]), jnp.stack([l1, l1]))
  assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(np.asarray(lse)))
  # One empty part next to a full one leaves the full one's result.
  o2, l2 = _partial(q, k, v, 0, 128)
  o, lse = pallas_flash.merge_attention_states([o1, o2], [l1, l2])
  np.testing.assert_allclose(np.asarray(o), np.asarray(o2), rtol=1e-6, atol=1e-6)


def test_gradients_through_the_merge():
  q, k, v, parts = _parts(splits=(0, 50, 128))
  do = jax.random.normal(jax.random.key(7), q.shape)

  def merged(q, k, v):
    outs, lses = zip(*(_partial(q, k, v, lo, hi) for lo, hi in parts))
    return pallas_flash.merge_attention_states(outs, lses)[0]

  def whole(q, k, v):
    return pallas_flash.flash_attention(q, k, v, implementation="reference")

  g, g_ref = jax.jit(lambda *x: [jax.vjp(f, *x)[1](do) for f in (merged, whole)])(q, k, v)
  for name, a, b in zip(("dq", "dk", "dv"), g, g_ref):
    assert_close_to_ref(name, a, b, 5e-6)


@pytest.mark.parametrize("outs,lses,error,match", [
    (np.zeros((2, 1, 4, 2, 8)), np.zeros((2, 1, 4, 2)), ValueError, "lses"),
    (np.zeros((1, 4, 2, 8)), np.zeros((1, 2, 4)), ValueError, r"\[N, B, T, H, D\]"),
    ([np.zeros((1, 4, 2, 8)), np.zeros((1, 3, 2, 8))], [np.zeros((1, 2, 4))] * 2, ValueError,
     "`outputs` as a sequence must hold arrays .* of one shape"),
    ([], [], ValueError, "Nothing to merge"),
    (np.zeros((2, 1, 4, 2, 8), np.int32), np.zeros((2, 1, 2, 4)), TypeError,
     "must be float arrays"),
])
def test_bad_shapes_name_the_argument(outs, lses, error, match):
  with pytest.raises(error, match=match):
    pallas_flash.merge_attention_states(outs, lses)


def test_sinks_grad_is_the_autodiff_of_add_sinks():
  """merge.sinks_grad (the backends that add the sinks themselves) from the sinks' o and lse
  and delta = rowsum(do * o) - dlse equals autodiff through merge.add_sinks, rows that saw no
  key (lse -inf before the sinks) included."""
  from pallas_flash import merge
  keys = jax.random.split(jax.random.key(3), 5)
  b, t, h, d = 2, 24, 3, 8
  out = jax.random.normal(keys[0], (b, t, h, d))
  lse = jax.random.normal(keys[1], (b, h, t)).at[:, :, :4].set(-jnp.inf)
  sinks = jax.random.normal(keys[2], (h,)) * 2.0
  do, dlse = jax.random.normal(keys[3], (b, t, h, d)), jax.random.normal(keys[4], (b, h, t))

  @jax.jit  # one program: op by op, each operation compiles on its own
  def both(sinks):
    (o_s, lse_s), vjp = jax.vjp(lambda s: merge.add_sinks(out, lse, s), sinks)
    delta = jnp.einsum("bthd,bthd->bht", do, o_s) - dlse
    return merge.sinks_grad(sinks, lse_s, delta), vjp((do, dlse))[0]

  got, want = both(sinks)
  assert_close_to_ref("dsinks", got, want, 1e-5)
