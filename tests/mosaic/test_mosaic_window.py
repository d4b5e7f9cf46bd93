"""local_window_size on the Mosaic GPU kernels, forward and backward (the default
MosaicConfig.window_backward="mosaic"; "triton" runs the Triton kernels): the interpreted
kernels against the reference, lowering for CUDA on the CPU, the dispatch, and the band's block
limits in both orientations (q tiles streaming keys, kv tiles streaming queries).

With 64-row tiles the windows below cover a few key blocks out of several, so a kernel that
streamed the wrong blocks, or masked a window edge wrongly, misses keys or sees extra ones.
"""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import use_abstract_mesh

import pallas_flash
from pallas_flash.mosaic_gpu import _common, backward, forward
from pallas_flash.mosaic_gpu.config import tuned
from pallas_flash.call import AttentionParams
from pallas_flash.reference import attention_reference
from testing import (H200, MOSAIC_INTERPRET_SMALL, TRITON_CALL, export_for_h200, kernel_case_id,
                     kernel_inputs, kernel_specs, max_abs, max_rel_err, random_segments)

TOL = {jnp.bfloat16: (1.5e-2, 3e-2), jnp.float16: (3e-3, 6e-3)}
SMALL = MOSAIC_INTERPRET_SMALL  # testing.py says why these tiles
MOSAIC_BWD = dataclasses.replace(SMALL, window_backward="mosaic")
_rel = max_rel_err



CASES = [  # B, T, S, H, K, D, causal, dtype, (left, right)
    (1, 300, 300, 2, 1, 64, True, jnp.bfloat16, (70, 0)),  # sliding window, several blocks
    (1, 256, 256, 2, 2, 64, True, jnp.float16, (5, 0)),  # narrower than a block
    (1, 200, 333, 2, 1, 64, False, jnp.bfloat16, (13, 6)),  # two-sided, T < S
    (1, 333, 200, 4, 2, 128, True, jnp.bfloat16, (100, 0)),  # T > S: rows past the keys
    (1, 130, 190, 2, 1, 64, False, jnp.bfloat16, (1000, 0)),  # wider than the sequence
]


def _case_id(case):
  return kernel_case_id(case[:8]) + "_w{}-{}".format(*case[8])


def _params(case, *, segments=False):
  d, causal, window = case[5], case[6], case[8]
  return AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=segments,
                         local_window=window)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_windowed_forward_matches_reference(case):
  b, t, s, h, kh, d, causal, dtype, _ = case
  q, k, v, _ = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s)
  p = _params(case)
  o, lse = forward(q, k, v, None, None, params=p, config=SMALL)
  ro, rlse = attention_reference(q, k, v, None, None, params=p)
  assert _rel(o, ro) <= TOL[dtype][0], _rel(o, ro)
  finite = jnp.isfinite(rlse)
  assert bool(jnp.array_equal(finite, jnp.isfinite(lse)))
  assert max_abs(jnp.where(finite, lse - rlse, 0.0)) <= 1e-4 * max(
      1.0, max_abs(jnp.where(finite, rlse, 0.0)))


def test_windowed_forward_with_segment_ids_matches_reference():
  case = (1, 320, 320, 2, 1, 64, True, jnp.bfloat16, (90, 0))
  b, t, s, h, kh, d, causal, dtype, _ = case
  q, k, v, _ = kernel_inputs(b, t, s, h, kh, d, dtype, seed=5)
  seg = random_segments(jax.random.key(3), b, t, num_docs=3)
  p = _params(case, segments=True)
  o, _ = forward(q, k, v, seg, seg, params=p, config=SMALL)
  ro, _ = attention_reference(q, k, v, seg, seg, params=p)
  assert _rel(o, ro) <= TOL[dtype][0], _rel(o, ro)


def _assert_gradients_match(case, seg=None, seed=0):
  """The interpreted Mosaic backward of `case` (segment ids `seg` or None) against the
  reference's VJP, every dq/dk/dv element compared; o and lse from the interpreted Mosaic
  forward, or at head dim 256 the reference's (that forward is the GPU suite's)."""
  b, t, s, h, kh, d, causal, dtype, _ = case
  q, k, v, do = kernel_inputs(b, t, s, h, kh, d, dtype, seed=seed)
  p = _params(case, segments=seg is not None)
  (o, lse), vjp = jax.vjp(lambda *a: attention_reference(*a, seg, seg, params=p), q, k, v)
  if d <= 128:
    o, lse = forward(q, k, v, seg, seg, params=p, config=SMALL)
  got = backward(q, k, v, seg, seg, o, lse, do, None, params=p, config=MOSAIC_BWD)
  for name, g, r in zip(("dq", "dk", "dv"), got, vjp((do, jnp.zeros(lse.shape, jnp.float32)))):
    assert g.shape == r.shape and g.dtype == r.dtype
    assert _rel(g, r) <= TOL[dtype][1], (name, _rel(g, r))


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]], ids=_case_id)
def test_windowed_gradients_match_reference(case):
  _assert_gradients_match(case, seed=case[1] * case[2])


def test_windowed_head_dim_256_gradients_match_reference():
  """backward_wide, the role-split dK/dV kernel, over the band's q blocks."""
  _assert_gradients_match((1, 200, 333, 2, 1, 256, True, jnp.bfloat16, (70, 0)), seed=11)


def test_windowed_gradients_with_segment_ids_match_reference():
  case = (1, 320, 320, 2, 1, 64, True, jnp.bfloat16, (90, 0))
  seg = random_segments(jax.random.key(4), 1, 320, num_docs=3)
  _assert_gradients_match(case, seg, seed=7)


LOWER = [  # B, T, S, H, K, D, causal
    (1, 4096, 4096, 8, 2, 128, True),
    (1, 3000, 3000, 4, 4, 64, False),
    (1, 2048, 2048, 4, 4, 256, True),
]


@pytest.mark.parametrize("window_backward", [None, "triton", "mosaic"])
@pytest.mark.parametrize("case", LOWER, ids=kernel_case_id)
def test_windowed_forward_and_grad_lower(case, window_backward):
  """None: the tuned config as the dispatch picks it, whose backward is the Mosaic kernels'."""
  *shape, causal = case
  q, kv = kernel_specs(*shape)
  config = tuned(shape[-1], causal, shape[2])
  if window_backward is not None:
    config = dataclasses.replace(config, window_backward=window_backward)

  def attn(q, k, v):
    return pallas_flash.flash_attention(q, k, v, is_causal=causal, local_window_size=(511, 0),
                                        implementation="mosaic", config=config)

  def grads(q, k, v):
    return jax.grad(lambda *a: attn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

  assert export_for_h200(attn, q, kv, kv).mlir_module().count("mosaic_gpu") >= 1
  if window_backward != "triton":
    text = export_for_h200(grads, q, kv, kv).mlir_module()  # the export refuses Triton calls
    assert text.count("mosaic_gpu") >= 3 and "pallas_flash_bwd_dq" not in text
  else:
    text = export_for_h200(grads, q, kv, kv, disabled_checks=[TRITON_CALL]).mlir_module()
    assert text.count("mosaic_gpu") >= 1 and "pallas_flash_bwd_dq" in text


def test_windowed_calls_choose_the_mosaic_kernels():
  q = jax.ShapeDtypeStruct((1, 4096, 4, 128), jnp.bfloat16)
  slopes = jax.ShapeDtypeStruct((4,), jnp.float32)
  with use_abstract_mesh(H200):
    why = pallas_flash.explain(q, q, q, is_causal=True, local_window_size=(1023, 0))
    alibi = pallas_flash.explain(q, q, q, local_window_size=64, alibi_slopes=slopes)
  assert why.chosen == "mosaic", why
  assert why.blocks_computed < 0.3, why  # the band's blocks only
  assert alibi.chosen == "triton"
  assert "alibi_slopes" in alibi.reasons["mosaic"]


@pytest.mark.parametrize("t,s,causal,window", [(300, 300, True, (70, 0)),
                                               (200, 333, False, (13, 6)),
                                               (333, 200, True, (100, 0))])
def test_window_limits_are_the_band_blocks(t, s, causal, window):
  """The forward's limits: each q tile of 128 rows streams exactly the hull of the 64-key
  blocks its rows' windows touch, and skips the mask only on blocks every row sees whole."""
  p = AttentionParams(scale=1.0, is_causal=causal, has_segments=False, local_window=window)
  q, k = kernel_specs(1, t, s, 2, 1, 64)
  t_pad, s_pad = -(-t // 128) * 128, -(-s // 64) * 64
  kp = _common.KernelParams.make(q, k, params=p, block_q=64, block_kv=64, stages=2,
                                 t_pad=t_pad, s_pad=s_pad, kv_len=s, config=SMALL)
  fwd_module = importlib.import_module("pallas_flash.mosaic_gpu.forward")  # not the function
  got = np.asarray(fwd_module.window_limits(None, p, kp, 1))[0]
  _assert_band_blocks(got, _seen(t_pad, s_pad, s, causal, window), tile_rows=128, block=64)


@pytest.mark.parametrize("t,s,causal,window", [(300, 300, True, (70, 0)),
                                               (200, 333, False, (13, 6)),
                                               (333, 200, True, (100, 0))])
def test_backward_window_limits_are_the_band_blocks(t, s, causal, window):
  """The split backward's limits (segment_inputs): the dQ kernel's q tiles of 128 rows over
  64-key blocks, and the dK/dV kernel's kv tiles of 128 keys over 64-row q blocks (the band
  mirrored), both against the brute-force band."""
  p = AttentionParams(scale=1.0, is_causal=causal, has_segments=False, local_window=window)
  t_pad, s_pad = -(-t // 128) * 128, -(-s // 128) * 128
  ids = jnp.zeros((1, t), jnp.int32), jnp.zeros((1, s), jnp.int32)
  bwd_module = importlib.import_module("pallas_flash.mosaic_gpu.backward")
  (_, _, kv_limits), (_, _, q_limits) = bwd_module.segment_inputs(
      *ids, t_pad, s_pad, dq_tiles=(128, 64), dkdv_tiles=(64, 128), params=p)
  seen = _seen(t_pad, s_pad, s, causal, window)
  _assert_band_blocks(np.asarray(kv_limits)[0], seen, tile_rows=128, block=64)
  # Keys own these tiles, padded ones included (their gradients are dropped); padded queries
  # are not seen, like padded keys above.
  seen_t = _seen(t_pad, s_pad, s_pad, causal, window).T & (np.arange(t_pad) < t)[None, :]
  _assert_band_blocks(np.asarray(q_limits)[0], seen_t, tile_rows=128, block=64)


def _seen(t_pad, s_pad, s, causal, window):
  """[t_pad, s_pad] bool: query i sees key j (window, causal, keys past s unseen)."""
  rows, cols = np.arange(t_pad)[:, None], np.arange(s_pad)[None, :]
  seen = (cols - rows >= -window[0]) & (cols - rows <= window[1]) & (cols < s)
  if causal:
    seen &= cols <= rows
  return seen


def _assert_band_blocks(got, seen, *, tile_rows, block):
  """got [tiles, 4] (first, last, full_first, full_last) against seen [owned, streamed]: the
  streamed run is the hull of the blocks any owned row sees, the unmasked run lies inside the
  blocks every row sees whole (it may be narrower, never wider)."""
  for tile in range(seen.shape[0] // tile_rows):
    blocks = seen[tile * tile_rows:(tile + 1) * tile_rows].reshape(tile_rows, -1, block)
    touched = np.flatnonzero(blocks.any(axis=(0, 2)))
    whole = np.flatnonzero(blocks.all(axis=(0, 2)))
    if touched.size:
      assert (got[tile, 0], got[tile, 1]) == (touched[0], touched[-1] + 1), (tile, got[tile])
    run = set(range(got[tile, 2], got[tile, 3]))
    assert run <= set(whole.tolist()), (tile, got[tile], whole)
