"""The oracle itself: against jax.nn.dot_product_attention, and its gradients numerically."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import pallas_flash
from testing import Case, assert_close_to_ref, jitted, make_inputs


@pytest.mark.parametrize("case", [
    Case(), Case(is_causal=True), Case(q_len=17, kv_len=300, is_causal=True),
    Case(q_len=300, kv_len=17, is_causal=True), Case(lengths=True), Case(num_kv_heads=1),
], ids=lambda c: c.id)
def test_reference_matches_jax_nn(case):
  (q, k, v, _), kwargs = make_inputs(case)
  ours = jitted(pallas_flash.flash_attention, implementation="reference")(q, k, v, **kwargs)
  # Both return zeros on padded query rows. A query whose keys are all padding is where the two
  # differ by design (jax.nn averages the values, we return zeros): make_inputs keeps kv
  # lengths >= 1, so there is none here.
  theirs = jitted(jax.nn.dot_product_attention, implementation="xla")(q, k, v, **kwargs)
  assert_close_to_ref("out", ours, theirs, 1e-5)


@pytest.mark.parametrize("impl", ["reference", "xla", "interpret"])
@pytest.mark.parametrize("causal", [False, True])
def test_check_grads(impl, causal):
  (q, k, v, _), kwargs = make_inputs(Case(batch=1, q_len=20, kv_len=24, num_heads=2,
                                          num_kv_heads=1, head_dim=16, is_causal=causal))

  def f(q, k, v):
    return pallas_flash.flash_attention(q, k, v, implementation=impl, **kwargs)

  # jit: the numerical derivative evaluates f several times; one program serves them all.
  check_grads(jax.jit(f), (q, k, v), order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-2)


def test_fully_masked_rows_give_zeros_and_zero_grads():
  (q, k, v, do), _ = make_inputs(Case(q_len=64, kv_len=64))
  # Query segment 7 appears among no keys: those rows see nothing.
  q_seg = jnp.where(jnp.arange(64) < 20, 7, 0)[None].repeat(2, 0).astype(jnp.int32)
  kv_seg = jnp.zeros((2, 64), jnp.int32)
  for impl in ("reference", "xla", "interpret"):
    @jax.jit
    def out_and_grads(q, k, v, impl=impl):
      def f(q, k, v):
        return pallas_flash.flash_attention(q, k, v, query_segment_ids=q_seg,
                                            key_value_segment_ids=kv_seg, implementation=impl,
                                            return_residuals=True)
      (o, lse), vjp = jax.vjp(f, q, k, v)
      return (o, lse), vjp((do, jnp.ones_like(lse)))
    (o, lse), (dq, dk, dv) = out_and_grads(q, k, v)
    assert np.all(np.asarray(o[:, :20]) == 0.0), impl
    assert np.all(np.isneginf(np.asarray(lse[:, :, :20]))), impl
    assert np.all(np.isfinite(np.asarray(o))), impl
    for g in (dq, dk, dv):
      assert np.all(np.isfinite(np.asarray(g))), impl
    assert np.all(np.asarray(dq[:, :20]) == 0.0), impl
    assert np.abs(np.asarray(dq[:, 20:])).max() > 0, impl
    if impl == "reference":
      want = (o, lse), (dq, dk, dv)
      continue
    # dK / dV too (another kernel than dQ's): the empty rows must add nothing to them.
    for name, x, x_ref in zip(("out", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv),
                              (*want[0], *want[1])):
      assert_close_to_ref(f"{impl} {name}", x, x_ref, 1e-4)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_poisoned_padding_does_not_leak(impl):
  """NaN in padded queries/keys and huge values in padded values must not reach valid rows."""
  case = Case(q_len=96, kv_len=80)
  (q, k, v, _), _ = make_inputs(case)
  q_lens, kv_lens = jnp.array([50, 96]), jnp.array([33, 80])
  q_pad = jnp.arange(96)[None, :, None, None] >= q_lens[:, None, None, None]
  kv_pad = jnp.arange(80)[None, :, None, None] >= kv_lens[:, None, None, None]
  kw = dict(query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens)
  want = jitted(pallas_flash.flash_attention, implementation="reference")(q, k, v, **kw)
  got = jitted(pallas_flash.flash_attention, implementation=impl)(
      jnp.where(q_pad, jnp.nan, q), jnp.where(kv_pad, jnp.nan, k), jnp.where(kv_pad, 1e30, v),
      **kw)
  assert_close_to_ref("out", got, want, 2e-5)


def test_float32_dv_error_is_within_a_factor_of_plain_float32():
  """Issue 46's shape and inputs (uniform in [1, 2): large logits, |qk·scale| ~ 20): the Triton
  kernels' float32 dV against a float64 truth, within 2x the error of plain float32 jnp
  (measured 4.3e-5 against 2.5e-5, 1.75x; 5.8e-5, 2.4x, with the lse round trip that
  triton/common.probabilities avoids). The rest of the gap is the float32 lse itself (the max
  rounded at |s| ~ 30 in log2 units, about 2 ulps) and the blocked summation order."""
  keys = jax.random.split(jax.random.key(0), 4)
  q, do = (jax.random.uniform(kk, (2, 256, 4, 64), jnp.float32, 1, 2) for kk in keys[::3])
  k, v = (jax.random.uniform(kk, (2, 8, 4, 64), jnp.float32, 1, 2) for kk in keys[1:3])

  def plain(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") / np.sqrt(q.shape[-1])
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v, precision="highest")

  def dv_of(f, *args):  # one program: op by op, each operation compiles on its own
    return jax.jit(lambda *a: jax.vjp(f, *a)[1](do.astype(a[0].dtype))[2])(*args)

  with jax.enable_x64(True):
    truth = np.asarray(dv_of(plain, *(x.astype(jnp.float64) for x in (q, k, v))))
  err_plain = np.abs(np.asarray(dv_of(plain, q, k, v), np.float64) - truth).max()
  kernel = functools.partial(pallas_flash.flash_attention, implementation="interpret")
  err = np.abs(np.asarray(dv_of(kernel, q, k, v), np.float64) - truth).max()
  assert err <= 2.0 * err_plain, f"dV error {err:.3g} vs plain float32's {err_plain:.3g}"
