"""The Mosaic GPU kernels on a Hopper GPU: forward and gradients against the reference.

Run on the H200 in every session that touches pallas_flash/mosaic_gpu:
  PYTHONPATH=. python3 -m pytest -q -m gpu tests/mosaic/test_mosaic_gpu.py
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import pallas_flash
from pallas_flash import mosaic_gpu
from pallas_flash.mosaic_gpu import TUNED, backward_fused
from pallas_flash.mosaic_gpu import config as mconfig
from pallas_flash.call import AttentionParams
from pallas_flash.reference import attention_reference
from testing import kernel_case_id, kernel_inputs, max_abs, on_hopper, rel_err


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not on_hopper(), reason="needs a Hopper (sm_90) GPU")]

TOL = {jnp.bfloat16: (1e-2, 2e-2), jnp.float16: (2e-3, 4e-3)}

CASES = [  # B, T, S, H, K, D, causal, dtype
    (2, 1024, 1024, 4, 4, 128, False, jnp.bfloat16),
    (2, 1024, 1024, 4, 4, 128, True, jnp.bfloat16),
    (1, 1000, 1100, 8, 2, 64, True, jnp.bfloat16),
    (1, 1100, 1000, 4, 4, 128, True, jnp.bfloat16),
    (1, 777, 777, 4, 1, 128, True, jnp.float16),
    (1, 2048, 2048, 4, 2, 64, False, jnp.float16),
    (1, 512, 512, 2, 2, 256, True, jnp.bfloat16),
    (1, 300, 700, 4, 2, 256, False, jnp.bfloat16),
    (1, 1, 1, 2, 1, 64, False, jnp.bfloat16),
    (1, 113, 203, 4, 2, 128, False, jnp.bfloat16),
]


def _rel(x, ref):
  # testing.rel_err's floor: with one key the reference gradient is exactly zero and the kernel's
  # is rounding noise (~1e-7), which a bare relative error would blow up.
  return rel_err(x.astype(jnp.float32), ref.astype(jnp.float32))


def _fwd_bwd(attn):
  def f(q, k, v, do):
    o, vjp = jax.vjp(attn, q, k, v)
    return (o, *vjp(do))
  return jax.jit(f)


def _mosaic(causal, **features):
  return lambda q, k, v: pallas_flash.flash_attention(q, k, v, is_causal=causal,
                                                      implementation="mosaic", **features)


def _assert_matches_reference(q, k, v, do, p: AttentionParams, dtype, **features):
  """flash_attention(implementation="mosaic", **features) forward and gradients against the
  reference under p (the same call's parameters), and bit-reproducible run to run."""
  mosaic = _mosaic(p.is_causal, **features)
  got = _fwd_bwd(mosaic)(q, k, v, do)
  want = _fwd_bwd(lambda *a: attention_reference(*a, None, None, params=p)[0])(q, k, v, do)
  assert _rel(got[0], want[0]) <= TOL[dtype][0], _rel(got[0], want[0])
  for name, g, r in zip(("dq", "dk", "dv"), got[1:], want[1:]):
    assert _rel(g, r) <= TOL[dtype][1], (name, _rel(g, r))
  again = _fwd_bwd(mosaic)(q, k, v, do)
  assert all(bool(jnp.array_equal(a, b)) for a, b in zip(got, again)), "not bit-reproducible"


@pytest.mark.parametrize("case", CASES, ids=kernel_case_id)
def test_forward_and_gradients(case):
  b, t, s, h, kh, d, causal, dtype = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s + d)
  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  _assert_matches_reference(q, k, v, do, p, dtype)


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 1, 2, 4, 6, 9)], ids=kernel_case_id)
def test_forward_with_intra_wg_overlap(case):
  """MosaicConfig.fwd_intra_wg_overlap: o and lse against the reference, bit-reproducible."""
  b, t, s, h, kh, d, causal, dtype = case
  q, k, v, _ = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s + d)
  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  config = dataclasses.replace(TUNED[(d, causal)], fwd_intra_wg_overlap=True)
  fwd = jax.jit(lambda q, k, v: mosaic_gpu.forward(q, k, v, None, None, params=p, config=config))
  o, lse = fwd(q, k, v)
  ro, rlse = attention_reference(q, k, v, None, None, params=p)
  assert _rel(o, ro) <= TOL[dtype][0], _rel(o, ro)
  assert max_abs(lse - rlse) < 1e-3
  again = fwd(q, k, v)
  assert bool(jnp.array_equal(o, again[0])) and bool(jnp.array_equal(lse, again[1]))


def _assert_near_reference(got, q, k, v, do, *, causal, dtype, with_output=False):
  """got = (o, dq, dk, dv): the gradients (and with_output o) within tolerance of the float32
  reference's."""
  p = AttentionParams(scale=q.shape[3] ** -0.5, is_causal=causal, has_segments=False)
  want = _fwd_bwd(lambda *a: attention_reference(*a, None, None, params=p)[0])(q, k, v, do)
  first = 0 if with_output else 1
  for name, g, r in zip(("o", "dq", "dk", "dv")[first:], got[first:], want[first:]):
    assert _rel(g, r) <= TOL[dtype][1], (name, _rel(g, r))


def _assert_same_fwd_bwd(case, changes, baseline, *, against_reference: bool = False):
  """o, dq, dk, dv with TUNED + `changes` are bitwise those with TUNED + `baseline` (and, with
  against_reference, within tolerance of the reference's: one compile fewer than a separate
  _assert_config_gradients)."""
  b, t, s, h, kh, d, causal, dtype = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s + d)

  def run(kw):
    config = dataclasses.replace(TUNED[(d, causal)], **kw)
    return _fwd_bwd(lambda *a: pallas_flash.flash_attention(
        *a, is_causal=causal, implementation="mosaic", config=config))(q, k, v, do)

  got = run(changes)
  for name, g, r in zip(("o", "dq", "dk", "dv"), got, run(baseline)):
    assert bool(jnp.array_equal(g, r)), name
  if against_reference:
    _assert_near_reference(got, q, k, v, do, causal=causal, dtype=dtype)


@pytest.mark.parametrize("schedule", ["batched", "overlap"])
@pytest.mark.parametrize("case", [CASES[i] for i in (0, 1, 2, 4)], ids=kernel_case_id)
def test_dkdv_schedules_give_the_same_gradients(case, schedule):
  """MosaicConfig.dkdv_schedule "batched" and "overlap" only move waits: the same products
  in the same order as "serial", so bitwise equal gradients."""
  _assert_same_fwd_bwd(case, dict(dkdv_schedule=schedule), dict(dkdv_schedule="serial"))


@pytest.mark.parametrize("case", [c for c in CASES if c[5] == 128], ids=kernel_case_id)
def test_q_registers_give_the_same_outputs(case):
  """MosaicConfig.fwd_q_registers only moves the forward's Q operand from shared memory into
  registers (the overlapped loop of the head-dim-128 table): bitwise equal outputs. Also the
  guard against the ptxas miscompile that keeps it out of the plain loop (forward._q_operand):
  with tails, float16, GQA and T = 113, whose registers ptxas lays out differently."""
  d, causal = case[5], case[6]
  assert TUNED[(d, causal)].fwd_intra_wg_overlap
  # 128-key tiles: with the 192 of the long non-causal default Q does not fit in registers
  _assert_same_fwd_bwd(case, dict(fwd_q_registers=True, block_kv=128),
                       dict(fwd_q_registers=False, block_kv=128))


@pytest.mark.parametrize("case", [(1, 300, 700, 4, 2, 128, False, jnp.bfloat16),
                                  (2, 1024, 1152, 4, 4, 128, False, jnp.float16),
                                  (1, 113, 203, 4, 1, 128, False, jnp.bfloat16)],
                         ids=kernel_case_id)
def test_long_non_causal_default_forward_and_gradients(case):
  """TUNED[(128, False)], the default past config.MEDIUM_KV_LEN keys (192-key tiles, the
  partial last one streamed first), forced at short lengths: against the reference,
  bit-reproducible."""
  b, t, s, h, kh, d, causal, dtype = case
  config = TUNED[(d, causal)]
  assert config.block_kv == 192 and not config.fwd_persistent
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s + d + 3)
  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  run = _fwd_bwd(lambda *a: pallas_flash.flash_attention(
      *a, is_causal=causal, implementation="mosaic", config=config))
  got = run(q, k, v, do)
  want = _fwd_bwd(lambda *a: attention_reference(*a, None, None, params=p)[0])(q, k, v, do)
  assert _rel(got[0], want[0]) <= TOL[dtype][0]
  for name, g, r in zip(("dq", "dk", "dv"), got[1:], want[1:]):
    assert _rel(g, r) <= TOL[dtype][1], (name, _rel(g, r))
  assert all(bool(jnp.array_equal(a, b)) for a, b in zip(got, run(q, k, v, do)))


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 1, 2, 4)], ids=kernel_case_id)
def test_dkdv_pingpong_gives_the_same_gradients(case):
  """MosaicConfig.dkdv_pingpong only adds schedule-barrier rounds: bitwise equal gradients."""
  _assert_same_fwd_bwd(case, dict(dkdv_pingpong=True), dict(dkdv_pingpong=False))


def _assert_config_gradients(case, seed_offset, **changes):
  """Gradients with TUNED + `changes` against the reference, and bitwise run to run (for
  changes that sum in another order than the tuned kernels, so not bitwise theirs)."""
  b, t, s, h, kh, d, causal, dtype = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s + d + seed_offset)
  config = dataclasses.replace(TUNED[(d, causal)], **changes)
  attn = _fwd_bwd(lambda *a: pallas_flash.flash_attention(
      *a, is_causal=causal, implementation="mosaic", config=config))
  got = attn(q, k, v, do)
  _assert_near_reference(got, q, k, v, do, causal=causal, dtype=dtype)
  assert all(bool(jnp.array_equal(a, b)) for a, b in zip(got, attn(q, k, v, do)))


@pytest.mark.parametrize("case", [c for c in CASES if c[5] == 128], ids=kernel_case_id)
def test_dkdv_fold_stats_gradients(case):
  """MosaicConfig.dkdv_fold_stats starts the dK/dV kernel's Sᵀ and dPᵀ accumulators from
  -lse2/c and -delta: other float32 roundings, so checked against the reference (and run to
  run), not bitwise against the unfolded kernel."""
  d, causal = case[5], case[6]
  assert TUNED[(d, causal)].dkdv_schedule == "overlap"  # the steps the fold applies to
  _assert_config_gradients(case, 1, dkdv_fold_stats=True)


@pytest.mark.parametrize("case", [(2, 1000, 1100, 4, 2, 256, True, jnp.bfloat16),
                                  (1, 777, 777, 4, 1, 256, False, jnp.float16),
                                  (1, 4096, 4096, 8, 8, 256, True, jnp.bfloat16)],
                         ids=kernel_case_id)
def test_head_dim_256_mosaic_backward(case):
  """MosaicConfig(wide_backward="mosaic") against the reference and run to run."""
  _assert_config_gradients(case, 0, wide_backward="mosaic")


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 1, 2, 4)], ids=kernel_case_id)
def test_backward_launch_order_gives_the_same_gradients(case):
  """MosaicConfig.bwd_heads_fastest only renumbers the backward's CTAs: bitwise equal."""
  _assert_same_fwd_bwd(case, dict(bwd_heads_fastest=True), dict(bwd_heads_fastest=False))


@pytest.mark.parametrize("case", [(2, 1024, 1024, 4, 2, 64, True, jnp.bfloat16),
                                  (3, 1000, 1100, 4, 4, 128, False, jnp.float16),
                                  (2, 1000, 1100, 4, 2, 256, True, jnp.bfloat16)],
                         ids=kernel_case_id)
def test_flat_stats_give_the_same_gradients(case):
  """MosaicConfig.bwd_flat_stats (the default) only changes how the split's dK/dV kernels
  address lse and delta at batch > 1: bitwise the gradients of [B, H, Tp] loads, which match
  the reference."""
  assert TUNED[(case[5], case[6])].bwd_flat_stats
  _assert_same_fwd_bwd(case, dict(bwd_flat_stats=True), dict(bwd_flat_stats=False),
                       against_reference=True)


FUSED = dict(fused_backward=True, fused_dq_shared=True, compute_registers=240,
             producer_registers=24)
# The deferred form without automatic barriers (config.FUSED_LONG_CAUSAL's kernel).
DEFER_NB = dict(fused_defer_dq=True, fused_defer_inline=True, fused_auto_barriers=False)


@pytest.mark.fused
@pytest.mark.parametrize("changes", [{}, dict(fused_defer_dq=True),
                                     dict(fused_defer_dq=True, fused_offset=True),
                                     dict(fused_defer_dq=True, fused_defer_inline=True),
                                     dict(fused_overlap=True),
                                     dict(fused_auto_barriers=False),
                                     DEFER_NB,
                                     dict(DEFER_NB, fused_dq_head_major=True),
                                     dict(DEFER_NB, fused_batch_slowest=True),
                                     dict(DEFER_NB, fused_per_batch_entry=True),
                                     dict(DEFER_NB, bwd_flat_stats=False),
                                     dict(DEFER_NB, fused_offset=True),
                                     dict(DEFER_NB, fused_split_loop=True),
                                     dict(DEFER_NB, fused_early_probs=True),
                                     dict(DEFER_NB, fused_split_loop=True,
                                          fused_early_probs=True),
                                     dict(DEFER_NB, fused_split_loop=True, fused_dq_first=True),
                                     dict(DEFER_NB, fused_dq_first=True,
                                          fused_early_probs=True),
                                     dict(DEFER_NB, fused_static_wg=True),
                                     dict(DEFER_NB, fused_split_loop=True,
                                          fused_early_probs=True, fused_static_wg=True)],
                         ids=["dq_shared", "defer_dq", "defer_dq_offset", "defer_inline",
                              "overlap", "no_auto_barriers", "defer_inline_no_auto_barriers",
                              "head_major", "batch_slowest", "per_batch_entry",
                              "stats_3d", "defer_inline_offset",
                              "defer_inline_split_loop", "defer_inline_early_probs",
                              "defer_inline_split_loop_early_probs",
                              "defer_inline_split_loop_dq_first",
                              "defer_inline_dq_first_early_probs",
                              "defer_inline_static_wg",
                              "defer_inline_split_loop_early_probs_static_wg"])
@pytest.mark.parametrize("case", [CASES[i] for i in (0, 1, 3, 4, 9)], ids=kernel_case_id)
def test_fused_backward_gradients(case, changes):
  """The single-kernel backward's forms (dQ summed by float32 atomics, so compared with the
  reference only, not bitwise run to run)."""
  b, t, s, h, kh, d, causal, dtype = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s + d + 1)
  config = dataclasses.replace(TUNED[(d, causal)], **FUSED, **changes)
  assert backward_fused.unsupported_reason(q, config) is None  # no fallback to the split
  got = _fwd_bwd(lambda *a: pallas_flash.flash_attention(
      *a, is_causal=causal, implementation="mosaic", config=config))(q, k, v, do)
  _assert_near_reference(got, q, k, v, do, causal=causal, dtype=dtype)


@pytest.mark.fused
@pytest.mark.parametrize("b,h,kh", [(2, 4, 2), (8, 2, 2)], ids=["b2_gqa", "b8"])
def test_default_noncausal_gradients_run_the_fused_kernel_with_split_loop(b, h, kh):
  """A non-causal call with 4K keys at batch 2 (GQA) and 8 runs the fused kernel by default
  (config.FUSED_NONCAUSAL): its gradients against the float32 reference."""
  t, d = 4096, 128
  p = AttentionParams(scale=d ** -0.5, is_causal=False, has_segments=False)
  assert mconfig.call_config(d, p, t, b) == dataclasses.replace(
      mconfig.tuned(d, False, t), **mconfig.FUSED_NONCAUSAL)
  q, k, v, do = kernel_inputs(b, t, t, h, kh, d, jnp.bfloat16, seed=11)
  got = _fwd_bwd(lambda *a: pallas_flash.flash_attention(*a, implementation="mosaic"))(
      q, k, v, do)
  _assert_near_reference(got, q, k, v, do, causal=False, dtype=jnp.bfloat16, with_output=True)


@pytest.mark.fused
def test_deterministic_long_causal_gradients_are_bitwise_reproducible():
  """deterministic=True (the split backward) is bitwise equal run to run at 16K causal; the
  default there, the fused kernel (float32 atomics, config.FUSED_LONG_CAUSAL), agrees with it
  closely."""
  q, k, v, do = kernel_inputs(1, 16384, 16384, 4, 2, 128, jnp.bfloat16, seed=7)

  def run(**kw):
    return _fwd_bwd(lambda *a: pallas_flash.flash_attention(
        *a, is_causal=True, implementation="mosaic", **kw))(q, k, v, do)

  first, again = run(deterministic=True), run(deterministic=True)
  fused = run()
  assert all(bool(jnp.array_equal(a, b)) for a, b in zip(first, again)), "not bit-reproducible"
  for name, g, r in zip(("o", "dq", "dk", "dv"), fused, first):
    assert _rel(g, r) <= 1e-2, (name, _rel(g, r))


def test_lse_matches_reference():
  q, k, v, _ = kernel_inputs(1, 1000, 1000, 4, 2, 128, jnp.bfloat16)
  p = AttentionParams(scale=128 ** -0.5, is_causal=True, has_segments=False)
  _, lse = pallas_flash.flash_attention(q, k, v, is_causal=True, implementation="mosaic",
                                        return_residuals=True)
  _, ref = attention_reference(q, k, v, None, None, params=p)
  assert max_abs(lse - ref) < 1e-3


@pytest.mark.parametrize("t,causal", [(16384, True), (32768, False), (16500, True), (5000, False)],
                         ids=["16k_causal", "32k", "16500_causal", "5000"])
def test_large_shapes_agree_with_cudnn(t, causal):
  """Long sequences, where the materialising reference does not fit: compare with cuDNN."""
  q, k, v, do = kernel_inputs(1, t, t, 8, 8, 128, jnp.bfloat16, seed=t)
  cudnn = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
      q, k, v, is_causal=causal, implementation="cudnn" if t % 128 == 0 else "xla")
  got = _fwd_bwd(_mosaic(causal))(q, k, v, do)
  want = _fwd_bwd(cudnn)(q, k, v, do)
  assert _rel(got[0], want[0]) <= 1e-2
  for g, r in zip(got[1:], want[1:]):
    assert _rel(g, r) <= 3e-2


SEGMENT_CASES = [  # B, T, S, H, K, D, causal, dtype, ids
    (2, 4096, 4096, 8, 2, 128, True, jnp.bfloat16, "packed"),
    (1, 2048, 2048, 4, 4, 64, False, jnp.float16, "packed"),
    (1, 1000, 1100, 4, 2, 128, True, jnp.bfloat16, "unsorted"),
    (2, 777, 777, 4, 4, 128, False, jnp.bfloat16, "lengths"),
    (1, 512, 512, 2, 2, 256, True, jnp.bfloat16, "packed"),
    (1, 1000, 1100, 4, 2, 256, False, jnp.float16, "unsorted"),
    (2, 777, 777, 4, 4, 256, True, jnp.bfloat16, "lengths"),
]


def _segment_kwargs(case):
  """flash_attention keyword arguments of a SEGMENT_CASES case: sorted documents (most key
  blocks skipped), unsorted ids (none skipped) or lengths (folded into ids by the API)."""
  b, t, s, *_, ids = case
  key = jax.random.key(t + s)
  if ids == "lengths":
    lens = jnp.array([t, t // 3], jnp.int32)[:b]
    return dict(query_seq_lengths=lens, key_value_seq_lengths=lens)
  if ids == "unsorted":
    kq, kk = jax.random.split(key)
    return dict(query_segment_ids=jax.random.randint(kq, (b, t), 0, 3, jnp.int32),
                key_value_segment_ids=jax.random.randint(kk, (b, s), 0, 3, jnp.int32))
  starts = jnp.sort(jax.random.randint(key, (b, 5), 0, max(t, s)), axis=1)
  docs = (jnp.arange(max(t, s))[None, :, None] >= starts[:, None, :]).sum(-1).astype(jnp.int32)
  return dict(query_segment_ids=docs[:, :t], key_value_segment_ids=docs[:, :s])


@pytest.mark.parametrize("case", SEGMENT_CASES,
                         ids=lambda c: f"{kernel_case_id(c[:-1])}_{c[-1]}")
def test_segments_forward_and_gradients(case):
  """Segment ids and lengths on the mosaic kernels (tuned configs) against the reference, and
  bit-reproducible."""
  _assert_call_matches_reference(case, 0, **_segment_kwargs(case))


def _assert_call_matches_reference(case, seed_offset: int, **kw):
  """flash_attention(implementation="mosaic", **kw) on a SEGMENT_CASES case against the API's
  reference implementation in float32 (forward and gradients), and bit-reproducible."""
  b, t, s, h, kh, d, causal, dtype, _ = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s + d + seed_offset)

  def attn(impl):
    return lambda *a: pallas_flash.flash_attention(*a, is_causal=causal, implementation=impl,
                                                   **kw)

  got = _fwd_bwd(attn("mosaic"))(q, k, v, do)
  want = _fwd_bwd(attn("reference"))(*(x.astype(jnp.float32) for x in (q, k, v, do)))
  assert _rel(got[0], want[0]) <= TOL[dtype][0], _rel(got[0], want[0])
  for name, g, r in zip(("dq", "dk", "dv"), got[1:], want[1:]):
    assert _rel(g, r) <= TOL[dtype][1], (name, _rel(g, r))
  again = _fwd_bwd(attn("mosaic"))(q, k, v, do)
  assert all(bool(jnp.array_equal(a, b)) for a, b in zip(got, again)), "not bit-reproducible"


SOFT_CAP_CASES = [  # B, T, S, H, K, D, causal, dtype, cap, q multiplier
    (2, 1024, 1024, 4, 4, 128, False, jnp.bfloat16, 1.5, 1.0),  # persistent, overlap (1K)
    (1, 3000, 3000, 4, 2, 128, False, jnp.bfloat16, 30.0, 8.0),  # persistent, overlap
    (1, 5000, 5000, 4, 4, 128, False, jnp.bfloat16, 30.0, 8.0),  # 192-key tiles
    (1, 1100, 1000, 4, 4, 128, True, jnp.bfloat16, 1.5, 1.0),
    (1, 2048, 2048, 4, 2, 64, False, jnp.float16, 1.5, 1.0),  # 256-key tiles, split tail
    (1, 1000, 1100, 8, 2, 64, True, jnp.bfloat16, 30.0, 8.0),
    (1, 512, 512, 2, 2, 256, True, jnp.bfloat16, 1.5, 1.0),  # the Triton backward
]


def _soft_cap_id(case):
  return kernel_case_id(case[:8]) + f"_cap{case[8]:g}_x{case[9]:g}"


@pytest.mark.parametrize("case", SOFT_CAP_CASES, ids=_soft_cap_id)
def test_soft_capped_forward_and_gradients(case):
  """logits_soft_cap through the tuned configs' kernels; q scaled up so that scores reach the
  tanh's saturated range where the multiplier is 8."""
  b, t, s, h, kh, d, causal, dtype, cap, mult = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s + d)
  q = (q.astype(jnp.float32) * mult).astype(dtype)
  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False,
                      logits_soft_cap=cap)
  _assert_matches_reference(q, k, v, do, p, dtype, logits_soft_cap=cap)


WINDOW_CASES = [  # B, T, S, H, K, D, causal, dtype, (left, right)
    (1, 4096, 4096, 8, 2, 128, True, jnp.bfloat16, (511, 0)),
    (2, 1024, 1024, 4, 4, 128, True, jnp.bfloat16, (127, 0)),
    (1, 3000, 3000, 4, 4, 64, False, jnp.float16, (100, 50)),
    (1, 1100, 1000, 4, 2, 128, True, jnp.bfloat16, (300, 0)),
    (1, 1024, 1024, 2, 2, 256, True, jnp.bfloat16, (200, 0)),
]


def _window_id(case):
  return kernel_case_id(case[:8]) + "_w{}-{}".format(*case[8])


@pytest.mark.parametrize("window_backward", ["triton", "mosaic"])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=_window_id)
def test_windowed_forward_and_gradients(case, window_backward):
  """local_window_size: the Mosaic forward over the band's blocks, the backward the Mosaic
  kernels' over the band's blocks (the default, window_backward="mosaic") or Triton's."""
  b, t, s, h, kh, d, causal, dtype, window = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s + d)
  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False,
                      local_window=window)
  config = dataclasses.replace(mconfig.tuned(d, causal, s), window_backward=window_backward)
  _assert_matches_reference(q, k, v, do, p, dtype, local_window_size=window, config=config)


@pytest.mark.parametrize("case", [SEGMENT_CASES[i] for i in (0, 3, 6)],
                         ids=lambda c: f"{kernel_case_id(c[:-1])}_{c[-1]}")
def test_windowed_segments_forward_and_gradients(case):
  """A window with segment ids or lengths (tuned configs): the band's limits intersected with
  the documents', and the ids compared, against the reference; bit-reproducible."""
  causal = case[6]
  _assert_call_matches_reference(
      case, 2, **_segment_kwargs(case),
      local_window_size=(300, 0) if causal else (200, 100))
