"""The split tail of the non-causal Mosaic forward and split backward (MosaicConfig.
fwd_split_tail, bwd_split_tail; split_tail.py).

On CPU: the cost model and where the split applies, the launch order it decodes, the merge of
partial results against the reference, the kernels' math in the Mosaic GPU interpreter (each
case in a subprocess with a time limit, see INTERPRET_CASES), and their lowering for an H200.
On a Hopper GPU (marker `gpu`): forced splits against the float32 reference.
"""

import dataclasses
import importlib
import itertools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash
from pallas_flash.mosaic_gpu import TUNED, MosaicConfig
from pallas_flash.mosaic_gpu import _common, split_tail
from pallas_flash.call import AttentionParams
from pallas_flash.reference import attention_reference
from testing import (export_for_h200, kernel_case_id, kernel_inputs, kernel_specs, max_abs,
                     on_hopper, rel_err)

forward_module = importlib.import_module("pallas_flash.mosaic_gpu.forward")
backward_module = importlib.import_module("pallas_flash.mosaic_gpu.backward")
NON_CAUSAL = AttentionParams(scale=0.125, is_causal=False, has_segments=False)
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def test_tail_parts_even_divides_the_steps():
  # (tiles, steps): the cost model's parts, and its cheapest divisor of the steps.
  for tiles, steps, free, even in ((2048, 256, 9, 16), (2048, 128, 7, 8), (2048, 96, 5, 3),
                                   (200, 7, 1, 1)):
    assert split_tail.tail_parts(tiles, steps, 132) == free
    assert split_tail.tail_parts(tiles, steps, 132, even=True) == even
    assert steps % even == 0


def test_tail_parts_cost_model():
  # 16 heads x 16K: 2048 tiles of 128 key blocks, 68 in the last wave of 132.
  assert split_tail.tail_parts(2048, 128, 132) == 7
  # 32K: 4 tiles in the 32nd wave; as many parts as fill the SMs once.
  assert split_tail.tail_parts(4096, 256, 132) == 33
  # 8K: 100 tiles of 64 blocks in the last wave; no split pays for its merge (s12 run2).
  assert split_tail.tail_parts(1024, 64, 132) == 1
  assert split_tail.tail_parts(132 * 5, 128, 132) == 1  # whole waves
  for tiles, blocks in itertools.product((3, 100, 133, 1000), (1, 2, 7, 500)):
    parts = split_tail.tail_parts(tiles, blocks, 132)
    assert 1 <= parts <= min(max(blocks, 1), split_tail.MAX_TAIL_PARTS)


def test_tail_split_applies_only_where_it_can():
  cfg = dataclasses.replace(TUNED[(128, False)], fwd_split_tail=True, block_kv=128)
  q = jax.ShapeDtypeStruct((1, 16384, 16, 128), jnp.bfloat16)
  split = forward_module.tail_split(q, cfg, NON_CAUSAL, 128, False)
  assert (split.tiles, split.main, split.parts, split.ctas) == (2048, 1980, 7, 1980 + 68 * 7)
  off = dataclasses.replace(cfg, fwd_split_tail=False)
  assert forward_module.tail_split(q, off, NON_CAUSAL, 128, False) is None
  assert TUNED[(64, False)].fwd_split_tail and not TUNED[(128, False)].fwd_split_tail
  # hd128's 192-key tiles leave no room for the staging tile
  tuned_192 = dataclasses.replace(TUNED[(128, False)], fwd_split_tail=True)
  assert tuned_192.block_kv == 192
  assert forward_module.tail_split(q, tuned_192, NON_CAUSAL, 86, False) is None
  assert not (TUNED[(128, True)].fwd_split_tail or TUNED[(64, True)].fwd_split_tail)
  causal = dataclasses.replace(NON_CAUSAL, is_causal=True)
  segments = dataclasses.replace(NON_CAUSAL, has_segments=True)
  assert forward_module.tail_split(q, cfg, causal, 128, False) is None
  assert forward_module.tail_split(q, cfg, segments, 128, False) is None
  assert forward_module.tail_split(q, cfg, NON_CAUSAL, 128, True) is None  # persistent
  hd256 = jax.ShapeDtypeStruct((1, 16384, 16, 256), jnp.bfloat16)  # no room for the staging
  cfg256 = dataclasses.replace(TUNED[(256, False)], fwd_split_tail=True)
  assert forward_module.tail_split(hd256, cfg256, NON_CAUSAL, 256, False) is None
  whole = jax.ShapeDtypeStruct((1, 16384, 33, 128), jnp.bfloat16)  # exactly 32 waves
  assert forward_module.tail_split(whole, cfg, NON_CAUSAL, 128, False) is None
  forced = dataclasses.replace(cfg, tail_parts=500)  # capped at the key blocks
  assert forward_module.tail_split(q, forced, NON_CAUSAL, 128, False).parts == 128


@pytest.mark.parametrize("heads_fastest", [False, True], ids=["tiles", "heads"])
def test_tail_split_coords_follow_the_launch_order(heads_fastest):
  """TailSplit numbers tiles as the grid kernel's launch dispatches them (its grid's last axis
  fastest), so the split CTAs are the last ones the grid would have launched."""
  b, h, nqt = 3, 4, 5
  launch = _common.launch_grid(nqt, h, b, ("qt", "h", "b"), heads_fastest=heads_fastest)
  order = [dict(zip(launch["grid_names"], idx))
           for idx in itertools.product(*(range(n) for n in launch["grid"]))]
  split = split_tail.TailSplit(tiles=b * h * nqt, main=0, parts=2, batch=b, heads=h,
                                   num_tiles=nqt, heads_fastest=heads_fastest)
  got = split.coords(np.arange(b * h * nqt), div=np.floor_divide, rem=np.remainder)
  assert [tuple(map(int, x)) for x in zip(*got)] == [(o["b"], o["h"], o["qt"]) for o in order]


def _partials(q, k, v, split, block_q, bounds, params):
  """What the kernel's split CTAs write: per tail tile and part, o and lse of the tile's rows
  over the part's keys alone ([tail tiles · parts, 2, block_q, D], [.., 2, block_q])."""
  b_idx, h_idx, qt = split.coords(np.arange(split.main, split.tiles), div=np.floor_divide,
                                  rem=np.remainder)
  o_parts, lse_parts = [], []
  for b, h, t in zip(b_idx, h_idx, qt):
    rows = slice(t * 2 * block_q, (t + 1) * 2 * block_q)
    for lo, hi in bounds:
      o, lse = attention_reference(q[b:b + 1, rows, h:h + 1], k[b:b + 1, lo:hi, h:h + 1],
                                   v[b:b + 1, lo:hi, h:h + 1], None, None, params=params)
      o_parts.append(o[0, :, 0].reshape(2, block_q, -1))
      lse_parts.append(lse[0, 0].reshape(2, block_q))
  return jnp.stack(o_parts), jnp.stack(lse_parts)


def test_combine_tail_merges_parts_into_the_unsplit_result():
  """combine_tail on reference partials over uneven key ranges: the tail tiles (poisoned
  before the merge) equal the reference over all keys; the other rows are left alone."""
  b, t, s, h, d, block_q = 2, 256, 300, 3, 32, 64
  q, k, v, _ = kernel_inputs(b, t, s, h, h, d, jnp.float32, seed=3)
  params = AttentionParams(scale=d ** -0.5, is_causal=False, has_segments=False)
  split = split_tail.TailSplit(tiles=b * h * 2, main=7, parts=3, batch=b, heads=h,
                                   num_tiles=2, heads_fastest=False)
  ro, rlse = attention_reference(q, k, v, None, None, params=params)
  o_part, lse_part = _partials(q, k, v, split, block_q, [(0, 17), (17, 200), (200, s)], params)
  tail = np.zeros((b, t, h), bool)
  for bi, hi, qi in zip(*split.coords(np.arange(split.main, split.tiles),
                                       div=np.floor_divide, rem=np.remainder)):
    tail[bi, qi * 2 * block_q:(qi + 1) * 2 * block_q, hi] = True
  o0 = jnp.where(tail[..., None], jnp.nan, ro)
  lse0 = jnp.where(tail.transpose(0, 2, 1), jnp.nan, rlse)
  o, lse = forward_module.combine_tail(o0, lse0, o_part, lse_part, split)
  assert rel_err(o, ro) <= 1e-5
  assert max_abs(lse - rlse) <= 1e-5
  assert bool(jnp.array_equal(o[~tail], ro[~tail]))


# (B, T, S, H, K, D, dtype, config overrides): grids whose last wave the interpreter splits.
# Each runs in a subprocess with a time limit, so that a hang fails the case instead of
# stalling the suite. The last two deadlocked in the interpreter until conftest.py turned off
# XLA's concurrency-optimised CPU schedule (two q tiles per head, parts of one key block;
# _common.INTERPRET_XLA_FLAG says why); they ran on the H200 all along.
INTERPRET_CASES = [
    (1, 128, 200, 3, 1, 64, jnp.bfloat16,
     dict(wave_ctas=2, tail_parts=3, fwd_intra_wg_overlap=True)),  # padded keys, GQA
    (2, 128, 320, 2, 1, 64, jnp.float16, dict(wave_ctas=3, tail_parts=2)),  # uneven parts
    (1, 128, 128, 7, 7, 64, jnp.bfloat16, dict(wave_ctas=2, tail_parts=2)),
    (1, 256, 128, 2, 2, 64, jnp.bfloat16, dict(wave_ctas=3, tail_parts=2)),
    (2, 256, 128, 2, 2, 64, jnp.float16, dict(wave_ctas=3, tail_parts=2)),
]
_INTERPRET_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from pallas_flash.mosaic_gpu import MosaicConfig, forward
from pallas_flash.call import AttentionParams
from pallas_flash.reference import attention_reference
from testing import kernel_inputs, max_abs, rel_err
b, t, s, h, kh, d, dtype, kw = json.loads(sys.argv[1])
dtype = jnp.dtype(dtype)
q, k, v, _ = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s + h)
p = AttentionParams(scale=d ** -0.5, is_causal=False, has_segments=False)
cfg = MosaicConfig(block_q=64, block_kv=64, interpret=True, fwd_split_tail=True, **kw)
o, lse = forward(q, k, v, None, None, params=p, config=cfg)
ro, rlse = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), None, None, params=p)
print(json.dumps(dict(o_err=rel_err(o.astype(jnp.float32), ro),
                      lse_err=max_abs(lse - rlse))))
"""


def _interpret_in_subprocess(script, case):
  """The errors dict that `script` prints for (B, T, S, H, K, D, dtype, overrides) `case`,
  run in its own Python with a time limit (an interpreter hang fails the test)."""
  *shape, dtype, kw = case
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))
  arg = json.dumps([*shape, jnp.dtype(dtype).name, kw])
  done = subprocess.run([sys.executable, "-c", script, arg], env=env, cwd=root,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", INTERPRET_CASES,
                         ids=[f"{kernel_case_id((*c[:6], False, c[6]))}_{i}"
                              for i, c in enumerate(INTERPRET_CASES)])
def test_split_tail_forward_in_interpreter(case):
  *shape, dtype, kw = case
  q = jax.ShapeDtypeStruct(tuple(shape[i] for i in (0, 1, 3, 5)), dtype)
  cfg = MosaicConfig(block_q=64, block_kv=64, fwd_split_tail=True, **kw)
  split = forward_module.tail_split(q, cfg, NON_CAUSAL, -(-shape[2] // 64), False)
  assert split is not None and split.parts >= 2  # the case does split
  errs = _interpret_in_subprocess(_INTERPRET_SCRIPT, case)
  assert errs["o_err"] <= TOL[dtype], errs
  assert errs["lse_err"] <= 1e-3, errs


@pytest.mark.parametrize("case", [(1, 16384, 16384, 16, 16, 128, False),
                                  (2, 16384, 16384, 8, 4, 128, False),
                                  (4, 4096, 4096, 32, 32, 64, False)], ids=kernel_case_id)
def test_split_tail_forward_lowers(case):
  *shape, causal = case
  q, kv = kernel_specs(*shape)
  # hd128: the split tail with 128-key tiles (TUNED's 192 leave no room for it)
  config = dataclasses.replace(TUNED[(shape[-1], False)], fwd_split_tail=True,
                               **({"block_kv": 128} if shape[-1] == 128 else {}))
  assert forward_module.tail_split(q, config, NON_CAUSAL, shape[2] // config.block_kv,
                                   False) is not None
  fn = lambda q, k, v: pallas_flash.flash_attention(  # noqa: E731
      q, k, v, is_causal=causal, implementation="mosaic", config=config)
  assert export_for_h200(fn, q, kv, kv).mlir_module().count("mosaic_gpu") >= 1


# B, T, S, H, K, D, dtype, wave_ctas, heads_fastest, tail_parts (0: the cost model's).
GPU_CASES = [
    (3, 1000, 1100, 5, 1, 128, jnp.float16, 7, False, 0),
    (2, 777, 1025, 4, 4, 64, jnp.bfloat16, 5, False, 0),
    (1, 4096, 4096, 3, 3, 128, jnp.bfloat16, 20, True, 3),
    (2, 300, 5000, 8, 2, 128, jnp.bfloat16, 7, False, 11),
]


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("case", GPU_CASES,
                         ids=[f"{kernel_case_id((*c[:6], False, c[6]))}_w{c[7]}" for c in GPU_CASES])
def test_split_tail_forward_on_gpu(case):
  b, t, s, h, kh, d, dtype, wave, heads_fastest, parts = case
  q, k, v, _ = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s)
  # 128-key tiles: the head-dim-64 table's 256-key tiles leave the hd64 case 5 key blocks,
  # too few for the cost model to split.
  cfg = dataclasses.replace(TUNED[(d, False)], fwd_split_tail=True, wave_ctas=wave,
                            heads_fastest=heads_fastest, tail_parts=parts, block_kv=128)
  p = AttentionParams(scale=d ** -0.5, is_causal=False, has_segments=False)
  assert forward_module.tail_split(q, cfg, p, -(-s // cfg.block_kv), False) is not None
  o, lse = jax.jit(lambda q, k, v: pallas_flash.flash_attention(
      q, k, v, implementation="mosaic", config=cfg, return_residuals=True))(q, k, v)
  ro, rlse = jax.jit(lambda q, k, v: attention_reference(q, k, v, None, None, params=p))(
      *(x.astype(jnp.float32) for x in (q, k, v)))
  assert rel_err(o.astype(jnp.float32), ro) <= TOL[dtype]
  assert max_abs(lse - rlse) <= 1e-3


# The backward (bwd_split_tail): the dQ kernel's tiles split along their key blocks, the dK/dV
# kernel's along their (q block, query head) steps; XLA sums the float32 partial gradients.


def _bwd_splits(shape, config, params=NON_CAUSAL):
  q, kv = kernel_specs(*shape[:6])
  return backward_module.planned_tail_splits(q, kv, params, config)


def _summary(split):
  return split and (split.tiles, split.main, split.parts)


def test_backward_step_cost_in_forward_steps():
  assert backward_module.step_cost(3, 128, 128) == 1.5  # dQ: S, dP, dQ of 128 x 128
  assert backward_module.step_cost(4, 128, 64) == 1.0  # dK/dV: Sᵀ, dPᵀ, dV, dK of 128 x 64


def test_backward_tail_splits_apply_only_where_they_can():
  both = dataclasses.replace(TUNED[(128, False)], bwd_split_tail="dq,dkdv")
  mha = (1, 16384, 16384, 16, 16, 128)
  # The dK/dV kernel's parts divide its 256 steps per tile (its loops have static lengths).
  assert [_summary(x) for x in _bwd_splits(mha, both)] == [(2048, 1980, 9), (2048, 1980, 16)]
  # Four kv heads: the dK/dV kernel's 1024 tiles of 512 steps each (2 query heads per step's
  # q block), 100 in the last wave.
  assert [_summary(x) for x in _bwd_splits((2, 16384, 16384, 8, 4, 128), both)] == \
      [(2048, 1980, 9), (1024, 924, 16)]
  # Forced parts: the dK/dV kernel takes the largest divisor of its steps up to them.
  forced = dataclasses.replace(both, tail_parts=11)
  assert [x.parts for x in _bwd_splits(mha, forced)] == [11, 8]
  dq_only = dataclasses.replace(both, bwd_split_tail="dq")
  assert _bwd_splits(mha, dq_only)[1] is None and _bwd_splits(mha, dq_only)[0] is not None
  assert _bwd_splits(mha, dataclasses.replace(both, bwd_split_tail="")) == (None, None)
  for params in (dataclasses.replace(NON_CAUSAL, is_causal=True),
                 dataclasses.replace(NON_CAUSAL, has_segments=True)):
    assert _bwd_splits(mha, both, params) == (None, None)
  grouped = dataclasses.replace(both, bwd_heads_fastest=True, bwd_head_group=4)
  assert _bwd_splits(mha, grouped) == (None, None)  # coords decode the plain orders only
  heads = _bwd_splits(mha, dataclasses.replace(both, bwd_heads_fastest=True))
  assert all(x.heads_fastest for x in heads)
  assert _bwd_splits((1, 16384, 16384, 33, 33, 128), both) == (None, None)  # 32 waves
  with pytest.raises(ValueError, match="bwd_split_tail"):
    MosaicConfig(bwd_split_tail="dk")


def test_sum_parts_sets_each_tail_tile_to_its_parts_sum():
  b, rows, h, d, r_tile = 2, 256, 3, 16, 64  # 2 x 2 x 64 rows per tile
  split = split_tail.TailSplit(tiles=b * h * 2, main=5, parts=3, batch=b, heads=h,
                               num_tiles=2, heads_fastest=True)
  x = jax.random.normal(jax.random.key(0), (b, rows, h, d), jnp.float32)
  part = jax.random.normal(jax.random.key(1), (split.tail_tiles * 3, 2, r_tile, d), jnp.float32)
  tail = np.zeros((b, rows, h), bool)
  for bi, hi, ti in zip(*split.tail_coords()):
    tail[bi, ti * 2 * r_tile:(ti + 1) * 2 * r_tile, hi] = True
  got = split_tail.sum_parts(jnp.where(tail[..., None], jnp.nan, x), part, split)
  want = part.reshape(split.tail_tiles, 3, 2 * r_tile, d).sum(axis=1)
  b_idx, h_idx, t_idx = split.tail_coords()
  for i, (bi, hi, ti) in enumerate(zip(b_idx, h_idx, t_idx)):
    np.testing.assert_array_equal(got[bi, ti * 2 * r_tile:(ti + 1) * 2 * r_tile, hi], want[i])
  assert bool(jnp.array_equal(got[~tail], x[~tail]))


# (B, T, S, H, K, D, dtype, config overrides), run like INTERPRET_CASES: dQ and dK/dV tails
# split with main CTAs before them or none, GQA, padded keys, forced parts that the dK/dV
# kernel rounds down to a divisor of its steps (3 -> 2), the statistics computed in XLA.
BWD_INTERPRET_CASES = [
    (1, 128, 256, 3, 3, 64, jnp.bfloat16, dict(wave_ctas=4, tail_parts=2)),
    (1, 200, 333, 4, 2, 64, jnp.float16, dict(wave_ctas=5, tail_parts=3)),
    (1, 256, 128, 2, 2, 64, jnp.bfloat16, dict(wave_ctas=3, tail_parts=4,
                                               bwd_delta_in_kernel=False)),
    # head dim 128, two batch entries, heads fastest: without _common.INTERPRET_XLA_FLAG
    # (conftest.py) this launch hangs, as the thirteenth session saw; with it, ~15 s
    (2, 256, 192, 2, 1, 128, jnp.bfloat16, dict(wave_ctas=3, tail_parts=3,
                                                bwd_heads_fastest=True)),
]
_BWD_INTERPRET_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from pallas_flash.mosaic_gpu import MosaicConfig, backward, forward
from pallas_flash.call import AttentionParams
from pallas_flash.reference import attention_reference
from testing import kernel_inputs, rel_err
b, t, s, h, kh, d, dtype, kw = json.loads(sys.argv[1])
dtype = jnp.dtype(dtype)
small = dict(block_q=64, block_kv=64, block_q_dq=64, block_kv_dq=64, block_q_dkv=64,
             block_kv_dkv=64, interpret=True)
q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s + h)
p = AttentionParams(scale=d ** -0.5, is_causal=False, has_segments=False)
o, lse = forward(q, k, v, None, None, params=p, config=MosaicConfig(**small))
got = backward(q, k, v, None, None, o, lse, do, None, params=p,
               config=MosaicConfig(bwd_split_tail="dq,dkdv", **small, **kw))
f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
_, vjp = jax.vjp(lambda *a: attention_reference(*a, None, None, params=p)[0], *f32[:3])
print(json.dumps({n: rel_err(g.astype(jnp.float32), r)
                  for n, g, r in zip(("dq", "dk", "dv"), got, vjp(f32[3]))}))
"""


@pytest.mark.slow  # bwd_split_tail is opt-in
@pytest.mark.parametrize("case", BWD_INTERPRET_CASES,
                         ids=[f"{kernel_case_id((*c[:6], False, c[6]))}_{i}"
                              for i, c in enumerate(BWD_INTERPRET_CASES)])
def test_split_tail_backward_in_interpreter(case):
  *shape, dtype, kw = case
  small = MosaicConfig(block_q=64, block_kv=64, block_q_dq=64, block_kv_dq=64, block_q_dkv=64,
                       block_kv_dkv=64, bwd_split_tail="dq,dkdv", **kw)
  splits = _bwd_splits(shape, small)
  assert all(x is not None and x.parts >= 2 for x in splits)  # both kernels do split
  errs = _interpret_in_subprocess(_BWD_INTERPRET_SCRIPT, case)
  assert all(e <= 2 * TOL[dtype] for e in errs.values()), errs


@pytest.mark.parametrize("case", [(1, 16384, 16384, 16, 16, 128, False),
                                  (2, 16384, 16384, 8, 4, 128, False),
                                  (4, 4096, 4096, 32, 32, 64, False)], ids=kernel_case_id)
def test_split_tail_backward_lowers(case):
  *shape, causal = case
  q, kv = kernel_specs(*shape)
  config = dataclasses.replace(TUNED[(shape[-1], False)], bwd_split_tail="dq,dkdv")
  assert all(x is not None for x in _bwd_splits(shape, config))
  fn = lambda q, k, v: pallas_flash.flash_attention(  # noqa: E731
      q, k, v, is_causal=causal, implementation="mosaic", config=config)
  grads = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  assert export_for_h200(grads, q, kv, kv).mlir_module().count("mosaic_gpu") >= 3


# B, T, S, H, K, D, dtype, config overrides (as scripts/bwd_split_tail_bench.py's FORCED).
BWD_GPU_CASES = [
    (3, 1000, 1100, 5, 1, 128, jnp.float16, dict(wave_ctas=7, tail_parts=4)),
    # 64-row dK/dV q tiles: with the hd64 table's 128 the dK/dV steps do not divide into 3.
    (2, 777, 1025, 4, 4, 64, jnp.bfloat16, dict(wave_ctas=5, tail_parts=3, block_q_dkv=64)),
    (1, 4096, 4096, 3, 3, 128, jnp.bfloat16, dict(wave_ctas=20, bwd_heads_fastest=True,
                                                   tail_parts=3)),
    (2, 300, 5000, 8, 2, 128, jnp.bfloat16, dict(wave_ctas=7, tail_parts=11,
                                                  bwd_delta_in_kernel=False)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("case", BWD_GPU_CASES,
                         ids=[f"{kernel_case_id((*c[:6], False, c[6]))}_{i}"
                              for i, c in enumerate(BWD_GPU_CASES)])
def test_split_tail_backward_on_gpu(case):
  """Forced splits of both backward kernels against the float32 reference's gradients, and
  bitwise equal run to run (the parts are summed in a fixed order)."""
  b, t, s, h, kh, d, dtype, kw = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s)
  cfg = dataclasses.replace(TUNED[(d, False)], bwd_split_tail="dq,dkdv", **kw)
  p = AttentionParams(scale=d ** -0.5, is_causal=False, has_segments=False)
  assert all(x is not None for x in _bwd_splits((b, t, s, h, kh, d), cfg, p))

  def attn(q, k, v):
    return pallas_flash.flash_attention(q, k, v, implementation="mosaic", config=cfg)

  step = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))
  got = step(q, k, v, do)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  ref = jax.jit(lambda q, k, v, do: jax.vjp(
      lambda *a: attention_reference(*a, None, None, params=p)[0], q, k, v)[1](do))(*f32)
  for name, g, r in zip(("dq", "dk", "dv"), got, ref):
    assert rel_err(g.astype(jnp.float32), r) <= 2 * TOL[dtype], name
  again = step(q, k, v, do)
  assert all(bool(jnp.array_equal(a, g)) for a, g in zip(again, got))
