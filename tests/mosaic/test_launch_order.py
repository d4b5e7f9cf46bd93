"""The order in which the Mosaic grid kernels' CTAs start (`_common.launch_grid`).

Mosaic GPU reverses `plgpu.kernel`'s grid into CUDA's (x, y, z) (jax/_src/pallas/mosaic_gpu/
lowering.py, `parallel_grid[::-1]`) and CTAs are dispatched x fastest, so the grid's *last*
axis varies fastest: a row-major walk of the grid is the launch order. Until the eighth
session launch_grid assumed the first axis, and each value of heads_fastest built the other's
grid; these tests pin the order each value names.
"""

import itertools

import pytest

from pallas_flash.mosaic_gpu import _common

TILES, HEADS, BATCH = 3, 4, 2


def _launches(monkeypatch, **kw):
  """(tile, head, batch) of every CTA, in launch order, through launch_grid's grid and
  tile_and_head's decoding of it (axis_index replaced by the walk's indices)."""
  names = ("t", "h", "b")
  launch = _common.launch_grid(TILES, HEADS, BATCH, names, **kw)
  order = []
  for idx in itertools.product(*map(range, launch["grid"])):
    at = dict(zip(launch["grid_names"], idx))
    monkeypatch.setattr(_common.lax, "axis_index", lambda name, at=at: at[name])
    # The batch axis is read by name wherever it sits: tile_and_head has no batch_slowest.
    tile, head = _common.tile_and_head(names[:2], HEADS, **{
        k: v for k, v in kw.items() if k != "batch_slowest"})
    order.append((int(tile), int(head), at["b"]))
  return order


@pytest.mark.parametrize("kw", [dict(heads_fastest=False), dict(heads_fastest=True),
                                dict(heads_fastest=True, head_group=2)],
                         ids=["tiles_fastest", "heads_fastest", "head_group2"])
def test_every_cta_once(monkeypatch, kw):
  order = _launches(monkeypatch, **kw)
  assert sorted(order) == list(itertools.product(range(TILES), range(HEADS), range(BATCH)))


def test_tiles_fastest_runs_one_head_at_a_time(monkeypatch):
  # After the batch entries: every tile of head 0, then of head 1, ...
  assert _launches(monkeypatch, heads_fastest=False) == [
      (t, h, b) for h in range(HEADS) for t in range(TILES) for b in range(BATCH)]


def test_heads_fastest_runs_one_tile_of_every_head_first(monkeypatch):
  assert _launches(monkeypatch, heads_fastest=True) == [
      (t, h, b) for t in range(TILES) for h in range(HEADS) for b in range(BATCH)]


def test_head_groups_take_all_their_tiles_before_the_next_group(monkeypatch):
  g = 2
  assert _launches(monkeypatch, heads_fastest=True, head_group=g) == [
      (t, grp * g + hh, b) for grp in range(HEADS // g) for t in range(TILES)
      for hh in range(g) for b in range(BATCH)]


@pytest.mark.parametrize("heads_fastest", [False, True], ids=["tiles_fastest", "heads_fastest"])
def test_batch_slowest_runs_one_batch_entry_at_a_time(monkeypatch, heads_fastest):
  inner = [(t, h) for h in range(HEADS) for t in range(TILES)]
  if heads_fastest:
    inner = [(t, h) for t in range(TILES) for h in range(HEADS)]
  assert _launches(monkeypatch, heads_fastest=heads_fastest, batch_slowest=True) == [
      (t, h, b) for b in range(BATCH) for t, h in inner]
