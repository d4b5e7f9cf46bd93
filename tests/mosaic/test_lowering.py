"""The Mosaic kernels lowered for an abstract H200 on the CPU, and the rules that configure them.

`jax.export` runs Mosaic's layout inference and dialect lowering in Python and checks shared
memory against the sm_90 limit; PTX generation and ptxas happen on the GPU only. The default
calls' kernels are pinned by tests/test_gate.py; these cover the configs a user may choose.
"""

import collections
import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import use_abstract_mesh

import pallas_flash
from pallas_flash import backends, masks, mosaic_gpu
from pallas_flash.call import AttentionParams, CallInfo
from pallas_flash.mosaic_gpu import TUNED, MosaicConfig, MosaicDebug
from pallas_flash.mosaic_gpu import config as mconfig
from pallas_flash.mosaic_gpu.sm90 import common, forward, fused, split_tail
from testing import H200, Case, export_for_h200, specs


def _grad_module(case: Case, config=None, **kw) -> str:
  """The StableHLO text of the case's gradient on mosaic, lowered for an H200 (V at the
  case's value head dim)."""
  q, k = specs(case)
  v = k if case.value_head_dim is None else jax.ShapeDtypeStruct(
      (*k.shape[:3], case.value_head_dim), k.dtype)

  def grads(q, k, v):
    def loss(*a):
      return pallas_flash.flash_attention(*a, is_causal=case.is_causal, implementation="mosaic",
                                          config=config, **kw).astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  return export_for_h200(grads, q, k, v).mlir_module()


HD128 = Case(batch=1, q_len=2048, kv_len=2048, num_heads=4, num_kv_heads=4, head_dim=128,
             dtype=jnp.float16)


@pytest.mark.parametrize("config", [
    MosaicConfig(num_stages=3), MosaicConfig(block_kv=192), MosaicConfig(heads_fastest=True),
    MosaicConfig(bwd_stages=3, block_kv_dq=64), MosaicConfig(dkdv_overlap=True,
                                                             **mconfig.WIDE_REGISTERS),
    MosaicConfig(fwd_persistent=True), MosaicConfig(fwd_split_tail=True, block_kv=64),
    MosaicConfig(fused_backward=True, **mconfig.WIDE_REGISTERS)],
    ids=["stages3", "kv192", "heads_fastest", "bwd_stages3", "dkdv_overlap", "persistent",
         "split_tail", "fused"])
def test_configs_a_user_may_choose_lower_and_fit(config):
  assert _grad_module(HD128, config).count("custom_call @mosaic_gpu_v2") >= 2


def test_shared_memory_overflow_is_reported():
  q, _ = specs(dataclasses.replace(HD128, head_dim=256))
  fn = lambda q, k, v: pallas_flash.flash_attention(  # noqa: E731
      q, k, v, implementation="mosaic", config=MosaicConfig(block_kv=128, num_stages=3))
  with pytest.raises(Exception, match="shared memory"):
    export_for_h200(fn, q, q, q)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_split_backward_is_only_the_kernels(causal):
  """The dQ kernel computes delta = rowsum(O∘dO) and lse in log2 units itself, so fwd+bwd at
  an aligned length is the three kernels and nothing else; a dQ tile with no room for O beside
  it runs FA2's preprocessing in XLA instead (a dot_general over O and dO)."""
  case = dataclasses.replace(HD128, q_len=4096, kv_len=4096, is_causal=causal,
                             dtype=jnp.bfloat16)
  q, kv = specs(case)

  def ops(config):
    def fwd_bwd(q, k, v, do):
      attn = lambda *a: pallas_flash.flash_attention(  # noqa: E731
          *a, is_causal=causal, implementation="mosaic", config=config)
      return jax.vjp(attn, q, k, v)[1](do)

    text = export_for_h200(fwd_bwd, q, kv, kv, q).mlir_module()
    assert text.count("custom_call @mosaic_gpu_v2") == 3
    return collections.Counter(re.findall(r"stablehlo\.(\w+)", text))

  assert set(ops(TUNED[(128, causal)])) == {"custom_call"}
  assert ops(MosaicConfig(block_q_dq=128, block_kv_dq=64))["dot_general"] == 1


@pytest.mark.parametrize("causal, config", [
    (True, None), (False, MosaicConfig(fwd_persistent=True)),
    (False, MosaicConfig(fwd_split_tail=True, block_kv=64))],
    ids=["causal-default", "persistent", "split_tail"])
def test_sinks_are_an_input_of_the_forward_kernel(causal, config):
  """implementation=None on an H200 adds the sinks in the Mosaic forward: the kernel takes them
  as a fourth input and no XLA pass rescales its output (merge.add_sinks's sigmoid, a
  `logistic`); their gradient lowers beside the backward kernels, and where the split backward
  runs (causal) it reduces the dQ kernel's delta: no XLA pass over O and dO (a dot_general)."""
  case = dataclasses.replace(HD128, q_len=4096, kv_len=4096, dtype=jnp.bfloat16)
  q, kv = specs(case)
  sinks = jax.ShapeDtypeStruct((case.num_heads,), jnp.float32)

  def attn(q, k, v, sinks):
    return pallas_flash.flash_attention(q, k, v, is_causal=causal, sinks=sinks, config=config)

  text = export_for_h200(attn, q, kv, kv, sinks).mlir_module()
  calls = re.findall(r"custom_call @mosaic_gpu_v2\((.*?)\)", text)
  assert [len(c.split(",")) for c in calls] == [4], calls  # q, k, v, sinks
  assert "logistic" not in text

  def fwd_bwd(q, k, v, sinks, do):
    return jax.vjp(attn, q, k, v, sinks)[1](do)

  text = export_for_h200(fwd_bwd, q, kv, kv, sinks, q).mlir_module()
  assert text.count("custom_call @mosaic_gpu_v2") >= 2 and "logistic" not in text
  if causal:
    assert text.count("custom_call @mosaic_gpu_v2") == 3 and "dot_general" not in text


@pytest.mark.parametrize("head_dim,fused_backward", [(64, False), (128, False), (256, False),
                                                     (128, True)])
def test_ragged_operands_are_padded_to_tma_rows_only(head_dim, fused_backward):
  """q, k, v, dO and O reach the kernels padded to TMA's 8-row tile (300 -> 304, 700 -> 704),
  not to the tile grid: TMA zero-fills reads and drops stores past the end, so XLA copies
  nothing but those few rows, in the forward and in every backward kernel."""
  case = Case(batch=1, q_len=300, kv_len=700, num_heads=4, num_kv_heads=4, head_dim=head_dim,
              dtype=jnp.bfloat16)
  config = (dataclasses.replace(TUNED[(head_dim, False)], fused_backward=True)
            if fused_backward else None)
  text = _grad_module(case, config)
  rows = set(map(int, re.findall(rf"tensor<1x(\d+)x4x{head_dim}xbf16>", text)))
  assert rows == {300, 304, 700, 704}, rows
  if fused_backward:  # the fused kernel ran: its float32 dQ sum at 304 rows, then sliced
    assert set(map(int, re.findall(rf"tensor<1x(\d+)x4x{head_dim}xf32>", text))) == {300, 304}


@pytest.mark.parametrize("case,kw,match", [
    (dataclasses.replace(HD128, head_dim=64), {}, "head_dim 64"),
    (HD128, dict(query_segment_ids=jnp.zeros((1, 2048), jnp.int32)), "segment ids"),
    (HD128, dict(alibi_slopes=jnp.ones(4, jnp.float32)), "ALiBi"),
], ids=["hd64", "segments", "alibi"])
def test_fused_config_falls_back_to_the_split_with_a_warning(case, kw, match):
  config = MosaicConfig(fused_backward=True, **mconfig.WIDE_REGISTERS)
  with pytest.warns(UserWarning, match=match):
    text = _grad_module(case, config, **kw)
  assert text.count("custom_call @mosaic_gpu_v2") == 3


def test_fused_shared_memory_estimate_refuses_what_does_not_fit():
  q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  assert fused.unsupported_reason(q, MosaicConfig(fused_backward=True)) is None
  assert "shared memory" in fused.unsupported_reason(
      q, MosaicConfig(fused_backward=True, fused_stages=4))


@pytest.mark.parametrize("make,field", [
    (lambda: MosaicConfig(block_q=96), "block_q"),
    (lambda: MosaicConfig(bwd_stages=0), "bwd_stages"),
    (lambda: MosaicConfig(compute_registers=236), "compute_registers"),
    # 512: hangs on the GPU (setmaxnreg's pool is 3 x 168)
    (lambda: MosaicConfig(compute_registers=248, producer_registers=24),
     "2 \\* compute_registers"),
    (lambda: MosaicDebug(persistent_ctas=-1), "persistent_ctas"),
    (lambda: MosaicConfig(debug=dict(interpret=True)), "MosaicDebug"),
    (lambda: MosaicConfig(native_value_head_dim=1), "native_value_head_dim"),
    (lambda: MosaicConfig(fp8_block_kv=192), "fp8_block_kv"),
    (lambda: MosaicConfig(fp8_block_kv=-128), "fp8_block_kv")],
    ids=["block_q", "bwd_stages", "registers", "register_pool", "debug_field", "debug_type",
         "native_value_head_dim", "fp8_block_kv", "fp8_block_kv_negative"])
def test_bad_config_is_refused_naming_the_field(make, field):
  with pytest.raises((ValueError, TypeError), match=field):
    make()


# (D, Dv, the kernels' head dim, run by implementation=None): 80, 96 and 192 at their own
# kernels (MLA's 192 / 128 with V padded to 192), others zero-padded (72 to 80, 112 to 128).
HEAD_DIMS = [(80, 80, 80, True), (96, 96, 96, True), (72, 72, 80, True),
             (112, 112, 128, True), (192, 192, 192, True), (192, 128, 192, True),
             (128, 64, 128, False), (224, 224, 256, True), (64, 64, 64, True),
             (256, 256, 256, True)]


@pytest.mark.parametrize("d,dv,kernel_dim,measured", HEAD_DIMS,
                         ids=[f"d{d}v{dv}" for d, dv, _, _ in HEAD_DIMS])
def test_head_dims_run_padded_and_unmeasured_ones_only_when_asked(d, dv, kernel_dim, measured):
  """Every head dim up to 256 runs here, zero-padded to the next kernel head dim where it is
  not one; `implementation=None` runs every head dim and passes the value head dims of their
  own not yet measured by, with a reason naming the padding; a config is that of the kernels'
  head dim (128's for 80 and 96, with the split backward at their own width), with V at its
  own width where the kernels take it."""
  info = _info(head_dim=d, value_head_dim=dv)
  assert mosaic_gpu.unsupported_reason(info) is None
  assert mconfig.kernel_head_dim(d, dv) == kernel_dim
  why = backends.auto_reason("mosaic", info, None)
  if measured:
    assert why is None
  else:
    assert "only when asked" in why and "not yet measured" in why
    assert (f"zero-padded to {kernel_dim}" in why) == (d != kernel_dim or dv != kernel_dim)
    assert ("value head dim" in why) == (dv != d)
  config_dim = 128 if kernel_dim in mosaic_gpu.NARROW_HEAD_DIMS else kernel_dim
  assert mconfig.config_head_dim(d, dv) == config_dim
  native = dv != d and mconfig.native_value_reason(d, dv) is None
  assert mosaic_gpu.default_config(info) == dataclasses.replace(
      mconfig.call_config(config_dim, info.params, info.kv_len, info.batch),
      native_value_head_dim=native)
  assert mconfig.kernel_head_dims(d, dv, mosaic_gpu.default_config(info)) == (
      (d, dv) if native else (kernel_dim, kernel_dim))


@pytest.mark.parametrize("d", mosaic_gpu.NARROW_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_narrow_head_dims_take_the_split_backward_at_their_own_width(d, causal):
  """Head dims 80 / 96 where head dim 128 takes the fused backward (8K keys) run the split
  one at their own width instead (measured faster), keeping 128's other fields."""
  info = _info(head_dim=d, q_len=8192, kv_len=8192,
               params=AttentionParams(scale=1.0, is_causal=causal, has_segments=False))
  fused = mconfig.call_config(128, info.params, info.kv_len, info.batch)
  assert fused.fused_backward
  config = mosaic_gpu.default_config(info)
  assert config == dataclasses.replace(fused, fused_backward=False)
  assert mconfig.kernel_head_dims(d, d, config, backward=True) == (d, d)


# (D, Dv, causal): each runs the kernels of its kernel head dim (128: overlapped forward and
# dK/dV steps; 192: the forward at 64-key tiles, hd256.py's backward), q/k/v padded to it
# once where they differ and the results sliced.
PADDED = [(112, 112, True), (192, 128, False), pytest.param(72, 72, False, marks=pytest.mark.slow),
          pytest.param(192, 192, True, marks=pytest.mark.slow)]


@pytest.mark.parametrize("d,dv,causal", PADDED,
                         ids=["d112_causal", "d192v128_full", "d72_full", "d192_causal"])
def test_padded_head_dims_lower_at_the_kernel_head_dim(d, dv, causal):
  p = mconfig.kernel_head_dim(d, dv)
  q = jax.ShapeDtypeStruct((2, 1024, 8, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 1024, 2, d), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((2, 1024, 2, dv), jnp.bfloat16)

  def grads(q, k, v):
    def loss(*a):
      return pallas_flash.flash_attention(*a, is_causal=causal, implementation="mosaic").astype(
          jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  text = export_for_h200(grads, q, k, v).mlir_module()
  assert text.count("custom_call @mosaic_gpu_v2") == 3  # forward, dQ, dK/dV
  # The kernels see only their head dim; the call's own dims come back sliced.
  assert set(map(int, re.findall(r"tensor<2x1024x\d+x(\d+)xbf16>", text))) == {d, dv, p}
  with use_abstract_mesh(H200):
    why = pallas_flash.explain(q, k, v, is_causal=causal)
  if d == dv or (d, dv) in mosaic_gpu.MEASURED_VALUE_HEAD_DIMS:
    assert why.chosen == "mosaic"
  else:
    assert why.chosen == "triton" and "only when asked" in why.reasons["mosaic"]
  assert why.reasons_when_named["mosaic"] is None


# MosaicConfig.native_value_head_dim at (D, Dv, causal): every kernel takes V, O, dO and dV at
# Dv and Q, K, dQ, dK at D (the types of the forward's, the dQ and the dK/dV kernels' calls),
# nothing is padded along the head dim, and the kernels fit in shared memory.
NATIVE = [(192, 128, False), (192, 128, True), pytest.param(256, 64, True, marks=pytest.mark.slow)]


@pytest.mark.parametrize("d,dv,causal", NATIVE, ids=["d192v128_full", "d192v128_causal",
                                                     "d256v64_causal"])
def test_native_value_head_dim_kernels_take_v_at_its_own_width(d, dv, causal):
  case = Case(batch=2, q_len=1024, kv_len=1024, num_heads=8, num_kv_heads=2, head_dim=d,
              value_head_dim=dv, is_causal=causal, dtype=jnp.bfloat16)
  config = dataclasses.replace(TUNED[(d, causal)], native_value_head_dim=True)
  text = _grad_module(case, config)
  calls = re.findall(r"custom_call @mosaic_gpu_v2\(.* : \((.*?)\) -> \(?(.*?)\)? loc\(", text)
  rows = lambda types: re.findall(r"2x1024x(\d+)x(\d+)xbf16", types)  # noqa: E731
  q_, kv, o_, v_ = ("8", str(d)), ("2", str(d)), ("8", str(dv)), ("2", str(dv))
  assert [(rows(a), rows(r)) for a, r in calls] == [
      ([q_, kv, v_], [o_]),  # forward: o
      ([q_, kv, v_, o_], [q_]),  # dQ (dO): dq
      ([q_, kv, v_, o_], [kv, v_]),  # dK/dV (dO): dk, dv
  ], calls
  assert "stablehlo.pad" not in text


# (D, causal, fused backward): head dims 80 and 96 run head dim 128's forward and split backward
# at their own width (a 32- or 64-byte swizzle: common.swizzle_bytes), with head dim 128's
# configs; a config with the fused backward (head dim 128 only) runs that zero-padded to 128.
NARROW = [(80, False, False), (96, False, True),
          pytest.param(96, True, False, marks=pytest.mark.slow),
          pytest.param(80, True, False, marks=pytest.mark.slow)]


@pytest.mark.parametrize("d,causal,fused_backward", NARROW,
                         ids=["d80_full", "d96_fused", "d96_causal", "d80_causal"])
def test_narrow_head_dims_run_the_kernels_at_their_own_width(d, causal, fused_backward):
  assert common.swizzle_bytes(d) == {80: 32, 96: 64}[d]
  case = Case(batch=2, q_len=1024, kv_len=1024, num_heads=8, num_kv_heads=2, head_dim=d,
              is_causal=causal, dtype=jnp.bfloat16)
  config = TUNED[(128, causal)]
  if fused_backward:
    config = dataclasses.replace(config, **mconfig.FUSED)
  text = _grad_module(case, config)
  dims = set(map(int, re.findall(r"tensor<2x1024x\d+x(\d+)xbf16>", text)))
  if fused_backward:  # the forward, then the fused kernel on operands padded to 128
    assert text.count("custom_call @mosaic_gpu_v2") == 2 and dims == {d, 128}
  else:  # forward, dQ, dK/dV, none of them padded
    assert text.count("custom_call @mosaic_gpu_v2") == 3 and dims == {d}


def test_swizzle_is_the_widest_that_divides_a_row():
  assert [common.swizzle_bytes(d) for d in (16, 48, 64, 80, 96, 112, 128, 192, 256)] == [
      32, 32, 128, 32, 64, 32, 128, 128, 128]
  assert common.swizzle_bytes(64, itemsize=1) == 64
  with pytest.raises(ValueError, match="multiples of 16"):
    common.swizzle_bytes(72)


def _info(**kw):
  base = dict(batch=1, q_len=128, kv_len=128, num_heads=4, num_kv_heads=4, head_dim=128,
              dtype=jnp.dtype(jnp.bfloat16),
              params=AttentionParams(scale=1.0, is_causal=False, has_segments=False),
              platform="gpu", compute_capability=(9, 0), device_kind="NVIDIA H200")
  base.update(kw)
  base.setdefault("value_head_dim", base["head_dim"])
  return CallInfo(**base)


NATIVE_CONFIG = MosaicConfig(native_value_head_dim=True)


@pytest.mark.parametrize("kw,config,expected", [
    (dict(), None, None),
    (dict(platform="cpu", compute_capability=None, device_kind="cpu"), None,
     "needs a Hopper GPU"),
    (dict(compute_capability=(8, 0), device_kind="NVIDIA A100"), None, "needs a Hopper GPU"),
    (dict(dtype=jnp.dtype(jnp.float32)), None, "float32"),
    (dict(head_dim=96), None, None),
    (dict(head_dim=288), None, "head dims up to 256"),
    (dict(head_dim=128, value_head_dim=320), None, "value head dim 320"),
    (dict(params=AttentionParams(scale=1.0, is_causal=True, has_segments=True)), None, None),
    (dict(params=AttentionParams(scale=1.0, is_causal=True, has_segments=False,
                                 deterministic=True)),
     MosaicConfig(fused_backward=True), "deterministic=True rules out"),
    (dict(params=AttentionParams(scale=1.0, is_causal=True, has_segments=False,
                                 has_alibi=True)), None, None),
    (dict(q_len=2**23, kv_len=2**23, params=AttentionParams(
        scale=1.0, is_causal=True, has_segments=False, has_alibi=True)), None,
     "ALiBi distances are exact below"),
    # MosaicConfig.native_value_head_dim: D of 192 or 256, Dv a multiple of 64 below it.
    (dict(head_dim=192, value_head_dim=128), NATIVE_CONFIG, None),
    (dict(head_dim=256, value_head_dim=192), NATIVE_CONFIG, None),
    (dict(head_dim=192, value_head_dim=192), NATIVE_CONFIG, None),
    (dict(head_dim=128, value_head_dim=64), NATIVE_CONFIG, "query/key head dims (192, 256)"),
    (dict(head_dim=176, value_head_dim=128), NATIVE_CONFIG, "query/key head dims (192, 256)"),
    (dict(head_dim=192, value_head_dim=96), NATIVE_CONFIG, "multiples of 64 below"),
    (dict(head_dim=192, value_head_dim=256), NATIVE_CONFIG, "multiples of 64 below"),
], ids=["ok", "cpu", "ampere", "f32", "hd96", "hd288", "dv320", "segments",
        "deterministic_fused", "alibi", "alibi_8m", "native_d192v128", "native_d256v192",
        "native_d192v192", "native_d128v64", "native_d176v128", "native_d192v96",
        "native_d192v256"])
def test_unsupported_reason(kw, config, expected):
  reason = mosaic_gpu.unsupported_reason(_info(**kw), config)
  assert reason is None if expected is None else expected in reason


@pytest.mark.parametrize("d,dv,native,forward,backward", [
    (192, 128, False, (192, 192), (192, 192)), (192, 128, True, (192, 128), (192, 128)),
    (256, 64, True, (256, 64), (256, 64)), (192, 192, True, (192, 192), (192, 192)),
    (112, 64, False, (128, 128), (128, 128))])
def test_kernel_head_dims_are_resolved_in_one_place(d, dv, native, forward, backward):
  """config.kernel_head_dims: (query/key, value) head dims of the kernels, padded (one head
  dim, kernel_head_dim) unless the config asks for V's own."""
  config = MosaicConfig(native_value_head_dim=native)
  assert mconfig.kernel_head_dims(d, dv, config) == forward
  assert mconfig.kernel_head_dims(d, dv, config, backward=True) == backward


@pytest.mark.parametrize("shape,causal,fused_backward", [
    ((1, 16384, 16, 16, 128), True, True),  # long causal: the fused backward
    ((2, 16384, 8, 4, 128), False, True),  # long non-causal GQA: the fused backward
    ((4, 1024, 16, 16, 128), True, False)],  # short: the split backward
    ids=["causal_16k", "gqa_noncausal_16k", "causal_1k"])
def test_explain_reports_the_per_call_config(shape, causal, fused_backward):
  b, t, h, kh, d = shape
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, t, kh, d), jnp.bfloat16)
  with use_abstract_mesh(H200):
    why = pallas_flash.explain(q, kv, kv, is_causal=causal)
    passed = pallas_flash.explain(q, kv, kv, is_causal=causal, config=MosaicConfig())
    deterministic = pallas_flash.explain(q, kv, kv, is_causal=causal, deterministic=True)
  params = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  assert why.chosen == "mosaic"
  assert why.config == mconfig.call_config(d, params, t, b)
  assert why.config.fused_backward == fused_backward
  assert ("fused_backward=True" in str(why)) == fused_backward
  assert passed.config == MosaicConfig()
  assert not deterministic.config.fused_backward


# ALiBi in each default form: hd64 persistent (1K), split tail (4K), causal; hd128 persistent
# overlapped (2K), 192-key grid (8K, where plain calls take the fused backward), causal (Q in
# registers, dK/dV overlap); hd256. Every one lowers with its shared memory within the H200's.
ALIBI_FORMS = [(64, False, 1024), (64, False, 4096), (64, True, 2048), (128, False, 2048),
               (128, False, 8192), (128, True, 2048), (256, True, 1024)]


def _form_params(forms):
  """pytest params of (head_dim, causal, kv_len) forms; head dim 64's, whose tiles take the
  least shared memory, run with -m slow (suite time)."""
  return [pytest.param(d, c, s, id=f"d{d}_{'causal' if c else 'full'}_{s}",
                       marks=pytest.mark.slow if d == 64 else ()) for d, c, s in forms]


@pytest.mark.parametrize("head_dim,causal,kv_len", _form_params(ALIBI_FORMS))
def test_alibi_default_kernels_lower_and_fit(head_dim, causal, kv_len):
  case = Case(batch=1, q_len=kv_len, kv_len=kv_len, num_heads=4, num_kv_heads=2,
              head_dim=head_dim, dtype=jnp.bfloat16, is_causal=causal)
  text = _grad_module(case, alibi_slopes=jnp.linspace(0.1, 1.0, 4, dtype=jnp.float32))
  assert text.count("custom_call @mosaic_gpu_v2") == 3  # forward, dQ, dK/dV: not fused


def test_explain_runs_alibi_on_mosaic_without_the_fused_backward():
  """ALiBi runs on the Mosaic kernels by automatic choice on an H200 (measured 1.25x Triton);
  a long causal call, which takes the fused backward without it, runs the split backward (the
  fused kernel does not add ALiBi)."""
  q = jax.ShapeDtypeStruct((1, 16384, 16, 128), jnp.bfloat16)
  slopes = jax.ShapeDtypeStruct((16,), jnp.float32)
  with use_abstract_mesh(H200):
    auto = pallas_flash.explain(q, q, q, is_causal=True, alibi_slopes=slopes)
    plain = pallas_flash.explain(q, q, q, is_causal=True)
  assert auto.chosen == "mosaic", auto
  assert plain.config.fused_backward and not auto.config.fused_backward


# ALIBI_FORMS, and head dims 96 (head dim 128's kernels at a 64-byte swizzle) and 192 (hd256.py).
DROPOUT_FORMS = ALIBI_FORMS + [(96, False, 2048), (192, True, 1024)]


@pytest.mark.parametrize("head_dim,causal,kv_len", _form_params(DROPOUT_FORMS))
def test_dropout_default_kernels_lower_and_fit(head_dim, causal, kv_len):
  """Dropout in each default form: forward, dQ and dK/dV kernels on Mosaic (never the fused
  backward)."""
  case = Case(batch=1, q_len=kv_len, kv_len=kv_len, num_heads=4, num_kv_heads=2,
              head_dim=head_dim, dtype=jnp.bfloat16, is_causal=causal)
  text = _grad_module(case, dropout_rate=0.1, dropout_rng=jax.random.key(0))
  assert text.count("custom_call @mosaic_gpu_v2") == 3


@pytest.mark.parametrize("head_dim,causal,kv_len", ALIBI_FORMS,
                         ids=[f"d{d}_{'causal' if c else 'full'}_{s}" for d, c, s in ALIBI_FORMS])
def test_dropout_configs_keep_narrow_tiles(head_dim, causal, kv_len):
  """call_config with dropout is the plain call's config with dropout_tiles: forward tiles of
  at most 128 keys (Q in registers where a 192-key tile read it from shared memory) and 64-row
  dK/dV q tiles, the tiles ptxas compiled without main-loop spills; never the fused backward."""
  params = AttentionParams(scale=1.0, is_causal=causal, has_segments=False)
  plain = mconfig.call_config(head_dim, params, kv_len, 1)
  got = mconfig.call_config(head_dim, dataclasses.replace(params, dropout_rate=0.1), kv_len, 1)
  assert got.block_kv == min(plain.block_kv, 128) and got.block_q_dkv == 64
  assert not got.fused_backward
  if plain.block_kv > 128 and plain.fwd_intra_wg_overlap:
    assert got.fwd_q_registers
  unchanged = ("block_kv", "block_q_dkv", "fwd_q_registers", "fused_backward",
               "compute_registers", "producer_registers")
  assert all(getattr(got, f.name) == getattr(plain, f.name)
             for f in dataclasses.fields(MosaicConfig) if f.name not in unchanged)


@pytest.mark.parametrize("feature", ["bias", "mask", "dropout"])
def test_block_mask_configs_take_their_features_tiles(feature):
  """A block mask's call takes the causal config with its features' tiles, as a causal call
  with the same features does, except that with a dense bias or mask its forward runs the
  plain kv loop (the overlapped one with a bias: 0.49x with Q in registers, 0.92x from shared
  memory, one H100, 2026-12-06)."""
  extra = {"bias": dict(has_bias=True), "mask": dict(has_mask=True),
           "dropout": dict(dropout_rate=0.1)}[feature]
  causal = AttentionParams(scale=1.0, is_causal=True, has_segments=False, **extra)
  masked = dataclasses.replace(causal, is_causal=False, block_mask_blocks=(128, 128),
                               block_mask_fn_types=(masks.CausalMask,))
  plain = mconfig.call_config(128, dataclasses.replace(masked, has_bias=False, has_mask=False,
                                                       dropout_rate=0.0), 4096, 4)
  got = mconfig.call_config(128, masked, 4096, 4)
  want = mconfig.call_config(128, causal, 4096, 4)
  if feature == "dropout":
    assert got == mconfig.dropout_tiles(plain)
    return
  assert not got.fwd_intra_wg_overlap and plain.fwd_intra_wg_overlap
  assert got == dataclasses.replace(want, fwd_intra_wg_overlap=False, fused_backward=False)
  assert not got.fwd_q_registers and got.block_kv_dq == 64 and got.block_q_dkv == 64


def test_dropout_runs_on_mosaic_without_the_fused_backward():
  """Dropout runs on the Mosaic kernels on an H200 by automatic choice (measured 1.17-1.21x
  the Triton kernels'); a long causal call, which takes the fused backward without it, runs
  the split backward (the fused kernel does not form the mask), and a config that asks for
  the fused backward is told why not."""
  from pallas_flash import backends, validation
  q = jax.ShapeDtypeStruct((1, 16384, 16, 128), jnp.bfloat16)
  kw = dict(is_causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0))
  with use_abstract_mesh(H200):
    auto = pallas_flash.explain(q, q, q, **kw)
    named = backends.resolve_config(
        "mosaic", validation.abstract_call_info(q, q, q, validation.with_defaults(kw)), None)
    plain = pallas_flash.explain(q, q, q, is_causal=True)
  assert auto.chosen == "mosaic" and auto.config == named
  assert plain.config.fused_backward and not named.fused_backward
  with pytest.warns(UserWarning, match="dropout's mask is formed in the split kernels only"):
    _grad_module(Case(batch=1, q_len=1024, kv_len=1024, num_heads=4, num_kv_heads=4,
                      head_dim=128, dtype=jnp.bfloat16, is_causal=True),
                 MosaicConfig(fused_backward=True, **mconfig.WIDE_REGISTERS),
                 dropout_rate=0.1, dropout_rng=jax.random.key(0))


TILES, HEADS, BATCH = 3, 4, 2


@pytest.mark.parametrize("heads_fastest", [False, True])
def test_launch_grid_order(heads_fastest):
  """Mosaic GPU reverses plgpu.kernel's grid into CUDA's (x, y, z) and dispatches x fastest,
  so a row-major walk of the grid is the launch order: after the batch entries, tiles of one
  head (heads_fastest False) or one tile of every head (True) run together."""
  launch = common.launch_grid(TILES, HEADS, BATCH, ("t", "h", "b"), heads_fastest=heads_fastest)
  order = [dict(zip(launch["grid_names"], idx))
           for idx in itertools.product(*map(range, launch["grid"]))]
  got = [(at["t"], at["h"], at["b"]) for at in order]
  outer, inner = ((range(TILES), range(HEADS)) if heads_fastest else (range(HEADS), range(TILES)))
  want = [(x, y, b) if heads_fastest else (y, x, b) for x in outer for y in inner
          for b in range(BATCH)]
  assert got == want


def test_split_tail_cost_model_and_launch_order():
  """The split pays only for a partial last wave, with a few parts; its coordinates follow
  the forward grid's launch order (batch fastest, then q tiles of one head)."""
  assert split_tail.tail_parts(tiles=264, steps=128, wave=132) == 1  # whole waves
  parts = split_tail.tail_parts(tiles=2048, steps=128, wave=132)
  assert 2 <= parts <= 17
  config = MosaicConfig(debug=MosaicDebug(wave_ctas=5, tail_parts=2))
  split = split_tail.plan(3, 2, 2, 8, heads_fastest=False, config=config)
  assert (split.tiles, split.main, split.parts, split.ctas) == (12, 10, 2, 14)
  b, h, qt = split.tail_coords()
  assert list(zip(b.tolist(), h.tolist(), qt.tolist())) == [(0, 1, 2), (1, 1, 2)]
  assert split_tail.plan(3, 2, 2, 8, heads_fastest=False, config=dataclasses.replace(
      config, debug=MosaicDebug(wave_ctas=4))) is None  # 12 tiles: whole waves of 4


def test_split_tail_merge_equals_the_unsplit_result():
  """combine_tail: the parts' (o, lse), each normalised over its keys, merge into the tile's
  attention over all keys."""
  config = MosaicConfig(debug=MosaicDebug(wave_ctas=3, tail_parts=2))
  split = split_tail.plan(2, 1, 2, 4, heads_fastest=False, config=config)
  rows, d = 2 * 64, 8
  keys = jax.random.split(jax.random.key(0), 3)
  o_parts = jax.random.normal(keys[0], (split.tail_tiles * split.parts, 2, 64, d))
  lse_parts = jax.random.normal(keys[1], (split.tail_tiles * split.parts, 2, 64))
  o = jnp.zeros((2, 2 * rows, 1, d))
  lse = jnp.zeros((2, 1, 2 * rows))
  o, lse = forward.combine_tail(o, lse, o_parts, lse_parts, split)
  w = jax.nn.softmax(lse_parts.reshape(split.tail_tiles, split.parts, rows), axis=1)
  want = (w[..., None] * o_parts.reshape(split.tail_tiles, split.parts, rows, d)).sum(1)
  b, h, qt = split.tail_coords()
  for i in range(split.tail_tiles):
    got = o[b[i], qt[i] * rows:(qt[i] + 1) * rows, h[i]]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want[i]), rtol=1e-5, atol=1e-6)


# The FP8 forward (sm90/fp8_forward.py) at its default key tiles per head dim (256 up to 128,
# 128 at 256), at 128-key tiles (MosaicConfig.fp8_block_kv), and with the bf16 kernels' tuned
# config (192-key bf16 tiles), which leaves the FP8 tiles at their default: both matmuls
# lowered to e4m3 wgmma with an fp32 accumulator, P·V taking P from registers, P rounded with
# cvt...satfinite.e4m3x2.f32.
@pytest.mark.parametrize("head_dim,causal,config", [
    pytest.param(64, False, None, marks=pytest.mark.slow), (64, True, None), (128, False, None),
    pytest.param(128, True, None, marks=pytest.mark.slow),
    (128, True, MosaicConfig(fp8_block_kv=128)),  # 128-key tiles (head dim 256's default)
    (128, False, TUNED[(128, False)]),  # block_kv=192: the FP8 forward keeps its 256
    pytest.param(256, False, None, marks=pytest.mark.slow),
    pytest.param(256, True, None, marks=pytest.mark.slow)],
    ids=["hd64", "hd64-causal", "hd128", "hd128-causal", "hd128-causal-kv128",
         "hd128-bf16-tuned-config", "hd256", "hd256-causal"])
def test_fp8_forward_lowers_to_e4m3_wgmma(head_dim, causal, config):
  from pallas_flash import fp8
  from pallas_flash.mosaic_gpu.sm90 import fp8_forward
  q = jax.ShapeDtypeStruct((1, 1024, 4, head_dim), jnp.float8_e4m3fn)
  kv = jax.ShapeDtypeStruct((1, 1024, 2, head_dim), jnp.float8_e4m3fn)
  scale = jax.ShapeDtypeStruct((), jnp.float32)

  def fn(q, k, v, sq, sk, sv):
    return pallas_flash.flash_attention(q, k, v, descale=fp8.Fp8Scales(sq, sk, sv),
                                        is_causal=causal, implementation="mosaic",
                                        config=config)

  text = export_for_h200(fn, q, kv, kv, scale, scale, scale).mlir_module()
  assert text.count("custom_call @mosaic_gpu_v2") == 1
  mmas = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k32)\.f32\.e4m3\.e4m3 "
                        r"\{[$\d,]+\}, (\{[$\d,]+\}|\$\d+)", text))
  # S = Q·Kᵀ: m64n{key tile} with Q's descriptor; O += P·V: m64n{head_dim} with P's registers.
  block_kv = fp8_forward.block_kv(head_dim, config)
  assert (f"m64n{block_kv}k32", False) in {(m, a.startswith("{")) for m, a in mmas}, mmas
  assert (f"m64n{head_dim}k32", True) in {(m, a.startswith("{")) for m, a in mmas}, mmas
  assert "cvt.rn.satfinite.e4m3x2.f32" in text


# The FP8 forward's features, named with implementation="mosaic": e4m3 wgmma as above; the
# soft cap as tanh.approx.f32 on the score tile; segment ids, sequence lengths and windows
# through the segment-id path, whose kernel takes the ids and the per-CTA key-block limits
# [B, q tiles, 4] after q, k, Vᵀ and the scales.
@pytest.mark.parametrize("head_dim,causal,features,t,s", [
    (128, True, ("softcap",), 1000, 1100), (64, False, ("window",), 1000, 1100),
    (128, True, ("segments",), 1000, 1100), (128, False, ("segments",), 1024, 1024),
    pytest.param(256, False, ("lengths", "softcap"), 1000, 1100, marks=pytest.mark.slow)],
    ids=["hd128-causal-softcap", "hd64-window", "hd128-causal-segments", "hd128-segments",
         "hd256-lengths-softcap"])
def test_fp8_forward_features_lower(head_dim, causal, features, t, s):
  from pallas_flash import fp8
  b = 2
  q = jax.ShapeDtypeStruct((b, t, 4, head_dim), jnp.float8_e4m3fn)
  kv = jax.ShapeDtypeStruct((b, s, 2, head_dim), jnp.float8_e4m3fn)
  scale = jax.ShapeDtypeStruct((), jnp.float32)
  index = {"segments": [jax.ShapeDtypeStruct((b, t), jnp.int32),
                        jax.ShapeDtypeStruct((b, s), jnp.int32)],
           "lengths": [jax.ShapeDtypeStruct((b,), jnp.int32)] * 2}
  names = {"segments": ("query_segment_ids", "key_value_segment_ids"),
           "lengths": ("query_seq_lengths", "key_value_seq_lengths")}
  kind = next((f for f in features if f in index), None)
  static = dict(logits_soft_cap=30.0 if "softcap" in features else None,
                local_window_size=(300, 0) if "window" in features else None)

  def fn(q, k, v, sq, sk, sv, *ids):
    return pallas_flash.flash_attention(
        q, k, v, descale=fp8.Fp8Scales(sq, sk, sv), is_causal=causal, implementation="mosaic",
        **static, **(dict(zip(names[kind], ids)) if kind else {}))

  text = export_for_h200(fn, q, kv, kv, scale, scale, scale,
                         *(index[kind] if kind else ())).mlir_module()
  assert text.count("custom_call @mosaic_gpu_v2") == 1
  assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", text)
  assert ("tanh.approx.f32" in text) == ("softcap" in features)
  call = re.search(r"custom_call @mosaic_gpu_v2\([^\n]*", text).group(0)
  tiles = -(-t // 128)
  assert (f"tensor<{b}x{tiles}x4xi32>" in call) == (kind is not None or "window" in features)


def test_fp8_register_relabelling_matches_the_key_permutation():
  """P's e4m3 registers (the WGMMA accumulator layout, 2 elements each) regrouped into
  WGMMA_8BIT registers (4 each) by p_operand: the key each element is read as must be the
  key permute_keys puts at that position of Vᵀ, for every thread and register."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from pallas_flash.mosaic_gpu.sm90 import fp8_forward

  def elements(layout, shape):
    """{(warp, lane, register index, vector element): (row, column)} of a TiledLayout."""
    tiled = layout.tiling.tile_shape(shape)
    strides = layout.tiling.tile_strides((shape[1], 1))
    n = len(tiled)
    out = {}
    for warp in range(4):
      for lane in range(32):
        fixed = [0] * n
        for dims, idx in ((layout.warp_dims, warp), (layout.lane_dims, lane)):
          sizes = [tiled[d] for d in dims]
          for d, size in zip(dims, sizes):
            rest = int(np.prod(sizes[dims.index(d) + 1:]))
            fixed[n + d] = (idx // rest) % size
        for reg in np.ndindex(layout.registers_shape(shape)):
          for e in range(layout.vector_length):
            full = [fixed[i] + (reg[i] if tiled[i] > 1 else 0) for i in range(n)]
            full[n + layout.vector_dim] = e
            offset = sum(i * s for i, s in zip(full, strides))
            out[(warp, lane, reg, e)] = divmod(offset, shape[1])
    return out

  shape = (64, 128)
  acc = elements(fa.WGMMA_LAYOUT, shape)
  a8 = elements(fa.WGMMA_LAYOUT_8BIT, shape)
  position = np.asarray(fp8_forward.permute_keys(jnp.arange(shape[1])))  # key at each position
  for (warp, lane, reg, e), (row, col) in a8.items():
    # p_operand's register reg = concat(acc register (.., 2·reg[1], ..), (.., 2·reg[1] + 1, ..))
    src = (reg[0], 2 * reg[1] + e // 2, *reg[2:])
    src_row, src_key = acc[(warp, lane, src, e % 2)]
    assert src_row == row and position[col] == src_key, (warp, lane, reg, e)


@pytest.mark.parametrize("causal,seq_len,kernels", [
    (True, 2048, 3), pytest.param(False, 4096, 2, marks=pytest.mark.slow)],
    ids=["causal-split", "fused"])
def test_fp8_training_lowers_to_the_fp8_forward_and_the_bf16_backward(causal, seq_len, kernels):
  """quantized_attention's gradient on an H200: the FP8 forward (e4m3 wgmma) and the bf16
  backward's kernels (bf16 wgmma): the split dQ and dK/dV kernels, or the fused one where
  the default config takes it (non-causal 4K keys at head dim 128)."""
  q = jax.ShapeDtypeStruct((1, seq_len, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, seq_len, 2, 128), jnp.bfloat16)

  def grads(q, k, v):
    return jax.grad(lambda *a: pallas_flash.quantized_attention(
        *a, is_causal=causal, implementation="mosaic").astype(jnp.float32).sum(),
        argnums=(0, 1, 2))(q, k, v)

  text = export_for_h200(grads, q, kv, kv).mlir_module()
  assert text.count("custom_call @mosaic_gpu_v2") == kernels
  assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", text)
  assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16", text)


@pytest.mark.parametrize("d", [64, 128])
def test_block_mask_lowers_with_the_default_configs(d):
  """A block mask's forward, dQ and dK/dV kernels (the causal configs' tiles, the dK/dV
  kernel's overlapped full steps at head dim 128) lower for the H200 and fit."""
  case = Case(batch=2, q_len=1000, kv_len=1000, num_heads=8, num_kv_heads=2, head_dim=d,
              dtype=jnp.bfloat16)
  q, kv = specs(case)
  seg = jax.ShapeDtypeStruct((2, 1000), jnp.int32)

  def grads(q, k, v, seg):
    fn = (pallas_flash.CausalMask() & pallas_flash.SegmentMask(seg, seg)) | (
        pallas_flash.PrefixLMMask(jnp.array([9, 300])) & pallas_flash.LocalMask(0, 64))
    bm = pallas_flash.BlockMask.build(fn, q_len=1000, kv_len=1000, block_q=64, block_kv=64)

    def loss(*a):
      return pallas_flash.flash_attention(*a, block_mask=bm, implementation="mosaic").astype(
          jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  module = export_for_h200(grads, q, kv, kv, seg).mlir_module()
  assert module.count("custom_call @mosaic_gpu_v2") == 3


@pytest.mark.parametrize("bias_dtype, d, block_kv_dq", [
    (jnp.bfloat16, 128, 128),  # dbias through the O tile: its width
    (jnp.float32, 128, 64),  # no staging (dS in float32): dense_config's steps
    (jnp.bfloat16, 64, 64),  # head dim 64: its O tile's width too
    (jnp.float32, 64, 128),  # no staging: TUNED's steps
])
@pytest.mark.parametrize("block_masked", [False, True], ids=["causal", "block_mask"])
def test_a_causal_bias_in_the_inputs_dtype_takes_dq_steps_of_the_o_tile(bias_dtype, d,
                                                                         block_kv_dq,
                                                                         block_masked):
  """The config of a causal call (or a block mask's) with a dense bias: dQ steps of O's
  width (the head dim) where the bias is in the inputs' 16-bit dtype (dS to dbias through
  O's tile, which needs its width), the tuned or dense_config's steps otherwise."""
  from pallas_flash import validation
  q = jax.ShapeDtypeStruct((2, 1024, 4, d), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 4, 1024, 1024), bias_dtype)
  mask = dict(is_causal=True)
  if block_masked:
    mask = dict(block_mask=pallas_flash.BlockMask.build(pallas_flash.CausalMask(), q_len=1024,
                                                        kv_len=1024, block_q=128,
                                                        block_kv=128))
  with use_abstract_mesh(H200):
    info = validation.abstract_call_info(q, q, q, validation.with_defaults(
        dict(bias=bias, **mask)))
  assert mosaic_gpu.default_config(info).block_kv_dq == block_kv_dq


@pytest.mark.parametrize("bias", [False, True], ids=["window", "window_bias"])
def test_a_causal_window_takes_the_persistent_forward_unless_dense_tiles(bias):
  """config.window_form: a causal window alone at head dim 128 runs the persistent forward;
  with a dense bias the features' tiles turn it off again (that kernel loads no dense
  tiles), so the config `explain` reports is the one that runs."""
  q = jax.ShapeDtypeStruct((1, 4096, 4, 128), jnp.bfloat16)
  extra = {"bias": jax.ShapeDtypeStruct((1, 4, 4096, 4096), jnp.bfloat16)} if bias else {}
  with use_abstract_mesh(H200):
    got = pallas_flash.explain(q, q, q, is_causal=True, local_window_size=(1023, 0), **extra)
  assert got.chosen == "mosaic"
  assert got.config.fwd_persistent == (not bias)
