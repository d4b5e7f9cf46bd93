"""The fused (FlashAttention-3 style) Mosaic GPU backward on CPU: CUDA lowering and interpreter.

Lowering (`jax.export` for CUDA, sm_90) checks tracing, layouts, the TMA reduce-add and shared
memory; the interpreter checks the math, indexing, GQA and causal skipping against the float32
reference. Neither sees async hazards, register spills or the atomics' timing: the GPU script
scripts/fused_bwd_check.py does.
"""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import pallas_flash
from pallas_flash.mosaic_gpu import TUNED, MosaicConfig, _common, backward, backward_fused
from pallas_flash.mosaic_gpu.config import SMEM_LIMIT_BYTES
from pallas_flash.mosaic_gpu import config as mconfig
from pallas_flash.call import AttentionParams
from pallas_flash.reference import attention_reference
from testing import TRITON_CALL, export_for_h200, kernel_case_id, kernel_specs, max_rel_err


def _mosaic_calls(text: str) -> int:
  return collections.Counter(re.findall(r"custom_call @(\w+)", text))["mosaic_gpu_v2"]


def _grad_module(b, t, s, h, kh, d, causal, config) -> str:
  q, kv = kernel_specs(b, t, s, h, kh, d)

  def loss(q, k, v):
    o = pallas_flash.flash_attention(q, k, v, is_causal=causal, implementation="mosaic",
                                     config=config)
    return o.astype(jnp.float32).sum()

  return export_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv,
                         disabled_checks=[TRITON_CALL]).mlir_module()


def _fused(d, causal, **kw) -> MosaicConfig:
  return dataclasses.replace(TUNED[(d, causal)], fused_backward=True, **kw)


LOWER = [  # B, T, S, H, K, D, causal
    (2, 1024, 1024, 8, 2, 64, False),
    (1, 300, 300, 8, 2, 64, True),
    (2, 1024, 1024, 8, 2, 128, True),
    (1, 300, 300, 8, 2, 128, False),
    (1, 4096, 4096, 16, 16, 128, False),
]


@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
@pytest.mark.parametrize("case", LOWER, ids=kernel_case_id)
def test_fused_grad_lowers_as_one_backward_kernel(case, overlap):
  b, t, s, h, kh, d, causal = case
  text = _grad_module(b, t, s, h, kh, d, causal, _fused(d, causal, fused_overlap=overlap))
  # Forward + fused backward; the split backward would add a third kernel.
  assert _mosaic_calls(text) == 2
  # The zeroed float32 dQ buffer is passed by reference and aliased to a kernel output.
  assert "output_operand_aliases" in text


@pytest.mark.parametrize("b", [1, 3])
def test_per_batch_entry_launches_one_backward_kernel_per_entry(b):
  text = _grad_module(b, 1024, 1024, 8, 2, 128, True,
                      _fused(128, True, fused_dq_shared=True, fused_per_batch_entry=True))
  assert _mosaic_calls(text) == 1 + b


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hd256_runs_the_wide_backward(causal):
  # No fused kernel at head_dim 256 (registers): fused_backward=True runs the wide backward's
  # dQ and dK/dV kernels, or Triton's with wide_backward="triton".
  text = _grad_module(1, 512, 512, 8, 2, 256, causal, _fused(256, causal))
  assert _mosaic_calls(text) == 3 and "pallas_flash_bwd_dq" not in text
  text = _grad_module(1, 512, 512, 8, 2, 256, causal,
                      _fused(256, causal, wide_backward="triton"))
  assert _mosaic_calls(text) == 1
  assert "pallas_flash_bwd_dq" in text and "pallas_flash_bwd_dkdv" in text


@pytest.mark.parametrize("d,kw", [
    (64, dict(block_q_fused=128)), (64, dict(block_kv_fused=128)), (64, dict(fused_stages=3)),
    (64, dict(fused_stagger_q=True)), (128, dict(fused_dq_blocks=2)),
    (128, dict(compute_registers=240, producer_registers=24)), (128, dict(fused_dq_shared=True)),
    (128, dict(fused_dq_shared=True, fused_stages=3)),
    (64, dict(fused_overlap=True, fused_stages=3)),
    (128, dict(fused_overlap=True, fused_dq_shared=True, fused_stagger_q=True)),
    (128, dict(fused_overlap=True, fused_dq_shared=True, fused_stages=3)),
    (128, dict(fused_dq_shared=True, fused_defer_dq=True, compute_registers=240,
               producer_registers=24)),
    (128, dict(fused_dq_shared=True, fused_defer_dq=True, fused_offset=True)),
    (128, dict(fused_dq_shared=True, fused_defer_dq=True, fused_defer_inline=True,
               compute_registers=240, producer_registers=24)),
    (128, dict(fused_dq_shared=True, fused_auto_barriers=False)),
    (128, dict(fused_dq_shared=True, fused_defer_dq=True, fused_defer_inline=True,
               fused_auto_barriers=False)),
    (128, dict(fused_dq_shared=True, fused_overlap=True, fused_auto_barriers=False)),
    (64, dict(fused_auto_barriers=False)),
    (128, dict(fused_dq_shared=True, fused_defer_dq=True, fused_defer_inline=True,
               fused_auto_barriers=False, fused_dq_head_major=True)),
    (64, dict(fused_dq_head_major=True)),
    (128, dict(fused_dq_shared=True, fused_batch_slowest=True)),
    (128, dict(fused_dq_shared=True, bwd_flat_stats=False)),
    (128, dict(fused_dq_shared=True, fused_defer_dq=True, fused_defer_inline=True,
               fused_auto_barriers=False, fused_early_probs=True)),
    (64, dict(fused_early_probs=True)),
    (128, dict(fused_dq_shared=True, fused_defer_dq=True, fused_defer_inline=True,
               fused_auto_barriers=False, fused_dq_first=True)),
    (128, dict(fused_dq_shared=True, fused_defer_dq=True, fused_defer_inline=True,
               fused_auto_barriers=False, fused_split_loop=True, fused_static_wg=True)),
    (64, dict(fused_static_wg=True))],
    ids=["d64_bq128", "d64_bkv128", "d64_stages3", "d64_stagger", "d128_dq_blocks2",
         "d128_regs240", "d128_dq_shared", "d128_dq_shared_stages3", "d64_overlap_stages3",
         "d128_overlap_dq_shared_stagger", "d128_overlap_dq_shared_stages3",
         "d128_defer_dq_regs240", "d128_defer_dq_offset", "d128_defer_inline_regs240",
         "d128_dq_shared_no_auto_barriers", "d128_defer_inline_no_auto_barriers",
         "d128_overlap_no_auto_barriers", "d64_no_auto_barriers", "d128_defer_inline_head_major",
         "d64_head_major", "d128_batch_slowest", "d128_stats_3d", "d128_defer_inline_early_probs",
         "d64_early_probs", "d128_defer_inline_dq_first", "d128_split_loop_static_wg",
         "d64_static_wg"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_variants_lower(d, kw, causal):
  text = _grad_module(1, 1000, 1000, 4, 2, d, causal, _fused(d, causal, **kw))
  assert _mosaic_calls(text) == 2


def test_too_much_smem_falls_back_to_split_with_a_warning():
  config = _fused(128, False, fused_stages=3)
  assert "shared memory" in backward_fused.unsupported_reason(
      jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16), config)
  with pytest.warns(UserWarning, match="using the split backward"):
    text = _grad_module(1, 1024, 1024, 4, 2, 128, False, config)
  assert _mosaic_calls(text) == 3


@pytest.mark.parametrize("d,stages", [(64, 2), (64, 3), (128, 2)])
def test_smem_estimate_fits(d, stages):
  q = jax.ShapeDtypeStruct((1, 1024, 4, d), jnp.bfloat16)
  assert backward_fused.unsupported_reason(q, _fused(d, False, fused_stages=stages)) is None


@pytest.mark.parametrize("d,kw,slots", [
    (64, dict(), 2), (64, dict(fused_stages=3), 2),
    # head_dim 128: a second [block_q, D] f32 slot per WG (64 KiB) does not fit next to the
    # rest (~210 KiB); with fused_dq_shared the slots are [block_q, D/2] and 2 stages fit.
    (128, dict(), 1), (128, dict(fused_dq_shared=True), 2),
    (128, dict(fused_dq_shared=True, fused_stages=3), 1)])
def test_overlap_double_buffers_dq_where_it_fits(d, kw, slots):
  q = jax.ShapeDtypeStruct((1, 1024, 4, d), jnp.bfloat16)
  config = _fused(d, False, fused_overlap=True, **kw)
  assert backward_fused.dq_slots(d, config) == slots
  assert backward_fused.unsupported_reason(q, config) is None
  assert backward_fused.dq_slots(d, dataclasses.replace(config, fused_overlap=False)) == 1


def test_profiled_overlap_leaves_room_for_the_profiler():
  """With profile_dir the profiler's event buffer (27,648 B) shares the CTA's shared memory:
  the head_dim 128 form drops to one dQ slot, which leaves room for it; two would not."""
  config = _fused(128, False, fused_overlap=True, fused_dq_shared=True)
  profiled = dataclasses.replace(config, profile_dir="/tmp/unused")
  assert backward_fused.dq_slots(128, config) == 2
  assert backward_fused.dq_slots(128, profiled) == 1
  extra = _common.profiler_smem_bytes(backward_fused.PROFILE_STEPS)
  bq, bkv, stages = config.block_q_fused, config.block_kv_fused, config.fused_stages
  for slots, fits in ((1, True), (2, False)):
    need = backward_fused.smem_bytes(128, bq, bkv, stages, dq_shared=True, dq_slots=slots)
    assert (need + extra <= SMEM_LIMIT_BYTES) == fits, (slots, need, extra)


@pytest.mark.parametrize("kw,expected", [
    (dict(fused_defer_dq=True), "fused_dq_shared"),
    (dict(fused_defer_dq=True, fused_dq_shared=True, fused_overlap=True), "fused_overlap"),
    (dict(fused_offset=True, fused_dq_shared=True), "fused_defer_dq"),
    (dict(fused_defer_inline=True, fused_dq_shared=True), "fused_defer_dq")])
def test_defer_dq_needs_a_shared_dq_without_overlap(kw, expected):
  q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
  assert expected in backward_fused.unsupported_reason(q, _fused(128, False, **kw))
  ok = _fused(128, False, fused_dq_shared=True, fused_defer_dq=True, fused_offset=True)
  assert backward_fused.unsupported_reason(q, ok) is None


def test_overlap_needs_one_dq_block():
  q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
  config = _fused(128, False, fused_overlap=True, fused_dq_blocks=2)
  assert "fused_overlap" in backward_fused.unsupported_reason(q, config)


@pytest.mark.parametrize("kw,expected", [
    (dict(fused_dq_blocks=2), "fused_dq_blocks"), (dict(fused_dq_shared=True), "fused_dq_shared")])
def test_dq_column_splits_need_64_wide_blocks(kw, expected):
  q = jax.ShapeDtypeStruct((1, 1024, 4, 64), jnp.bfloat16)
  assert expected in backward_fused.unsupported_reason(q, _fused(64, False, **kw))


@pytest.mark.parametrize("kw", [dict(block_q_fused=96), dict(block_kv_fused=0),
                                dict(fused_stages=0), dict(fused_dq_blocks=0)])
def test_config_validation(kw):
  with pytest.raises(ValueError):
    MosaicConfig(**kw)


def test_config_defaults_and_tuned_configs_run_the_split():
  assert not MosaicConfig().fused_backward
  assert not any(c.fused_backward for c in TUNED.values())


def test_no_tuned_config_runs_the_fused_backward():
  """`tuned` (the split backward, bitwise reproducible) is what calls fall back to; only
  call_config switches to the fused kernel."""
  for d in (64, 128, 256):
    for causal in (False, True):
      for s in (1024, 4096, 16384, 65536):
        assert not mconfig.tuned(d, causal, s).fused_backward, (d, causal, s)
  q = jax.ShapeDtypeStruct((1, 16384, 4, 128), jnp.bfloat16)
  for causal, form in ((True, mconfig.FUSED_DEFERRED), (True, mconfig.FUSED_LONG_CAUSAL),
                       (False, mconfig.FUSED_NONCAUSAL)):
    assert backward_fused.unsupported_reason(q, dataclasses.replace(TUNED[(128, causal)],
                                                                    **form)) is None


def _params(causal=True, **kw):
  return AttentionParams(scale=1.0, is_causal=causal, has_segments=kw.pop("segments", False),
                         **kw)


FULL = _params(causal=False)


@pytest.mark.parametrize("d,s,b,params,form", [
    (128, 16384, 1, _params(), "causal"), (128, 131072, 1, _params(), "causal"),
    (128, 16384, 2, _params(), "causal"), (128, 16384, 16, _params(), None),
    (128, 8191, 1, _params(), None), (128, 8192, 1, _params(), "causal"),
    (128, 4096, 1, _params(), None),
    (128, 16384, 1, FULL, "full"), (128, 4096, 4, FULL, "full"), (128, 32768, 1, FULL, "full"),
    (128, 2048, 1, FULL, "full"), (128, 1024, 1, FULL, None), (128, 4000, 1, FULL, None),
    (128, 8192, 8, FULL, "full"), (128, 4096, 16, FULL, "full"), (128, 4096, 32, FULL, None),
    (64, 16384, 1, _params(), None), (256, 16384, 1, _params(), None),
    (64, 16384, 1, FULL, None), (128, 16384, 1, _params(deterministic=True), None),
    (128, 16384, 1, _params(causal=False, deterministic=True), None),
    (128, 16384, 1, _params(segments=True), None),
    (128, 16384, 1, _params(causal=False, segments=True), None),
    (128, 16384, 1, _params(local_window=(4095, 0)), None),
    (128, 16384, 1, _params(logits_soft_cap=30.0), None)],
    ids=["16k", "128k", "batch2", "batch16", "8k-1", "8k", "4k", "full", "full-4k-batch4",
         "full-32k", "full-2k", "full-1k", "full-tail", "full-batch8", "full-batch16",
         "full-batch32", "d64", "d256",
         "full-d64", "deterministic", "full-deterministic", "segments", "full-segments", "window",
         "soft_cap"])
def test_long_calls_default_to_the_fused_backward(d, s, b, params, form):
  """call_config: FUSED_LONG_CAUSAL / FUSED_NONCAUSAL where measured faster, else `tuned`."""
  config = mconfig.call_config(d, params, s, b)
  assert config.fused_backward == (form is not None)
  changes = {"causal": mconfig.FUSED_LONG_CAUSAL, "full": mconfig.FUSED_NONCAUSAL, None: {}}
  want = dataclasses.replace(mconfig.tuned(d, params.is_causal, s), **changes[form])
  assert config == want


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("group", [1, 2, 16], ids=["mha", "gqa", "mqa"])
def test_fused_defaults_form_probabilities_early_in_per_warpgroup_bodies(causal, group):
  """Both fused defaults run the early Pᵀ in one consumer body per warpgroup, at any number of
  query heads per kv head (thirty-fourth session: faster together everywhere measured)."""
  q = jax.ShapeDtypeStruct((1, 16384, 16, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 16384, 16 // group, 128), jnp.bfloat16)
  config = _common.config_for(q, k, _params(causal=causal))
  assert config.fused_backward and config.fused_early_probs and config.fused_static_wg
  assert config.fused_split_loop == (not causal)


@pytest.mark.parametrize("b,causal,deterministic,kernels", [
    (1, True, False, 2), (1, True, True, 3), (2, True, False, 2), (16, True, False, 3),
    (1, False, False, 2)])
def test_default_long_grad_lowers_to_the_fused_kernel(b, causal, deterministic, kernels):
  """Forward + fused backward by default up to FUSED_MAX_BATCH entries causal (and at 16K keys
  non-causal); deterministic=True or a larger batch run the split (dQ, dK/dV)."""
  q, kv = kernel_specs(b, 16384, 16384, 4, 2, 128)

  def loss(q, k, v):
    o = pallas_flash.flash_attention(q, k, v, is_causal=causal, implementation="mosaic",
                                     deterministic=deterministic)
    return o.astype(jnp.float32).sum()

  text = export_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv,
                         disabled_checks=[TRITON_CALL]).mlir_module()
  assert _mosaic_calls(text) == kernels
  # The fused kernel's zeroed dQ buffers come after an optimization barrier (see fused_call).
  fused = not deterministic and b <= mconfig.FUSED_MAX_BATCH
  barriers = re.findall(r"stablehlo\.optimization_barrier %\w+, %\w+ : tensor<f32>", text)
  assert len(barriers) == int(fused)


def test_deterministic_rejects_a_fused_config():
  q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="deterministic=True"):
    jax.eval_shape(lambda q: pallas_flash.flash_attention(
        q, q, q, implementation="mosaic", deterministic=True,
        config=_fused(128, False)), q)


# Interpreter: 64-row tiles so that short sequences still give several CTAs, several steps per
# ring slot, causal idle steps and kv-tail masking.
SMALL = MosaicConfig(block_q=64, block_kv=64, block_q_fused=64, block_kv_fused=64,
                     num_stages=2, fused_stages=2, fused_backward=True, interpret=True)
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
INTERPRET = [  # B, T, S, H, K, D, causal, dtype, config changes
    (1, 192, 192, 8, 2, 64, True, jnp.bfloat16, {}),
    (1, 190, 130, 2, 2, 64, True, jnp.float16, {}),
    # Keys past the last query are never seen: whole CTAs run no step and store zeros.
    (1, 130, 260, 2, 1, 64, True, jnp.float16, {}),
    (1, 200, 260, 2, 1, 64, False, jnp.bfloat16, dict(fused_stagger_q=True)),
    (1, 130, 200, 4, 1, 128, False, jnp.float16, {}),
    (2, 200, 200, 2, 1, 128, True, jnp.bfloat16, dict(fused_dq_blocks=2)),
    (1, 190, 130, 4, 2, 128, True, jnp.float16, dict(fused_dq_shared=True)),
    (1, 130, 260, 2, 1, 128, True, jnp.bfloat16, dict(fused_dq_shared=True)),
    (1, 200, 260, 2, 2, 128, False, jnp.float16, dict(fused_dq_shared=True, fused_stagger_q=True)),
    # fused_overlap: reordered matmuls and stats, double-buffered dQ staging (one slot at
    # head_dim 128 without fused_dq_shared).
    (1, 190, 130, 8, 2, 64, True, jnp.bfloat16, dict(fused_overlap=True)),
    (1, 200, 260, 2, 1, 64, False, jnp.float16, dict(fused_overlap=True, fused_stages=3)),
    (1, 130, 200, 4, 1, 128, False, jnp.bfloat16, dict(fused_overlap=True)),
    (1, 190, 130, 4, 2, 128, True, jnp.float16, dict(fused_overlap=True, fused_dq_shared=True)),
    (1, 200, 260, 2, 2, 128, False, jnp.bfloat16,
     dict(fused_overlap=True, fused_dq_shared=True, fused_stagger_q=True)),
    # The other launch order (heads fastest; tiles of one head consecutive is the default).
    (1, 190, 130, 4, 2, 128, True, jnp.float16, dict(fused_dq_shared=True,
                                                     bwd_heads_fastest=True)),
    (2, 200, 260, 2, 1, 64, False, jnp.bfloat16, dict(bwd_heads_fastest=True)),
    # fused_defer_dq: dQ_part one step late through 4 dSᵀ slots (more steps than slots), the
    # last one after the loop; causal CTAs whose first WG idles; a WG started late.
    (1, 190, 130, 4, 2, 128, True, jnp.float16, dict(fused_dq_shared=True,
                                                     fused_defer_dq=True)),
    (1, 330, 260, 2, 1, 128, True, jnp.bfloat16, dict(fused_dq_shared=True,
                                                      fused_defer_dq=True)),
    (1, 200, 260, 2, 2, 128, False, jnp.bfloat16, dict(fused_dq_shared=True,
                                                       fused_defer_dq=True, fused_offset=True)),
    (1, 330, 260, 2, 1, 128, True, jnp.float16, dict(fused_dq_shared=True, fused_defer_dq=True,
                                                     fused_defer_inline=True)),
    (1, 200, 260, 2, 2, 128, False, jnp.bfloat16, dict(fused_dq_shared=True,
                                                       fused_defer_dq=True,
                                                       fused_defer_inline=True)),
    # The split loop (no key tail: 256 keys, two 128-key CTAs), GQA.
    (1, 200, 256, 4, 2, 128, False, jnp.bfloat16, dict(fused_dq_shared=True,
                                                       fused_defer_dq=True,
                                                       fused_defer_inline=True,
                                                       fused_split_loop=True)),
    # FUSED_NONCAUSAL's form: the split loop, the early Pᵀ, one consumer body per warpgroup
    # (fused_static_wg); FUSED_LONG_CAUSAL's: the early Pᵀ in masked (causal, key tail) steps,
    # batch 2; the static bodies without dq_shared.
    (1, 200, 256, 4, 2, 128, False, jnp.bfloat16, dict(fused_dq_shared=True,
                                                       fused_defer_dq=True,
                                                       fused_defer_inline=True,
                                                       fused_split_loop=True,
                                                       fused_early_probs=True,
                                                       fused_static_wg=True)),
    (2, 330, 260, 2, 1, 128, True, jnp.float16, dict(fused_dq_shared=True, fused_defer_dq=True,
                                                     fused_defer_inline=True,
                                                     fused_early_probs=True,
                                                     fused_static_wg=True)),
    (1, 130, 200, 2, 2, 64, False, jnp.bfloat16, dict(fused_static_wg=True)),
    # fused_dq_first: dQ_part between dV and dK, step 0's (zeros) reduced too; with the split
    # loop (GQA) and causal with a key tail.
    (1, 200, 256, 4, 2, 128, False, jnp.bfloat16, dict(fused_dq_shared=True,
                                                       fused_defer_dq=True,
                                                       fused_defer_inline=True,
                                                       fused_split_loop=True,
                                                       fused_dq_first=True)),
    (1, 330, 260, 2, 1, 128, True, jnp.float16, dict(fused_dq_shared=True, fused_defer_dq=True,
                                                     fused_defer_inline=True,
                                                     fused_dq_first=True)),
    # The head-major dQ accumulator, at batch 2 with GQA (heads and batches in its index).
    (2, 330, 260, 4, 2, 128, True, jnp.bfloat16, dict(fused_dq_shared=True, fused_defer_dq=True,
                                                     fused_defer_inline=True,
                                                     fused_dq_head_major=True)),
    (2, 130, 200, 2, 1, 64, False, jnp.float16, dict(fused_dq_head_major=True)),
    # Batch entries launched one after the other.
    (2, 190, 130, 4, 2, 128, True, jnp.float16, dict(fused_dq_shared=True,
                                                     fused_batch_slowest=True)),
    (3, 200, 130, 2, 1, 64, False, jnp.bfloat16, dict(fused_batch_slowest=True,
                                                      bwd_heads_fastest=True)),
    # lse and delta as [B, H, Tp] (3-D loads; the default reads a [1, B·H, Tp] view).
    (2, 190, 130, 4, 2, 128, True, jnp.bfloat16, dict(fused_dq_shared=True, fused_defer_dq=True,
                                                     fused_defer_inline=True,
                                                     bwd_flat_stats=False)),
    (3, 200, 130, 2, 1, 64, False, jnp.float16, dict(bwd_flat_stats=False,
                                                     fused_per_batch_entry=True)),
    # One kernel call per batch entry.
    (3, 190, 130, 4, 2, 128, True, jnp.bfloat16, dict(fused_dq_shared=True,
                                                      fused_per_batch_entry=True)),
    # bwd_head_group is ignored by the fused kernel (see fused_call).
    (1, 130, 200, 8, 4, 128, True, jnp.bfloat16, dict(fused_dq_shared=True,
                                                      bwd_heads_fastest=True, bwd_head_group=2)),
]


# Forms no default runs (measured slower, docs/perf.md): their interpreter cases are `slow`.
OPT_IN = {"fused_stagger_q", "fused_dq_blocks", "fused_overlap", "fused_offset", "fused_dq_first",
          "fused_dq_head_major", "fused_batch_slowest", "fused_per_batch_entry", "bwd_flat_stats",
          "bwd_head_group", "bwd_heads_fastest"}
INTERPRET = [pytest.param(c, marks=pytest.mark.slow) if OPT_IN & set(c[8]) else c
             for c in INTERPRET]


def _interpret_id(c):
  changes = (f"{k}={v}" for k, v in c[8].items())
  return "_".join([kernel_case_id(c[:7]), jnp.dtype(c[7]).name, *changes])


_rel = max_rel_err


@pytest.mark.parametrize("case", INTERPRET, ids=_interpret_id)
def test_fused_gradients_match_reference(case, monkeypatch):
  b, t, s, h, kh, d, causal, dtype, changes = case
  ks = jax.random.split(jax.random.key(t * s + h), 4)
  q, do = (jax.random.normal(k, (b, t, h, d), dtype) for k in (ks[0], ks[3]))
  k, v = (jax.random.normal(k, (b, s, kh, d), dtype) for k in (ks[1], ks[2]))
  config = dataclasses.replace(SMALL, **changes)
  calls = []
  fused_call = backward_fused.fused_call
  monkeypatch.setattr(backward_fused, "fused_call",
                      lambda *a, **kw: calls.append(1) or fused_call(*a, **kw))

  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  # The forward's residuals come from the reference (the interpreted forward has its own tests).
  o, lse = attention_reference(q, k, v, None, None, params=p)
  # BACKWARD_COMPUTES_DELTA: delta is only the lse cotangent's correction (none here); the
  # backend computes rowsum(O∘dO) itself, for the fused kernel in XLA.
  got = backward(q, k, v, None, None, o, lse, do, None, params=p, config=config)
  assert calls, "the fused kernel did not run"

  up = [x.astype(jnp.float32) for x in (q, k, v, do)]
  _, vjp = jax.vjp(lambda *a: pallas_flash.flash_attention(
      *a, is_causal=causal, implementation="reference"), *up[:3])
  for name, g, r in zip(("dq", "dk", "dv"), got, vjp(up[3])):
    assert g.shape == r.shape and g.dtype == dtype, (name, g.shape, g.dtype)
    assert _rel(g, r) <= TOL[dtype], (name, _rel(g, r))
