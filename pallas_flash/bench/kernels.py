"""Where a call's device time goes (`--kernels`): each XLA op's time per call, from a profile.

The call runs a few times under `jax.profiler`; the trace's device events (GPU kernels on the
GPU's stream lines, or the host's XLA op events on a CPU) are summed per HLO op and divided by
the calls. The features grid prints them under each row, so that a slow feature shows which of
its kernels (the forward, dQ, dK/dV, XLA's pads and reductions) holds the time. The profiler adds
no work to the kernels, but these are one loop's times, not the interleaved rounds' medians:
read them as shares, not as the row's speed.
"""

from __future__ import annotations

import glob
import os
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Callable

import jax

CALLS = 5
_SKIPPED_LINES = ("XLA Ops", "XLA Modules", "Launch Stats", "Steps", "Framework")


def _events(plane):
  """(line name, event) of a plane's lines that hold executed work, not derived summaries."""
  for line in plane.lines:
    if not line.name.startswith(_SKIPPED_LINES):
      for event in line.events:
        yield line.name, event


def op_times(profile: jax.profiler.ProfileData, calls: int) -> dict[str, float]:
  """Microseconds per call of each HLO op, largest first. An op's name is its `hlo_op` with
  the kernel's name where they differ; where one name runs k times a call (the kernels of a
  command buffer share its op, and Mosaic's kernels one name), its launches are told apart
  by their order within the call, "#1" .. "#k". Device planes are read where the trace has
  any (a GPU); otherwise the host's, whose XLA op events carry the same `hlo_op` statistic."""
  planes = [p for p in profile.planes if p.name.startswith("/device:")]
  planes = [p for p in planes if any(True for _ in _events(p))] or [
      p for p in profile.planes if p.name.startswith("/host:CPU")]
  launches: dict[str, list[tuple[float, float]]] = defaultdict(list)  # name -> (start, µs)
  for plane in planes:
    for _, event in _events(plane):
      with warnings.catch_warnings():  # jaxlib's event_stats type lacks a __module__
        warnings.simplefilter("ignore", DeprecationWarning)
        stats = dict(event.stats)
      op = stats.get("hlo_op")
      if op is None:
        continue
      name = op if event.name in (op, "") else f"{op} ({event.name})"
      launches[name].append((event.start_ns, event.duration_ns / 1e3))
  total: dict[str, float] = defaultdict(float)
  for name, runs in launches.items():
    per_call = len(runs) // calls if len(runs) % calls == 0 else 1
    for i, (_, us) in enumerate(sorted(runs)):
      label = name if per_call == 1 else f"{name} #{i % per_call + 1}"
      total[label] += us / calls
  return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def kernel_times(fn: Callable[[], object], calls: int = CALLS) -> dict[str, float]:
  """`op_times` of `calls` back-to-back calls of fn (compiled, no arguments), after one
  untimed call."""
  jax.block_until_ready(fn())
  with tempfile.TemporaryDirectory() as tmp:
    jax.profiler.start_trace(tmp)
    try:
      out = [fn() for _ in range(calls)]
      jax.block_until_ready(out)
    finally:
      jax.profiler.stop_trace()
    (path,) = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
    return op_times(jax.profiler.ProfileData.from_file(path), calls)


def summary(times: dict[str, float], top: int = 8, width: int = 70) -> list[str]:
  """Lines `µs  share  op` of the `top` largest ops and the rest together."""
  total = sum(times.values()) or 1.0
  items = list(times.items())
  lines = [f"{us:10.1f} µs {us / total:6.1%}  {name[:width]}" for name, us in items[:top]]
  if len(items) > top:
    rest = sum(us for _, us in items[top:])
    lines.append(f"{rest:10.1f} µs {rest / total:6.1%}  ({len(items) - top} more ops)")
  lines.append(f"{total:10.1f} µs  total device time per call")
  return lines
