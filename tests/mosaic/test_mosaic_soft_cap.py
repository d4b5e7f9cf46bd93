"""logits_soft_cap on the Mosaic GPU kernels: interpreted math against the reference, lowering
for CUDA on the CPU, and the dispatch (head_dim 256's backward and the fused backward).

The cap c·tanh(s / c) is applied to the scaled scores before masking (pallas_flash.call), so
a cap of 1.5 on unit-variance inputs changes most probabilities noticeably: a kernel that
skipped it, or applied it after the mask, fails these tolerances.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import use_abstract_mesh

import pallas_flash
from pallas_flash.mosaic_gpu import backward, backward_fused, forward
from pallas_flash.call import AttentionParams
from pallas_flash.reference import attention_reference
from testing import (H200, MOSAIC_INTERPRET_SMALL, TRITON_CALL, export_for_h200, kernel_case_id,
                     kernel_inputs, kernel_specs, max_abs, max_rel_err)

CAP = 1.5
TOL = {jnp.bfloat16: (1.5e-2, 3e-2), jnp.float16: (3e-3, 6e-3)}
SMALL = MOSAIC_INTERPRET_SMALL  # testing.py says why these tiles
_rel = max_rel_err



def _params(d, causal, cap=CAP):
  return AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False,
                         logits_soft_cap=cap)


FWD = [  # B, T, S, H, K, D, causal, dtype, cap, q multiplier
    (1, 200, 333, 2, 1, 64, True, jnp.bfloat16, CAP, 1.0),
    # q scaled up: whole rows saturate at +cap or at -cap.
    (1, 150, 200, 2, 1, 128, False, jnp.bfloat16, 30.0, 8.0),
    (1, 130, 190, 2, 2, 128, False, jnp.float16, CAP, 1.0),
    (1, 130, 190, 2, 1, 64, True, jnp.bfloat16, 100.0, 40.0),
]
LOOPS = {
    "plain": SMALL,
    "overlap": dataclasses.replace(SMALL, fwd_intra_wg_overlap=True),
}


def _fwd_id(case):
  return kernel_case_id(case[:8]) + f"_cap{case[8]:g}_x{case[9]:g}"


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("case", FWD, ids=_fwd_id)
def test_capped_forward_matches_reference(case, loop):
  b, t, s, h, kh, d, causal, dtype, cap, mult = case
  q, k, v, _ = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s)
  q = (q.astype(jnp.float32) * mult).astype(dtype)
  p = _params(d, causal, cap)
  o, lse = forward(q, k, v, None, None, params=p, config=LOOPS[loop])
  ro, rlse = attention_reference(q, k, v, None, None, params=p)
  assert _rel(o, ro) <= TOL[dtype][0], _rel(o, ro)
  assert max_abs(lse - rlse) <= 1e-4 * max(1.0, max_abs(rlse))
  # The cap matters at these inputs: the uncapped output is far from the capped reference.
  uo, _ = attention_reference(q, k, v, None, None, params=_params(d, causal, None))
  assert _rel(uo, ro) > 10 * TOL[dtype][0]


def test_capped_persistent_forward_matches_reference():
  q, k, v, _ = kernel_inputs(1, 300, 260, 2, 1, 64, jnp.bfloat16, seed=3)
  p = _params(64, False)
  config = dataclasses.replace(SMALL, fwd_persistent=True, persistent_ctas=2)
  o, _ = forward(q, k, v, None, None, params=p, config=config)
  ro, _ = attention_reference(q, k, v, None, None, params=p)
  assert _rel(o, ro) <= TOL[jnp.bfloat16][0], _rel(o, ro)


BWD = [
    (1, 256, 256, 2, 1, 64, True, jnp.bfloat16),
    (1, 190, 130, 4, 2, 128, False, jnp.float16),
]


def _assert_capped_gradients_match(case, config):
  b, t, s, h, kh, d, causal, dtype = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t * s)
  p = _params(d, causal)
  _, vjp = jax.vjp(lambda *a: attention_reference(*a, None, None, params=p), q, k, v)
  o, lse = forward(q, k, v, None, None, params=p, config=config)
  got = backward(q, k, v, None, None, o, lse, do, None, params=p, config=config)
  want = vjp((do, jnp.zeros(lse.shape, jnp.float32)))
  for name, g, r in zip(("dq", "dk", "dv"), got, want):
    assert g.shape == r.shape and g.dtype == r.dtype
    assert _rel(g, r) <= TOL[dtype][1], (name, _rel(g, r))
  # dq and dk go through the cap's slope: without it they would be off by far more.
  _, vjp_uncapped = jax.vjp(
      lambda *a: attention_reference(*a, None, None, params=_params(d, causal, None)), q, k, v)
  assert _rel(vjp_uncapped((do, jnp.zeros(lse.shape, jnp.float32)))[0], want[0]) > 0.1


@pytest.mark.parametrize("case", BWD, ids=kernel_case_id)
def test_capped_gradients_match_reference(case):
  _assert_capped_gradients_match(case, SMALL)


def test_capped_head_dim_256_backward_runs_the_triton_kernels():
  # backward_wide's dS warpgroup has no Sᵀ for the cap's slope; the Triton kernels take it.
  _assert_capped_gradients_match((1, 96, 130, 2, 1, 256, True, jnp.bfloat16), SMALL)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_capped_fused_backward_matches_reference(overlap, monkeypatch):
  # The opt-in fused kernel shares the split dK/dV kernel's Pᵀ / dSᵀ helpers, cap included.
  calls = []
  fused_call = backward_fused.fused_call
  monkeypatch.setattr(backward_fused, "fused_call",
                      lambda *a, **kw: calls.append(1) or fused_call(*a, **kw))
  config = dataclasses.replace(SMALL, fused_backward=True, block_q_fused=64, block_kv_fused=64,
                               fused_dq_shared=overlap, fused_overlap=overlap)
  _assert_capped_gradients_match((1, 200, 256, 2, 1, 128, True, jnp.bfloat16), config)
  assert calls, "the fused kernel did not run"


CASES = [  # B, T, S, H, K, D, causal
    (1, 1000, 1100, 8, 2, 64, True),
    (2, 4096, 4096, 8, 8, 128, False),
    (1, 2048, 2048, 4, 4, 128, True),
    (1, 300, 700, 4, 4, 256, False),
]


@pytest.mark.parametrize("case", CASES, ids=kernel_case_id)
def test_capped_forward_and_grad_lower(case):
  *shape, causal = case
  q, kv = kernel_specs(*shape)

  def attn(q, k, v):
    return pallas_flash.flash_attention(q, k, v, is_causal=causal, logits_soft_cap=30.0,
                                        implementation="mosaic")

  def grads(q, k, v):
    return jax.grad(lambda *a: attn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

  assert export_for_h200(attn, q, kv, kv).mlir_module().count("mosaic_gpu") >= 1
  text = export_for_h200(grads, q, kv, kv, disabled_checks=[TRITON_CALL]).mlir_module()
  if shape[-1] == 256:  # the Mosaic forward, the Triton backward
    assert text.count("mosaic_gpu") >= 1 and "pallas_flash_bwd" in text
  else:
    assert text.count("mosaic_gpu") >= 3 and "pallas_flash_bwd_dq" not in text


def test_capped_calls_choose_the_mosaic_kernels():
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  slopes = jax.ShapeDtypeStruct((4,), jnp.float32)
  with use_abstract_mesh(H200):
    why = pallas_flash.explain(q, q, q, logits_soft_cap=50.0)
    alibi = pallas_flash.explain(q, q, q, logits_soft_cap=50.0, alibi_slopes=slopes)
  assert why.chosen == "mosaic", why
  assert alibi.chosen == "triton"
  assert "alibi_slopes" in alibi.reasons["mosaic"]
