"""The persistent Mosaic GPU forward (MosaicConfig.fwd_persistent): CTAs that loop over tiles.

On CPU: the kernel's math in the Mosaic GPU interpreter with a few CTAs, each running several
tiles (uneven counts, so the Q double buffer and the ring cross tile boundaries in both
parities), and its lowering for an H200. On a Hopper GPU (marker `gpu`): against the reference
and bitwise against the one-CTA-per-tile kernel's output at the SM count.
"""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import pytest

import pallas_flash
from pallas_flash.mosaic_gpu import TUNED, MosaicConfig, forward
from pallas_flash.call import AttentionParams
from pallas_flash.reference import attention_reference
from testing import (export_for_h200, kernel_case_id, kernel_inputs, kernel_specs, max_abs,
                     on_hopper, rel_err)

# The package re-exports the function `forward` under the module's name.
forward_module = importlib.import_module("pallas_flash.mosaic_gpu.forward")
config_module = importlib.import_module("pallas_flash.mosaic_gpu.config")
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
SMALL = MosaicConfig(block_q=64, block_kv=64, num_stages=2, interpret=True, fwd_persistent=True)

CASES = [  # B, T, S, H, K, D, causal, dtype; persistent_ctas, intra-WG overlap
    ((1, 256, 192, 3, 1, 64, False, jnp.bfloat16), 2, False),  # 6 tiles: 3 per CTA
    ((2, 128, 130, 2, 2, 64, False, jnp.float16), 3, True),  # 4 tiles on 3 CTAs; padded keys
    ((1, 256, 256, 2, 1, 64, False, jnp.bfloat16), 1, True),  # one CTA runs all 4 tiles
    ((1, 200, 64, 2, 2, 64, False, jnp.bfloat16), 2, False),  # one kv block: ring of 1 slot
]


@pytest.mark.parametrize("case,ctas,overlap", CASES,
                         ids=[f"{kernel_case_id(c)}_ctas{n}{'_overlap' * o}" for c, n, o in CASES])
def test_persistent_forward_matches_reference(case, ctas, overlap):
  b, t, s, h, kh, d, causal, dtype = case
  q, k, v, _ = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t + s + ctas)
  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  config = dataclasses.replace(SMALL, persistent_ctas=ctas, fwd_intra_wg_overlap=overlap)
  assert forward_module.persistent_ctas(q, config, p) == ctas  # the persistent kernel runs
  o, lse = forward(q, k, v, None, None, params=p, config=config)
  ro, rlse = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), None, None,
                                 params=p)
  assert rel_err(o.astype(jnp.float32), ro) <= TOL[dtype]
  assert max_abs(lse - rlse) <= 1e-4 * max(1.0, max_abs(rlse))


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_persistent_forward_in_q_tile_order_matches_reference(overlap):
  # heads_fastest=False: CTA c's tiles c, c + ctas, ... walk the q tiles of one head first
  # (the default at 2049-4096 keys, config.MEDIUM_KV_LEN).
  b, t, s, h, kh, d, causal, dtype = (2, 256, 192, 3, 1, 64, False, jnp.bfloat16)
  q, k, v, _ = kernel_inputs(b, t, s, h, kh, d, dtype, seed=7)
  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  config = dataclasses.replace(SMALL, persistent_ctas=5, fwd_intra_wg_overlap=overlap,
                               heads_fastest=False)
  assert forward_module.persistent_ctas(q, config, p) == 5
  o, lse = forward(q, k, v, None, None, params=p, config=config)
  ro, rlse = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), None, None,
                                 params=p)
  assert rel_err(o.astype(jnp.float32), ro) <= TOL[dtype]
  assert max_abs(lse - rlse) <= 1e-4 * max(1.0, max_abs(rlse))


def test_persistent_applies_only_where_it_can():
  """Causal calls and head_dim 256 (no room for Q's second buffer) run one CTA per tile;
  the CTA count is capped by the tile count."""
  p = AttentionParams(scale=0.1, is_causal=False, has_segments=False)
  causal = dataclasses.replace(p, is_causal=True)
  cfg = MosaicConfig(fwd_persistent=True)
  q = jax.ShapeDtypeStruct((4, 4096, 16, 128), jnp.bfloat16)
  assert forward_module.persistent_ctas(q, cfg, p) == 132  # no GPU here: H100/H200's count
  assert forward_module.persistent_ctas(q, cfg, causal) == 0
  assert forward_module.persistent_ctas(q, MosaicConfig(), p) == 0
  small = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)  # 2 q tiles x 2 heads
  assert forward_module.persistent_ctas(small, cfg, p) == 4
  hd256 = jax.ShapeDtypeStruct((1, 4096, 4, 256), jnp.bfloat16)
  assert forward_module.persistent_ctas(hd256, dataclasses.replace(cfg, block_kv=64), p) == 0


def test_tuned_table_runs_short_non_causal_calls_persistent():
  short = config_module.tuned(64, False, config_module.SHORT_KV_LEN)
  assert short.fwd_persistent and not short.fwd_intra_wg_overlap and short.heads_fastest
  assert short.dkdv_schedule == TUNED[(64, False)].dkdv_schedule  # backward untouched
  for d in (64, 128):
    assert config_module.tuned(d, True, 1024) == TUNED[(d, True)]
  assert config_module.tuned(64, False, config_module.SHORT_KV_LEN + 1) == TUNED[(64, False)]
  # Head dim 128 runs one form from the shortest calls up to MEDIUM_KV_LEN keys.
  medium = config_module.tuned(128, False, config_module.MEDIUM_KV_LEN)
  for kv_len in (64, 1024, config_module.SHORT_KV_LEN, config_module.MEDIUM_KV_LEN):
    assert config_module.tuned(128, False, kv_len) == medium
  assert medium.fwd_persistent and medium.fwd_intra_wg_overlap and not medium.heads_fastest
  assert medium.dkdv_schedule == TUNED[(128, False)].dkdv_schedule
  # The persistent kernel's second Q buffer leaves room for 128-key tiles only (TUNED: 192).
  assert medium.block_kv == 128 and medium.fwd_q_registers and TUNED[(128, False)].block_kv == 192
  assert config_module.tuned(128, False, config_module.MEDIUM_KV_LEN + 1) == TUNED[(128, False)]
  assert config_module.tuned(256, False, 1024) == TUNED[(256, False)]


def test_persistent_ctas_must_not_be_negative():
  with pytest.raises(ValueError, match="persistent_ctas"):
    MosaicConfig(persistent_ctas=-1)


LOWER = [  # B, T, S, H, K, D, causal
    (4, 4096, 4096, 16, 16, 128, False),
    (1, 777, 1025, 8, 1, 128, False),
    (2, 4096, 4096, 8, 8, 64, False),
]


@pytest.mark.parametrize("case", LOWER, ids=kernel_case_id)
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_persistent_forward_lowers(case, overlap):
  *shape, causal = case
  q, kv = kernel_specs(*shape)
  config = MosaicConfig(fwd_persistent=True, fwd_intra_wg_overlap=overlap)
  fn = lambda q, k, v: pallas_flash.flash_attention(  # noqa: E731
      q, k, v, is_causal=causal, implementation="mosaic", config=config)
  text = export_for_h200(fn, q, kv, kv).mlir_module()
  assert text.count("mosaic_gpu") >= 1


GPU_CASES = [  # B, T, S, H, K, D, causal, dtype
    (4, 4096, 4096, 16, 16, 128, False, jnp.bfloat16),
    (1, 16384, 16384, 16, 16, 128, False, jnp.bfloat16),
    (16, 1024, 1024, 16, 16, 64, False, jnp.bfloat16),
    (1, 1100, 1000, 8, 2, 128, False, jnp.float16),
    (3, 777, 1025, 5, 1, 64, False, jnp.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("heads_fastest", [True, False], ids=["heads", "qtiles"])
@pytest.mark.parametrize("case", GPU_CASES, ids=kernel_case_id)
def test_persistent_forward_on_gpu(case, heads_fastest):
  """Against the f32 reference, and bitwise equal to the one-CTA-per-tile kernel (same loop,
  same order of operations per tile), in either tile order."""
  b, t, s, h, kh, d, causal, dtype = case
  q, k, v, _ = kernel_inputs(b, t, s, h, kh, d, dtype, seed=t)
  # The grid kernel without its split tail, whose merge sums in another order.
  base = dataclasses.replace(TUNED[(d, causal)], heads_fastest=heads_fastest,
                             fwd_split_tail=False)
  run = lambda cfg: jax.jit(lambda q, k, v: pallas_flash.flash_attention(  # noqa: E731
      q, k, v, is_causal=causal, implementation="mosaic", config=cfg, return_residuals=True))(
          q, k, v)
  o, lse = run(dataclasses.replace(base, fwd_persistent=True))
  o_grid, lse_grid = run(dataclasses.replace(base, fwd_persistent=False))
  assert bool(jnp.array_equal(o, o_grid)) and bool(jnp.array_equal(lse, lse_grid))
  p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
  hs = slice(0, 2)  # heads are independent: check two against the materialising reference
  kvs = slice(0, 1) if h // kh >= 2 else hs  # with GQA both sit in kv head 0
  ro, _ = jax.jit(lambda q, k, v: attention_reference(q, k, v, None, None, params=p))(
      q[:, :, hs].astype(jnp.float32), k[:, :, kvs].astype(jnp.float32),
      v[:, :, kvs].astype(jnp.float32))
  assert rel_err(o[:, :, hs].astype(jnp.float32), ro) <= TOL[dtype]
