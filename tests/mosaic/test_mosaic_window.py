"""local_window_size on the Mosaic GPU forward (its backward runs the Triton kernels): the
interpreted forward against the reference, gradients through the Triton backward, lowering for
CUDA on the CPU, and the dispatch.

With 64-row tiles the windows below cover a few key blocks out of several, so a kernel that
streamed the wrong blocks, or masked a window edge wrongly, misses keys or sees extra ones.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import use_abstract_mesh

import pallas_flash
from pallas_flash.mosaic_gpu import _common, backward, forward
from pallas_flash.params import AttentionParams
from pallas_flash.reference import attention_reference
from testing import (H200, MOSAIC_INTERPRET_SMALL, TRITON_CALL, export_for_h200, kernel_case_id,
                     kernel_inputs, kernel_specs, max_rel_err, random_segments)

TOL = {jnp.bfloat16: (1.5e-2, 3e-2), jnp.float16: (3e-3, 6e-3)}
SMALL = MOSAIC_INTERPRET_SMALL  # testing.py says why these tiles
_rel = max_rel_err



CASES = [  # B, T, S, H, K, D, causal, dtype, (left, right)
    (1, 300, 300, 2, 1, 64, True, jnp.bfloat16, (70, 0)),  # sliding window, several blocks
    (1, 256, 256, 2, 2, 64, True, jnp.float16, (5, 0)),  # narrower than a block
    (1, 200, 333, 2, 1, 64, False, jnp.bfloat16, (13, 6)),  # two-sided, T < S
    (1, 333, 200, 4, 2, 128, True, jnp.bfloat16, (100, 0)),  # T > S: rows past the keys
    (1, 130, 190, 2, 1, 64, False, jnp.bfloat16, (1000, 0)),  # wider than the sequence
]


def _case_id(case):
  return kernel_case_id(case[:8]) + "_w{}-{}".format(*case[8])


def _params(case, *, segments=False):
  d, causal, window = case[5], case[6], case[8]
  return AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=segments,
                         local_window=window)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_windowed_forward_matches_reference(case):
  b, t, s, h, kh, d, causal, dtype, _ = case
  q, k, v, _ = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s)
  p = _params(case)
  o, lse = forward(q, k, v, None, None, params=p, config=SMALL)
  ro, rlse = attention_reference(q, k, v, None, None, params=p)
  assert _rel(o, ro) <= TOL[dtype][0], _rel(o, ro)
  finite = jnp.isfinite(rlse)
  assert bool(jnp.array_equal(finite, jnp.isfinite(lse)))
  assert float(jnp.abs(jnp.where(finite, lse - rlse, 0.0)).max()) <= 1e-4 * max(
      1.0, float(jnp.abs(jnp.where(finite, rlse, 0.0)).max()))


def test_windowed_forward_with_segment_ids_matches_reference():
  case = (1, 320, 320, 2, 1, 64, True, jnp.bfloat16, (90, 0))
  b, t, s, h, kh, d, causal, dtype, _ = case
  q, k, v, _ = kernel_inputs(b, t, s, h, kh, d, dtype, seed=5)
  seg = random_segments(jax.random.key(3), b, t, num_docs=3)
  p = _params(case, segments=True)
  o, _ = forward(q, k, v, seg, seg, params=p, config=SMALL)
  ro, _ = attention_reference(q, k, v, seg, seg, params=p)
  assert _rel(o, ro) <= TOL[dtype][0], _rel(o, ro)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=_case_id)
def test_windowed_gradients_match_reference(case):
  b, t, s, h, kh, d, causal, dtype, _ = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t * s)
  p = _params(case)
  _, vjp = jax.vjp(lambda *a: attention_reference(*a, None, None, params=p), q, k, v)
  o, lse = forward(q, k, v, None, None, params=p, config=SMALL)
  got = backward(q, k, v, None, None, o, lse, do, None, params=p, config=SMALL)
  for name, g, r in zip(("dq", "dk", "dv"), got, vjp((do, jnp.zeros(lse.shape, jnp.float32)))):
    assert g.shape == r.shape and g.dtype == r.dtype
    assert _rel(g, r) <= TOL[dtype][1], (name, _rel(g, r))


LOWER = [  # B, T, S, H, K, D, causal
    (1, 4096, 4096, 8, 2, 128, True),
    (1, 3000, 3000, 4, 4, 64, False),
    (1, 2048, 2048, 4, 4, 256, True),
]


@pytest.mark.parametrize("case", LOWER, ids=kernel_case_id)
def test_windowed_forward_and_grad_lower(case):
  *shape, causal = case
  q, kv = kernel_specs(*shape)

  def attn(q, k, v):
    return pallas_flash.flash_attention(q, k, v, is_causal=causal, local_window_size=(511, 0),
                                        implementation="mosaic")

  def grads(q, k, v):
    return jax.grad(lambda *a: attn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

  assert export_for_h200(attn, q, kv, kv).mlir_module().count("mosaic_gpu") >= 1
  text = export_for_h200(grads, q, kv, kv, disabled_checks=[TRITON_CALL]).mlir_module()
  assert text.count("mosaic_gpu") >= 1 and "pallas_flash_bwd_dq" in text


def test_windowed_calls_choose_the_mosaic_kernels():
  q = jax.ShapeDtypeStruct((1, 4096, 4, 128), jnp.bfloat16)
  slopes = jax.ShapeDtypeStruct((4,), jnp.float32)
  with use_abstract_mesh(H200):
    why = pallas_flash.explain(q, q, q, is_causal=True, local_window_size=(1023, 0))
    alibi = pallas_flash.explain(q, q, q, local_window_size=64, alibi_slopes=slopes)
  assert why.chosen == "mosaic", why
  assert why.blocks_computed < 0.3, why  # the band's blocks only
  assert alibi.chosen == "triton"
  assert "alibi_slopes" in alibi.reasons["mosaic"]


@pytest.mark.parametrize("t,s,causal,window", [(300, 300, True, (70, 0)),
                                               (200, 333, False, (13, 6)),
                                               (333, 200, True, (100, 0))])
def test_window_limits_are_the_band_blocks(t, s, causal, window):
  """Each CTA tile streams exactly the hull of the key blocks its rows' windows touch, and
  skips the mask only on blocks every row sees whole (brute force over positions)."""

  p = AttentionParams(scale=1.0, is_causal=causal, has_segments=False, local_window=window)
  q, k = kernel_specs(1, t, s, 2, 1, 64)
  t_pad, s_pad = -(-t // 128) * 128, -(-s // 64) * 64
  kp = _common.KernelParams.make(q, k, params=p, block_q=64, block_kv=64, stages=2,
                                 t_pad=t_pad, s_pad=s_pad, kv_len=s, config=SMALL)
  nq = t_pad // 128
  fwd_module = importlib.import_module("pallas_flash.mosaic_gpu.forward")  # not the function
  got = np.asarray(fwd_module.window_limits(None, p, kp, 1))[0]
  rows, cols = np.arange(t_pad)[:, None], np.arange(s_pad)[None, :]
  seen = (cols - rows >= -window[0]) & (cols - rows <= window[1]) & (cols < s)
  if causal:
    seen &= cols <= rows
  for tile in range(nq):
    r = seen[tile * 128:(tile + 1) * 128]
    blocks = r.reshape(128, -1, 64)
    touched = np.flatnonzero(blocks.any(axis=(0, 2)))
    whole = np.flatnonzero(blocks.all(axis=(0, 2)))
    first, last = (touched[0], touched[-1] + 1) if touched.size else (None, None)
    if first is not None:
      assert (got[tile, 0], got[tile, 1]) == (first, last), (tile, got[tile])
    # The unmasked run lies inside the whole blocks (it may be narrower, never wider).
    run = set(range(got[tile, 2], got[tile, 3]))
    assert run <= set(whole.tolist()), (tile, got[tile], whole)
