"""The dense bias and mask in the Mosaic kernels (sm90/dense.py): the interpreter against the
reference (outputs, lse and dq, dk, dv, dbias), the kernels lowered for an abstract H200, and
the reasons `explain` gives for the forms that run elsewhere."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import use_abstract_mesh

import pallas_flash
from pallas_flash import mosaic_gpu
from pallas_flash.call import AttentionParams, CallInfo, FeatureArrays
from pallas_flash.mosaic_gpu import MosaicConfig
from pallas_flash.mosaic_gpu import config as mconfig
from pallas_flash.mosaic_gpu.sm90 import backward, common, dense
from testing import (H200, assert_close_to_ref, check_against_reference, export_for_h200,
                     interpret_config, small_case, tolerance)


_config, _case = interpret_config, functools.partial(small_case, b=2)


_slow = functools.partial(pytest.param, marks=pytest.mark.slow)
# (name, config, case). "bias" is [1, H, T, S] and "bias_bcast" [B, 1, T, S] (from [B, 1, 1,
# S]): dbias is summed over the other axis; "mask_empty_rows" hides every key from every 7th
# query (o = 0, zero gradients); "bias_full" is [B, H, T, S] in the inputs' dtype (dbias
# written in it, no sum). Ragged lengths (a padded key tile, padded query rows), causal
# GQA; the slow ones: the overlapped forward and head dim 128, a dQ tile with XLA's delta,
# segment ids, a soft cap with ALiBi (the bias after both); and with the bias inside the cap.
DENSE = [
    # bias_dropout below runs the same causal GQA shape with the bias (and a mask): slow.
    _slow("bias_causal_gqa", _config(), _case(140, 100, b=1, is_causal=True,
                                              features=("bias",))),
    ("mask_rows_bias_bcast", _config(), _case(100, 150, features=("bias_bcast",
                                                                  "mask_empty_rows"))),
    # Composed with dropout (its key tables are inputs before the dense tiles).
    ("bias_dropout", _config(), _case(140, 100, b=1, is_causal=True,
                                      features=("bias", "mask", "dropout"))),
    _slow("mask_causal", _config(), _case(200, 170, is_causal=True,
                                          features=("mask_empty_rows",))),
    # A config's key tiles of 192 (the mask's bits in 64-column chunks, [rows, cols] iotas).
    _slow("mask_192_keys", _config(block_kv=192), _case(200, 400, is_causal=True,
                                                        features=("mask_empty_rows",))),
    _slow("overlap_hd128", _config(fwd_intra_wg_overlap=True, block_kv=128),
          _case(333, 200, h=4, kh=1, d=128, dtype=jnp.float16, is_causal=True,
                features=("bias", "mask"))),
    _slow("xla_delta", _config(block_q_dq=128, block_kv_dq=64),
          _case(256, 128, d=128, features=("bias",))),
    _slow("bias_full", _config(), _case(200, 170, h=2, kh=2, features=("bias_full",))),
    # [1, H, T, S] in the inputs' dtype over a batch of 2: the batch's CTAs add dS into one
    # zeroed entry (dense.dbias_form), XLA only cuts it to [T, S].
    ("bias_shared_causal", _config(), _case(200, 170, b=2, h=2, kh=1, is_causal=True,
                                            features=("bias_shared",))),
    # Causal, with no XLA op after the dQ kernel (no broadcast axis, tiles filled): the kernel
    # writes dbias's zero tiles itself (dense.dbias_form).
    ("bias_full_causal", _config(), _case(128, 128, b=1, h=2, kh=1, is_causal=True,
                                          features=("bias_full",))),
    _slow("segments", _config(), _case(300, 300, h=4, kh=2, is_causal=True, segments=True,
                                       features=("bias", "mask"))),
    _slow("softcap_alibi", _config(), _case(190, 130, is_causal=True, lengths=True,
                                            features=("bias", "softcap", "alibi"))),
    # logits_soft_cap_order="bias_then_cap": ALiBi and the bias (std 5, so that the order
    # shows) inside the cap, the mask after it (rows that see no key too); dbias the raw dS.
    ("bias_then_cap", _config(), _case(190, 130, b=1, is_causal=True, lengths=True,
                                       features=("bias_std5", "mask_empty_rows", "softcap",
                                                 "alibi", "bias_then_cap"))),
    # Above head dim 128 (by name only): hd256.py's backward, its "P" role adding the
    # transposed tiles to Sᵀ; and MLA's 192 / 128 with V at its own width, inside a cap (the
    # default run has a bias at 256 with a block mask, test_interpret.py).
    _slow("hd256", _config(), _case(130, 100, b=1, d=256, is_causal=True,
                                    features=("bias", "mask_empty_rows"))),
    _slow("hd192v128_bias_then_cap", _config(native_value_head_dim=True),
          _case(130, 100, d=192, value_head_dim=128, lengths=True,
                features=("bias_bcast", "mask_empty_rows", "softcap", "bias_then_cap"))),
]


@pytest.mark.parametrize("name, config, case", DENSE, ids=[
    f"{f[0]}-{f[2].id}" for f in (getattr(f, "values", f) for f in DENSE)])
def test_dense_matches_reference(name, config, case):
  del name
  check_against_reference("mosaic", case, config=config)


def _grad_module(d, causal, s_len, bias_shape, mask: bool, config=None) -> str:
  """The forward and gradient (dq, dk, dv, dbias) module of a bf16 call with a bias of
  bias_shape (or none) and a [B, 1, T, S] mask, lowered for the H200."""
  b, h, kh = 2, 4, 2
  q = jax.ShapeDtypeStruct((b, s_len, h, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, s_len, kh, d), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct(bias_shape or (1,), jnp.bfloat16)
  mask_spec = jax.ShapeDtypeStruct((b, 1, s_len, s_len), jnp.bool_)

  def grads(q, k, v, bias, mask_arg):
    def loss(q, k, v, bias):
      return pallas_flash.flash_attention(
          q, k, v, bias=bias if bias_shape else None, mask=mask_arg if mask else None,
          is_causal=causal, implementation="mosaic", config=config).astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

  return export_for_h200(grads, q, kv, kv, bias, mask_spec).mlir_module()


# The default configs' forms (head dims 64 and 128, causal and not, 128-, 192- and 256-key
# forward tiles): forward, dQ with dbias, dK/dV; each fits the H200's shared memory.
LOWERED = [(64, False, 1024, (1, 4, 1024, 1024), False), (64, True, 2048, None, True),
           (128, False, 2048, (2, 1, 2048, 2048), True), (128, True, 2048, (1, 4, 2048, 2048),
                                                          False),
           (128, False, 8192, (1, 4, 8192, 8192), False), (64, False, 4096, None, True)]


@pytest.mark.parametrize("d,causal,s_len,bias_shape,mask", LOWERED, ids=[
    f"d{d}_{'causal' if c else 'full'}_{s}{'_bias' if b else ''}{'_mask' if m else ''}"
    for d, c, s, b, m in LOWERED])
def test_default_forms_lower_and_fit(d, causal, s_len, bias_shape, mask):
  text = _grad_module(d, causal, s_len, bias_shape, mask)
  assert text.count("custom_call @mosaic_gpu_v2") == 3  # forward, dQ, dK/dV
  # dS goes through O's tile (dQ steps of its width), and the batch's CTAs sum it
  # (dense.dbias_form).
  if bias_shape and bias_shape[0] == 1:
    assert f"tensor<1x4x{s_len}x{s_len}xbf16>" in text
    assert f"tensor<2x4x{s_len}x{s_len}x" not in text
  elif bias_shape:  # the dQ kernel's dS, summed over the bias's broadcast axis by XLA
    assert f"tensor<2x4x{s_len}x{s_len}xf32>" in text


# (bias shape, length, causal, segment ids, changes, form): "batch_sum" the batch's CTAs add
# dS into one zeroed entry; "kernel" the kernel writes every block (zero tiles too); "select"
# XLA, running an op on dbias anyway, selects the zeros of the blocks the kernel skips.
DBIAS_FORMS = [
    ((1, 4, 256, 256), 256, True, False, {}, "batch_sum"),
    ((1, 4, 256, 256), 256, True, False, dict(deterministic=True), "select"),
    ((1, 4, 256, 256), 256, True, False, dict(with_o=False), "select"),  # no staging tile
    ((1, 4, 256, 256), 256, True, False, dict(dtype=jnp.float32), "select"),  # float32 dS
    ((2, 4, 256, 256), 256, True, False, {}, "kernel"),  # no XLA op after the kernel
    ((2, 4, 200, 200), 200, True, False, {}, "select"),  # XLA cuts dbias to [T, S]
    ((2, 1, 256, 256), 256, False, False, {}, "kernel"),  # every key visible: nothing to zero
    ((2, 1, 256, 256), 256, False, True, {}, "select"),  # segment ids hide keys
]


@pytest.mark.parametrize("bias_shape,length,causal,segments,changes,form", DBIAS_FORMS, ids=[
    "batch_sum", "deterministic", "no_o_tile", "f32_bias", "no_op", "cut", "all_visible",
    "segments"])
def test_dbias_form(bias_shape, length, causal, segments, changes, form):
  """A bias shared by the batch, written through the staging tile, is summed by the batch's
  CTAs (not under `deterministic`); else, where XLA runs an op on dbias anyway, it selects
  the zeros of the key blocks the dQ kernel skips, and the kernel writes no zero tiles; else
  the kernel writes them."""
  q = jax.ShapeDtypeStruct((2, length, 4, 128), jnp.bfloat16)
  params = AttentionParams(scale=1.0, is_causal=causal, has_segments=segments, has_bias=True,
                           deterministic=changes.get("deterministic", False))
  config = MosaicConfig(**mconfig.WIDE_REGISTERS)
  t_pad, s_pad = backward.padded_lengths(length, length, config)
  kp_dq, _ = backward.split_kernel_params(q, q, params, config, t_pad=t_pad, s_pad=s_pad)
  seg = jnp.arange(2 * length).reshape(2, length) // 100 if segments else None
  arrays = FeatureArrays(bias=jax.ShapeDtypeStruct(bias_shape, changes.get("dtype",
                                                                           jnp.bfloat16)))
  kp_dq = dense.o_tile_stages(kp_dq, arrays, with_o=changes.get("with_o", True))
  kp_dq, visible = dense.dbias_form(kp_dq, params, arrays, seg, seg, batch=2, heads=4,
                                    t=length, s=length)
  assert kp_dq.dbias_batch_sum == (form == "batch_sum")
  assert kp_dq.dbias_zero_tiles == (form == "kernel")
  assert (visible is None) == (form != "select")
  if visible is not None:
    want = np.tril(np.ones((length, length), bool)) if causal else np.ones((length,) * 2, bool)
    if segments:
      want = want & np.asarray(seg[:, :, None] == seg[:, None, :])
    got = np.broadcast_to(np.asarray(visible), (2, 1, length, length))[:, 0]
    np.testing.assert_array_equal(got, np.broadcast_to(want, (2, length, length)))


def test_fused_config_falls_back_to_the_split_with_a_warning():
  config = MosaicConfig(fused_backward=True, **mconfig.WIDE_REGISTERS)
  with pytest.warns(UserWarning, match="dense bias or mask"):
    text = _grad_module(128, True, 2048, (1, 4, 2048, 2048), False, config)
  assert text.count("custom_call @mosaic_gpu_v2") == 3


def _info(**kw) -> CallInfo:
  params = AttentionParams(scale=1.0, is_causal=True, has_segments=False, has_bias=True)
  base = dict(batch=1, q_len=1024, kv_len=1024, num_heads=4, num_kv_heads=4, head_dim=128,
              value_head_dim=128, dtype=jnp.dtype(jnp.bfloat16), params=params,
              platform="gpu", compute_capability=(9, 0), device_kind="NVIDIA H200")
  return CallInfo(**{**base, **kw})


@pytest.mark.parametrize("kw,expected", [
    (dict(), None),
    (dict(head_dim=112, value_head_dim=112), None),  # zero-padded to 128
    (dict(head_dim=256, value_head_dim=256), None),
    (dict(params=AttentionParams(scale=1.0, is_causal=False, has_segments=False,
                                 has_mask=True, logits_soft_cap=30.0)), None),
    (dict(params=AttentionParams(scale=1.0, is_causal=False, has_segments=False,
                                 has_bias=True, logits_soft_cap=30.0, bias_in_cap=True)), None),
], ids=["hd128", "hd112", "hd256", "mask_softcap", "bias_then_cap"])
def test_unsupported_reason(kw, expected):
  reason = mosaic_gpu.unsupported_reason(_info(**kw))
  assert reason is None if expected is None else expected in reason


def test_explain_runs_bias_and_mask_on_mosaic():
  """On an H200 implementation=None runs a dense bias and mask on the Mosaic kernels, with the
  split backward (a long causal call that takes the fused one without them does not), and at
  head dim 256 (hd256.py's backward)."""
  q = jax.ShapeDtypeStruct((1, 16384, 4, 128), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 4, 16384, 16384), jnp.bfloat16)
  mask = jax.ShapeDtypeStruct((1, 1, 16384, 16384), jnp.bool_)
  q256 = jax.ShapeDtypeStruct((1, 1024, 4, 256), jnp.bfloat16)
  mask256 = jax.ShapeDtypeStruct((1, 1, 1024, 1024), jnp.bool_)
  with use_abstract_mesh(H200):
    auto = pallas_flash.explain(q, q, q, bias=bias, mask=mask, is_causal=True)
    plain = pallas_flash.explain(q, q, q, is_causal=True)
    wide = pallas_flash.explain(q256, q256, q256, mask=mask256)
  assert auto.chosen == "mosaic", auto
  assert plain.config.fused_backward and not auto.config.fused_backward
  assert wide.chosen == "mosaic", wide


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_packed_mask_bits(transposed):
  """dense.pack_mask: key c of a row is bit (c mod 128) // 8 of word 8·(c // 128) + c mod 8
  (the keys of the thread that holds column c mod 8 of each 8), keys past S hidden; with
  `transposed` the same of maskᵀ."""
  mask = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 1, 100, 200))
  words = np.asarray(dense.pack_mask(mask, transposed=transposed))
  want = np.asarray(mask).swapaxes(2, 3) if transposed else np.asarray(mask)
  n = want.shape[3]
  padded = -(-n // 128) * 128
  assert words.shape == (*want.shape[:3], padded // 16) and words.dtype == np.int32
  c = np.arange(padded)
  bits = (words[..., c // 128 * 8 + c % 8] >> (c % 128 // 8)) & 1
  np.testing.assert_array_equal(bits[..., :n], want)
  assert not bits[..., n:].any()


@pytest.mark.parametrize("shape,dtype", [((1, 2, 3, 8), jnp.bfloat16), ((3, 5), jnp.float16),
                                         ((2, 4), jnp.float32)], ids=["words", "odd", "f32"])
def test_zeroed_buffer(shape, dtype):
  """The batch sum's zeroed dbias buffer (16-bit as 32-bit words where the last axis is even)
  has the buffer's shape and dtype, every element +0.0."""
  x = jax.jit(common._zeros, static_argnums=(0, 1))(shape, dtype)
  assert x.shape == shape and x.dtype == dtype
  np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.zeros(shape))
  assert not np.signbit(np.asarray(x.astype(jnp.float32))).any()


# Interpreted with -m slow (suite time): the rule's launches are bias_shared_causal's kernel.
@pytest.mark.parametrize("mode", ["lowered", pytest.param("interpreted", marks=pytest.mark.slow)])
def test_batch_sum_under_vmap(mode):
  """jax.vmap over calls whose dbias the batch's CTAs sum (pl.run_state has no batching rule:
  one launch per mapped entry): lowered for the H200 at head dim 128, and interpreted against
  the reference's gradients at head dim 64."""
  def grads(q, k, v, bias, impl, config=None):
    def loss(q, k, v, bias):
      o = pallas_flash.flash_attention(q, k, v, bias=bias, is_causal=True, implementation=impl,
                                       config=config)
      return (o.astype(jnp.float32) * jnp.cos(o.astype(jnp.float32))).sum()
    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

  if mode == "lowered":
    q = jax.ShapeDtypeStruct((3, 2, 1024, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((3, 2, 1024, 2, 128), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((3, 1, 4, 1024, 1024), jnp.bfloat16)
    text = export_for_h200(jax.vmap(functools.partial(grads, impl="mosaic")), q, kv, kv,
                           bias).mlir_module()
    assert "tensor<1x4x1024x1024xbf16>" in text  # each launch's batch sum
    return
  ks = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(ks[0], (2, 2, 96, 2, 64), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (2, 2, 96, 1, 64), jnp.bfloat16) for kk in ks[1:3])
  bias = jax.random.normal(ks[3], (2, 1, 2, 96, 96), jnp.bfloat16)
  got = jax.jit(jax.vmap(functools.partial(grads, impl="mosaic", config=_config())))(
      q, k, v, bias)
  want = jax.vmap(functools.partial(grads, impl="reference"))(
      *(x.astype(jnp.float32) for x in (q, k, v, bias)))
  for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):  # gradients: twice the budget
    assert_close_to_ref(name, g.astype(jnp.float32), w, 2 * tolerance(jnp.bfloat16))
