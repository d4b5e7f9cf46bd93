"""Segment ids (and lengths, which the API folds into them) in the Mosaic GPU kernels, on CPU in
the Mosaic GPU interpreter, against the reference.

The kernels load only the key (forward, dQ) or query (dK/dV) blocks that may share an id with
their tile and compare ids on those blocks, except where both blocks lie wholly inside one
document; these cases cover sorted packed documents (blocks skipped), documents longer than a
tile (unmasked runs), unsorted ids (nothing skipped, every block masked), ids a tile never
meets (rows with no visible key: zeros), causal and not, GQA, and lengths that pad both axes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_flash import api, validation
from pallas_flash.mosaic_gpu import backward, forward
from pallas_flash.call import AttentionParams, FeatureArrays
from pallas_flash.reference import attention_reference
from testing import (MOSAIC_INTERPRET_SMALL, kernel_inputs, max_abs, max_rel_err,
                     random_segments)

TOL = {jnp.bfloat16: (1e-2, 2e-2), jnp.float16: (2e-3, 4e-3)}
SMALL = MOSAIC_INTERPRET_SMALL  # testing.py says why these tiles
_rel = max_rel_err

CASES = [  # B, T, S, H, K, D, causal, dtype, ids
    (1, 512, 512, 2, 1, 64, True, jnp.bfloat16, "packed"),
    (2, 384, 448, 2, 2, 64, False, jnp.float16, "packed"),
    (1, 300, 300, 4, 2, 64, True, jnp.float16, "unsorted"),
    (1, 256, 320, 2, 1, 128, False, jnp.bfloat16, "unmatched"),
    # Documents longer than a tile: blocks wholly inside one document skip the id test.
    (1, 640, 640, 2, 2, 64, True, jnp.bfloat16, "long_docs"),
    (2, 576, 576, 2, 1, 64, False, jnp.float16, "long_docs"),
    # Head dim 256: backward_wide.py's dQ and role-split dK/dV kernels.
    (1, 320, 320, 2, 1, 256, True, jnp.bfloat16, "packed"),
    (1, 256, 320, 4, 2, 256, False, jnp.float16, "unmatched"),
    (1, 200, 200, 2, 2, 256, True, jnp.float16, "unsorted"),
]


def _case_id(case):
  b, t, s, h, kh, d, causal, dtype, ids = case
  return (f"b{b}_t{t}_s{s}_h{h}k{kh}_d{d}_{'causal' if causal else 'full'}_"
          f"{jnp.dtype(dtype).name}_{ids}")


def _segments(case, key):
  """q_seg [B, T], kv_seg [B, S] int32 for the case's kind of ids."""
  b, t, s, *_, ids = case
  kq, kk = jax.random.split(key)
  if ids == "packed":  # one document layout over max(T, S), cut to each length
    docs = random_segments(kq, b, max(t, s), num_docs=5)
    return docs[:, :t], docs[:, :s]
  if ids == "long_docs":  # [0, 320), [320, 330), [330, ...)
    docs = (jnp.arange(max(t, s))[:, None] >= jnp.array([320, 330])).sum(-1).astype(jnp.int32)
    return docs[None, :t].repeat(b, 0), docs[None, :s].repeat(b, 0)
  if ids == "unsorted":
    return (jax.random.randint(kq, (b, t), 0, 3, jnp.int32),
            jax.random.randint(kk, (b, s), 0, 3, jnp.int32))
  # "unmatched": the first 100 queries carry an id no key has, so their rows see nothing.
  q_seg = jnp.where(jnp.arange(t) < 100, 7, jnp.arange(t) // 128)[None].repeat(b, 0)
  return q_seg.astype(jnp.int32), (jnp.arange(s) // 128)[None].repeat(b, 0).astype(jnp.int32)



def _setup(case):
  b, t, s, h, kh, d, causal, dtype, _ = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + 3 * s)
  q_seg, kv_seg = _segments(case, jax.random.key(t * s))
  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=True)
  return (q, k, v, do), (q_seg, kv_seg), p


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_with_segments_matches_reference(case):
  (q, k, v, _), segs, p = _setup(case)
  o, lse = forward(q, k, v, *segs, params=p, config=SMALL)
  ro, rlse = attention_reference(q, k, v, *segs, params=p)
  assert _rel(o, ro) <= TOL[case[7]][0], _rel(o, ro)
  seen = jnp.isfinite(rlse)
  assert bool(jnp.array_equal(jnp.isfinite(lse), seen))  # rows with no visible key: -inf
  assert max_abs(jnp.where(seen, lse - rlse, 0.0)) <= 1e-4 * max(
      1.0, max_abs(jnp.where(seen, rlse, 0.0)))
  assert bool(jnp.all(jnp.where(seen.transpose(0, 2, 1)[..., None], True, o == 0)))


def _assert_gradients_match_reference(case, config):
  (q, k, v, do), segs, p = _setup(case)
  _, vjp = jax.vjp(lambda *a: attention_reference(*a, *segs, params=p)[0], q, k, v)
  o, lse = forward(q, k, v, *segs, params=p, config=config)
  got = backward(q, k, v, *segs, o, lse, do, None, params=p, config=config)
  for name, g, r in zip(("dq", "dk", "dv"), got, vjp(do)):
    assert g.shape == r.shape and g.dtype == r.dtype
    assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), name
    assert _rel(g, r) <= TOL[case[7]][1], (name, _rel(g, r))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gradients_with_segments_match_reference(case):
  _assert_gradients_match_reference(case, SMALL)


@pytest.mark.parametrize("case", [CASES[1], CASES[5]], ids=_case_id)
def test_gradients_with_segments_and_128_row_dkdv_tiles(case):
  """block_q_dkv=128 (head dim 64's tuned non-causal dK/dV tiles): the q-block hull and the
  unmasked runs of a kv tile counted in 128-row blocks."""
  _assert_gradients_match_reference(case, dataclasses.replace(SMALL, block_q_dkv=128))


def test_lengths_folded_by_the_api_match_reference():
  """Sequence lengths reach the kernels as segment ids (validation._fold_lengths): padded queries get
  zeros and no gradient, padded keys no weight."""
  b, t, h, d = 2, 200, 2, 64
  q, k, v, do = kernel_inputs(b, t, t, h, h, d, jnp.bfloat16, seed=5)
  lens = jnp.array([200, 77], jnp.int32)
  segs = validation._fold_lengths(None, None, lens, lens, t, t)
  p = AttentionParams(scale=d ** -0.5, is_causal=True, has_segments=True)
  mosaic = lambda *a: api._differentiable("mosaic", p, SMALL)(  # noqa: E731
      *a, *segs, FeatureArrays())[0]
  reference = lambda *a: attention_reference(*a, *segs, params=p)[0]  # noqa: E731
  o, vjp = jax.vjp(mosaic, q, k, v)
  ro, rvjp = jax.vjp(reference, q, k, v)
  assert _rel(o, ro) <= TOL[jnp.bfloat16][0]
  assert bool(jnp.all(o[1, 77:] == 0))
  for name, g, r in zip(("dq", "dk", "dv"), vjp(do), rvjp(do)):
    assert _rel(g, r) <= TOL[jnp.bfloat16][1], name
    assert bool(jnp.all(g[1, 77:] == 0)), name


def test_segments_never_take_the_persistent_or_fused_kernels():
  """Both would ignore the ids: the forward runs the grid kernel, the backward the split."""
  case = CASES[1]
  (q, k, v, do), segs, p = _setup(case)
  config = dataclasses.replace(SMALL, fwd_persistent=True, persistent_ctas=2)
  o, lse = forward(q, k, v, *segs, params=p, config=config)
  ro, _ = attention_reference(q, k, v, *segs, params=p)
  assert _rel(o, ro) <= TOL[case[7]][0]
  fused = dataclasses.replace(SMALL, fused_backward=True)
  with pytest.warns(UserWarning, match="segment"):
    got = backward(q, k, v, *segs, o, lse, do, None, params=p, config=fused)
  _, vjp = jax.vjp(lambda *a: attention_reference(*a, *segs, params=p)[0], q, k, v)
  for g, r in zip(got, vjp(do)):
    assert _rel(g, r) <= TOL[case[7]][1]
