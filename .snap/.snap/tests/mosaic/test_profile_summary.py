"""scripts/mosaic_profile.py's trace summary on a hand-made Mosaic profiler trace (CPU)."""

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "mosaic_profile.py"
_SPEC = importlib.util.spec_from_file_location("mosaic_profile", _PATH)
mosaic_profile = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(mosaic_profile)


def _ev(name, ph, ts, tid):
  return dict(name=name, ph=ph, ts=ts, pid=1, tid=tid)


def test_exclusive_times_subtract_nested_regions_and_count_gaps():
  # Block 0: WG0 (tid 1) has an outer region with a nested one and a gap; WG2 (tid 3) one
  # region. Block 1: WG0 again (tid 4 = 1 + 0 + 3 * 1).
  events = [_ev("step", "B", 0.0, 1), _ev("softmax", "B", 1.0, 1), _ev("softmax", "E", 3.0, 1),
            _ev("step", "E", 4.0, 1), _ev("epilogue", "B", 6.0, 1), _ev("epilogue", "E", 7.0, 1),
            _ev("wait_free", "B", 0.0, 3), _ev("wait_free", "E", 5.0, 3),
            _ev("step", "B", 10.0, 4), _ev("step", "E", 12.0, 4)]
  per_wg = mosaic_profile.exclusive_times(events)
  regions, spans = per_wg[0]
  assert spans == [7.0, 2.0]
  assert regions["step"] == [2.0, 2.0]  # 4 - 2 nested, then the second block's 2
  assert regions["softmax"] == [2.0]
  assert regions["epilogue"] == [1.0]
  assert regions["(none)"] == [2.0, 0.0]  # 4 .. 6 outside every region
  regions, spans = per_wg[2]
  assert regions["wait_free"] == [5.0] and spans == [5.0]
  text = mosaic_profile.report(per_wg)
  assert "consumer WG0" in text and "producer WG2" in text


def test_unbalanced_trace_is_an_error():
  with pytest.raises(IndexError):
    mosaic_profile.exclusive_times([_ev("x", "E", 1.0, 1)])
