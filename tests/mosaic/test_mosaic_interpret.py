"""The Mosaic GPU kernels' math on CPU, in the Mosaic GPU interpreter, against the reference.

`MosaicConfig(interpret=True)` runs TMA, barriers and the warp-specialised rings in the
interpreter and stages register wgmma operands through shared memory (which the interpreter can
run). Async hazards are not modelled here: the GPU suite covers them.
"""

import dataclasses
import functools
import importlib
import os
import warnings

import jax
import jax.numpy as jnp
import pytest

from pallas_flash import api
from pallas_flash.mosaic_gpu import _common, backward, forward
from pallas_flash.call import AttentionParams, FeatureArrays
from pallas_flash.reference import attention_reference
from testing import (MOSAIC_INTERPRET_SMALL, kernel_case_id, kernel_inputs, max_abs,
                     max_rel_err)

TOL = {jnp.bfloat16: (1e-2, 2e-2), jnp.float16: (2e-3, 4e-3)}
SMALL = MOSAIC_INTERPRET_SMALL  # testing.py says why these tiles
_rel = max_rel_err



FWD = [  # B, T, S, H, K, D, causal, dtype
    (1, 128, 128, 2, 1, 64, False, jnp.bfloat16),
    (1, 200, 333, 2, 1, 64, True, jnp.float16),
    (1, 333, 200, 2, 2, 64, True, jnp.bfloat16),
    (1, 1, 1, 2, 1, 64, False, jnp.bfloat16),
    (1, 130, 190, 1, 1, 128, True, jnp.float16),
]
BWD = [
    (1, 128, 128, 2, 1, 64, False, jnp.float16),
    (1, 256, 256, 2, 1, 64, True, jnp.bfloat16),
    (1, 190, 130, 2, 2, 64, True, jnp.float16),
    (1, 130, 190, 4, 2, 128, False, jnp.bfloat16),
]


def _assert_forward_matches_reference(case, config):
  b, t, s, h, kh, d, causal, dtype = case
  q, k, v, _ = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s)
  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  o, lse = forward(q, k, v, None, None, params=p, config=config)
  ro, rlse = attention_reference(q, k, v, None, None, params=p)
  assert _rel(o, ro) <= TOL[dtype][0], _rel(o, ro)
  assert max_abs(lse - rlse) <= 1e-4 * max(1.0, max_abs(rlse))


@pytest.mark.parametrize("case", FWD, ids=kernel_case_id)
def test_forward_matches_reference(case):
  _assert_forward_matches_reference(case, SMALL)


# Intra-warpgroup overlap: several kv steps (non-causal, causal with idle steps, GQA, odd
# lengths on both sides) and a single kv block (prologue and epilogue only).
OVERLAP = [
    (1, 256, 320, 2, 1, 64, False, jnp.float16),
    (1, 200, 333, 2, 1, 64, True, jnp.bfloat16),
    (1, 333, 200, 4, 2, 64, True, jnp.float16),
    (1, 130, 190, 1, 1, 128, False, jnp.bfloat16),
    (1, 1, 1, 2, 1, 64, False, jnp.bfloat16),
]


@pytest.mark.parametrize("case", OVERLAP, ids=kernel_case_id)
def test_forward_with_intra_wg_overlap_matches_reference(case):
  _assert_forward_matches_reference(case, dataclasses.replace(SMALL, fwd_intra_wg_overlap=True))


@pytest.mark.parametrize("case", [(1, 300, 520, 2, 1, 64, False, jnp.bfloat16),
                                  (2, 64, 100, 2, 2, 64, False, jnp.float16)], ids=kernel_case_id)
def test_forward_with_256_key_tiles_matches_reference(case):
  """block_kv=256 (head dim 64's tuned non-causal forward tiles), padded keys in the last
  tile; the persistent kernel (short calls) with the same tiles too."""
  config = dataclasses.replace(SMALL, block_kv=256)
  _assert_forward_matches_reference(case, config)
  _assert_forward_matches_reference(case, dataclasses.replace(config, fwd_persistent=True,
                                                              heads_fastest=True))


@pytest.mark.parametrize("case", [(1, 130, 500, 2, 1, 128, False, jnp.bfloat16),
                                  (1, 64, 384, 2, 2, 128, False, jnp.float16)],
                         ids=kernel_case_id)
def test_forward_with_192_key_tiles_matches_reference(case):
  """block_kv=192 with the overlapped loop (head dim 128's tuned long non-causal forward):
  500 keys leave a partial last tile, which streams first (forward._last_block_first); 384
  none."""
  _assert_forward_matches_reference(case, dataclasses.replace(
      SMALL, block_kv=192, fwd_intra_wg_overlap=True))


@pytest.mark.parametrize("case", [(1, 300, 300, 2, 1, 64, True, jnp.bfloat16),
                                  (1, 333, 200, 2, 2, 64, True, jnp.float16),
                                  (1, 200, 333, 2, 1, 64, True, jnp.bfloat16),
                                  (2, 256, 256, 2, 2, 64, True, jnp.float16)],
                         ids=kernel_case_id)
def test_causal_forward_streams_the_diagonal_block_first(case):
  """Causal, overlapped loop, block_kv = 2·block_q (the tuned causal tiles): each CTA streams
  its diagonal block (or, with T > S, the key tail) first and masks no loop step
  (forward._last_block_first); queries past the keys, keys past the queries, an aligned
  length."""
  b, t, s, h, kh, d, _, dtype = case
  config = dataclasses.replace(SMALL, block_kv=128, fwd_intra_wg_overlap=True)
  kp = _common.KernelParams.make(
      jax.ShapeDtypeStruct((b, t, h, d), dtype), jax.ShapeDtypeStruct((b, s, kh, d), dtype),
      params=AttentionParams(scale=d ** -0.5, is_causal=True, has_segments=False),
      block_q=64, block_kv=128, stages=2, t_pad=-(-t // 128) * 128, s_pad=-(-s // 128) * 128,
      kv_len=s, config=config)
  assert importlib.import_module("pallas_flash.mosaic_gpu.forward")._last_block_first(kp)
  _assert_forward_matches_reference(case, config)


def test_one_stage_causal_forward_is_refused():
  # One ring slot deadlocks the causal idle steps (found in the interpreter): refuse it.
  q, k, v, _ = kernel_inputs(1, 200, 200, 2, 1, 64, jnp.bfloat16, seed=0)
  p = AttentionParams(scale=0.125, is_causal=True, has_segments=False)
  with pytest.raises(ValueError, match="num_stages=1"):
    forward(q, k, v, None, None, params=p, config=dataclasses.replace(SMALL, num_stages=1))


# (bwd_delta_in_kernel, lse cotangent): the dQ kernel's own delta and lse2, with and without a
# cotangent on lse, and the XLA preprocessing (the A/B switch) with one.
STATS = [(True, False), (True, True), (False, True)]


def _stats_id(c):
  return ("kernel_delta" if c[0] else "xla_delta") + ("_dlse" if c[1] else "")


def _assert_gradients_match_reference(case, config, *, lse_cotangent: bool):
  """The interpreted forward and backward with `config` against the reference's gradients,
  with or without a cotangent on lse."""
  b, t, s, h, kh, d, causal, dtype = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t * s)
  dlse = jax.random.normal(jax.random.key(t + s), (b, h, t), jnp.float32)
  if not lse_cotangent:
    dlse = jnp.zeros_like(dlse)
  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  _, vjp = jax.vjp(lambda *a: attention_reference(*a, None, None, params=p), q, k, v)
  o, lse = forward(q, k, v, None, None, params=p, config=config)
  # The backend contract (BACKWARD_COMPUTES_DELTA): the forward's lse and delta = -dlse or None.
  got = backward(q, k, v, None, None, o, lse, do, -dlse if lse_cotangent else None, params=p,
                 config=config)
  for name, g, r in zip(("dq", "dk", "dv"), got, vjp((do, dlse))):
    assert g.shape == r.shape and g.dtype == r.dtype
    assert _rel(g, r) <= TOL[dtype][1], (name, _rel(g, r))


@pytest.mark.parametrize("stats", STATS, ids=_stats_id)
@pytest.mark.parametrize("case", BWD, ids=kernel_case_id)
def test_gradients_match_reference(case, stats):
  delta_in_kernel, lse_cotangent = stats
  _assert_gradients_match_reference(
      case, dataclasses.replace(SMALL, bwd_delta_in_kernel=delta_in_kernel),
      lse_cotangent=lse_cotangent)


@pytest.mark.parametrize("case", [c for c in BWD if c[5] == 64], ids=kernel_case_id)
def test_dkdv_kernel_with_128_row_query_tiles_matches_reference(case):
  """block_q_dkv=128 (the tuned head-dim-64 non-causal dK/dV tiles): Sᵀ and dPᵀ of 64 keys x
  128 queries per warpgroup, padded rows and causal masking included."""
  _assert_gradients_match_reference(case, dataclasses.replace(SMALL, block_q_dkv=128),
                                    lse_cotangent=False)


def _assert_wide_backward_matches_reference(case, config):
  """The backend's backward at D = 256 with `config`, given the reference's o and lse (the
  Mosaic forward at D = 256 is the GPU suite's) and a cotangent on lse, against the
  reference's gradients. Returns the backward's jaxpr as text."""
  b, t, s, h, kh, d, causal, dtype = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s)
  dlse = jax.random.normal(jax.random.key(t), (b, h, t), jnp.float32)
  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  (o, lse), vjp = jax.vjp(lambda *a: attention_reference(*a, None, None, params=p), q, k, v)
  run = functools.partial(backward, params=p, config=config)
  args = (q, k, v, None, None, o, lse, do, -dlse)  # the contract's raw lse and -dlse
  for name, g, r in zip(("dq", "dk", "dv"), run(*args), vjp((do, dlse))):
    assert g.shape == r.shape and g.dtype == r.dtype
    assert _rel(g, r) <= TOL[dtype][1], (name, _rel(g, r))
  return str(jax.make_jaxpr(run)(*args))


@pytest.mark.parametrize("case", [(1, 96, 130, 2, 1, 256, True, jnp.bfloat16),
                                  (2, 70, 64, 2, 2, 256, False, jnp.float16)], ids=kernel_case_id)
def test_head_dim_256_backward_runs_the_triton_kernels(case):
  """MosaicConfig(wide_backward="triton"): the backend runs Triton's kernels at D = 256
  (interpreted here)."""
  jaxpr = _assert_wide_backward_matches_reference(
      case, dataclasses.replace(SMALL, wide_backward="triton"))
  assert "pallas_flash_bwd_dkdv" in jaxpr and "pallas_flash_bwd_dq" in jaxpr


WIDE = [  # B, T, S, H, K, D, causal, dtype: padded rows and keys, GQA, T != S, one token
    (1, 64, 64, 2, 1, 256, True, jnp.bfloat16),
    (1, 200, 333, 4, 2, 256, True, jnp.float16),
    (2, 130, 70, 2, 2, 256, True, jnp.bfloat16),
    (1, 333, 200, 2, 1, 256, False, jnp.bfloat16),
    (1, 1, 1, 2, 1, 256, True, jnp.bfloat16),
]


@pytest.mark.parametrize("case", WIDE, ids=kernel_case_id)
def test_head_dim_256_mosaic_backward_matches_reference(case):
  """The default backward at D = 256 (wide_backward="mosaic"): the role-split dK/dV kernel
  (one warpgroup forms Pᵀ and dV, the other dSᵀ from its Pᵀ and dK) and the dQ kernel."""
  assert SMALL.wide_backward == "mosaic"
  jaxpr = _assert_wide_backward_matches_reference(case, SMALL)
  assert "pallas_flash_bwd_dq" not in jaxpr  # no Triton kernel


def _assert_same_backward(case, seed, changes, baseline):
  """dq, dk, dv of the interpreted backward with SMALL + `changes` are bitwise those with
  SMALL + `baseline` (same forward residuals)."""
  b, t, s, h, kh, d, causal, dtype = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=seed)
  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  o, lse = forward(q, k, v, None, None, params=p, config=SMALL)
  got, want = (backward(q, k, v, None, None, o, lse, do, None, params=p,
                        config=dataclasses.replace(SMALL, **kw))
               for kw in (changes, baseline))
  for name, g, r in zip(("dq", "dk", "dv"), got, want):
    assert bool(jnp.array_equal(g, r)), name


@pytest.mark.slow  # dkdv_pingpong is opt-in (measured slower)
@pytest.mark.parametrize("case", BWD, ids=kernel_case_id)
def test_dkdv_pingpong_gives_the_same_gradients(case):
  """MosaicConfig.dkdv_pingpong only adds schedule-barrier rounds (which the interpreter
  checks for pairing, including the causal skip steps): same dK, dV to the bit."""
  _assert_same_backward(case, case[1] + case[2], dict(dkdv_pingpong=True),
                        dict(dkdv_pingpong=False))


@pytest.mark.slow  # bwd_heads_fastest and bwd_head_group are opt-in
@pytest.mark.parametrize("group", [0, 1, 2], ids=["all_heads", "group1", "group2"])
@pytest.mark.parametrize("case", BWD, ids=kernel_case_id)
def test_backward_launch_order_gives_the_same_gradients(case, group):
  """MosaicConfig.bwd_heads_fastest / bwd_head_group only renumber the CTAs (and reverse the
  causal dQ kernel's q tiles): every tile is still computed once, by the same products. (A
  group that does not divide a kernel's head count falls back to all heads.)"""
  _assert_same_backward(case, case[1] + case[2] + 1,
                        dict(bwd_heads_fastest=True, bwd_head_group=group),
                        dict(bwd_heads_fastest=False, bwd_head_group=group))


# Batch > 1, where the dK/dV kernel's lse / delta rows are b·H + h of a [1, B·H, Tp] view.
BATCHED = [(2, 190, 130, 2, 1, 64, True, jnp.bfloat16),
           (3, 70, 200, 2, 1, 128, False, jnp.float16)]


@pytest.mark.parametrize("case", BATCHED, ids=kernel_case_id)
def test_batched_gradients_with_flat_and_3d_stats(case):
  """Gradients at batch > 1 (a cotangent on lse too) against the reference; and
  MosaicConfig.bwd_flat_stats (the default) only changes how the dK/dV kernel addresses lse
  and delta: the same dQ, dK, dV to the bit as with [B, H, Tp] loads."""
  assert SMALL.bwd_flat_stats
  b, t, s, h, kh, d, causal, dtype = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t * s)
  dlse = jax.random.normal(jax.random.key(t + s), (b, h, t), jnp.float32)
  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  _, vjp = jax.vjp(lambda *a: attention_reference(*a, None, None, params=p), q, k, v)
  o, lse = forward(q, k, v, None, None, params=p, config=SMALL)
  flat, three_d = (backward(q, k, v, None, None, o, lse, do, -dlse, params=p,
                            config=dataclasses.replace(SMALL, bwd_flat_stats=flag))
                   for flag in (True, False))
  for name, g, g3, r in zip(("dq", "dk", "dv"), flat, three_d, vjp((do, dlse))):
    assert _rel(g, r) <= TOL[dtype][1], (name, _rel(g, r))
    assert bool(jnp.array_equal(g, g3)), name


def test_fully_masked_row_contributes_nothing():
  # Such a row (segment ids a query's keys never carry: test_mosaic_segments.py) gets o = 0
  # and lse = -inf, which the dQ kernel maps to lse2 = +inf (P = 0) as the XLA path does.
  b, t, s, h, kh, d = 1, 128, 192, 2, 1, 64
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, jnp.bfloat16, seed=3)
  p = AttentionParams(scale=d ** -0.5, is_causal=False, has_segments=False)
  o, lse = forward(q, k, v, None, None, params=p, config=SMALL)
  o, lse = o.at[:, 5].set(0), lse.at[:, :, 5].set(-jnp.inf)
  got = [backward(q, k, v, None, None, o, lse, do, None, params=p,
                  config=dataclasses.replace(SMALL, bwd_delta_in_kernel=flag))
         for flag in (True, False)]
  assert not jnp.any(got[0][0][:, 5])
  for name, g, r in zip(("dq", "dk", "dv"), *got):
    assert bool(jnp.isfinite(g.astype(jnp.float32)).all()), name
    assert _rel(g, r) <= 1e-2, (name, _rel(g, r))


@pytest.mark.parametrize("uses", ["o", "lse", "o_and_lse"])
def test_api_vjp_gives_the_backend_its_contract(uses):
  # The API's custom_vjp with this backend (BACKWARD_COMPUTES_DELTA, symbolic zeros): no lse
  # cotangent (delta None), only an lse cotangent (dO zero), and both.
  q, k, v, do = kernel_inputs(1, 200, 130, 4, 2, 64, jnp.float16, seed=7)
  p = AttentionParams(scale=0.125, is_causal=True, has_segments=False)

  def loss(attention, q, k, v):
    o, lse = attention(q, k, v)
    terms = {"o": (o.astype(jnp.float32) * do).sum(), "lse": jnp.sin(lse).sum()}
    return sum(terms[name] for name in terms if name in uses)

  mosaic = lambda *a: api._differentiable("mosaic", p, SMALL)(  # noqa: E731
      *a, None, None, FeatureArrays())
  reference = lambda *a: attention_reference(*a, None, None, params=p)  # noqa: E731
  got = jax.grad(functools.partial(loss, mosaic), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(functools.partial(loss, reference), argnums=(0, 1, 2))(q, k, v)
  for name, g, r in zip(("dq", "dk", "dv"), got, want):
    if not jnp.any(r):  # dV of lse alone
      assert not jnp.any(g), name
    else:
      assert _rel(g, r) <= TOL[jnp.float16][1], (name, _rel(g, r))


def test_the_suite_runs_the_interpreter_with_its_xla_flag():
  """conftest.py put the flag in XLA_FLAGS (without it some launches deadlock on 2 cores)."""
  assert _common.INTERPRET_XLA_FLAG in os.environ["XLA_FLAGS"].split()


def test_the_interpreter_warns_once_without_its_xla_flag(monkeypatch):
  monkeypatch.setattr(_common, "_warned_interpret_flag", False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  with pytest.warns(RuntimeWarning, match="concurrency_optimized_scheduler=false"):
    assert _common.interpret_params(True) is not None
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert _common.interpret_params(True) is not None  # once per process
    monkeypatch.setattr(_common, "_warned_interpret_flag", False)
    monkeypatch.setenv("XLA_FLAGS", _common.with_interpret_xla_flag("--xla_force_host_platform_"
                                                                     "device_count=2"))
    assert _common.interpret_params(True) is not None  # flag present: silent
    assert _common.interpret_params(False) is None
