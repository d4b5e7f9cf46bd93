"""Block-run arithmetic of _tiling.py against brute force over the element mask."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from testing import jitted

from pallas_flash import _tiling
from pallas_flash.call import KV_PAD_SEGMENT, Q_PAD_SEGMENT, AttentionParams

BANDS = [(None, None), (None, 0), (-5, 0), (-5, 3), (0, 7), (-40, None), (-1, -1), (None, -3),
         (-200, 200)]


def _brute(band, t, s, bq, bk, tail, nk=None):
  """Per owner block: visited blocks (any visible element) and fully visible ones.

  Rows are padded to whole blocks and count like real ones (the kernels cannot tell them
  apart); columns at or past `tail` are padding and never visible; nk: the column blocks
  (default: S rounded up).
  """
  lo, hi = band
  nq, nk = -(-t // bq), nk or -(-s // bk)
  d = np.arange(nk * bk)[None, :] - np.arange(nq * bq)[:, None]
  vis = np.ones(d.shape, bool)
  if lo is not None:
    vis &= d >= lo
  if hi is not None:
    vis &= d <= hi
  vis &= np.arange(nk * bk)[None, :] < tail
  blocks = vis.reshape(nq, bq, nk, bk)
  return blocks.any((1, 3)), blocks.all((1, 3))


@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("t, s, bq, bk", [(64, 64, 16, 16), (70, 90, 32, 16), (50, 200, 16, 64),
                                          (1, 1, 16, 16), (200, 50, 16, 16)])
@pytest.mark.parametrize("extra", [0, 2], ids=["", "extra_blocks"])
def test_block_runs_match_brute_force(band, t, s, bq, bk, extra):
  """extra: whole blocks of padding past the tail's (a length padded for other tiles too)."""
  nq, nk = -(-t // bq), -(-s // bk) + extra
  any_, full = _brute(band, t, s, bq, bk, tail=s, nk=nk)
  for i in range(nq):
    first, full_lo, full_hi, last = (int(x) for x in _tiling.block_runs(
        jnp.int32(i), owner_block=bq, other_block=bk, num_other=nk, band=band,
        element_mask=False, other_len=s))
    # Also for owners that see nothing: [0, first) and [last, nk) are the skipped blocks.
    assert 0 <= first <= full_lo <= full_hi <= last <= nk, (i, first, full_lo, full_hi, last)
    visited = np.zeros(nk, bool)
    visited[first:last] = True
    assert (visited >= any_[i]).all(), f"block {i} misses visible blocks"
    # Exact up to the first/last block: every visited block but the ones at the ends has work.
    if any_[i].any() and not extra:  # past the padding's first block, a run may end later
      idx = np.flatnonzero(any_[i])
      assert first == idx[0] and last == idx[-1] + 1
    unmasked = np.zeros(nk, bool)
    unmasked[full_lo:full_hi] = True
    assert not (unmasked & ~full[i]).any(), f"block {i}: an unmasked block needs the mask"


def test_mirrored_band_serves_the_transposed_direction():
  for band in BANDS:
    any_, _ = _brute(band, 70, 90, 16, 32, tail=90)
    for j in range(3):
      first, _, _, last = _tiling.block_runs(jnp.int32(j), owner_block=32, other_block=16,
                                           num_other=5, band=_tiling.mirrored(band),
                                           element_mask=False, other_len=None)
      assert np.flatnonzero(any_[:, j]).tolist() == list(range(int(first), int(last))) or \
          not any_[:, j].any()


def test_params_band_combines_causal_and_window():
  p = lambda **kw: AttentionParams(scale=1.0, has_segments=False, **kw)  # noqa: E731
  assert p(is_causal=False).band == (None, None)
  assert p(is_causal=True).band == (None, 0)
  assert p(is_causal=True, local_window=(4, 9)).band == (-4, 0)
  assert p(is_causal=False, local_window=(4, 9)).band == (-4, 9)


def test_segment_limits_are_block_diagonal_for_sorted_ids():
  # Documents of lengths 20, 44, 30 packed into 96 tokens, then 32 tokens of padding.
  ids = np.repeat([0, 1, 2], [20, 44, 30])
  q_seg = np.concatenate([ids, np.full(34, Q_PAD_SEGMENT)])[None]
  kv_seg = np.concatenate([ids, np.full(34, KV_PAD_SEGMENT)])[None]
  kv_lim, q_lim = _tiling.segment_block_limits(jnp.asarray(q_seg, jnp.int32),
                                             jnp.asarray(kv_seg, jnp.int32), block_q=16,
                                             block_kv=32)
  shares = (q_seg[0, :, None] == kv_seg[0, None, :]) & (q_seg[0, :, None] >= 0)
  blocks = shares.reshape(8, 16, 4, 32).any((1, 3))
  for i in range(8):
    idx = np.flatnonzero(blocks[i])
    want = (idx[0], idx[-1] + 1) if idx.size else (0, 0)
    assert tuple(np.asarray(kv_lim[0, i, :2]).tolist()) == want
  for j in range(4):
    idx = np.flatnonzero(blocks[:, j])
    want = (idx[0], idx[-1] + 1) if idx.size else (0, 0)
    assert tuple(np.asarray(q_lim[0, j, :2]).tolist()) == want


def test_segment_limits_are_a_superset_for_unsorted_ids():
  rng = np.random.default_rng(0)
  limits = jitted(_tiling.segment_block_limits, block_q=16, block_kv=16)
  for _ in range(5):
    q_seg = rng.integers(0, 4, (2, 64)).astype(np.int32)
    kv_seg = rng.integers(0, 4, (2, 48)).astype(np.int32)
    kv_lim = np.asarray(limits(jnp.asarray(q_seg), jnp.asarray(kv_seg))[0])
    shares = q_seg[:, :, None] == kv_seg[:, None, :]
    blocks = shares.reshape(2, 4, 16, 3, 16).any((2, 4))
    for b, i in itertools.product(range(2), range(4)):
      first, last, full_first, full_last = kv_lim[b, i].tolist()
      assert all(first <= j < last for j in np.flatnonzero(blocks[b, i]))
      assert full_first == full_last  # random ids: no block is one document throughout


@pytest.mark.parametrize("block_q,block_kv", [(16, 16), (16, 32), (32, 16)])
def test_segment_full_runs_are_exactly_the_single_document_blocks(block_q, block_kv):
  # Sorted documents with padding ids at the end: a (q, kv) block pair is "full" iff every
  # position of both blocks carries the same real id.
  ids = np.repeat([0, 1, 2, 3], [40, 70, 9, 25])  # 144 real tokens, then 16 pad
  q_seg = np.concatenate([ids, np.full(16, Q_PAD_SEGMENT)])[None].astype(np.int32)
  kv_seg = np.concatenate([ids, np.full(16, KV_PAD_SEGMENT)])[None].astype(np.int32)
  kv_lim, q_lim = (np.asarray(x) for x in jitted(
      _tiling.segment_block_limits, block_q=block_q, block_kv=block_kv)(jnp.asarray(q_seg),
                                                                        jnp.asarray(kv_seg)))
  qb, kb = q_seg[0].reshape(-1, block_q), kv_seg[0].reshape(-1, block_kv)
  single_q = (qb == qb[:, :1]).all(1) & (qb[:, 0] >= 0)
  single_k = (kb == kb[:, :1]).all(1) & (kb[:, 0] >= 0)
  full = single_q[:, None] & single_k[None, :] & (qb[:, :1] == kb[:, 0][None, :])
  for lim, f in ((kv_lim, full), (q_lim, full.T)):
    for i, row in enumerate(f):
      idx = np.flatnonzero(row)
      want = (idx[0], idx[-1] + 1) if idx.size else (0, 0)
      got = tuple(lim[0, i, 2:].tolist())
      assert got == want or (not idx.size and got[0] == got[1]), (i, got, want)


def test_fraction_computed():
  assert _tiling.fraction_computed(q_len=1024, kv_len=1024, block_q=128, block_kv=128,
                                 band=(None, None)) == 1.0
  frac = _tiling.fraction_computed(q_len=32768, kv_len=32768, block_q=128, block_kv=128,
                                 band=(-4095, 0))
  assert frac == (sum(range(1, 33)) + 224 * 33) / 256**2  # ramp-up, then 33 blocks per row
