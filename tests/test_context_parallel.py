"""Context parallelism: the planner's exactness and choices here; forward and gradients on 8 host
CPU devices against the unsharded reference in subprocesses (context_parallel_checks.py says
why and lists the cases: mesh sizes 2, 4, 8; ring and all-gather; zig-zag and contiguous;
causal or not, GQA, segment ids crossing shards, windows, soft cap, fully masked rows; both
entry points)."""

from __future__ import annotations

import context_parallel_checks as checks
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import use_abstract_mesh

import pallas_flash
from pallas_flash import _tiling
from pallas_flash.call import AttentionParams
from pallas_flash.context_parallel import layout as layouts
from pallas_flash.context_parallel import plan as plans
from pallas_flash.context_parallel import sharding
from testing import H200


# ring-8 (an 8-device ring with soft cap, masked rows and a window's skipped steps) repeats
# what ring-2-4 and all-gather cover at 8 devices, and "interpret" runs ring-2-4's logic on the
# Triton interpreter: both run with -m slow (suite time).
@pytest.mark.parametrize("group", [pytest.param(g, marks=pytest.mark.slow)
                                   if g in ("ring-8", "interpret") else g for g in checks.GROUPS])
def test_against_reference_on_8_devices(group):
  checks.assert_all_pass_in_subprocess("context_parallel_checks.py", checks.GROUPS[group], group)


# The planner, checked exhaustively without devices

def _params(is_causal=False, window=None) -> AttentionParams:
  return AttentionParams(scale=1.0, is_causal=is_causal, has_segments=False,
                         local_window=window)


def _global_rows(layout: str, p: int, r: int, local: int) -> np.ndarray:
  """Global positions of device r's local rows."""
  m = layouts.chunks_per_device(layout)
  c = local // m
  return np.concatenate([g * c + np.arange(c) for g in layouts.device_chunks(layout, p, r)])


PLAN_CASES = [
    # (layout, P, is_causal, window, local q len, local kv len)
    *[(lay, p, True, None, 8, 8) for lay in layouts.LAYOUTS for p in (1, 2, 3, 8)],
    *[(lay, 4, False, None, 8, 8) for lay in layouts.LAYOUTS],
    *[(lay, p, True, w, 8, 8) for lay in layouts.LAYOUTS for p in (3, 5) for w in
      ((3, 0), (4, 0), (5, 0), (20, 0), (0, 0))],
    *[(lay, 5, False, w, 8, 8) for lay in layouts.LAYOUTS for w in
      ((2, 7), (0, 5), (9, 0), (3, 3), (30, 1))],
    ("zigzag", 4, True, None, 2, 2),  # one-row chunks
    ("zigzag", 3, True, (1, 0), 2, 2),
    ("contiguous", 4, True, None, 8, 12),  # T != S: top-left alignment over global positions
    ("zigzag", 3, False, (5, 2), 8, 4),
    ("zigzag", 3, True, (6, 3), 4, 10),
]


@pytest.mark.parametrize("layout,p,is_causal,window,tl,sl", PLAN_CASES,
                         ids=[f"{c[0]}-p{c[1]}-{'causal' if c[2] else 'full'}-w{c[3]}-{c[4]}x{c[5]}"
                              for c in PLAN_CASES])
def test_plan_computes_every_visible_pair_exactly_once(layout, p, is_causal, window, tl, sl):
  """Over the ring, each device's kernel calls cover exactly its queries' band over global
  positions: every visible pair once (merging one twice would be wrong), nothing else."""
  base = _params(is_causal, window)
  plan = plans.ring_plan(base, layout, p, tl, sl)
  for r in range(p):
    counts = np.zeros((tl, p * sl), np.int64)
    for t, row in zip(plan.steps, plan.table):
      keys = _global_rows(layout, p, (r - t) % p, sl)
      for call in plan.programs[row[r]]:
        (i0, i1), (j0, j1) = call.q_rows, call.kv_rows
        lo, hi = call.params.band
        assert (lo is None or lo <= 0) and (hi is None or hi >= 0), call  # valid for the API
        vis = _tiling.band_mask(np.arange(i1 - i0), np.arange(j1 - j0), call.params.band)
        vis = np.ones((i1 - i0, j1 - j0), bool) if vis is None else vis
        np.add.at(counts, (np.arange(i0, i1)[:, None], keys[None, j0:j1]), vis)
    want = _tiling.band_mask(_global_rows(layout, p, r, tl), np.arange(p * sl), base.band)
    want = np.ones_like(counts, bool) if want is None else want
    assert (counts == want).all(), f"device {r}: {np.argwhere(counts != want)[:5].tolist()}"


def test_zigzag_balances_causal_work():
  plan = plans.ring_plan(_params(is_causal=True), "zigzag", 8, 64, 64)
  assert plan.steps == tuple(range(8))
  assert (plan.kernel_calls() == 1).all()  # one kernel call per device and step
  assert plan.balance() == 1.0
  # Contiguous placement: the last device does all steps, the first one step.
  assert plans.ring_plan(_params(is_causal=True), "contiguous", 8, 64, 64).balance() < 0.6


def test_window_runs_only_the_ring_steps_inside_its_band():
  spec = jax.ShapeDtypeStruct((1, 16, 4, 8), jnp.bfloat16)
  explain = lambda **kw: pallas_flash.context_parallel_explain(
      spec, spec, spec, axis_size=8, strategy="ring", is_causal=True, **kw)
  assert explain(local_window_size=(15, 0), layout="contiguous").ring.steps == (0, 1)
  assert explain(local_window_size=(17, 0), layout="contiguous").ring.steps == (0, 1, 2)
  # Zig-zag places chunks r and 2P-1-r: a window within a chunk needs devices r -+ 1.
  assert explain(local_window_size=(7, 0)).ring.steps == (0, 1, 7)
  dense, windowed = explain(), explain(local_window_size=(15, 0), layout="contiguous")
  assert windowed.bytes_sent[0] == dense.bytes_sent[0] // 7  # one hop instead of seven


def test_to_zigzag_places_chunks_r_and_2p_minus_1_minus_r():
  p, n = 4, 32
  x = pallas_flash.to_zigzag(jnp.arange(n), p, axis=0)
  chunks = np.asarray(x).reshape(p, 2, n // (2 * p))[..., 0] // (n // (2 * p))
  assert chunks.tolist() == [[r, 2 * p - 1 - r] for r in range(p)]
  y = jnp.arange(2 * n).reshape(2, n)
  assert (pallas_flash.from_zigzag(pallas_flash.to_zigzag(y, p), p) == y).all()


def _spec(b, t, h, d=64, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct((b, t, h, d), dtype)


@pytest.mark.parametrize("t,h,kh,kw,want", [
    (512, 8, 8, {}, "all_gather"),  # short: a step cannot hide its transfer
    (8192, 8, 8, {}, "ring"),
    (1024, 32, 4, {}, "ring"),  # GQA 8: T_local x G = 8192
    (1024, 8, 8, {"local_window_size": (256, 0)}, "ring"),
    (512, 8, 8, {"strategy": "ring"}, "ring"),
    (8192, 8, 8, {"implementation": "reference"}, "all_gather"),
])
def test_strategy_rule(t, h, kh, kw, want):
  ex = pallas_flash.context_parallel_explain(_spec(1, t, h), _spec(1, t, kh), _spec(1, t, kh),
                                             axis_size=8, is_causal=True, **kw)
  assert ex.strategy == want, ex.why
  assert want in str(ex)


def test_all_gather_gives_way_to_the_ring_when_k_v_are_large():
  big = _spec(64, 512, 64, 128, jnp.float32)
  ex = pallas_flash.context_parallel_explain(big, big, big, axis_size=8, is_causal=True)
  assert ex.strategy == "ring" and "MiB" in ex.why


@pytest.mark.parametrize("kw", [
    {"alibi_slopes": jnp.ones(4)},
    {"dropout_rate": 0.1, "dropout_rng": jax.random.key(0)},
    {"bias": jnp.zeros((1, 4, 64, 64))},
], ids=["alibi", "dropout", "bias"])
def test_position_dependent_features_are_refused(kw):
  s = _spec(1, 64, 4)
  with pytest.raises(NotImplementedError, match="context parallelism does not support"):
    pallas_flash.context_parallel_explain(s, s, s, axis_size=4, **kw)


def test_a_value_head_dim_of_its_own_is_refused():
  s = _spec(1, 64, 4)
  v = jax.ShapeDtypeStruct((*s.shape[:3], 2 * s.shape[3]), s.dtype)
  with pytest.raises(NotImplementedError, match="one head dim for query, key and value"):
    pallas_flash.context_parallel_explain(s, s, v, axis_size=4)


@pytest.mark.parametrize("head_dim, dtype, want", [(128, jnp.bfloat16, "mosaic"),
                                                   (112, jnp.bfloat16, "mosaic"),
                                                   (128, jnp.float32, "triton")])
def test_automatic_choice_is_flash_attentions_on_an_h200(head_dim, dtype, want):
  """Without a name the ring's kernels are the ones flash_attention would pick (mosaic for
  bf16 at any head dim, 112 zero-padded; triton for float32, which wgmma does not take), and
  a named implementation runs."""
  s = jax.ShapeDtypeStruct((1, 1024, 4, head_dim), dtype)
  with use_abstract_mesh(H200):
    ex = pallas_flash.context_parallel_explain(s, s, s, axis_size=4, is_causal=True)
    assert ex.implementation == pallas_flash.explain(s, s, s, is_causal=True).chosen == want
    named = pallas_flash.context_parallel_explain(s, s, s, axis_size=4, is_causal=True,
                                                  implementation="triton")
  assert named.implementation == "triton" and named.reasons["triton"] is None


def test_zigzag_needs_even_local_lengths():
  s = _spec(1, 7, 4)
  with pytest.raises(ValueError, match="2 equal chunks"):
    pallas_flash.context_parallel_explain(s, s, s, axis_size=4)


def test_unsharded_inputs_are_not_dispatched():
  x = jnp.zeros((1, 16, 2, 8))
  assert sharding.sequence_sharding(x, x, x) is None
  assert sharding.sequence_sharding(_spec(1, 16, 2), _spec(1, 16, 2), _spec(1, 16, 2)) is None
  seen = []
  jax.jit(lambda x: seen.append(sharding.sequence_sharding(x, x, x)) or x)(x)
  assert seen == [None]


def test_explanation_names_the_plan():
  s = _spec(2, 16, 4)
  text = str(pallas_flash.context_parallel_explain(s, s, s, axis_size=4, is_causal=True,
                                                   strategy="ring"))
  assert "ring steps run: [0, 1, 2, 3] of 4" in text and "load balance 100.0%" in text
  assert "q[0:16] x kv[0:16] causal" in text


def test_all_gather_plan_stacks_chunks_with_k_v_windows():
  s = _spec(2, 16, 4)
  ex = pallas_flash.context_parallel_explain(s, s, s, axis_size=4, is_causal=True,
                                             strategy="all_gather")
  ag = ex.all_gather
  # Zig-zag chunks of 8 queries; each sees the 56 keys before it and its own 8 (causal).
  assert ag.rotate and (ag.left, ag.right, ag.window) == (56, 0, 64)
  assert ag.call.shape == (8, 64) and ag.call.params.band == (-7, 56)
  assert ag.call.params.has_segments  # padding outside the sequence has a segment of its own
  assert ex.configs[0][1] == pallas_flash.XlaConfig()


def test_ring_names_its_residuals_like_flash_attention():
  """A remat policy saving pallas_flash.CHECKPOINT_NAME keeps the ring's (out, lse) too."""
  from pallas_flash.context_parallel import ring

  assert ring.CHECKPOINT_NAME == pallas_flash.CHECKPOINT_NAME
