"""Lowers the Mosaic GPU kernels for CUDA on the CPU: tracing, layout and SMEM-overflow errors.

`jax.export` runs Mosaic's layout inference and dialect lowering in Python and checks shared
memory against the sm_90 limit; PTX generation and ptxas only happen on the GPU.
"""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import use_abstract_mesh

import pallas_flash
from pallas_flash import mosaic_gpu
from pallas_flash.mosaic_gpu import TUNED, MosaicConfig
from pallas_flash.call import AttentionParams, CallInfo
from testing import H200, export_for_h200, kernel_case_id, kernel_specs


CASES = [  # B, T, S, H, K, D, causal
    (2, 4096, 4096, 8, 8, 64, False),
    (1, 1000, 1100, 8, 2, 64, True),
    (2, 4096, 4096, 8, 8, 128, True),
    (1, 777, 1025, 8, 1, 128, False),
    (1, 300, 5000, 4, 2, 128, False),  # past MEDIUM_KV_LEN: 192-key tiles, the tail first
    (1, 2048, 2048, 4, 2, 256, True),
    (1, 300, 700, 4, 4, 256, False),
]


@pytest.mark.parametrize("case", CASES, ids=kernel_case_id)
def test_forward_and_grad_lower(case):
  *shape, causal = case
  q, kv = kernel_specs(*shape)

  def attn(q, k, v):
    return pallas_flash.flash_attention(q, k, v, is_causal=causal, implementation="mosaic")

  def grads(q, k, v):
    return jax.grad(lambda *a: attn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

  assert export_for_h200(attn, q, kv, kv).mlir_module().count("mosaic_gpu") >= 1
  # Forward, dQ and dK/dV kernels at every head dim (at 256 backward_wide.py's), no Triton.
  text = export_for_h200(grads, q, kv, kv).mlir_module()
  assert text.count("mosaic_gpu") >= 3 and "pallas_flash_bwd_dq" not in text


@pytest.mark.parametrize("config", [MosaicConfig(num_stages=3), MosaicConfig(block_kv=192),
                                    MosaicConfig(bwd_stages=3, block_kv_dq=64),
                                    MosaicConfig(heads_fastest=True),
                                    MosaicConfig(dkdv_schedule="batched"),
                                    MosaicConfig(dkdv_pingpong=True),
                                    MosaicConfig(dkdv_schedule="overlap", compute_registers=240,
                                                 producer_registers=24),
                                    MosaicConfig(dkdv_schedule="overlap", compute_registers=240,
                                                 producer_registers=24, dkdv_fold_stats=True),
                                    MosaicConfig(bwd_heads_fastest=True),
                                    MosaicConfig(bwd_heads_fastest=True, bwd_head_group=2)],
                         ids=["stages3", "kv192", "bwd_stages3", "heads_fastest", "dkdv_batched",
                              "dkdv_pingpong", "dkdv_overlap", "dkdv_fold_stats",
                              "bwd_heads_fastest", "bwd_head_group2"])
def test_alternative_configs_fit_in_smem_at_hd128(config):
  q = jax.ShapeDtypeStruct((1, 2048, 4, 128), jnp.float16)
  fn = lambda q, k, v: pallas_flash.flash_attention(  # noqa: E731
      q, k, v, implementation="mosaic", config=config)
  export_for_h200(jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)), q, q, q)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("in_kernel", [True, False], ids=["kernel_delta", "xla_delta"])
def test_split_backward_is_only_the_kernels(in_kernel, causal):
  # bwd_delta_in_kernel: the dQ kernel computes delta = rowsum(O∘dO) and lse in log2 units, so
  # fwd+bwd at an aligned length is the three kernels and nothing else; False runs FA2's
  # preprocessing (a dot_general over O and dO, the lse select) in XLA first.
  q, kv = kernel_specs(1, 4096, 4096, 4, 4, 128)
  config = dataclasses.replace(TUNED[(128, causal)], bwd_delta_in_kernel=in_kernel)

  def fwd_bwd(q, k, v, do):
    attn = lambda *a: pallas_flash.flash_attention(  # noqa: E731
        *a, is_causal=causal, implementation="mosaic", config=config)
    return jax.vjp(attn, q, k, v)[1](do)

  text = export_for_h200(fwd_bwd, q, kv, kv, q).mlir_module()
  ops = collections.Counter(re.findall(r"stablehlo\.(\w+)", text))
  assert text.count("custom_call @mosaic_gpu_v2") == 3
  if in_kernel:
    assert set(ops) == {"custom_call"}, ops
  else:
    assert ops["dot_general"] == 1, ops


def test_delta_in_kernel_falls_back_where_o_does_not_fit():
  # 128-row dQ tiles: Q, dO and O of both warpgroups (192 KiB) leave no room for the K/V ring.
  config = MosaicConfig(block_q_dq=128, block_kv_dq=64)
  q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
  fn = lambda q, k, v: pallas_flash.flash_attention(  # noqa: E731
      q, k, v, implementation="mosaic", config=config)
  with pytest.warns(UserWarning, match="bwd_delta_in_kernel"):
    export_for_h200(jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)),
                    q, q, q)


OVERLAP_CASES = [  # B, T, S, H, K, D, causal
    (1, 1024, 1024, 8, 8, 64, False),
    (1, 1000, 1100, 8, 2, 64, True),
    (2, 2048, 2048, 4, 4, 128, False),
    (1, 777, 1025, 8, 1, 128, True),
    (1, 1024, 1024, 4, 2, 256, True),
    (1, 300, 700, 4, 4, 256, False),
]


@pytest.mark.parametrize("case", OVERLAP_CASES, ids=kernel_case_id)
def test_forward_with_intra_wg_overlap_lowers(case):
  *shape, causal = case
  q, kv = kernel_specs(*shape)
  config = MosaicConfig(block_kv=64 if shape[-1] == 256 else 128, fwd_intra_wg_overlap=True)
  fn = lambda q, k, v: pallas_flash.flash_attention(  # noqa: E731
      q, k, v, is_causal=causal, implementation="mosaic", config=config)
  text = export_for_h200(fn, q, kv, kv).mlir_module()
  assert text.count("mosaic_gpu") >= 1


def test_smem_overflow_is_reported():
  q = jax.ShapeDtypeStruct((1, 2048, 4, 256), jnp.bfloat16)
  fn = lambda q, k, v: pallas_flash.flash_attention(  # noqa: E731
      q, k, v, implementation="mosaic", config=MosaicConfig(block_kv=128, num_stages=3))
  with pytest.raises(Exception, match="shared memory"):
    export_for_h200(fn, q, q, q)


def _info(**kw):
  base = dict(batch=1, q_len=128, kv_len=128, num_heads=4, num_kv_heads=4, head_dim=128,
              dtype=jnp.dtype(jnp.bfloat16),
              params=AttentionParams(scale=1.0, is_causal=False, has_segments=False),
              platform="gpu", compute_capability=(9, 0), device_kind="NVIDIA H200")
  base.update(kw)
  return CallInfo(**base)


@pytest.mark.parametrize("kw,expected", [
    (dict(), None),
    (dict(platform="cpu", compute_capability=None, device_kind="cpu"), "needs a Hopper GPU"),
    (dict(compute_capability=(8, 0), device_kind="NVIDIA A100"), "needs a Hopper GPU"),
    (dict(dtype=jnp.dtype(jnp.float32)), "float32"),
    (dict(head_dim=96), "head_dim 96"),
    (dict(params=AttentionParams(scale=1.0, is_causal=True, has_segments=True)), None),
], ids=["ok", "cpu", "ampere", "f32", "hd96", "segments"])
def test_unsupported_reason(kw, expected):
  reason = mosaic_gpu.unsupported_reason(_info(**kw))
  if expected is None:
    assert reason is None
  else:
    assert expected in reason


def test_segment_calls_run_the_mosaic_kernels():
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  seg = jnp.zeros((1, 256), jnp.int32)
  with use_abstract_mesh(H200):
    why = pallas_flash.explain(q, q, q, query_segment_ids=seg)
  assert why.chosen == "mosaic", why


@pytest.mark.parametrize("case", [(2, 1000, 1000, 8, 2, 64, True),
                                  (1, 2048, 2048, 4, 4, 128, False),
                                  (1, 777, 1025, 8, 1, 128, True),
                                  (1, 1000, 777, 4, 2, 256, True)], ids=kernel_case_id)
@pytest.mark.parametrize("kind", ["segments", "lengths"])
def test_segmented_forward_and_grad_lower(case, kind):
  # Segment ids (lengths are folded into them) add GMEM id loads and the hull of blocks per
  # tile to the forward (plain loop), dQ and dK/dV kernels.
  *shape, causal = case
  q, kv = kernel_specs(*shape)
  b, t, s = shape[:3]
  if kind == "segments":
    extra = dict(query_segment_ids=jax.ShapeDtypeStruct((b, t), jnp.int32),
                 key_value_segment_ids=jax.ShapeDtypeStruct((b, s), jnp.int32))
  else:
    extra = dict(query_seq_lengths=jax.ShapeDtypeStruct((b,), jnp.int32),
                 key_value_seq_lengths=jax.ShapeDtypeStruct((b,), jnp.int32))

  def attn(q, k, v, a, c):
    kw = dict(zip(extra, (a, c)))
    return pallas_flash.flash_attention(q, k, v, is_causal=causal, implementation="mosaic",
                                        config=TUNED[(shape[-1], causal)], **kw)

  def grads(q, k, v, a, c):
    return jax.grad(lambda *x: attn(*x, a, c).astype(jnp.float32).sum(),
                    argnums=(0, 1, 2))(q, k, v)

  text = export_for_h200(grads, q, kv, kv, *extra.values()).mlir_module()
  # Forward, dQ and dK/dV kernels (at head dim 256 backward_wide.py's), no Triton.
  assert text.count("mosaic_gpu") >= 3 and "pallas_flash_bwd_dq" not in text


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dim_256_mosaic_backward_lowers(causal):
  """MosaicConfig(wide_backward="mosaic"): the head-dim-256 dQ and role-split dK/dV kernels
  compile for an H200 (shared memory, registers) next to the forward; GQA, odd length."""
  q, kv = kernel_specs(2, 1000, 1000, 4, 2, 256)
  config = dataclasses.replace(TUNED[(256, causal)], wide_backward="mosaic")
  fn = lambda q, k, v: pallas_flash.flash_attention(  # noqa: E731
      q, k, v, is_causal=causal, implementation="mosaic", config=config)
  grads = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  text = export_for_h200(grads, q, kv, kv).mlir_module()
  assert text.count("mosaic_gpu") >= 3 and "pallas_flash_bwd_dq" not in text  # no Triton


@pytest.mark.parametrize("head_dim,config", [(64, None), (128, None), (256, None),
                                             (128, "fused")])
def test_ragged_operands_are_padded_to_tma_rows_only(head_dim, config):
  """q, k, v, dO and O reach the kernels padded to TMA's 8-row tile (300 -> 304, 700 -> 704),
  not to the tile grid (384 query rows): TMA zero-fills reads and drops stores past the end,
  so XLA copies nothing but those few rows, in the forward and in every backward kernel."""
  q, kv = kernel_specs(1, 300, 700, 4, 4, head_dim)
  if config == "fused":
    config = dataclasses.replace(TUNED[(head_dim, False)], fused_backward=True,
                                 fused_dq_shared=True)
  grads = jax.grad(lambda *a: pallas_flash.flash_attention(
      *a, implementation="mosaic", config=config).astype(jnp.float32).sum(),
      argnums=(0, 1, 2))
  text = export_for_h200(grads, q, kv, kv).mlir_module()
  rows = set(map(int, re.findall(rf"tensor<1x(\d+)x4x{head_dim}xbf16>", text)))
  assert rows == {300, 304, 700, 704}, rows
  if config is not None:  # the fused kernel ran: its float32 dQ sum at 304 rows, then sliced
    assert set(map(int, re.findall(rf"tensor<1x(\d+)x4x{head_dim}xf32>", text))) == {300, 304}


@pytest.mark.parametrize("kw,field", [(dict(block_q=96), "block_q"),
                                      (dict(bwd_stages=0), "bwd_stages"),
                                      (dict(compute_registers=236), "compute_registers"),
                                      (dict(compute_registers=248, producer_registers=24),
                                       "2 \\* compute_registers"),
                                      # 512: hangs on the GPU (setmaxnreg's pool is 3 x 168)
                                      (dict(compute_registers=224, producer_registers=64),
                                       "2 \\* compute_registers"),
                                      (dict(dkdv_schedule="lookahead"), "dkdv_schedule"),
                                      (dict(wide_backward="xla"), "wide_backward"),
                                      (dict(window_backward="xla"), "window_backward")])
def test_bad_config_is_refused_naming_the_field(kw, field):
  with pytest.raises(ValueError, match=field):
    MosaicConfig(**kw)


@pytest.mark.parametrize("shape,causal,fused,early", [
    ((1, 16384, 16, 16, 128), True, True, True),  # FUSED_LONG_CAUSAL
    ((2, 16384, 8, 4, 128), False, True, True),  # FUSED_NONCAUSAL
    ((4, 1024, 16, 16, 128), True, False, False)],  # short: the split backward
    ids=["causal_16k", "gqa_noncausal_16k", "causal_1k"])
def test_explain_reports_the_per_call_mosaic_config(shape, causal, fused, early):
  b, t, h, kh, d = shape
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, t, kh, d), jnp.bfloat16)
  with use_abstract_mesh(H200):
    why = pallas_flash.explain(q, kv, kv, is_causal=causal)
    passed = pallas_flash.explain(q, kv, kv, is_causal=causal, config=MosaicConfig())
  params = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  assert why.chosen == "mosaic"
  assert why.config == mosaic_gpu.config.call_config(d, params, t, b)
  assert (why.config.fused_backward, why.config.fused_early_probs) == (fused, early)
  assert ("fused_backward=True" in str(why)) == fused and "config: MosaicConfig(" in str(why)
  assert passed.config == MosaicConfig()


def test_model_config_overrides_apply_to_each_calls_default(monkeypatch):
  """models.make_attention(config_overrides=...), train's --mosaic-config: the overrides go on
  top of each call's own default, so a long causal call keeps the fused backward."""
  from models import make_attention

  seen = []
  real = pallas_flash.flash_attention
  monkeypatch.setattr(pallas_flash, "flash_attention",
                      lambda *a, config=None, **kw: seen.append(config) or real(*a, **kw))
  fn = make_attention("ours", implementation="mosaic", config_overrides="fused_dq_first=True")
  q = jax.ShapeDtypeStruct((1, 16384, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 16384, 4, 128), jnp.bfloat16)
  call = lambda q, k, v: fn(q, k, v, is_causal=True, query_segment_ids=None,  # noqa: E731
                            key_value_segment_ids=None)
  with use_abstract_mesh(H200):
    jax.eval_shape(call, q, kv, kv)
    default = pallas_flash.explain(q, kv, kv, is_causal=True).config
  assert default.fused_backward and not default.fused_dq_first
  assert seen == [dataclasses.replace(default, fused_dq_first=True)]
  with pytest.raises(ValueError, match="need the Mosaic kernels"):  # on this CPU: xla runs
    jax.eval_shape(call, q, kv, kv)
