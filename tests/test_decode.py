"""decode_attention on CPU: the xla path and the Triton kernel in the Pallas interpreter against
the float32 reference (poisoned caches, ragged lengths, pages out of order, appends, GQA/MQA,
windows, soft caps, rotary), the end-aligned causal rule, split merging, use in jit / scan,
cache donation, bad input and the checked mode."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_testing import (DecodeCase, case_seed, check_decode, fill_page_table,
                            lowered_for_h200, make_decode_inputs)
from jax.experimental import checkify
from jax.sharding import use_abstract_mesh
from testing import (H200, assert_close_to_ref, assert_offsets_fit_int32, export_for_h200,
                     jitted, triton_operands)

import pallas_flash
from pallas_flash.decode import MosaicDecodeConfig, TritonDecodeConfig, XlaDecodeConfig
from pallas_flash.flax.rotary import apply_rotary

IMPLS = ["xla", "interpret"]

CASES = [
    # Tq = 1, GQA, ragged lengths including 0 and L_max, no append (the queries' own keys are
    # the last cache entries).
    DecodeCase(seqlens=(0, 37, 100), q_len=1, capacity=100),
    # Tq > 1 with an append that fills one sequence to L_max; MQA; float16.
    DecodeCase(seqlens=(97, 5, 0), q_len=3, num_heads=4, num_kv_heads=1, capacity=100,
               append=True, dtype=jnp.float16),
    # Paged: page 16 never divides a length, pages shuffled and interleaved, appends that cross
    # a page boundary (30 + 3 and 47 + 3 spill into the next page), garbage table entries.
    DecodeCase(seqlens=(30, 0, 47, 61), q_len=3, capacity=64, page_size=16, append=True),
    # MHA, window and soft cap, bfloat16, paged page 32 with rotary (base period).
    DecodeCase(seqlens=(64, 9), q_len=2, num_heads=4, num_kv_heads=4, capacity=96, page_size=32,
               append=True, window=20, softcap=5.0, rotary=10_000.0, dtype=jnp.bfloat16),
    # Rotary from tables over half the features; head_dim 48 (padded to 64 in the kernel).
    DecodeCase(seqlens=(50, 3), q_len=2, head_dim=48, capacity=80, append=True,
               rotary="tables"),
    # FP8 caches (float8_e4m3fn, kv_descale): per kv head, a bf16 query, ragged lengths with 0
    # and L_max and no append, head_dim 48 (24 words of two features, padded to 32: the padding
    # words repeat the last feature); per tensor, float16, paged with appends crossing pages
    # (quantised into the cache), a window and a soft cap.
    DecodeCase(seqlens=(0, 41, 100), q_len=1, capacity=100, head_dim=48, dtype=jnp.bfloat16,
               fp8="head"),
    DecodeCase(seqlens=(30, 0, 47), q_len=3, capacity=64, page_size=16, append=True,
               window=20, softcap=5.0, dtype=jnp.float16, fp8="tensor"),
    # A query far outside f16's range (the Triton kernel's FP8 dots run in f16 on a tile
    # scaled by a power of two), at head_dim 16 (halves of 8 words, padded to 16).
    DecodeCase(seqlens=(9, 50), q_len=2, capacity=64, head_dim=16, dtype=jnp.bfloat16,
               fp8="head", query_scale=1e6),
]


# Unsplit (one split, no merge) on the first contiguous and the first paged case; the other
# cases' unsplit runs repeat that path with their features and run with -m slow (suite time).
_UNSPLIT_ROUTINE = [next(c for c in CASES if (c.page_size is None) == contiguous)
                    for contiguous in (True, False)]


@pytest.mark.parametrize("case, num_splits", [
    pytest.param(c, n, id=f"{c.id}-{n}",
                 marks=() if n == 3 or c in _UNSPLIT_ROUTINE else pytest.mark.slow)
    for c in CASES for n in (1, 3)])
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference(impl, case, num_splits):
  # Small key tiles, so that one sequence spans several tiles and splits.
  config = (XlaDecodeConfig(block_kv=16) if impl == "xla" else TritonDecodeConfig(block_kv=16))
  check_decode(impl, case, seed=case_seed(case), num_splits=num_splits, config=config)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_prefill_rows_span_several_tiles(impl):
  """Tq * G = 80 rows: two 64-row tiles on the kernel (prefill tiles), unmasked tiles below the
  diagonal, masked ones on it; with a window, masked ones at its start too."""
  case = DecodeCase(seqlens=(60, 0), q_len=20, num_heads=8, num_kv_heads=2, capacity=96,
                    append=True, window=33)
  config = (XlaDecodeConfig(block_kv=16) if impl == "xla"
            else TritonDecodeConfig(block_kv=16, block_m=64))
  check_decode(impl, case, seed=1, num_splits=2, config=config)


def _top_left_causal(q, k, v, **kwargs):
  """flash_attention's reference (top-left causal, output and lse) for one sequence whose last
  Tq of n query positions hold q [Tq, H, D] (k, v: [1, n, K, D]); zeros before them."""
  n, tq = k.shape[1], q.shape[0]
  full_q = np.zeros((1, n, *q.shape[1:]), np.float32)
  full_q[0, n - tq:] = np.asarray(q, np.float32)
  return jitted(pallas_flash.flash_attention, is_causal=True, return_residuals=True,
                implementation="reference")(jnp.asarray(full_q), k, v, **kwargs)


def test_reference_is_end_aligned_causal_attention():
  """The oracle itself: each sequence's answer equals flash_attention's top-left causal
  attention over its n_b tokens, read at the last Tq query positions."""
  case = DecodeCase(seqlens=(20, 41), q_len=4, capacity=48, append=True)
  q, kc, vc, lens, kw = make_decode_inputs(case)
  out, lse, kc2, vc2 = jitted(pallas_flash.decode_reference)(q, kc, vc, lens, **kw)
  for b, n in enumerate(np.asarray(lens) + case.q_len):
    o, l = _top_left_causal(q[b], kc2[b:b + 1, :n], vc2[b:b + 1, :n])
    assert_close_to_ref("out", out[b], o[0, n - case.q_len:], 1e-6)
    assert_close_to_ref("lse", lse[b], l[0, :, n - case.q_len:], 1e-6)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_sinks_equal_flash_attentions_reference(impl):
  case = DecodeCase(seqlens=(0, 20, 41), q_len=3, capacity=48, append=True)
  q, kc, vc, lens, kw = make_decode_inputs(case)
  sinks = jnp.linspace(-2.0, 2.0, case.num_heads)
  out, lse, kc2, vc2 = jitted(pallas_flash.decode_attention, return_residuals=True,
                              implementation=impl)(q, kc, vc, lens, sinks=sinks, **kw)
  for b, n in enumerate(np.asarray(lens) + case.q_len):
    o, l = _top_left_causal(q[b], kc2[b:b + 1, :n], vc2[b:b + 1, :n], sinks=sinks)
    assert_close_to_ref("out", out[b], o[0, n - case.q_len:], 1e-5)
    assert_close_to_ref("lse", lse[b], l[0, :, n - case.q_len:], 1e-5)


def test_merge_of_split_caches_equals_one_call():
  """merge_attention_states of decodes over two halves of the cache = one decode (Tq = 1)."""
  case = DecodeCase(seqlens=(70, 31, 99), capacity=100)
  q, kc, vc, lens, _ = make_decode_inputs(case)
  cut = 40
  first = pallas_flash.decode_attention(q, kc[:, :cut], vc[:, :cut], jnp.minimum(lens, cut),
                                        return_residuals=True)
  second = pallas_flash.decode_attention(q, kc[:, cut:], vc[:, cut:],
                                         jnp.maximum(lens - cut, 0), return_residuals=True)
  merged = pallas_flash.merge_attention_states([first[0], second[0]], [first[1], second[1]])
  whole = pallas_flash.decode_attention(q, kc, vc, lens, return_residuals=True)
  assert_close_to_ref("out", merged[0], whole[0], 1e-5)
  assert_close_to_ref("lse", merged[1], whole[1], 1e-5)


@pytest.mark.parametrize("rows,block_m,slots,d_pad,merged_rows,chunk", [
    (4, 16, 16, 128, 4, 16),  # B = 1, 16 splits, G = 4: the 4 real rows, all 16 slots at once
    (4, 16, 39, 128, 4, 32),  # B = 8, 4 splits: 32 of 39 slots (a long ragged sequence's too)
    (4, 64, 39, 128, 4, 32),  # Mosaic's 64-row partials: still the 4 real rows
    (3, 16, 3, 128, 4, 2),  # rows rounded up; never more slots than there are (in bounds)
    (1, 16, 100, 64, 1, 64),  # MQA-like G = 1 at D 64
    (16, 16, 40, 128, 16, 8),  # a full 16-row tile: 8 slots fit
    (40, 16, 40, 256, 16, 4)])  # several row tiles: block_m rows each
def test_merge_reads_real_rows_and_slots_that_fit(rows, block_m, slots, d_pad, merged_rows,
                                                  chunk):
  """The merge kernel reads a row tile's real rows (a power of two), not the split kernel's
  padded tile, and as many slots a step as MERGE_CHUNK_FLOATS holds, within the slots (the
  ragged tests above run windows clamped at the end)."""
  from pallas_flash.decode import triton as decode_triton

  assert decode_triton.merge_rows(rows, block_m) == merged_rows
  assert decode_triton.merge_chunk(slots, merged_rows, d_pad) == chunk


@pytest.mark.parametrize("impl", IMPLS)
def test_split_counts_agree(impl):
  """Any split count (more splits than key blocks included) gives the same result."""
  case = DecodeCase(seqlens=(3, 77, 100), capacity=100)
  q, kc, vc, lens, _ = make_decode_inputs(case)
  config = XlaDecodeConfig(block_kv=16) if impl == "xla" else TritonDecodeConfig(block_kv=16)
  outs = [jitted(pallas_flash.decode_attention, num_splits=s, implementation=impl,
                 config=config)(q, kc, vc, lens) for s in (1, 4, 11)]
  for o in outs[1:]:
    assert_close_to_ref("out", o, outs[0], 1e-5)


def test_rotary_equals_pre_rotated_inputs():
  """rotary=theta rotates q and the new keys at positions cache_seqlens + i, as apply_rotary."""
  case = DecodeCase(seqlens=(10, 52), q_len=2, capacity=64, append=True)
  q, kc, vc, lens, kw = make_decode_inputs(case)
  pos = lens[:, None] + jnp.arange(2)[None, :]
  got = jitted(pallas_flash.decode_attention, rotary=1000.0)(q, kc, vc, lens, **kw)
  rotate = jitted(apply_rotary, theta=1000.0)
  rot = dict(kw, new_key=rotate(kw["new_key"], pos))
  want = jitted(pallas_flash.decode_attention)(rotate(q, pos), kc, vc, lens, **rot)
  for name, x, ref in zip(("out", "key_cache", "value_cache"), got, want):
    assert_close_to_ref(name, x, ref, 1e-5, poisoned=name != "out")


def test_append_writes_only_the_new_tokens():
  case = DecodeCase(seqlens=(30, 0, 47, 61), q_len=3, capacity=64, page_size=16, append=True)
  q, kc, vc, lens, kw = make_decode_inputs(case)
  _, kc2, _ = jitted(pallas_flash.decode_attention)(q, kc, vc, lens, **kw)
  table = np.asarray(kw["page_table"])
  expected = np.asarray(kc).copy()
  for b, n in enumerate(np.asarray(lens)):
    for i in range(3):
      p = n + i
      expected[table[b, p // 16], p % 16] = np.asarray(kw["new_key"][b, i])
  np.testing.assert_array_equal(np.asarray(kc2), expected)  # NaN == NaN here


def test_generation_loop_in_scan_with_donated_cache():
  """Tokens appended one per step inside lax.scan under jit with the caches donated: the
  final caches and the last step's output equal one reference call over all steps' tokens."""
  case = DecodeCase(seqlens=(5, 20), q_len=1, capacity=32, page_size=8, append=True)
  q, kc, vc, lens, kw = make_decode_inputs(case)
  steps = 6
  keys = jax.random.normal(jax.random.key(1), (steps, 2, 1, 2, 32))
  vals = jax.random.normal(jax.random.key(2), (steps, 2, 1, 2, 32))

  @jax.jit
  def generate(kc, vc, lens, table):
    def step(carry, kv):
      kc, vc, lens = carry
      out, kc, vc = pallas_flash.decode_attention(q, kc, vc, lens, page_table=table,
                                                  new_key=kv[0], new_value=kv[1])
      return (kc, vc, lens + 1), out

    (kc, vc, lens), outs = jax.lax.scan(step, (kc, vc, lens), (keys, vals))
    return kc, vc, outs[-1]

  table = fill_page_table(kw["page_table"], kc.shape[0])  # room to grow
  kc_n, vc_n, last = generate(kc, vc, lens, table)
  # The caches the steps should leave: the inputs with each step's token at its place (the
  # rest, poison included, untouched); the last output is the reference's over them.
  want_k, want_v, pages = np.array(kc), np.array(vc), np.asarray(table)
  for b, n in enumerate(np.asarray(lens)):
    for s in range(steps):
      p = n + s
      want_k[pages[b, p // 8], p % 8] = keys[s, b, 0]
      want_v[pages[b, p // 8], p % 8] = vals[s, b, 0]
  np.testing.assert_array_equal(np.asarray(kc_n), want_k)
  np.testing.assert_array_equal(np.asarray(vc_n), want_v)
  ref = pallas_flash.decode_reference(q, jnp.asarray(want_k), jnp.asarray(want_v),
                                      lens + steps, page_table=table)
  assert_close_to_ref("out", last, ref[0], 1e-5)
  # Donated to jit, the caches are updated in place (aliased to the outputs, never copied);
  # without donation XLA copies each cache once before the scatter.
  q, kc, vc, lens, kw = make_decode_inputs(DecodeCase(seqlens=(5, 20), capacity=32,
                                                      append=True))
  cache_copy = f"f32[{','.join(map(str, kc.shape))}]{{3,2,1,0}} copy("
  for donate, copies in (((0, 1), 0), ((), 2)):
    step = jax.jit(lambda kc, vc, lens, q, k, v: pallas_flash.decode_attention(
        q, kc, vc, lens, new_key=k, new_value=v)[1:], donate_argnums=donate)
    hlo = step.lower(kc, vc, lens, q, kw["new_key"], kw["new_value"]).compile().as_text()
    assert hlo.count(cache_copy) == copies, (donate, hlo)
    assert ("input_output_alias" in hlo) == bool(donate)


def test_under_jit_bad_values_are_contained():
  """Documented behaviour without checks: lengths clip to the cache, tokens that do not fit are
  dropped, pages outside the pool are never read or written."""
  case = DecodeCase(seqlens=(62, 10), q_len=3, capacity=64, page_size=16, append=True)
  q, kc, vc, lens, kw = make_decode_inputs(case)
  f = jax.jit(lambda lens, table: pallas_flash.decode_attention(
      q, kc, vc, lens, page_table=table, new_key=kw["new_key"], new_value=kw["new_value"]))
  table = kw["page_table"].at[1, 0].set(-5)
  out, kc2, _ = f(lens, table)  # 62 + 3 overflows the 64 slots; a page index -5
  assert np.isfinite(np.asarray(out[0])).all()  # positions 61..63 of a 64-token sequence
  new, old = np.asarray(kc2), np.asarray(kc)
  changed = ~((new == old) | (np.isnan(new) & np.isnan(old)))
  touched = np.flatnonzero(changed.any(axis=(1, 2, 3)))
  assert set(touched) <= {int(table[0, 3])}  # only sequence 0's last page got a token


def test_checked_mode_reports_values_through_checkify():
  case = DecodeCase(seqlens=(60, 10), q_len=3, capacity=64, page_size=16, append=True)
  q, kc, vc, lens, kw = make_decode_inputs(case)

  def f(lens, table):
    return pallas_flash.decode_attention(q, kc, vc, lens, page_table=table, checked=True,
                                         new_key=kw["new_key"], new_value=kw["new_value"])

  checked = checkify.checkify(jax.jit(f))
  err, _ = checked(lens, kw["page_table"])
  assert err.get() is None
  err, _ = checked(jnp.array([62, 10], jnp.int32), kw["page_table"])
  assert "sequence 0 (cache_seqlens[0] = 62) would overflow" in err.get()
  err, _ = checked(lens, kw["page_table"].at[1, 0].set(99))
  assert "page_table[1, 0] = 99 is outside the pool" in err.get()
  err, _ = checked(jnp.array([70, 10], jnp.int32), kw["page_table"])
  assert "cache_seqlens[0] = 70 is outside [0, capacity]" in err.get()
  with pytest.raises(ValueError, match="checkify"):  # staged without checkify.checkify
    jax.jit(f)(lens, kw["page_table"])


def _bad_inputs():
  q, kc, vc, lens, kw = make_decode_inputs(DecodeCase(seqlens=(30, 10), q_len=2, capacity=64,
                                                      page_size=16))
  table = kw["page_table"]
  nk = jnp.zeros((2, 2, 2, 32))
  contiguous = make_decode_inputs(DecodeCase(seqlens=(30, 10), q_len=2, capacity=64))[:4]
  fp8_cache = tuple(x.astype(jnp.float8_e4m3fn) for x in (kc, vc))
  fp8_nk = nk.astype(jnp.float8_e4m3fn)
  wrapping_table = np.asarray(table, np.int64).copy()
  wrapping_table[0, 1] += 2**32  # a valid page once wrapped to int32
  return [
      ("table rank", (q, kc, vc, lens), dict(page_table=table[0]), ValueError,
       r"`page_table` must have rank 2 \[batch, max_pages_per_seq\]"),
      ("table dtype", (q, kc, vc, lens), dict(page_table=table.astype(jnp.float32)), TypeError,
       r"`page_table` must be an int32 array .*astype\(jnp.int32\)"),
      ("lengths past L", (q, kc, vc, jnp.array([65, 3], jnp.int32)), dict(page_table=table),
       ValueError, r"cache_seqlens\[0\] = 65 is outside \[0, capacity\] for the cache of 64 "
       "tokens"),
      ("overflowing append", (q, kc, vc, jnp.array([30, 63], jnp.int32)),
       dict(page_table=table.at[1].set(jnp.arange(4)), new_key=nk, new_value=nk), ValueError,
       r"appending q_len = 2 tokens to sequence 1 \(cache_seqlens\[1\] = 63\) would overflow "
       r"the cache of 64 tokens"),
      ("page outside the pool", (q, kc, vc, lens), dict(page_table=table.at[0, 1].set(kc.shape[0])),
       ValueError, r"page_table\[0, 1\] = 11 is outside the pool of 11 pages"),
      # int64 indices are checked as given, not after wrapping to int32 (2**32 + 3 -> 3).
      ("int64 page outside the pool", (q, kc, vc, lens), dict(page_table=wrapping_table),
       ValueError, r"page_table\[0, 1\] = 42949\d+ is outside the pool"),
      ("cache rank", (q, kc[..., 0], vc[..., 0], lens), dict(page_table=table), ValueError,
       r"`key_cache` must have rank 4"),
      ("lengths dtype", (q, kc, vc, lens.astype(jnp.float32)), dict(page_table=table), TypeError,
       r"`cache_seqlens` must be an int32 array"),
      ("new_key alone", (q, kc, vc, lens), dict(page_table=table, new_key=nk), ValueError,
       "both `new_key` and `new_value`"),
      ("new_key shape", (q, kc, vc, lens), dict(page_table=table, new_key=nk[:, :1],
                                                new_value=nk[:, :1]), ValueError,
       r"`new_key` must have shape \(2, 2, 2, 32\)"),
      ("contiguous batch", (q, kc, vc, lens), {}, ValueError, "pass `page_table`"),
      ("dtypes", (q.astype(jnp.bfloat16), kc, vc, lens), dict(page_table=table), TypeError,
       "must have the query's dtype, or both be float8_e4m3fn"),
      ("fp8 without kv_descale", (q, *fp8_cache, lens), dict(page_table=table), ValueError,
       r"needs `kv_descale=\(key_descale, value_descale\)`"),
      ("kv_descale shape", (q, *fp8_cache, lens),
       dict(page_table=table, kv_descale=(jnp.ones(3), 1.0)), ValueError,
       r"key_descale must have shape \(\) \(per tensor\) or \(2,\)"),
      ("kv_descale value", (q, *fp8_cache, lens),
       dict(page_table=table, kv_descale=(1.0, jnp.array(-1.0))), ValueError,
       "value_descale must be finite and positive"),
      ("kv_descale on bf16", (q, kc, vc, lens), dict(page_table=table, kv_descale=(1.0, 1.0)),
       ValueError, "applies to float8_e4m3fn caches only"),
      ("kv_descale None entry", (q, *fp8_cache, lens),
       dict(page_table=table, kv_descale=(None, 1.0)), TypeError,
       "key_descale must be a float or a float array, got NoneType"),
      ("kv_descale one array", (q, *fp8_cache, lens),
       dict(page_table=table, kv_descale=jnp.array([0.1, 0.2])), TypeError,
       r"`kv_descale` must be a pair \(key_descale, value_descale\)"),
      ("fp8 new_key", (q, *fp8_cache, lens),
       dict(page_table=table, kv_descale=(1.0, 1.0), new_key=fp8_nk, new_value=fp8_nk),
       TypeError, "`new_key` must have the query's dtype float32"),
      ("mosaic fp8", (q.astype(jnp.bfloat16), *fp8_cache, lens),
       dict(page_table=table, kv_descale=(1.0, 1.0), implementation="mosaic",
            config=MosaicDecodeConfig(interpret=True)),
       NotImplementedError, "an FP8 cache: the Mosaic decode kernel"),
      ("triton fp8 odd head_dim", (q[..., :31].astype(jnp.bfloat16),
                                   *(x[..., :31] for x in fp8_cache), lens),
       dict(page_table=table, kv_descale=(1.0, 1.0), implementation="interpret"),
       NotImplementedError, r"an FP8 cache with an odd head_dim \(31\)"),
      ("flash fp8", (contiguous[0].astype(jnp.bfloat16),
                     *(x.astype(jnp.float8_e4m3fn) for x in contiguous[1:3]), contiguous[3]),
       dict(kv_descale=(1.0, 1.0), implementation="flash"),
       NotImplementedError, "an FP8 cache: flash_attention's FP8 kernel takes FP8 queries"),
      ("num_splits", (q, kc, vc, lens), dict(page_table=table, num_splits=0), ValueError,
       "`num_splits` must be None"),
      ("return_residuals", (q, kc, vc, lens), dict(page_table=table, return_residuals="no"),
       TypeError, "`return_residuals` must be a Python bool"),
      ("config type", (q, kc, vc, lens), dict(page_table=table, implementation="xla",
                                              config=TritonDecodeConfig()),
       NotImplementedError, "takes a XlaDecodeConfig"),
      ("mosaic", (q, kc, vc, lens), dict(page_table=table, implementation="mosaic"),
       NotImplementedError, "Mosaic decode kernel needs an NVIDIA GPU"),
      ("rotary tables", (q, kc, vc, lens), dict(page_table=table, rotary=(jnp.ones((10, 8)),) * 2),
       ValueError, "cover positions 0..9, but the cache holds 64"),
      ("flash paged", (q, kc, vc, lens), dict(page_table=table, implementation="flash"),
       NotImplementedError, "'flash' cannot run this call: a paged cache"),
      ("flash window", contiguous, dict(implementation="flash", local_window_size=8),
       NotImplementedError, "'flash' cannot run this call: a local window"),
      ("flash num_splits", contiguous, dict(implementation="flash", num_splits=2),
       NotImplementedError, "num_splits splits the keys"),
      ("flash config type", contiguous, dict(implementation="flash", config=XlaDecodeConfig()),
       NotImplementedError, "takes a FlashSplitConfig"),
  ]


@pytest.mark.parametrize("args,kwargs,error,match", [c[1:] for c in _bad_inputs()],
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_input_names_the_argument_and_the_fix(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    pallas_flash.decode_attention(*args, **kwargs)


# What decode_explain must refuse as the call does (concrete values, which its tracing skips).
_EXPLAIN_REFUSES = ("lengths past L", "page outside the pool", "kv_descale value",
                    "kv_descale None entry", "fp8 without kv_descale")


@pytest.mark.parametrize("args,kwargs,error,match",
                         [c[1:] for c in _bad_inputs() if c[0] in _EXPLAIN_REFUSES],
                         ids=[c[0] for c in _bad_inputs() if c[0] in _EXPLAIN_REFUSES])
def test_explain_refuses_what_the_call_refuses(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    pallas_flash.decode_explain(*args, **kwargs)


@pytest.mark.parametrize("make, error, match", [
    (lambda: TritonDecodeConfig(block_kv="64"), TypeError, "TritonDecodeConfig.block_kv must "
     "be a Python int"),
    (lambda: TritonDecodeConfig(num_stages=2.5), TypeError, "num_stages must be a Python int"),
    (lambda: MosaicDecodeConfig(block_kv="64"), TypeError, "MosaicDecodeConfig.block_kv"),
    (lambda: XlaDecodeConfig(block_kv=16.5), TypeError, "XlaDecodeConfig.block_kv"),
    (lambda: TritonDecodeConfig(block_kv=48), ValueError, "power of two >= 16"),
])
def test_decode_configs_name_a_bad_field(make, error, match):
  with pytest.raises(error, match=match):
    make()


def test_flash_split_config_names_flash_attentions_implementations():
  with pytest.raises(ValueError, match="flash_implementation must be None or one of"):
    pallas_flash.FlashSplitConfig(flash_implementation="cudnn")


def test_explain_on_cpu_and_for_h200():
  q = jax.ShapeDtypeStruct((1, 1, 32, 128), jnp.bfloat16)
  lens = jax.ShapeDtypeStruct((1,), jnp.int32)
  kv = jax.ShapeDtypeStruct((1, 131072, 8, 128), jnp.bfloat16)
  cpu = pallas_flash.decode_explain(q, kv, kv, lens)
  assert cpu.chosen == "xla" and cpu.runs is None and "off-GPU" in cpu.splits_reason
  with use_abstract_mesh(H200):
    gpu = pallas_flash.decode_explain(q, kv, kv, lens)
    # B = 1, K = 8: one wave on 132 SMs is 16 runs of 8K keys per kv head.
    assert (gpu.chosen, gpu.runs, gpu.programs, gpu.block_kv) == ("triton", 16, 128, 128)
    short = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)  # 8 blocks: 1 per run
    assert pallas_flash.decode_explain(q, short, short, lens).runs == 8
    tiny = jax.ShapeDtypeStruct((1, 256, 8, 128), jnp.bfloat16)  # never more runs than blocks
    assert pallas_flash.decode_explain(q, tiny, tiny, lens).runs == 2

    def batch_runs(b, length):
      q, kv = (jax.ShapeDtypeStruct(s, jnp.bfloat16)
               for s in ((b, 1, 32, 128), (b, length, 8, 128)))
      return pallas_flash.decode_explain(q, kv, kv, jax.ShapeDtypeStruct((b,), jnp.int32)).runs

    # One wave of runs (16 x 8 kv heads) while one program a sequence is under two waves.
    assert batch_runs(8, 131072) == batch_runs(32, 8192) == 16
    assert batch_runs(64, 32768) is None and batch_runs(128, 8192) is None
    assert pallas_flash.decode_explain(q, kv, kv, lens, num_splits=3).runs == 3
  assert "triton" in str(gpu) and "16 balanced runs" in str(gpu)


def test_calls_that_fit_several_ctas_an_sm_keep_splits_per_sequence():
  """e4m3 caches (three of the Triton kernel's CTAs fit an SM) keep S splits per sequence:
  S * B runs, 4 splits at B = 8 with 32K keys, where a bf16 cache takes one wave's 16 runs."""
  from pallas_flash.decode import config as decode_config
  from pallas_flash.decode import triton as decode_triton
  from pallas_flash.decode import validation as decode_validation

  q = jax.ShapeDtypeStruct((8, 1, 32, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((8, 32768, 8, 128), jnp.bfloat16)
  with use_abstract_mesh(H200):
    info = decode_validation.abstract_info(q, kv, kv, jax.ShapeDtypeStruct((8,), jnp.int32),
                                           decode_validation.with_defaults({}))
  fp8 = dataclasses.replace(info, cache_dtype=jnp.dtype(jnp.float8_e4m3fn))
  config = decode_triton.config_for(info, None)
  assert decode_triton.programs_per_sm(info, config) == 1
  assert decode_triton.programs_per_sm(fp8, config) == 3
  tiles = dict(block_m=config.block_m, block_kv=config.block_kv)
  assert decode_config.choose_runs(info, **tiles, per_sm=1)[0] == 16
  assert decode_config.choose_runs(fp8, **tiles, per_sm=3)[0] == 4 * 8


@pytest.mark.parametrize("num_splits", [1, None], ids=["one_split", "auto_splits"])
@pytest.mark.parametrize("paged", [False, True])
def test_triton_kernel_lowers_for_h200(paged, num_splits):
  """One Triton kernel without splits, the decode kernel and its merge kernel with them, and
  no other launch: the query is read in place and the outputs written in their layouts."""
  module = lowered_for_h200("triton", pool=(40, 64) if paged else None, max_pages=16,
                            num_splits=num_splits)
  assert module.count("xla.gpu.triton") == (1 if num_splits == 1 else 2)


@pytest.mark.parametrize("paged", [False, True])
def test_fp8_cache_lowers_for_h200(paged):
  """FP8 caches on the Triton kernel for an H200 (e4m3 converted in the kernel): the same
  launches as bf16 caches."""
  module = lowered_for_h200("triton", pool=(40, 64) if paged else None, max_pages=16,
                            fp8_cache=True)
  assert module.count("xla.gpu.triton") == 2 and "f8E4M3FN" in module


def test_fp8_halves_join_with_the_last_feature_in_padding_columns():
  """The Triton kernel's FP8 tiles, split from 16-bit words into even and odd features
  (decode/triton.py) and joined once per sequence, hold the cache's features and, past head_dim
  48 up to the tile's 64 columns, feature 47 in every padding column, as the bf16 tiles do: the
  stores clamp padding columns onto column D - 1, and on a GPU any of those lanes' writes may
  land (the interpreter keeps the last one)."""
  from jax.experimental import pallas as pl

  from pallas_flash.decode import triton as decode_triton

  rows, d, d_pad = 16, 48, 64
  x = jax.random.normal(jax.random.key(0), (rows, d)).astype(jnp.float8_e4m3fn)

  def kernel(words_ref, out_ref):
    r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    wcols = jax.lax.broadcasted_iota(jnp.int32, (d_pad // 2,), 0)
    words = decode_triton._load_rows(words_ref, r, wcols, None)
    lo, hi = decode_triton._unpack_words(words, jnp.float32, ptx=False)
    out_ref[...] = decode_triton._join_halves(lo, hi, d // 2)

  out = np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((rows, d_pad),
                                                                         jnp.float32),
                                  interpret=True)(decode_triton.fp8_words(x)))
  want = np.asarray(x.astype(jnp.float32))
  np.testing.assert_array_equal(out[:, :d], want)
  np.testing.assert_array_equal(out[:, d:], np.repeat(want[:, d - 1:], d_pad - d, axis=1))


@pytest.mark.parametrize("paged", [False, True])
def test_fp8_cache_offsets_fit_int32(paged):
  """Pallas-Triton addresses an operand of at most 2^32 bytes with int32 element offsets: no
  one-byte operand of 2^31 .. 2^32 elements may reach the kernels (an e4m3 cache of 3 GiB
  read the wrong rows, or faulted, on the H200). The FP8 cache arrives as 16-bit words."""
  b, L, kh, d = 24, 131072, 8, 128  # 3 GiB per cache
  q = jax.ShapeDtypeStruct((b, 1, 32, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b * L // 64, 64, kh, d) if paged else (b, L, kh, d),
                            jnp.float8_e4m3fn)
  table = jax.ShapeDtypeStruct((b, L // 64), jnp.int32) if paged else None
  lens = jax.ShapeDtypeStruct((b,), jnp.int32)

  def f(q, kc, vc, lens, table):
    return pallas_flash.decode_attention(q, kc, vc, lens, page_table=table,
                                         kv_descale=(1.0, 1.0), implementation="triton")

  operands = triton_operands(export_for_h200(f, q, kv, kv, lens, table).mlir_module())
  assert any(nbytes == b * L * kh * d for _, nbytes in operands), operands  # the caches
  assert_offsets_fit_int32(operands)


def test_attention_alone_is_one_or_two_kernels_on_h200():
  """Without append or rotary nothing but the Triton kernels is left in the compiled call."""
  q = jax.ShapeDtypeStruct((1, 1, 32, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)
  lens = jax.ShapeDtypeStruct((1,), jnp.int32)
  f = lambda q, k, v, lens: pallas_flash.decode_attention(q, k, v, lens)  # noqa: E731
  module = export_for_h200(f, q, kv, kv, lens).mlir_module()
  body = module[module.index("func.func public @main"):]
  assert body.count("xla.gpu.triton") == 2
  for op in ("stablehlo.transpose", "stablehlo.pad", "stablehlo.exponential",
             "stablehlo.reduce"):
    assert op not in body, op


# Ragged batches under the balanced partition (block_kv 16): runs crossing sequences at 2 and 3
# splits (lengths 0 and L_max among them); one sequence at L_max beside short ones; the paged
# layout with pages out of order, a window, a soft cap and Tq > 1 (runs crossing at 2 splits).
RAGGED_CASES = [
    DecodeCase(seqlens=(0, 166, 256, 13, 154, 0, 92, 33), capacity=256),
    DecodeCase(seqlens=(256, 3, 0, 1, 17, 9, 40, 5), capacity=256),
    DecodeCase(seqlens=(200, 0, 7, 253), q_len=3, capacity=256, page_size=16, append=True,
               window=100, softcap=5.0, dtype=jnp.bfloat16),
]
_RAGGED_PARAMS = [
    pytest.param(impl, case, splits, id=f"{impl}-case{i}-{case.id}-{splits}",
                 marks=() if (impl, i, splits) == ("interpret", 2, 2) else pytest.mark.slow)
    for impl in IMPLS for i, case in enumerate(RAGGED_CASES) for splits in (2, 3, 7)]


@pytest.mark.parametrize("impl,case,num_splits", _RAGGED_PARAMS)
def test_ragged_batches_split_by_blocks(impl, case, num_splits):
  """Forced split counts on ragged batches against the reference (one in CI, the sweep slow)."""
  config = (XlaDecodeConfig(block_kv=16) if impl == "xla" else TritonDecodeConfig(block_kv=16))
  check_decode(impl, case, seed=case_seed(case), num_splits=num_splits, config=config)


@pytest.mark.parametrize("impl", IMPLS)
def test_fewer_runs_than_sequences(impl, monkeypatch):
  """The automatic choice's runs at large batches: 3 runs for 8 sequences, each run spanning
  several, and one run of a whole paged batch with a window, against the reference."""
  from pallas_flash.decode import config as decode_config
  config = (XlaDecodeConfig(block_kv=16) if impl == "xla" else TritonDecodeConfig(block_kv=16))
  for runs, case in ((3, RAGGED_CASES[0]), (1, RAGGED_CASES[2])):
    monkeypatch.setattr(decode_config, "choose_runs", lambda info, runs=runs, **_: (runs, "test"))
    check_decode(impl, case, seed=case_seed(case), config=config)


def test_balanced_partition_covers_every_block_once():
  """The slots of split_ranges (the kernel's partition): every visible block of every sequence
  in exactly one slot, no program over ceil(total / N) blocks, and with equal lengths each
  sequence's blocks cut into its S splits as a per-sequence split would; also with fewer runs
  than sequences (N = 1 and 3)."""
  from pallas_flash.decode import config as decode_config
  from pallas_flash.decode.call import DecodeParams
  from pallas_flash.decode.xla import split_ranges

  modes = set()
  # (S splits per sequence, None) or (None, N runs).
  splits_or_runs = ((2, None), (3, None), (7, None), (None, 1), (None, 3))
  for (num_splits, runs), (lengths, window) in itertools.product(splits_or_runs, (
      ((0, 166, 256, 13, 154, 0, 92, 33), None), ((700, 2, 0, 333), 90), ((512,) * 5, None))):
    b = len(lengths)
    programs = runs or num_splits * b
    p = DecodeParams(scale=1.0, q_len=2, group=4, window=window, logits_soft_cap=None,
                     programs=programs, page_size=None)
    ranges = jax.jit(lambda lens, p=p: (split_ranges(lens, params=p, rows=8, block_kv=16),
                                        split_ranges(lens, rows=8, block_kv=16, params=(
                                            dataclasses.replace(p, programs=None)))))
    (seq, start, end), (_, lo, hi) = jax.tree.map(np.asarray,
                                                  ranges(jnp.asarray(lengths, jnp.int32)))
    modes.add(bool(decode_config.balanced_partition(jnp.asarray(hi - lo), programs).aligned))
    assert len(seq) == b + programs - 1
    for i in range(b):
      covered = [np.arange(s, e) for s, e, q in zip(start, end, seq) if q == i]
      np.testing.assert_array_equal(np.sort(np.concatenate(covered + [np.zeros(0, int)])),
                                    np.arange(lo[i], hi[i]))
    work = np.zeros(programs, int)
    held = end > start
    np.add.at(work, (np.arange(len(seq)) - seq)[held], (end - start)[held])
    assert work.max() <= -(-(hi - lo).sum() // programs)
    if len(set(lengths)) == 1 and num_splits:  # program i: split i % S of sequence i // S
      per = -(-(hi[0] - lo[0]) // num_splits)
      for j in np.flatnonzero(held):
        program = j - seq[j]
        assert program // num_splits == seq[j]
        assert start[j] == lo[0] + program % num_splits * per
        assert end[j] == min(start[j] + per, hi[0])
  assert modes == {True, False}  # sequences padded to whole runs, and runs crossing sequences
