"""The Triton and Mosaic decode kernels on a real GPU at serving sizes, against the float32
reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_testing import DecodeCase, case_seed, check_decode, fill_page_table, make_decode_inputs
from testing import assert_close_to_ref, tolerance

import pallas_flash

# Their caches take 3-8 GiB a case, and eight xdist workers each holding some ran the H200 out
# of memory: scripts/gpu_suite.sh runs them on two (decode-tests), apart from the other GPU
# tests; two workers ran the 47 in 289 s on one H100 (2026-12-05, commit b5b8756).
pytestmark = pytest.mark.gpu


def _ragged(batch: int, capacity: int, seed: int, q_len: int = 0) -> tuple[int, ...]:
  """Lengths in [0, capacity - q_len], the first 0 and the last full (after the append)."""
  rng = np.random.default_rng(seed)
  lens = rng.integers(0, capacity - q_len + 1, batch)
  lens[0], lens[-1] = 0, capacity - q_len
  return tuple(int(x) for x in lens)


_LLAMA = dict(num_heads=32, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
CASES = [
    DecodeCase(seqlens=_ragged(8, 8192, 0), capacity=8192, **_LLAMA),
    DecodeCase(seqlens=_ragged(8, 8192, 1), capacity=8192, page_size=64, **_LLAMA),
    DecodeCase(seqlens=(8192,) * 8, capacity=8192, page_size=64, **_LLAMA),
    DecodeCase(seqlens=(131072,), capacity=131072, **_LLAMA),
    DecodeCase(seqlens=(1024,), capacity=1024, **_LLAMA),
    # Speculative verification: 4 tokens appended and rotated, pages of 16.
    DecodeCase(seqlens=_ragged(4, 4096, 2, q_len=4), q_len=4, capacity=4096, page_size=16,
               append=True, rotary=500_000.0, **_LLAMA),
    # Window and soft cap (Gemma-like), page 256.
    DecodeCase(seqlens=_ragged(8, 8192, 3), capacity=8192, page_size=256, window=4096,
               softcap=50.0, **_LLAMA),
    # Other head dims, dtypes and group sizes.
    DecodeCase(seqlens=_ragged(4, 5000, 4), num_heads=16, num_kv_heads=2, head_dim=64,
               capacity=5000, dtype=jnp.float16),
    DecodeCase(seqlens=_ragged(2, 3000, 5, q_len=2), q_len=2, num_heads=8, num_kv_heads=1,
               head_dim=256, capacity=3008, page_size=32, append=True),
    DecodeCase(seqlens=_ragged(2, 2000, 6), num_heads=8, num_kv_heads=8, head_dim=96,
               capacity=2000, dtype=jnp.float32),
    # Chunked prefill: 1024 new tokens appended to a 31K cache (two 128-row tiles per token
    # block of the kernel at G = 4).
    DecodeCase(seqlens=(31744,), q_len=1024, capacity=32768, append=True, **_LLAMA),
    # FP8 (e4m3) caches: per kv head at 32K ragged, paged; per tensor, appended and rotated.
    DecodeCase(seqlens=_ragged(8, 32768, 8), capacity=32768, page_size=64, fp8="head",
               **_LLAMA),
    DecodeCase(seqlens=_ragged(4, 8192, 9, q_len=4), q_len=4, capacity=8192, append=True,
               rotary=10_000.0, fp8="tensor", **_LLAMA),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_triton_decode_against_reference(case):
  check_decode("triton", case, seed=case_seed(case))


def test_default_is_triton_and_splits_long_caches():
  q, kc, vc, lens, _ = make_decode_inputs(CASES[3])
  explanation = pallas_flash.decode_explain(q, kc, vc, lens)
  assert explanation.chosen == "triton" and explanation.runs is not None, str(explanation)


@pytest.mark.parametrize("implementation", [None, "mosaic"])
def test_generation_loop_on_gpu(implementation):
  """64 appended tokens in a jitted lax.scan with donated paged caches (the automatic choice,
  and the Mosaic kernel by name), equal to the reference; a second run gives the same result
  (no race between the ring's slots)."""
  case = DecodeCase(seqlens=_ragged(8, 1024 - 64, 7), capacity=1024, page_size=64,
                    append=True, **_LLAMA)
  q, kc, vc, lens, kw = make_decode_inputs(case)
  new = jax.random.normal(jax.random.key(0), (2, 64, 8, 1, 8, 128), jnp.bfloat16)
  table = fill_page_table(kw["page_table"], kc.shape[0])

  def generate(kc, vc, lens):
    def step(carry, kv):
      kc, vc, lens = carry
      out, kc, vc = pallas_flash.decode_attention(q, kc, vc, lens, page_table=table,
                                                  new_key=kv[0], new_value=kv[1],
                                                  implementation=implementation)
      return (kc, vc, lens + 1), out

    (kc, vc, _), outs = jax.lax.scan(step, (kc, vc, lens), (new[0], new[1]))
    return kc, vc, outs[-1]

  run = jax.jit(generate, donate_argnums=(0, 1))
  kc_n, vc_n, last = run(kc.copy(), vc.copy(), lens)
  ref = pallas_flash.decode_reference(q.astype(jnp.float32), kc_n.astype(jnp.float32),
                                      vc_n.astype(jnp.float32), lens + 64, page_table=table)
  assert_close_to_ref("out", last, ref[0], tolerance(jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(run(kc, vc, lens)[2]), np.asarray(last))


# The chunked-prefill route ("flash": the cached prefix and the chunk as two flash_attention
# calls on the Mosaic kernels, merged), chosen automatically for these on an H200. Ragged
# lengths: an empty cache, one shorter than the chunk (no append: its first queries see no
# key) and a full one; NaN in every slot past the lengths.
PREFILL_CASES = [
    DecodeCase(seqlens=_ragged(4, 8192, 10, q_len=512), q_len=512, capacity=8192, append=True,
               **_LLAMA),
    DecodeCase(seqlens=(0, 300, 20000, 32768), q_len=512, capacity=32768, **_LLAMA),
    DecodeCase(seqlens=_ragged(2, 32768, 11, q_len=512), q_len=512, capacity=32768,
               append=True, rotary=500_000.0, softcap=50.0, **_LLAMA),
    DecodeCase(seqlens=_ragged(3, 16384, 12, q_len=1024), q_len=1024, num_heads=16,
               num_kv_heads=2, head_dim=64, capacity=16384, append=True, dtype=jnp.float16),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: c.id)
def test_prefill_route_against_reference(case):
  q, kc, vc, lens, kw = make_decode_inputs(case)
  explanation = pallas_flash.decode_explain(q, kc, vc, lens, **kw)
  assert explanation.chosen == "flash", str(explanation)
  assert explanation.config.flash_implementation == "mosaic", str(explanation)
  check_decode(None, case, seed=case_seed(case))


def test_chunked_prefill_loop_on_the_route():
  """A 2048-token prompt appended in four 512-token chunks inside a jitted lax.scan with the
  caches donated: the last chunk's output equals the reference over the final caches."""
  case = DecodeCase(seqlens=(1000, 0, 6144), q_len=512, capacity=8192, append=True, **_LLAMA)
  _, kc, vc, lens, _ = make_decode_inputs(case)
  b, chunks, t = case.batch, 4, case.q_len
  keys = jax.random.split(jax.random.key(3), 3)
  qs = jax.random.normal(keys[0], (chunks, b, t, 32, 128), jnp.bfloat16)
  ks = jax.random.normal(keys[1], (chunks, b, t, 8, 128), jnp.bfloat16)
  vs = jax.random.normal(keys[2], (chunks, b, t, 8, 128), jnp.bfloat16)
  assert pallas_flash.decode_explain(qs[0], kc, vc, lens, new_key=ks[0],
                                     new_value=vs[0]).chosen == "flash"

  def prefill(kc, vc, lens):
    def step(carry, x):
      kc, vc, lens = carry
      out, kc, vc = pallas_flash.decode_attention(x[0], kc, vc, lens, new_key=x[1],
                                                  new_value=x[2], rotary=10_000.0)
      return (kc, vc, lens + t), out

    (kc, vc, _), outs = jax.lax.scan(step, (kc, vc, lens), (qs, ks, vs))
    return kc, vc, outs[-1]

  kc_n, vc_n, last = jax.jit(prefill, donate_argnums=(0, 1))(kc, vc, lens)
  ref = pallas_flash.decode_reference(qs[-1].astype(jnp.float32), kc_n.astype(jnp.float32),
                                      vc_n.astype(jnp.float32), lens + chunks * t,
                                      rotary=10_000.0)
  assert_close_to_ref("out", last, ref[0], tolerance(jnp.bfloat16))


# Ragged batches at 8K-128K under the balanced partition: one sequence at L_max beside short
# ones (runs that cross many sequences), random lengths, a length 0, paged and contiguous, at
# the automatic runs (fewer than the sequences at B = 32) and at forced split counts.
_SKEWED_8K = DecodeCase(seqlens=(8192, 12, 700, 0, 3000, 1, 64, 5), capacity=8192, **_LLAMA)
RAGGED = [
    (_SKEWED_8K, None),
    (_SKEWED_8K, 3),
    (dataclasses.replace(_SKEWED_8K, page_size=64), 7),
    (DecodeCase(seqlens=_ragged(8, 32768, 8), capacity=32768, page_size=64, **_LLAMA), None),
    (DecodeCase(seqlens=_ragged(16, 32768, 9), capacity=32768, **_LLAMA), None),
    # 32 sequences in the automatic 16 runs a kv head: every run spans several sequences.
    (DecodeCase(seqlens=_ragged(32, 8192, 11), capacity=8192, **_LLAMA), None),
    (DecodeCase(seqlens=(131072, 5, 40000, 0), capacity=131072, page_size=256, **_LLAMA), None),
    (DecodeCase(seqlens=(3, 131072 - 4, 17), q_len=4, capacity=131072, append=True,
                window=8192, softcap=50.0, **_LLAMA), None),
]


@pytest.mark.parametrize("case,num_splits", RAGGED,
                         ids=[f"{c.id}-splits{s}" for c, s in RAGGED])
def test_triton_ragged_batches_against_reference(case, num_splits):
  q, kc, vc, lens, kw = make_decode_inputs(case)
  explanation = pallas_flash.decode_explain(q, kc, vc, lens, num_splits=num_splits, **kw)
  assert explanation.runs is not None, str(explanation)
  check_decode("triton", case, seed=case_seed(case), num_splits=num_splits)


# The Mosaic (Hopper) kernel, by name: the serving cases it covers (Tq * G <= 64, head dim 64
# or 128, bf16/f16, capacity a multiple of 64, pages of 16-256), the ragged ones at their
# split counts, one split, and 64-key tiles with 4 stages.
MOSAIC_CASES = [
    *[(case, None) for case in CASES[:7]],
    (DecodeCase(seqlens=_ragged(4, 5056, 4), num_heads=16, num_kv_heads=2, head_dim=64,
                capacity=5056, dtype=jnp.float16), None),
    (DecodeCase(seqlens=_ragged(8, 8192, 0), capacity=8192, **_LLAMA), 1),
    *RAGGED,
]


def _mosaic_id(case, num_splits):
  return f"{case.id}-splits{num_splits}"


@pytest.mark.parametrize("case,num_splits", MOSAIC_CASES,
                         ids=[_mosaic_id(c, s) for c, s in MOSAIC_CASES])
def test_mosaic_decode_against_reference(case, num_splits):
  q, kc, vc, lens, kw = make_decode_inputs(case)
  explanation = pallas_flash.decode_explain(q, kc, vc, lens, implementation="mosaic",
                                            num_splits=num_splits, **kw)
  assert explanation.chosen == "mosaic", str(explanation)
  check_decode("mosaic", case, seed=case_seed(case), num_splits=num_splits)


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[5]], ids=lambda c: c.id)
def test_mosaic_decode_small_tiles_against_reference(case):
  """64-key tiles through a 4-stage ring (more tiles per run, the ring wrapping often)."""
  check_decode("mosaic", case, seed=case_seed(case),
               config=pallas_flash.MosaicDecodeConfig(block_kv=64, num_stages=4))


