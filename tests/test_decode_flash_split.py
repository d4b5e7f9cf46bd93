"""decode_attention's chunked-prefill route (implementation "flash", decode/flash_split.py) on
CPU: the prefix and own-token flash_attention calls merged, against the float32 decode
reference (ragged lengths with empty and full caches, appends or the cache's own tokens, GQA,
MQA, MHA, soft cap, rotary, sinks); the automatic choice for an abstract H200 and the lowered
Mosaic kernels; the Mosaic kernels in their interpreter on NaN-poisoned caches (-m slow)."""

import re

import jax
import jax.numpy as jnp
import pytest
from decode_testing import DecodeCase, make_decode_inputs
from jax.sharding import use_abstract_mesh
from testing import (H200, MOSAIC_INTERPRET, assert_close_to_ref, export_for_h200, jitted,
                     tolerance)

import pallas_flash
from pallas_flash import FlashSplitConfig, merge
from pallas_flash.decode import config as decode_config

# Stale tokens past the lengths: flash_attention's "xla" implementation reads every cache slot,
# so they must be finite there (flash_split.py); large, so that any weight on them shows.
STALE_KEY, STALE_VALUE = 30.0, -30.0

CASES = [
    # Appended chunk, GQA, ragged lengths: an empty cache, a partial one, one the chunk fills;
    # soft cap, rotary (base period) and sinks (applied once, after the merge).
    (DecodeCase(seqlens=(0, 37, 92), q_len=8, capacity=100, append=True, softcap=5.0,
                rotary=10_000.0), True),
    # No append (the chunk's tokens are the cache's last Tq): an empty sequence, one shorter
    # than the chunk (its first queries see no key), a partial and a full cache; MQA, bf16.
    (DecodeCase(seqlens=(0, 5, 37, 100), q_len=8, num_heads=4, num_kv_heads=1, capacity=100,
                dtype=jnp.bfloat16), False),
    # MHA, float16, rotary tables, head dim 64, a chunk of 16 filling the cache.
    pytest.param(DecodeCase(seqlens=(64, 0), q_len=16, num_heads=4, num_kv_heads=4,
                            head_dim=64, capacity=80, append=True, rotary="tables",
                            dtype=jnp.float16), False, marks=pytest.mark.slow),
]


def _inputs(case: DecodeCase, stale=(STALE_KEY, STALE_VALUE)):
  q, kc, vc, lens, kw = make_decode_inputs(case)
  if stale is not None:
    kc, vc = (jnp.where(jnp.isnan(x), jnp.asarray(s, x.dtype), x) for x, s in zip((kc, vc), stale))
  return q, kc, vc, lens, kw


def _decode(q, kc, vc, lens, kw, **call_kw):
  """decode_attention(..., return_residuals=True) under jit (arrays traced, the rest static)."""
  return jitted(pallas_flash.decode_attention, return_residuals=True)(q, kc, vc, lens,
                                                                      **{**kw, **call_kw})


def _reference(q, kc, vc, lens, kw):
  up = {n: (x.astype(jnp.float32) if n in ("new_key", "new_value") else x)
        for n, x in kw.items()}
  return jitted(pallas_flash.decode_reference)(*(x.astype(jnp.float32) for x in (q, kc, vc)),
                                               lens, **up)


def _id(x):
  return x.id if isinstance(x, DecodeCase) else ("sinks" if x else "no_sinks")


@pytest.mark.parametrize("case, sinks", CASES, ids=_id)
def test_flash_route_matches_reference(case, sinks):
  args = _inputs(case)
  kw = {"sinks": jnp.linspace(-2.0, 3.0, case.num_heads)} if sinks else {}
  got = _decode(*args, implementation="flash", **kw)
  want = _reference(*args)
  if sinks:  # the reference's (out, lse) with the sinks added (merge.add_sinks, tested there)
    want = (*merge.add_sinks(want[0], want[1], kw["sinks"]), *want[2:])
  tol = tolerance(case.dtype)
  assert got[0].dtype == args[0].dtype and got[0].shape == args[0].shape
  assert_close_to_ref("out", got[0], want[0], tol)
  assert_close_to_ref("lse", got[1], want[1], max(tol, 1e-5))
  if case.append:  # the append is the shared one, unchanged
    for name, x, ref in zip(("key_cache", "value_cache"), got[2:], want[2:]):
      assert_close_to_ref(name, x, ref, 0.0 if case.rotary is None else tol, poisoned=True)


def test_flash_route_is_chosen_for_long_chunks_on_hopper():
  sds = jax.ShapeDtypeStruct
  b, h, kh, d, cache = 2, 32, 8, 128, 32768
  lens = sds((b,), jnp.int32)

  def explain(t, dtype=jnp.bfloat16, head_dim=d, **kw):
    q = sds((b, t, h, head_dim), dtype)
    kv = sds((b, cache, kh, head_dim), dtype)
    if kw.pop("append", False):
      new = sds((b, t, kh, head_dim), dtype)
      kw.update(new_key=new, new_value=new)
    if kw.pop("paged", False):
      kv = sds((b * cache // 64, 64, kh, head_dim), dtype)
      kw["page_table"] = sds((b, cache // 64), jnp.int32)
    return pallas_flash.decode_explain(q, kv, kv, lens, **kw)

  threshold = decode_config.FLASH_SPLIT_MIN_Q_LEN
  # Off-GPU flash_attention would run its calls on "xla": the route is not chosen.
  cpu = explain(threshold)
  assert cpu.chosen == "xla" and "would run its calls on 'xla'" in cpu.reasons["flash"]
  with use_abstract_mesh(H200):
    # Head dim 112: flash_attention runs it zero-padded on its Mosaic kernels.
    for kw in ({}, {"append": True, "rotary": 1e4, "logits_soft_cap": 30.0}, {"head_dim": 112}):
      routed = explain(threshold, **kw)
      assert routed.chosen == "flash", str(routed)
      assert routed.config == FlashSplitConfig(flash_implementation="mosaic")
      assert f"Tq={threshold} >= FLASH_SPLIT_MIN_Q_LEN" in str(routed)
    short = explain(threshold - 1)
    assert short.chosen == "triton" and "FLASH_SPLIT_MIN_Q_LEN" in short.reasons["flash"]
    # Refusals that keep today's path: a window, pages, an explicit split count, and pieces
    # flash_attention would not run on its Mosaic kernels (float32).
    for kw, why in (({"local_window_size": 1024}, "local window"), ({"paged": True}, "paged"),
                    ({"num_splits": 4}, "num_splits"),
                    ({"dtype": jnp.float32}, "would run its calls on 'triton'")):
      other = explain(threshold, **kw)
      assert other.chosen == "triton" and why in other.reasons["flash"], (kw, str(other))
    # By name the route takes any length.
    assert explain(8, implementation="flash").chosen == "flash"


def test_flash_route_lowers_to_mosaic_kernels_for_h200():
  """On an H200 the routed call (the bench's form: the chunk's tokens already in the cache,
  so the causal call carries segment ids) is the Mosaic kernels of its two flash_attention
  calls and no Triton kernel."""
  b, t, h, kh, d, cache = 2, decode_config.FLASH_SPLIT_MIN_Q_LEN, 32, 8, 128, 1024
  sds = jax.ShapeDtypeStruct
  q, kv = sds((b, t, h, d), jnp.bfloat16), sds((b, cache, kh, d), jnp.bfloat16)
  f = lambda q, kc, vc, lens: pallas_flash.decode_attention(  # noqa: E731
      q, kc, vc, lens, logits_soft_cap=30.0)
  module = export_for_h200(f, q, kv, kv, sds((b,), jnp.int32)).mlir_module()
  assert len(re.findall(r"custom_call @mosaic_gpu", module)) == 2
  assert "xla.gpu.triton" not in module


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    DecodeCase(seqlens=(0, 37, 128), q_len=64, num_heads=2, num_kv_heads=1, head_dim=64,
               capacity=192, append=True, softcap=5.0, dtype=jnp.bfloat16),
    DecodeCase(seqlens=(0, 5, 100, 192), q_len=64, num_heads=2, num_kv_heads=1, head_dim=64,
               capacity=192, dtype=jnp.bfloat16),
], ids=lambda c: c.id)
def test_flash_route_on_mosaic_interpreter_ignores_nan_past_lengths(case):
  """The Mosaic kernels (64-key tiles <= Tq) stream no slot past a sequence's tokens: NaN
  there never reaches the output."""
  args = _inputs(case, stale=None)  # NaN in every slot no sequence holds
  got = _decode(*args, implementation="flash",
                config=FlashSplitConfig(flash_implementation="mosaic",
                                        flash_config=MOSAIC_INTERPRET))
  want = _reference(*args)
  assert_close_to_ref("out", got[0], want[0], tolerance(case.dtype))
  assert_close_to_ref("lse", got[1], want[1], tolerance(case.dtype))
