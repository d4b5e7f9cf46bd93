"""Where the Mosaic forward's time goes, per warpgroup and named region, from Mosaic's profiler.

On the GPU machine, from the repository root:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/mosaic_profile.py [--shape B,T,H,D]
      [--causal] [--backward] [--out DIR] [key=value ...]

runs the forward once with `MosaicConfig(profile_dir=...)` (the tuned config of the shape,
overridden by the key=value pairs), or with --backward the backward (the forward unprofiled:
the dK/dV kernel of the split path, or the fused kernel with fused_backward=True; the dQ
kernel is never profiled), and prints, for the consumer and producer warpgroups, the
share of each warpgroup's time spent in each named region of pallas_flash/mosaic_gpu/forward.py
(exclusive of nested regions; "(none)" is time outside every region, e.g. the wait at the end
of a run_state) and its mean length. Only the first PROFILE_STEPS (32) steps of each
warpgroup are recorded. The raw trace (Perfetto / chrome://tracing) stays in DIR.
Profiling adds a timer read per region boundary, so the kernel runs slower than unprofiled:
read the shares, not the absolute times. The profiler's event buffer takes 27,648 B of shared
memory per CTA (`_common.profiler_smem_bytes`): a fused_overlap kernel at head_dim 128 is
profiled with one dQ staging slot instead of two (`backward_fused.dq_slots`), and one with
fused_defer_dq does not fit at all (its four dSᵀ slots).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import sys
import tempfile

ROLES = {0: "consumer WG0", 1: "consumer WG1", 2: "producer WG2"}


def exclusive_times(events: list[dict], traces_per_block: int = 3) -> dict:
  """Per warpgroup index (0 .. traces_per_block-1): {region: [exclusive durations]} and the
  spans (first to last event) of its tracks, from one trace's B/E events.

  Tracks are keyed by `tid` (1 + warpgroup + traces_per_block * block); events of a track are
  in time order and properly nested. Time inside a track's span but outside every region is
  reported as the region "(none)".
  """
  tracks = collections.defaultdict(list)
  for ev in events:
    tracks[ev["tid"]].append(ev)
  out = {}
  for tid, evs in tracks.items():
    wg = (tid - 1) % traces_per_block
    regions, spans = out.setdefault(wg, (collections.defaultdict(list), []))
    stack = []  # [name, start, time spent in children]
    covered = 0.0
    for ev in evs:
      if ev["ph"] == "B":
        stack.append([ev["name"], ev["ts"], 0.0])
      else:
        name, start, children = stack.pop()
        length = ev["ts"] - start
        regions[name].append(length - children)
        if stack:
          stack[-1][2] += length
        else:
          covered += length
    span = evs[-1]["ts"] - evs[0]["ts"]
    spans.append(span)
    regions["(none)"].append(max(span - covered, 0.0))
  return out


def report(per_wg: dict) -> str:
  lines = []
  for wg in sorted(per_wg):
    regions, spans = per_wg[wg]
    total = sum(spans)
    lines.append(f"{ROLES.get(wg, f'WG{wg}')}: {len(spans)} tracks, mean span "
                 f"{total / max(len(spans), 1):.2f} us")
    rows = sorted(regions.items(), key=lambda kv: -sum(kv[1]))
    for name, times in rows:
      share = sum(times) / total if total else 0.0
      lines.append(f"  {name:<12} {100 * share:6.1f} %   mean {1e3 * sum(times) / len(times):9.1f}"
                   f" ns   x{len(times) / max(len(spans), 1):.1f} per track")
  return "\n".join(lines)


def merge(into: dict, part: dict) -> dict:
  for wg, (regions, spans) in part.items():
    r, s = into.setdefault(wg, (collections.defaultdict(list), []))
    for name, times in regions.items():
      r[name].extend(times)
    s.extend(spans)
  return into


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("overrides", nargs="*", help="MosaicConfig key=value")
  parser.add_argument("--shape", default="1,4096,16,128", help="B,T,H,D (S = T, K = H)")
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--backward", action="store_true", help="profile the backward kernel")
  parser.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp())
  args = parser.parse_args()

  import jax
  import jax.numpy as jnp

  import pallas_flash
  from pallas_flash.mosaic_gpu import backward, config as mconfig
  from pallas_flash.call import AttentionParams
  from mosaic_ptxas import parse_overrides  # beside this script, on sys.path when run

  b, t, h, d = (int(x) for x in args.shape.split(","))
  kw = parse_overrides(args.overrides)
  trace_dir = os.path.abspath(os.path.join(args.out, "mosaic_profile"))
  os.makedirs(trace_dir, exist_ok=True)
  plain = dataclasses.replace(mconfig.tuned(d, args.causal, t), **kw)
  config = dataclasses.replace(plain, profile_dir=trace_dir)
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in ks)
  before = set(glob.glob(os.path.join(trace_dir, "*-trace.json")))
  if args.backward:
    o, lse = pallas_flash.flash_attention(q, k, v, is_causal=args.causal,
                                          implementation="mosaic", config=plain,
                                          return_residuals=True)
    params = AttentionParams(scale=d ** -0.5, is_causal=args.causal, has_segments=False)
    out = backward(q, k, v, None, None, o, lse, do, None, params=params, config=config)
  else:
    out = pallas_flash.flash_attention(q, k, v, is_causal=args.causal,
                                       implementation="mosaic", config=config)
  jax.block_until_ready(out)
  jax.effects_barrier()  # the trace is written by a host callback
  new = sorted(set(glob.glob(os.path.join(trace_dir, "*-trace.json"))) - before)
  if not new:
    sys.exit(f"no trace was written to {trace_dir}")
  per_wg = {}
  for path in new:
    with open(path) as f:
      merge(per_wg, exclusive_times(json.load(f)["traceEvents"]))
  kind = "backward" if args.backward else "forward"
  print(f"{args.shape} causal={args.causal} {kind} {kw or ''} traces: {', '.join(new)}")
  print(report(per_wg))


if __name__ == "__main__":
  main()
