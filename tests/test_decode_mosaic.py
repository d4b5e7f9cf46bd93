"""The Mosaic GPU (Hopper) decode kernel on CPU: in the Mosaic GPU interpreter against the
float32 reference on NaN-poisoned caches (Tq 1 and 4, GQA, ragged lengths including 0 and L,
one split and balanced runs crossing sequences with empty pieces between, paged layouts with
tiles spanning pages and pages spanning tiles, window, soft cap), its interpreter race detector
on the producer / consumer ring, lowered for an abstract H200, and what it refuses."""

import re

import jax
import jax.numpy as jnp
import pytest
from decode_testing import DecodeCase, case_seed, check_decode, lowered_for_h200
from jax.sharding import use_abstract_mesh
from testing import H200

import pallas_flash
from pallas_flash.decode import MosaicDecodeConfig, api

# 64-key tiles and 2 stages, so that a sequence spans several tiles and the ring wraps.
INTERPRET = MosaicDecodeConfig(block_kv=64, num_stages=2, interpret=True)

CASES = [
    # Tq = 1, GQA 4:1, lengths 0, mid-tile and L (the queries' own keys are the cache's last
    # entries); one split: 4 runs of 3 blocks over 10, crossing sequences.
    (DecodeCase(seqlens=(200, 70, 0, 256), num_heads=4, num_kv_heads=1, head_dim=64,
                capacity=256, dtype=jnp.bfloat16), 1),
    # Tq = 4 appended (16 rows of 64), page 16 (four TMA copies per tile), pages shuffled, an
    # empty cache before the append, the longest sequence split over two runs.
    (DecodeCase(seqlens=(30, 0, 120), q_len=4, num_heads=4, num_kv_heads=1, head_dim=64,
                capacity=128, page_size=16, append=True, dtype=jnp.bfloat16), 2),
    # One split, not aligned (6 runs of 3 blocks over 13): run 0 holds sequences 0-4 with two
    # empty pieces between its three tiles, so the producer's ring wraps across sequences;
    # runs 1-4 hold the last sequence, run 5 nothing.
    (DecodeCase(seqlens=(50, 0, 64, 0, 10, 640), num_heads=4, num_kv_heads=1, head_dim=64,
                capacity=640, dtype=jnp.bfloat16), 1),
]
SLOW_CASES = [
    # Page 128 (two tiles per page), MHA, window and soft cap with rotary, float16.
    (DecodeCase(seqlens=(120, 9), q_len=2, num_heads=4, num_kv_heads=4, head_dim=64,
                capacity=256, page_size=128, append=True, window=70, softcap=5.0,
                rotary=10_000.0, dtype=jnp.float16), 3),
    # Ragged batch of 8 at D = 128: one sequence full, several tiny, an empty one.
    (DecodeCase(seqlens=(256, 3, 0, 1, 17, 9, 40, 5), num_heads=4, num_kv_heads=2,
                head_dim=128, capacity=256, dtype=jnp.bfloat16), 2),
    (DecodeCase(seqlens=(256, 3, 0, 1, 17, 9, 40, 5), num_heads=4, num_kv_heads=2,
                head_dim=128, capacity=256, dtype=jnp.bfloat16), 7),
    # Tq = 4 without an append (the last 4 cache entries are the queries' own; a short
    # sequence's first queries see no key), MQA with G = 16: all 64 rows real.
    (DecodeCase(seqlens=(2, 200, 64), q_len=4, num_heads=16, num_kv_heads=1, head_dim=64,
                capacity=256, window=100, dtype=jnp.bfloat16), 1),
]


def _id(param):
  case, splits = param
  return f"{case.id}-splits{splits}"


@pytest.mark.parametrize("case,num_splits", CASES, ids=[_id(c) for c in CASES])
def test_mosaic_kernel_in_interpreter_matches_reference(case, num_splits):
  check_decode("mosaic", case, seed=case_seed(case), num_splits=num_splits, config=INTERPRET)


@pytest.mark.slow
@pytest.mark.parametrize("case,num_splits", SLOW_CASES, ids=[_id(c) for c in SLOW_CASES])
def test_mosaic_kernel_in_interpreter_sweep(case, num_splits):
  check_decode("mosaic", case, seed=case_seed(case), num_splits=num_splits, config=INTERPRET)


@pytest.mark.slow
def test_mosaic_kernel_ring_has_no_races_in_interpreter(race_detector):
  """The interpreter's race detector, with wgmma operand reads (tests/race_detection.py), on
  runs that cross sequences, paged (four TMA copies a tile): the producer's refills of a slot
  never overlap the consumer's zeroing of V rows in it nor its products reading the slot."""
  case = DecodeCase(seqlens=(50, 0, 64, 0, 10, 640), num_heads=4, num_kv_heads=1, head_dim=64,
                    capacity=640, page_size=16, dtype=jnp.float16)
  check_decode("mosaic", case, seed=case_seed(case), num_splits=1, config=INTERPRET)
  assert race_detector.states and race_detector.wgmma_reads
  assert not any(race_detector.races), "the race detector reported a race (printed above)"


@pytest.mark.parametrize("paged,num_splits", [(False, 1), (True, None)])
def test_mosaic_kernel_lowers_for_h200(paged, num_splits):
  """One Mosaic GPU kernel between the Triton prepare and merge kernels and nothing else but
  the append: Llama-like heads, Tq 4 appended and rotated, window and soft cap; pages of 16
  keys (eight TMA copies per 128-key tile)."""
  module = lowered_for_h200("mosaic", pool=(130, 16) if paged else None, max_pages=64,
                            num_splits=num_splits)
  assert len(re.findall(r"custom_call @mosaic_gpu", module)) == 1
  assert module.count("xla.gpu.triton") == 2  # the prepare and merge kernels


def _explain(q_shape, kv_shape, dtype=jnp.bfloat16, **kw):
  q = jax.ShapeDtypeStruct(q_shape, dtype)
  kv = jax.ShapeDtypeStruct(kv_shape, dtype)
  lens = jax.ShapeDtypeStruct((q_shape[0],), jnp.int32)
  return pallas_flash.decode_explain(q, kv, kv, lens, **kw)


def test_mosaic_runs_by_name_and_refuses_what_it_does_not_cover():
  llama_q, llama_kv = (1, 1, 32, 128), (1, 131072, 8, 128)
  cpu = _explain(llama_q, llama_kv)
  assert "needs an NVIDIA GPU" in cpu.reasons["mosaic"]
  with use_abstract_mesh(H200):
    auto = _explain(llama_q, llama_kv)
    assert auto.chosen == "triton" and auto.reasons["mosaic"] == api.BY_NAME_ONLY["mosaic"]
    named = _explain(llama_q, llama_kv, implementation="mosaic")
    # The Triton kernel's 128-key tiles: the same 16 runs for B = 1 at 128K.
    assert (named.chosen, named.runs, named.block_kv) == ("mosaic", 16, 128)
    assert named.config == MosaicDecodeConfig(block_kv=128, num_stages=3)
    assert _explain((1, 1, 16, 64), (1, 4096, 2, 64), implementation="mosaic"
                    ).config.num_stages == 4
    assert _explain(llama_q, (1, 64 * 1001, 8, 128), implementation="mosaic"
                    ).config.block_kv == 64
    refusals = {
        "query rows per kv head > 64": _explain((1, 17, 32, 128), llama_kv),
        "head_dim 96": _explain((1, 1, 32, 96), (1, 4096, 8, 96)),
        "bf16 or f16": _explain((1, 1, 32, 128), (1, 4096, 8, 128), jnp.float32),
        "not a multiple of block_kv": _explain((1, 1, 32, 128), (1, 1000, 8, 128)),
        "page_size 24": _explain((1, 1, 32, 128), (8, 24, 8, 128),
                                 page_table=jax.ShapeDtypeStruct((1, 8), jnp.int32)),
    }
    for words, explanation in refusals.items():
      assert words in explanation.reasons["mosaic"], (words, str(explanation))
    with pytest.raises(NotImplementedError, match="head_dim 96"):
      _explain((1, 1, 32, 96), (1, 4096, 8, 96), implementation="mosaic")
    with pytest.raises(NotImplementedError, match="B of shared memory > 231424"):
      _explain(llama_q, llama_kv, config=MosaicDecodeConfig(block_kv=256, num_stages=4))
    # A MosaicDecodeConfig names the implementation as implementation="mosaic" does.
    assert _explain(llama_q, llama_kv, config=MosaicDecodeConfig(num_stages=1)).chosen == "mosaic"


def test_mosaic_config_rejects_bad_fields():
  with pytest.raises(ValueError, match="block_kv must be a power of two >= 64"):
    MosaicDecodeConfig(block_kv=32)
  with pytest.raises(ValueError, match="num_stages must be >= 1"):
    MosaicDecodeConfig(num_stages=0)
  with pytest.raises(TypeError, match="interpret must be a bool"):
    MosaicDecodeConfig(interpret=1)
