"""Block-sparse masks: tables against brute force, kernels against the reference, the API."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash
from pallas_flash import BlockMask, CausalMask, LocalMask, PrefixLMMask, SegmentMask
from pallas_flash.triton import TritonConfig
from testing import (Case, assert_close_to_ref, assert_matches_reference, make_inputs,
                     random_segments, run, tolerance)

T, S = 70, 90
SEG_Q = random_segments(3, 2, T, num_docs=3)
SEG_KV = random_segments(4, 2, S, num_docs=3)
PREFIX = jnp.array([17, 40])


def _masks(t, s):
  seg_q, seg_kv = SEG_Q[:, :t], SEG_KV[:, :s]
  return {
      "causal": CausalMask(),
      "local": LocalMask(9, 3),
      "document": SegmentMask(seg_q, seg_kv),
      "prefix_lm": PrefixLMMask(PREFIX),
      "causal_and_document": CausalMask() & SegmentMask(seg_q, seg_kv),
      "document_and_prefix_or_local": SegmentMask(seg_q, seg_kv) & (PrefixLMMask(5)
                                                                   | LocalMask(20, 0)),
  }


MASKS = _masks(T, S)


def _brute_state(bm: BlockMask) -> np.ndarray:
  """Per block pair from the dense mask: 0 skipped, 1 partial, 2 full (key padding invisible)."""
  t, s, bq, bk = bm.q_len, bm.kv_len, bm.block_q, bm.block_kv
  nq, nk = -(-t // bq), -(-s // bk)
  dense = np.zeros((bm.batch, nq * bq, nk * bk), bool)
  dense[:, :t, :s] = np.asarray(bm.dense())
  real = np.zeros(nq * bq, bool)
  real[:t] = True
  blocks = dense.reshape(bm.batch, nq, bq, nk, bk)
  real = real.reshape(nq, bq)[None, :, :, None, None]
  any_ = (blocks & real).any((2, 4))
  all_ = (blocks | ~real).all((2, 4))
  return np.where(all_, 2, np.where(any_, 1, 0))


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("t, s, bq, bk", [(70, 90, 16, 32), (33, 17, 8, 4), (1, 5, 16, 16)])
def test_tables_match_brute_force(name, t, s, bq, bk):
  bm = BlockMask.build(_masks(t, s)[name], q_len=t, kv_len=s, block_q=bq, block_kv=bk)
  state = _brute_state(bm)
  np.testing.assert_array_equal(bm.block_state, state)
  # The tables on the host: each eager slice of a jax array would be a program to compile.
  kv_blocks, kv_count, kv_partial, q_blocks, q_count, q_partial = (np.asarray(x) for x in (
      bm.kv_blocks, bm.kv_count, bm.kv_partial, bm.q_blocks, bm.q_count, bm.q_partial))
  for b in range(bm.batch):
    for i in range(state.shape[1]):
      listed = kv_blocks[b, i, :kv_count[b, i]]
      assert sorted(listed) == list(np.flatnonzero(state[b, i])), (b, i)
      np.testing.assert_array_equal(kv_partial[b, i, :kv_count[b, i]], state[b, i, listed] == 1)
    for j in range(state.shape[2]):
      listed = q_blocks[b, j, :q_count[b, j]]
      assert sorted(listed) == list(np.flatnonzero(state[b, :, j])), (b, j)
      np.testing.assert_array_equal(q_partial[b, j, :q_count[b, j]], state[b, listed, j] == 1)


def test_dense_semantics():
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  np.testing.assert_array_equal(MASKS["causal"].dense(T, S)[0], j <= i)
  np.testing.assert_array_equal(MASKS["local"].dense(T, S)[0], (j >= i - 9) & (j <= i + 3))
  np.testing.assert_array_equal(MASKS["prefix_lm"].dense(T, S)[1], (j < 40) | (j <= i))
  seg = np.asarray(SEG_Q)[1][:, None] == np.asarray(SEG_KV)[1][None, :]
  np.testing.assert_array_equal(MASKS["document"].dense(T, S)[1], seg)
  combo = (CausalMask() | LocalMask(0, 2)).dense(T, S)[0]
  np.testing.assert_array_equal(combo, j <= i + 2)


def _check(impl, case: Case, mask_fn, *, bq=16, bk=32, seed=0, bias=False):
  (q, k, v, do), _ = make_inputs(case, seed)
  bm = BlockMask.build(mask_fn, q_len=case.q_len, kv_len=case.kv_len, block_q=bq, block_kv=bk)
  kwargs = {"block_mask": bm}
  if bias:
    kwargs["bias"] = jax.random.normal(jax.random.key(9), (1, case.num_heads, case.q_len,
                                                            case.kv_len))
  result = run(impl, q, k, v, do, **dict(kwargs))
  up = [x.astype(jnp.float32) for x in (q, k, v, do)]
  assert_matches_reference(result, run("reference", *up, **dict(kwargs)), tolerance(case.dtype),
                           names=("dq", "dk", "dv") + (("dbias",) if bias else ()))
  return result[0]


GQA = Case(batch=2, q_len=T, kv_len=S, num_heads=4, num_kv_heads=2, head_dim=32)


# The single masks that the combinations compose (local, document, prefix_lm) run with -m slow
# (suite time); causal alone, the common one, runs in every run.
@pytest.mark.parametrize("impl", ["interpret", "xla"])
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow if n in ("local", "document", "prefix_lm") else ())
    for n in MASKS])
def test_matches_reference(impl, name):
  _check(impl, GQA, MASKS[name])


@pytest.mark.parametrize("impl", ["interpret", pytest.param("xla", marks=pytest.mark.slow)])
def test_bf16_bias_and_shared_tables(impl):
  case = Case(batch=2, q_len=64, kv_len=64, num_heads=2, num_kv_heads=1, head_dim=16,
              dtype=jnp.bfloat16)
  _check(impl, case, CausalMask() & LocalMask(20, 0), bq=16, bk=16, bias=True)


@pytest.mark.parametrize("impl", ["interpret", "xla"])
def test_fully_masked_rows_are_zero(impl):
  # Queries 32.. see no key: a prefix of 0 and a window that ends before them.
  case = Case(batch=1, q_len=48, kv_len=16, num_heads=2, num_kv_heads=2, head_dim=16)
  o, lse = _check(impl, case, LocalMask(100, 0) & LocalMask(0, 100) | (PrefixLMMask(0)
                                                                      & LocalMask(0, 0)),
                  bq=16, bk=16)
  assert np.all(np.asarray(o[:, 16:]) == 0) and np.all(np.isneginf(lse[:, :, 16:]))


def test_jit_reuse_across_layers():
  (q, k, v, _), _ = make_inputs(GQA)

  @jax.jit
  def two_layers(q, k, v, seg):
    bm = BlockMask.build(CausalMask() & SegmentMask(seg, seg),
                         q_len=T, kv_len=T, block_q=16, block_kv=16)
    x = pallas_flash.flash_attention(q, k[:, :T], v[:, :T], block_mask=bm,
                                     implementation="xla")
    return pallas_flash.flash_attention(x, k[:, :T], v[:, :T], block_mask=bm,
                                        implementation="xla")

  seg = SEG_Q
  got = two_layers(q, k, v, seg)
  kw = {"is_causal": True, "query_segment_ids": seg, "implementation": "reference"}
  x = pallas_flash.flash_attention(q, k[:, :T], v[:, :T], **kw)
  want = pallas_flash.flash_attention(x, k[:, :T], v[:, :T], **kw)
  assert_close_to_ref("out", got, want, 1e-5)
  # A BlockMask built on the host is a jit argument like any pytree.
  bm = BlockMask.build(CausalMask(), q_len=T, kv_len=S, block_q=16, block_kv=16)
  f = jax.jit(lambda q, k, v, bm: pallas_flash.flash_attention(q, k, v, block_mask=bm,
                                                               implementation="xla"))
  assert_close_to_ref("out", f(q, k, v, bm), pallas_flash.flash_attention(
      q, k, v, is_causal=True, implementation="reference"), 1e-5)


def test_validation_errors():
  (q, k, v, _), _ = make_inputs(GQA)
  bm = BlockMask.build(CausalMask(), q_len=T, kv_len=S, block_q=16, block_kv=32)
  with pytest.raises(ValueError, match="cannot be combined with is_causal"):
    pallas_flash.flash_attention(q, k, v, block_mask=bm, is_causal=True)
  with pytest.raises(ValueError, match="segment ids"):
    pallas_flash.flash_attention(q, k, v, block_mask=bm, key_value_seq_lengths=jnp.array([3, 4]))
  with pytest.raises(ValueError, match="was built for"):
    pallas_flash.flash_attention(q[:, :10], k, v, block_mask=bm)
  with pytest.raises(TypeError, match="must be a pallas_flash.BlockMask"):
    pallas_flash.flash_attention(q, k, v, block_mask=CausalMask())
  with pytest.raises(NotImplementedError, match="differ from the block_mask"):
    pallas_flash.flash_attention(q, k, v, block_mask=bm, implementation="interpret",
                                 config=TritonConfig(block_q=32, block_kv=32))
  odd = BlockMask.build(CausalMask(), q_len=T, kv_len=S, block_q=24, block_kv=16)
  with pytest.raises(NotImplementedError, match="powers of two"):
    pallas_flash.flash_attention(q, k, v, block_mask=odd, implementation="interpret")
  with pytest.raises(ValueError, match=re.escape(f"A kv-indexed mask array must have shape "
                                                f"[batch, {S}], got (2, {T})")):
    BlockMask.build(SegmentMask(SEG_Q, SEG_Q), q_len=T, kv_len=S)
  with pytest.raises(TypeError, match="integers"):
    PrefixLMMask(jnp.array([1.5])).dense(4, 4)
  for bad in (dict(block_q=0), dict(kv_len=True), dict(q_len=8.0)):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"`{name}` must be a positive Python int"):
      BlockMask.build(CausalMask(), **{**dict(q_len=T, kv_len=S), **bad})


def test_explain_reports_fraction():
  (q, k, v, _), _ = make_inputs(GQA)
  bm = BlockMask.build(LocalMask(16, 0), q_len=T, kv_len=S, block_q=16, block_kv=16)
  ex = pallas_flash.explain(q, k, v, block_mask=bm)
  state = _brute_state(bm)
  assert ex.blocks_computed == pytest.approx((state > 0).mean())
  assert ex.blocks_computed < 0.5 and ex.block_shape == (16, 16)
  assert "16x16" in str(ex) and ex.reasons["mosaic"] is not None


def test_triton_lowers_for_h200():
  from testing import export_for_h200
  q = jax.ShapeDtypeStruct((2, 1000, 8, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, 64), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((2, 1000), jnp.int32)

  def f(q, k, v, seg):
    bm = BlockMask.build(SegmentMask(seg, seg) & (CausalMask() | PrefixLMMask(jnp.array([9, 3]))),
                         q_len=1000, kv_len=1000, block_q=64, block_kv=32)
    o = pallas_flash.flash_attention(q, k, v, block_mask=bm, implementation="triton")
    return o.astype(jnp.float32).sum()

  module = export_for_h200(jax.grad(f, argnums=(0, 1, 2)), q, kv, kv, seg).mlir_module()
  assert module.count("xla.gpu.triton") == 3
