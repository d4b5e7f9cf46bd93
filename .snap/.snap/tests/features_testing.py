"""Feature arguments for tests: named recipes and a check of output, lse and every gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_flash
from testing import FWD_TOL, Case, assert_close_to_ref, make_inputs


def feature_kwargs(names: tuple[str, ...], case: Case, seed: int = 0) -> dict:
  """Keyword arguments of flash_attention turning on each named feature for `case`."""
  keys = jax.random.split(jax.random.key(1000 + seed), 4)
  b, h, t, s = case.batch, case.num_heads, case.q_len, case.kv_len
  recipes = {
      "window": lambda: {"local_window_size": (13, 6)},
      "window_left": lambda: {"local_window_size": (24, 0)},
      "window_512": lambda: {"local_window_size": (511, 0)},
      "softcap": lambda: {"logits_soft_cap": 1.5},
      "alibi": lambda: {"alibi_slopes": 2.0 ** -jnp.arange(1, h + 1, dtype=jnp.float32)},
      "dropout": lambda: {"dropout_rate": 0.25, "dropout_rng": jax.random.key(7 + seed)},
      "bias": lambda: {"bias": jax.random.normal(keys[0], (1, h, t, s))},
      "bias_bcast": lambda: {"bias": jax.random.normal(keys[1], (b, 1, 1, s))},
      "mask": lambda: {"mask": jax.random.bernoulli(keys[2], 0.8, (b, 1, t, s))},
  }
  kwargs = {}
  for name in names:
    kwargs.update(recipes[name]())
  return kwargs


def run(impl: str, q, k, v, do, *, config=None, **kwargs):
  """(o, lse) and the gradients (dq, dk, dv[, dbias]) of sum(o * do)."""
  bias = kwargs.pop("bias", None)
  primals = (q, k, v) if bias is None else (q, k, v, bias)

  def f(q, k, v, bias=None):
    return pallas_flash.flash_attention(q, k, v, bias, implementation=impl, config=config,
                                        return_residuals=True, **kwargs)

  (o, lse), vjp = jax.vjp(f, *primals)
  return (o, lse), vjp((do, jnp.zeros_like(lse)))


def check_features(impl: str, case: Case, names: tuple[str, ...], *, config=None, seed: int = 0,
                   tol_table=FWD_TOL) -> None:
  """Output, lse and gradients (bias included) of `impl` against the reference."""
  (q, k, v, do), kwargs = make_inputs(case, seed)
  kwargs.update(feature_kwargs(names, case, seed))
  (o, lse), grads = run(impl, q, k, v, do, config=config, **kwargs)
  up = [x.astype(jnp.float32) for x in (q, k, v, do)]
  (o_ref, lse_ref), grads_ref = run("reference", *up, **kwargs)
  tol = tol_table[case.dtype]
  assert_close_to_ref("out", o, o_ref, tol)
  assert_close_to_ref("lse", lse, lse_ref, max(tol, 1e-5))
  for name, g, g_ref in zip(("dq", "dk", "dv", "dbias"), grads, grads_ref):
    assert g.shape == g_ref.shape, f"{name}: shape {g.shape} != {g_ref.shape}"
    assert_close_to_ref(name, g, g_ref, 2 * tol)
