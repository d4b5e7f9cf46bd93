"""The Mosaic GPU kernels on a Hopper GPU: every form and feature against the reference.

  python -m pytest -q -m gpu tests/mosaic/test_gpu.py
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import pallas_flash
from pallas_flash.mosaic_gpu import TUNED
from pallas_flash.mosaic_gpu import config as mconfig
from testing import (FP8_TRAINING_TOLERANCE, Case, assert_close_to_ref, block_mask_fn,
                     check_against_reference, check_block_mask_against_reference,
                     check_fp8_against_reference, check_fp8_training, make_inputs, max_rel_err,
                     on_hopper, run, tolerance)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not on_hopper(), reason="needs a Hopper (sm_90) GPU")]


def _case(b, t, s, h, kh, d, causal, dtype=jnp.bfloat16, **kw) -> Case:
  return Case(batch=b, q_len=t, kv_len=s, num_heads=h, num_kv_heads=kh, head_dim=d,
              dtype=dtype, is_causal=causal, **kw)


# The default configs (implementation=None's) across head dims, GQA and odd lengths.
CASES = [
    _case(2, 1024, 1024, 4, 4, 128, False), _case(2, 1024, 1024, 4, 4, 128, True),
    _case(1, 1000, 1100, 8, 2, 64, True), _case(1, 1100, 1000, 4, 4, 128, True),
    _case(1, 777, 777, 4, 1, 128, True, jnp.float16), _case(1, 2048, 2048, 4, 2, 64, False,
                                                            jnp.float16),
    _case(1, 512, 512, 2, 2, 256, True), _case(1, 300, 700, 4, 2, 256, False),
    _case(1, 1, 1, 2, 1, 64, False), _case(1, 113, 203, 4, 2, 128, False),
    # Past MEDIUM_KV_LEN (192-key tiles) and the fused backward at 4K (non-causal, batch <= 16).
    _case(1, 300, 5000, 4, 2, 128, False), _case(2, 4096, 4096, 4, 2, 128, False),
]


def _assert_reproducible(case: Case, config=None, **extra):
  """A second run gives bitwise the same outputs and gradients."""
  (q, k, v, do), kw = make_inputs(case)
  first = jax.tree.leaves(run("mosaic", q, k, v, do, config=config, **dict(kw), **extra))
  again = jax.tree.leaves(run("mosaic", q, k, v, do, config=config, **dict(kw), **extra))
  assert all(bool(jnp.array_equal(a, b)) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_default_calls(case):
  check_against_reference("mosaic", case)


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 1, 2, 6)], ids=lambda c: c.id)
def test_split_backward_is_bitwise_reproducible(case):
  _assert_reproducible(case)


def _same(case: Case, changed: dict, baseline: dict):
  """Outputs and gradients with TUNED + changed are bitwise those with TUNED + baseline."""
  (q, k, v, do), kw = make_inputs(case)
  tuned = TUNED[(case.head_dim, case.is_causal)]
  got, want = (jax.tree.leaves(run("mosaic", q, k, v, do, **dict(kw),
                                   config=dataclasses.replace(tuned, **c)))
               for c in (changed, baseline))
  assert all(bool(jnp.array_equal(a, b)) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 1, 3, 4, 9)], ids=lambda c: c.id)
def test_forms_that_only_move_waits_give_the_same_bits(case):
  """dkdv_overlap (the dK/dV steps' issue order) and fwd_q_registers (Q as the register
  operand of the overlapped forward, 128-key tiles) sum the same products in the same order;
  the q_registers case also guards against the ptxas miscompile that keeps them out of the
  plain loop (tails, float16, GQA and T = 113 lay registers out differently)."""
  _same(case, dict(dkdv_overlap=False), dict(dkdv_overlap=True))
  _same(case, dict(fwd_q_registers=True, block_kv=128), dict(fwd_q_registers=False, block_kv=128))


FORMS = [  # (name, config changes on TUNED, case): the kept forms no default shape reaches here
    ("heads_fastest", dict(heads_fastest=True), CASES[1]),
    ("persistent_hd64", dict(fwd_persistent=True, heads_fastest=True), CASES[5]),
    ("persistent_hd128", dict(fwd_persistent=True, block_kv=128, fwd_q_registers=True),
     CASES[0]),
    ("split_tail", dict(fwd_split_tail=True), _case(1, 4096, 4096, 33, 33, 64, False)),
    ("kv192", dict(block_kv=192), _case(2, 1024, 1152, 4, 4, 128, False, jnp.float16)),
    ("fused_causal", dict(mconfig.FUSED), _case(1, 1100, 1000, 4, 2, 128, True)),
    ("fused_gqa", dict(mconfig.FUSED), _case(2, 2048, 2048, 8, 2, 128, False)),
    ("fused_tail", dict(mconfig.FUSED), _case(1, 113, 203, 4, 2, 128, False)),
]


@pytest.mark.parametrize("name, changes, case", FORMS, ids=[f[0] for f in FORMS])
def test_kept_forms_match_reference(name, changes, case):
  del name
  config = dataclasses.replace(TUNED[(case.head_dim, case.is_causal)], **changes)
  check_against_reference("mosaic", case, config=config)


def test_padded_key_blocks_are_masked_in_the_dq_kernel():
  """A causal call with a bias runs the dQ kernel in 64-key blocks and the dK/dV kernel in
  128-key tiles, so the split backward pads S = 1030 to 1152 and two dQ blocks hold padded
  keys (zero, with a zero bias); rows past S + 64 (T = 1200) reach both unmasked by the
  diagonal. Rows whose scores all lie far below 0 (lse < -11) must see neither, or float16's
  dS overflows and dQ is NaN (common.first_masked_block; the interpreter gives NaN at this
  config and shape without it)."""
  case = _case(1, 1200, 1030, 4, 2, 128, True, jnp.float16, features=("bias",))
  result = check_against_reference("mosaic", case, far_past=20.0)
  assert float(jnp.min(result[0][1])) < -11  # such rows exist


FEATURE_CASES = [
    _case(2, 4096, 4096, 8, 2, 128, True, segments=True),
    _case(1, 2048, 2048, 4, 4, 64, False, jnp.float16, segments=True),
    _case(1, 1000, 1100, 4, 2, 128, True, features=("unsorted_segments",)),
    _case(2, 777, 777, 4, 4, 128, False, lengths=True),
    _case(1, 512, 512, 2, 2, 256, True, segments=True),
    _case(2, 777, 777, 4, 4, 256, True, lengths=True),
    _case(1, 4096, 4096, 8, 2, 128, True, features=("window_512",)),
    # Windows alone at head dim 128 run the persistent forward (config.window_form, tuned):
    # causal over several CTA tiles per SM, and non-causal two-sided at an odd length.
    _case(4, 2048, 2048, 32, 8, 128, True, features=("window_512",)),
    _case(2, 3000, 3000, 8, 2, 128, False, features=("window",)),
    _case(1, 3000, 3000, 4, 4, 64, False, jnp.float16, features=("window",)),
    _case(1, 1024, 1024, 2, 2, 256, True, features=("window_512",)),
    _case(2, 4096, 4096, 8, 2, 128, True, segments=True, features=("window_512",)),
    _case(2, 1024, 1024, 4, 4, 128, False, features=("softcap",)),
    _case(1, 5000, 5000, 4, 4, 128, False, features=("softcap",)),
    _case(1, 2048, 2048, 4, 2, 64, False, jnp.float16, features=("softcap",)),
    _case(1, 1100, 1000, 4, 4, 128, True, features=("softcap",)),
    _case(1, 512, 512, 2, 2, 256, True, features=("softcap",)),
]


@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: c.id)
def test_features(case):
  check_against_reference("mosaic", case)
  _assert_reproducible(case)


# Block masks (issue 43): every mask function combination of testing.BLOCK_MASK_FNS at head
# dims 64 and 128 on the default configs' kernels, mask blocks equal to (128 x 128), dividing
# (64 x 64, 128 x 64) and straddling (32 x 96) the kernels' tiles, GQA and odd lengths; run on
# the Mosaic kernels by name (not yet the automatic choice), against the reference, twice for
# bitwise reproducibility.
BLOCK_MASK_CASES = [
    ("causal_local", _case(2, 4096, 4096, 8, 2, 128, False), (128, 128)),
    ("causal_segment", _case(2, 2048, 2048, 4, 4, 64, False), (64, 64)),
    ("prefix_lm", _case(2, 1000, 1100, 4, 2, 128, False), (64, 64)),
    ("local_or_prefix", _case(1, 777, 777, 4, 1, 64, False, jnp.float16), (32, 96)),
    ("segment_and_prefix_or_local", _case(2, 1024, 1024, 8, 2, 128, False), (128, 64)),
]


@pytest.mark.parametrize("name, case, blocks", BLOCK_MASK_CASES,
                         ids=[f"{n}-{b[0]}x{b[1]}-{c.id}" for n, c, b in BLOCK_MASK_CASES])
def test_block_mask(name, case, blocks):
  check_block_mask_against_reference("mosaic", case, name, blocks=blocks)
  bm = pallas_flash.BlockMask.build(block_mask_fn(name, case), q_len=case.q_len,
                                    kv_len=case.kv_len, block_q=blocks[0], block_kv=blocks[1])
  _assert_reproducible(case, block_mask=bm)


@pytest.mark.parametrize("feature", ["dropout", "bias"])
@pytest.mark.parametrize("name, case, blocks", [BLOCK_MASK_CASES[i] for i in (0, 1, 4)],
                         ids=["causal_local-128x128", "causal_segment-64x64-hd64",
                              "segment_and_prefix_or_local-128x64"])
def test_block_mask_with_features(name, case, blocks, feature):
  """Dropout's keys and the bias's tiles follow the tables' blocks, dbias is zero on the
  skipped ones (by name only until timed)."""
  if feature == "dropout":
    kw = dict(dropout_rate=0.1, dropout_rng=jax.random.key(6))
  else:
    kw = dict(bias=jax.random.normal(jax.random.key(6), (1, case.num_heads, case.q_len,
                                                          case.kv_len), jnp.bfloat16))
  check_block_mask_against_reference("mosaic", case, name, blocks=blocks, **kw)


@pytest.mark.parametrize("name, case, blocks", [
    ("causal_local", _case(2, 2048, 2048, 8, 2, 256, False), (128, 128)),
    ("segment_and_prefix_or_local", _case(2, 1024, 1024, 8, 2, 192, False, value_head_dim=128),
     (128, 64))], ids=["causal_local-hd256", "segment_and_prefix_or_local-hd192v128"])
def test_block_mask_above_head_dim_128(name, case, blocks):
  """hd256.py's backward over the tables (by name only until timed)."""
  check_block_mask_against_reference("mosaic", case, name, blocks=blocks)


# ALiBi (issue 43): the training shape causal and not (the overlapped forward, persistent
# non-causal), head dim 64 with segment ids, persistent and split-tail forwards, 192-key tiles
# with a key tail, a window with a soft cap, head dim 256, ALiBi inside the cap
# (logits_soft_cap_order="bias_then_cap") at 128 and 256; every one on the Mosaic kernels
# (by name: not yet the automatic choice), against the reference.
ALIBI_CASES = [
    _case(4, 2048, 2048, 8, 2, 128, True, features=("alibi",)),
    _case(4, 2048, 2048, 8, 2, 128, False, features=("alibi",)),
    _case(2, 1000, 1100, 8, 2, 64, True, segments=True, features=("alibi",)),
    _case(1, 2048, 2048, 4, 4, 64, False, jnp.float16, features=("alibi",)),
    _case(1, 4096, 4096, 33, 33, 64, False, features=("alibi",)),
    _case(1, 8000, 8000, 4, 2, 128, False, features=("alibi",)),
    _case(1, 3000, 3000, 4, 2, 128, True, lengths=True, features=("alibi", "window", "softcap")),
    _case(1, 1024, 1024, 4, 2, 256, True, features=("alibi",)),
    _case(1, 3000, 3000, 4, 2, 128, True, lengths=True,
          features=("alibi", "softcap", "bias_then_cap")),
    _case(1, 1024, 1024, 4, 2, 256, True, features=("alibi", "softcap", "bias_then_cap")),
]


@pytest.mark.parametrize("case", ALIBI_CASES, ids=lambda c: c.id)
def test_alibi(case):
  check_against_reference("mosaic", case)
  _assert_reproducible(case)


# A dense bias and mask (sm90/dense.py: tiles loaded by the forward grid kernel and the split
# backward; dbias from the dQ kernel): bias [1, H, T, S] (float32, and bf16: bias_shared) and
# [B, 1, T, S] (bias_bcast), masks with rows that see no key, causal and not, GQA, odd
# lengths, head dims 64, 96, 128, 256 and 192 / 128, with a soft cap and ALiBi (after them,
# and inside the cap: "bias_then_cap"), and the 192-key tiles past MEDIUM_KV_LEN.
BIAS_CASES = [
    _case(4, 2048, 2048, 8, 2, 128, True, features=("bias",)),
    _case(4, 2048, 2048, 8, 2, 128, False, features=("bias",)),
    _case(2, 1000, 1100, 8, 2, 64, True, features=("mask_empty_rows",)),
    _case(2, 1024, 1024, 4, 4, 64, False, features=("bias_bcast", "mask")),
    _case(1, 777, 777, 4, 1, 128, True, jnp.float16, features=("bias", "mask_empty_rows")),
    _case(1, 300, 5000, 4, 2, 128, False, features=("bias",)),
    # bf16 [1, H, T, S] over a batch: dbias summed by the batch's CTAs (dense.dbias_form).
    _case(4, 2048, 2048, 8, 2, 128, True, features=("bias_shared",)),
    _case(8, 1000, 1100, 4, 2, 128, False, features=("bias_shared", "mask_empty_rows")),
    _case(4, 2048, 2048, 8, 2, 64, True, features=("bias_shared",)),  # 64-key dQ steps
    _case(1, 1000, 1000, 4, 2, 96, True, features=("bias",)),
    _case(1, 1024, 1024, 4, 2, 128, True, features=("bias", "softcap", "alibi")),
    _case(1, 1000, 1100, 4, 2, 128, True, features=("bias", "dropout")),
    _case(1, 1000, 1000, 4, 2, 64, True, lengths=True,
          features=("bias_std5", "mask_empty_rows", "softcap", "alibi", "bias_then_cap")),
    # Above head dim 128 (hd256.py's backward).
    _case(1, 1000, 1100, 4, 2, 256, True, features=("bias", "mask_empty_rows")),
    _case(2, 1024, 1024, 4, 2, 192, False, value_head_dim=128, features=("bias_bcast", "mask")),
]


@pytest.mark.parametrize("case", BIAS_CASES, ids=lambda c: c.id)
def test_bias_and_mask(case):
  check_against_reference("mosaic", case)
  # A bias shared by the batch gets its gradient from reduce-adds in a varying order: bitwise
  # reproducible under deterministic=True (XLA's sum), which the check runs.
  shared = "bias_shared" in case.features
  _assert_reproducible(case, **({"deterministic": True} if shared else {}))


# Dropout (issue 43), its keep mask formed in the kernels from pallas_flash.dropout's keys:
# each default form (hd64 persistent at 1K, split tail at 4K, causal; hd128 persistent
# overlapped at 2K, 192-key tiles at 8K where a plain call takes the fused backward, causal),
# GQA, odd lengths, segment ids, a window with a soft cap, ALiBi, and head dim 256 (its
# role-split dK/dV kernel, with a soft cap too); against the reference with
# the same seed, and bitwise reproducible.
DROPOUT_CASES = [
    _case(4, 2048, 2048, 8, 2, 128, True, features=("dropout",)),
    _case(4, 2048, 2048, 8, 2, 128, False, features=("dropout",)),
    _case(1, 8000, 8000, 4, 2, 128, False, features=("dropout",)),
    _case(2, 1000, 1100, 8, 2, 64, True, segments=True, features=("dropout",)),
    _case(1, 1024, 1024, 4, 4, 64, False, jnp.float16, features=("dropout",)),
    _case(1, 4096, 4096, 33, 33, 64, False, features=("dropout",)),
    _case(1, 113, 203, 4, 2, 128, False, features=("dropout", "alibi")),
    _case(1, 3000, 3000, 4, 2, 128, True, lengths=True, features=("dropout", "window", "softcap")),
    _case(1, 1024, 1024, 4, 2, 256, True, features=("dropout",)),
    _case(1, 777, 777, 4, 4, 256, False, features=("dropout", "softcap")),
]


@pytest.mark.parametrize("case", DROPOUT_CASES, ids=lambda c: c.id)
def test_dropout(case):
  check_against_reference("mosaic", case)
  _assert_reproducible(case)


# Attention sinks, added in the forward kernels' epilogue (dsinks from the backward's delta):
# the training shape causal and not (the fused backward at 4K non-causal), head dim 64 and 256
# with GQA, lengths (rows that see no key: lse = the sink), segment ids with ALiBi, a window
# with a soft cap (at head dim 256 hd256.py's backward), and the persistent and
# split-tail forwards.
SINKS_CASES = [
    _case(4, 2048, 2048, 8, 2, 128, True, features=("sinks",)),
    _case(2, 4096, 4096, 4, 2, 128, False, features=("sinks",)),
    _case(1, 1000, 1100, 8, 2, 64, True, features=("sinks",)),
    _case(1, 777, 777, 4, 2, 256, True, features=("sinks",)),
    _case(2, 777, 777, 4, 4, 128, False, lengths=True, features=("sinks",)),
    _case(2, 1000, 1100, 8, 2, 64, True, segments=True, features=("sinks", "alibi")),
    _case(1, 1024, 1024, 2, 2, 256, True, features=("sinks", "window", "softcap")),
]


@pytest.mark.parametrize("case", SINKS_CASES, ids=lambda c: c.id)
def test_sinks(case):
  check_against_reference("mosaic", case)
  # The non-causal 4K case takes the fused backward (float32 atomics): the split one is bitwise.
  _assert_reproducible(case, deterministic=True)


@pytest.mark.parametrize("name, changes, case", [
    ("persistent", dict(fwd_persistent=True, block_kv=128), _case(2, 1024, 1024, 4, 4, 128, False,
                                                                  features=("sinks",))),
    ("split_tail", dict(fwd_split_tail=True), _case(1, 4096, 4096, 33, 33, 64, False,
                                                    features=("sinks",)))],
    ids=["persistent", "split_tail"])
def test_sinks_forms(name, changes, case):
  del name
  config = dataclasses.replace(TUNED[(case.head_dim, case.is_causal)], **changes)
  check_against_reference("mosaic", case, config=config)


# Head dims 80 and 96 (head dim 128's forward and split backward at their own width; the
# fused backward, which the non-causal training shape takes, zero-padded to 128), 192 (its own
# kernels: the forward at 64-key tiles, hd256.py's backward) and MLA's 192 / 128 (V padded to
# 192), by name (not yet the automatic choice): the training shape with GQA, causal and not,
# then segment ids and a soft cap (at 192 hd256.py's backward) on ragged lengths, and
# 96 past MEDIUM_KV_LEN keys (192-key forward tiles, a key tail, the split backward).
HEAD_DIM_CASES = [
    *(_case(2, 2048, 2048, 8, 2, d, causal, value_head_dim=dv)
      for d, dv in ((80, None), (96, None), (192, None), (192, 128)) for causal in (False, True)),
    _case(1, 1000, 1100, 4, 2, 96, True, segments=True),
    _case(1, 5000, 5000, 4, 2, 96, False),
    _case(1, 5000, 5000, 4, 2, 80, False),
    _case(1, 777, 777, 4, 4, 192, True, value_head_dim=128, features=("softcap",)),
]


@pytest.mark.parametrize("case", HEAD_DIM_CASES, ids=lambda c: c.id)
def test_head_dims(case):
  check_against_reference("mosaic", case)
  # The default backward may be the fused one (float32 atomics): only the split one is bitwise.
  _assert_reproducible(case, deterministic=True)


# MosaicConfig.native_value_head_dim (the default for these pairs) on MLA's 192 / 128 (V, O, dO
# and dV at 128 columns in the forward and hd256.py's backward): the training shape with GQA,
# causal and not; ragged causal with segment ids; a soft cap (hd256.py's backward, given V at
# 128); 256 / 128 and 192 / 64 (other pairs it takes); the tuned configs with the field set.
# Each also bitwise reproducible, and within the tolerance of the V-padded form's results.
NATIVE_VALUE_CASES = [
    *(_case(2, 2048, 2048, 8, 2, 192, causal, value_head_dim=128) for causal in (False, True)),
    _case(1, 1000, 1100, 4, 2, 192, True, value_head_dim=128, segments=True),
    _case(1, 777, 777, 4, 4, 192, True, value_head_dim=128, features=("softcap",)),
    _case(1, 1100, 1000, 4, 1, 256, True, value_head_dim=128),
    _case(1, 1024, 1024, 4, 2, 192, False, value_head_dim=64),
]


@pytest.mark.parametrize("case", NATIVE_VALUE_CASES, ids=lambda c: c.id)
def test_native_value_head_dim(case):
  config = dataclasses.replace(TUNED[(case.head_dim, case.is_causal)],
                               native_value_head_dim=True)
  check_against_reference("mosaic", case, config=config)
  _assert_reproducible(case, config=config)
  (q, k, v, do), kw = make_inputs(case)
  native = jax.tree.leaves(run("mosaic", q, k, v, do, config=config, **dict(kw)))
  padded = jax.tree.leaves(run("mosaic", q, k, v, do, **dict(kw), config=dataclasses.replace(
      config, native_value_head_dim=False)))
  # assert_close_to_ref: a row that sees no key (segments) has lse -inf in both.
  for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), native, padded, strict=True):
    assert_close_to_ref(f"native {name} vs padded", a, b, 2 * tolerance(case.dtype))


def test_deterministic_long_causal_gradients():
  """deterministic=True (the split backward) is bitwise equal run to run at 16K causal; the
  default there, the fused kernel (float32 atomics), agrees with it closely."""
  case = _case(1, 16384, 16384, 4, 2, 128, True)
  (q, k, v, do), _ = make_inputs(case)

  def fwd_bwd(**kw):
    return jax.tree.leaves(run("mosaic", q, k, v, do, is_causal=True, **kw))

  first, again, fused = fwd_bwd(deterministic=True), fwd_bwd(deterministic=True), fwd_bwd()
  assert all(bool(jnp.array_equal(a, b)) for a, b in zip(first, again, strict=True))
  for a, b in zip(fused, first, strict=True):
    assert max_rel_err(a, b) <= 1e-2


@pytest.mark.parametrize("t,causal", [(16384, True), (32768, False), (16500, True), (5000, False)],
                         ids=["16k_causal", "32k", "16500_causal", "5000"])
def test_large_shapes_agree_with_cudnn(t, causal):
  """Long sequences, where the materialising reference does not fit: compare with cuDNN (XLA
  for lengths cuDNN does not take)."""
  (q, k, v, do), _ = make_inputs(_case(1, t, t, 8, 8, 128, causal))
  impl = "cudnn" if t % 128 == 0 else "xla"

  def fwd_bwd(attn):
    o, vjp = jax.vjp(attn, q, k, v)
    return (o, *vjp(do))

  got = fwd_bwd(lambda *a: pallas_flash.flash_attention(*a, is_causal=causal,
                                                        implementation="mosaic"))
  want = fwd_bwd(lambda *a: jax.nn.dot_product_attention(*a, is_causal=causal,
                                                         implementation=impl))
  assert max_rel_err(got[0], want[0]) <= 1e-2
  for g, r in zip(got[1:], want[1:], strict=True):
    assert max_rel_err(g, r) <= 3e-2


# The FP8 forward (sm90/fp8_forward.py) against the reference semantics and the float32
# attention: 1x4096x16 at each head dim, causal and not; GQA; odd lengths; per-(batch, head)
# scales and float32 output.
FP8_CASES = [
    *(_case(1, 4096, 4096, 16, 16, d, causal) for d in (64, 128, 256) for causal in (False, True)),
    _case(2, 2048, 2048, 16, 4, 128, True), _case(2, 2048, 2048, 16, 2, 64, False),
    _case(1, 1000, 1100, 8, 2, 128, True), _case(1, 113, 203, 4, 2, 64, False),
]


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: c.id)
def test_fp8_forward(case):
  check_fp8_against_reference(case)


@pytest.mark.parametrize("case,block,out_dtype", [
    (FP8_CASES[2], "head", None), (FP8_CASES[3], None, jnp.float32),
    (FP8_CASES[6], "head", jnp.float16)], ids=["head", "f32_out", "gqa_head_f16"])
def test_fp8_forward_scales_and_outputs(case, block, out_dtype):
  check_fp8_against_reference(case, block=block, out_dtype=out_dtype)


@pytest.mark.parametrize("case", [FP8_CASES[3], FP8_CASES[6], FP8_CASES[9]],
                         ids=["hd128-causal", "gqa", "tail"])
def test_fp8_forward_128_key_tiles(case):
  """128-key tiles (MosaicConfig.fp8_block_kv) where the default takes 256 (head dims 64, 128)."""
  check_fp8_against_reference(case, config=pallas_flash.MosaicConfig(fp8_block_kv=128))


# The FP8 forward's soft cap (on the dequantized logits), local windows and segment ids /
# sequence lengths, named with implementation="mosaic" (implementation=None runs the reference
# semantics for them until these pass on the GPU): each head dim, causal and not, GQA, odd
# lengths; rows that see no key (past a query length) give zeros.
FP8_FEATURE_CASES = [
    _case(1, 4096, 4096, 16, 16, 128, False, features=("softcap",)),
    _case(1, 4096, 4096, 16, 16, 64, True, features=("window_512",)),
    _case(2, 2048, 2048, 16, 4, 128, True, segments=True),
    _case(2, 1000, 1100, 8, 2, 64, False, lengths=True),
    _case(1, 2048, 2048, 8, 8, 256, True, segments=True, features=("softcap", "window")),
    _case(1, 113, 203, 4, 2, 128, False, lengths=True, features=("window_left",)),
]


@pytest.mark.parametrize("case", FP8_FEATURE_CASES, ids=lambda c: c.id)
def test_fp8_forward_features(case):
  check_fp8_against_reference(case)


@pytest.mark.parametrize("case", [FP8_FEATURE_CASES[2], FP8_FEATURE_CASES[3]],
                         ids=["segments-gqa", "lengths"])
def test_fp8_forward_features_128_key_tiles(case):
  """128-key tiles (MosaicConfig.fp8_block_kv) where the default takes 256 (head dims 64, 128)."""
  check_fp8_against_reference(case, config=pallas_flash.MosaicConfig(fp8_block_kv=128))


def test_fp8_forward_is_chosen_and_bitwise_reproducible():
  from pallas_flash import fp8
  (q, k, v, _), _ = make_inputs(FP8_CASES[2])
  f8, scales = fp8.quantize(q, k, v)
  assert pallas_flash.explain(*f8, descale=scales).chosen == "mosaic"
  run_fp8 = jax.jit(lambda f8, s: pallas_flash.flash_attention(*f8, descale=s))
  assert bool(jnp.array_equal(run_fp8(f8, scales), run_fp8(f8, scales)))


# pallas_flash.quantized_attention's training path on the GPU: the FP8 forward, then the bf16 Mosaic
# backward (the split kernels, or the fused one where the default config takes it) on the
# dequantized values; gradients against the float32 gradient of the dequantized attention
# (FP8_TRAINING_TOLERANCE) and of the unquantised inputs (2 * FP8_TOLERANCE).
FP8_TRAINING_CASES = [
    (_case(2, 1024, 1024, 4, 2, 128, True), dict(rotate=True)),
    (_case(1, 4096, 4096, 16, 16, 128, False), {}),  # the fused backward
    (_case(1, 1000, 1100, 8, 2, 64, True), dict(block="head")),
    (_case(1, 512, 512, 2, 2, 256, True), dict(rotate=True)),
    (_case(1, 113, 203, 4, 2, 128, False), dict(deterministic=True)),
]


def _fp8_training_plan(case: Case, **kwargs):
  from pallas_flash import fp8
  (q, k, v, _), kw = make_inputs(case)
  _, scales = fp8.quantize(q, k, v, block=kwargs.pop("block", None))
  return fp8._training_plan([q, k, v], scales, jnp.dtype(jnp.bfloat16), {**kw, **kwargs})


@pytest.mark.parametrize("case,kwargs", FP8_TRAINING_CASES,
                         ids=[f"{c.id}-{'-'.join(kw) or 'tensor'}" for c, kw in FP8_TRAINING_CASES])
def test_fp8_training_gradients(case, kwargs):
  plan = _fp8_training_plan(case, **{n: x for n, x in kwargs.items() if n != "rotate"})
  assert (plan.name, plan.fp8_kernel) == ("mosaic", True)
  check_fp8_training(case, tol=FP8_TRAINING_TOLERANCE, **kwargs)


def test_fp8_training_deterministic_is_bitwise_reproducible():
  """deterministic=True reaches the bf16 backward: where the default takes the fused backward
  (dQ by float32 atomics) it runs the split kernels, and two runs agree bitwise."""
  case = _case(1, 8192, 8192, 4, 4, 128, True)
  assert _fp8_training_plan(case).config.fused_backward
  assert not _fp8_training_plan(case, deterministic=True).config.fused_backward
  (q, k, v, do), _ = make_inputs(case)
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(pallas_flash.quantized_attention(
      *a, is_causal=True, deterministic=True).astype(jnp.float32) * do), argnums=(0, 1, 2)))
  first, again = grads(q, k, v), grads(q, k, v)
  assert all(bool(jnp.array_equal(a, b)) for a, b in zip(first, again, strict=True))
