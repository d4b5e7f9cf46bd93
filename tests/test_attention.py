"""Forward, lse and gradients of every CPU-runnable implementation against the reference.

Each implementation runs the cases marked for it, which together cover every code path: a
single key, key tails on both sides, T > S and T < S, causal, GQA/MQA, every head-dim padding,
segment ids and lengths alone and together, float32, bfloat16 and float16. The blockwise `xla`
path runs most of the matrix; the Triton kernels in the Pallas interpreter (slow) fewer.
"""

import jax.numpy as jnp
import pytest

from pallas_flash.triton import TritonConfig
from pallas_flash.xla import XlaConfig
from testing import Case, check_against_reference

# Small blocks so that short test sequences still span several blocks, tails and diagonals.
SMALL = {"interpret": TritonConfig(block_q=32, block_kv=16, block_q_dkv=16, block_kv_dkv=32,
                                   block_q_dq=32, block_kv_dq=16),
         "xla": XlaConfig(block_q=32, block_kv=48)}


def _matrix(cases, interpreted, xla=None, slow=frozenset(), slow_xla=frozenset()):
  """pytest params (implementation, case): xla for the cases in `xla` (all by default),
  interpret for those in `interpreted`; the interpreted ones in `slow` and the xla ones in
  `slow_xla` marked slow (the suite's time)."""
  return ([pytest.param("xla", c, id=f"xla-{c.id}",
                        marks=[pytest.mark.slow] if i in slow_xla else [])
           for i, c in enumerate(cases) if xla is None or i in xla]
          + [pytest.param("interpret", c, id=f"interpret-{c.id}",
                          marks=[pytest.mark.slow] if i in slow else [])
             for i, c in enumerate(cases) if i in interpreted])


LENGTHS = [(1, 1), (17, 17), (128, 128), (300, 300), (17, 300), (300, 17), (128, 1000)]
SHAPES = _matrix([Case(q_len=t, kv_len=s, is_causal=c, num_heads=2, num_kv_heads=1)
                  for t, s in LENGTHS for c in (False, True)], interpreted={0, 5, 8, 11},
                 xla={0, 1, 3, 4, 7, 8, 9, 11, 12}, slow_xla={1, 3, 4, 7})


@pytest.mark.parametrize("impl, case", SHAPES)
def test_sequence_lengths(impl, case):
  check_against_reference(impl, case, config=SMALL[impl])


HEADS = _matrix([Case(q_len=100, kv_len=100, num_heads=h, num_kv_heads=kh, head_dim=d,
                      dtype=jnp.bfloat16, is_causal=True, batch=1)
                 for d in (64, 96, 128, 256) for h, kh in ((8, 8), (8, 2), (8, 1))],
                interpreted={2, 4, 9}, xla={0, 4, 8, 11})


@pytest.mark.parametrize("impl, case", HEADS)
def test_head_dims_and_groups(impl, case):
  check_against_reference(impl, case)


SEGMENTS = _matrix([Case(q_len=t, kv_len=s, dtype=dt, is_causal=c, segments=seg, lengths=ln)
                    for t, s in ((300, 300), (200, 130))
                    for dt in (jnp.float32, jnp.bfloat16)
                    for c in (False, True)
                    for seg, ln in ((True, False), (False, True), (True, True))],
                   interpreted={5, 14, 22}, xla={0, 4, 7, 12, 16, 23}, slow={22},
                   slow_xla={0, 7, 16})


@pytest.mark.parametrize("impl, case", SEGMENTS)
def test_segments_and_lengths(impl, case):
  check_against_reference(impl, case, config=SMALL[impl])


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["interpret", "xla"])
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence(impl, causal):
  case = Case(batch=1, q_len=1000, kv_len=1000, num_heads=2, num_kv_heads=1, is_causal=causal,
              segments=True)
  check_against_reference(impl, case)


@pytest.mark.parametrize("impl", ["interpret", pytest.param("xla", marks=pytest.mark.slow)])
def test_float16(impl):
  check_against_reference(impl, Case(dtype=jnp.float16, is_causal=True, segments=True),
                          config=SMALL[impl])


def test_reference_float16_matches_float32_reference():
  check_against_reference("reference", Case(dtype=jnp.float16, q_len=64, kv_len=64))


def test_triton_masks_every_padded_key_block_of_the_dq_kernel():
  """dK/dV tiles of 128 keys pad S = 130 to 256, so the dQ kernel's 32-key blocks 4-7 hold
  padded keys; rows whose scores all lie far below 0 would take exp2(0 − lse2) > 2^16 there
  and overflow float16's dS (NaN dQ) unless all of them run masked (_tiling.block_runs'
  other_len)."""
  case = Case(batch=1, q_len=64, kv_len=130, num_heads=1, num_kv_heads=1, head_dim=64,
              dtype=jnp.float16)
  config = TritonConfig(block_q=32, block_kv=32, block_q_dkv=32, block_kv_dkv=128,
                        block_q_dq=32, block_kv_dq=32)
  result = check_against_reference("interpret", case, config=config, far_past=20.0)
  assert float(jnp.min(result[0][1])) < -11  # such rows exist
