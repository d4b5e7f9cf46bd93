"""Where one attention call's GPU time goes, per kernel, ours against cuDNN.

On the GPU machine, from the repository root:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/attention_profile.py
      [--shapes 4x4096x16x128 2x16384x8x128x4] [--causal no] [--mode fwdbwd]
      [--impl mosaic cudnn] [--calls 10] [--warm-s 3] [--repeat 1] [--interleaved ITERS]
      [--keep-traces] [--out DIR]

For each shape and implementation: compiles the benchmark's step (`bench.timing.make_step`,
bf16 random inputs; one compile per process), runs it twice, then for `--warm-s` seconds (the
benchmark's loops run at the GPU's power cap, at lower clocks than a trace right after
compiling sees), then traces `--calls` back-to-back calls with `jax.profiler` and sums the
GPU kernels' time per kernel name, per call (with each kernel's shortest and longest launch).
Where `nvidia-smi` exists it samples the SM clock and the power draw meanwhile (the median of
the samples of the last second). The attention's own kernels sit beside their helpers (our
memset of the dQ buffer, dot(dO, O), dQ's scale and cast; cuDNN's own), so the table shows
which of them makes a difference in the ratio the benchmark prints. Also the traced span per
call and the GPU idle time inside it. `--repeat N` profiles the implementations N times in
turn (the run-to-run spread at the power cap); `--interleaved ITERS` also times them as the
benchmark does and then traces those loops (their kernels' time per call against the clock's).
DIR/attention_profile.json has the numbers; traces stay under DIR/traces.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import jax

from pallas_flash.bench import flops, timing, variants

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step_profile import idle_gaps, read_trace  # noqa: E402


def _sampler():
  """An nvidia-smi process printing "SM MHz, W" lines every 100 ms, or None without one."""
  if not shutil.which("nvidia-smi"):
    return None
  return subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                           "--format=csv,noheader,nounits", "-lms", "100"],
                          stdout=subprocess.PIPE, text=True)


def _clocks(sampler, last: int = 10) -> dict:
  """Median SM clock (MHz) and power (W) of the sampler's last `last` samples."""
  if sampler is None:
    return {}
  sampler.terminate()
  rows = []
  for line in sampler.communicate()[0].splitlines():
    try:
      rows.append([float(x) for x in line.split(",")])
    except ValueError:
      continue
  rows = rows[-last:]
  if not rows:
    return {}
  return dict(sm_mhz=statistics.median(r[0] for r in rows),
              power_w=statistics.median(r[1] for r in rows))


_TRACES = itertools.count()


@functools.cache
def _compiled(impl: str, spec, mode: str, causal: bool):
  """(bf16 inputs, the compiled benchmark step) of impl at spec; one compile per process."""
  import jax.numpy as jnp
  from pallas_flash.bench import shapes

  args = shapes.make_inputs(spec, jnp.bfloat16)
  return args, timing.compile_step(timing.make_step(impl, mode=mode, is_causal=causal), args)[0]


def profile(impl: str, spec, *, mode: str, causal: bool, calls: int, warm_s: float,
            out_dir: str, keep: bool) -> dict:
  """Per-call kernel times (ms) of `calls` traced calls of impl's step at spec."""
  args, step = _compiled(impl, spec, mode, causal)
  for _ in range(2):
    out = step(*args)
  jax.block_until_ready(out)
  # Sustained load takes the GPU to its power cap (and lower clocks), where the benchmark's
  # loops run; a trace right after compiling catches boost clocks.
  sampler, start = _sampler(), time.perf_counter()
  while time.perf_counter() - start < warm_s:
    for _ in range(5):
      out = step(*args)
    jax.block_until_ready(out)
  trace_dir = os.path.join(out_dir, "traces",
                           f"{spec.name}_{impl}_{'c' if causal else 'nc'}_{next(_TRACES)}")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(calls):
      out = step(*args)
    jax.block_until_ready(out)
  clocks = _clocks(sampler)
  traces = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
  if not traces:
    raise SystemExit(f"no trace written under {trace_dir}")
  if keep:
    shutil.copy(traces[-1], trace_dir + ".trace.json.gz")
  events, _ = read_trace(traces[-1])
  # A name launched n times per call (both our kernels are "anonymous" at some shapes) is
  # keyed by its launch's place in the call: name, name#2, ...
  per_call = collections.Counter(name for _, _, name in events)
  seen, per_kernel = collections.Counter(), collections.defaultdict(list)
  for start, stop, name in events:
    n = per_call[name] // calls
    k = seen[name] % n if n > 1 else 0
    seen[name] += 1
    per_kernel[name + (f"#{k + 1}" if k else "")].append(stop - start)
  idle, _ = idle_gaps(events)
  span_ms = (events[-1][1] - events[0][0]) / 1e3 / calls if events else 0.0
  f = flops.attention_flops(spec, is_causal=causal, mode=mode)
  kernel_ms = {k: sum(d) / 1e3 / calls for k, d in per_kernel.items()}
  return dict(impl=impl, **clocks, span_ms=span_ms, idle_ms=idle / 1e3 / calls,
              kernels_ms=sum(kernel_ms.values()),
              tflops_span=flops.tflops(f, span_ms / 1e3) if span_ms else None,
              kernel_ms=kernel_ms,
              kernel_range_ms={k: (min(d) / 1e3, max(d) / 1e3) for k, d in per_kernel.items()},
              q_address=hex(args[0].unsafe_buffer_pointer()),
              calls={k: len(d) / calls for k, d in per_kernel.items()})


def interleaved(spec, impls: list[str], *, mode: str, causal: bool, owners: dict[str, str],
                iters: int, out_dir: str) -> dict:
  """The benchmark's timing (bench.timing.time_interleaved) of impls, then the same once more
  traced: per impl, ms per call by the host's clock and by its kernels inside the benchmark's
  loops (owners: {kernel name: impl}, from each impl's own trace)."""
  compiled = {i: _compiled(i, spec, mode, causal)[1] for i in impls}
  args = _compiled(impls[0], spec, mode, causal)[0]
  timed = timing.time_interleaved(compiled, args, iters=iters, settle_s=1.0)  # as the bench
  trace_dir = os.path.join(out_dir, "traces", f"{spec.name}_interleaved")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    traced = timing.time_interleaved(compiled, args, iters=len(impls))
  traces = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
  events, _ = read_trace(traces[-1])
  kernel_us = collections.Counter()
  for start, stop, name in events:
    kernel_us[owners.get(name.split("#")[0], "other")] += stop - start
  rows = {}
  for i in impls:
    # time_interleaved's warm-up and sizing calls, then its loops.
    calls = 2 + len(traced[i].loop_s) * traced[i].calls_per_loop
    rows[i] = dict(bench_ms=timed[i].median_s * 1e3, traced_ms=traced[i].median_s * 1e3,
                   kernels_ms=kernel_us[i] / 1e3 / calls)
  rows["other_kernels_ms"] = kernel_us["other"] / 1e3
  return rows


def report(spec_name: str, causal: bool, rows: list[dict]) -> str:
  lines = [f"== {spec_name} {'causal' if causal else 'non-causal'}"]
  for r in rows:
    rate = f"{r['tflops_span']:.0f}" if r["tflops_span"] else "-"
    lines.append(f"[{r['impl']}] q at {r['q_address']}, span {r['span_ms']:.3f} ms per call "
                 f"({rate} TFLOP/s), kernels {r['kernels_ms']:.3f}, idle {r['idle_ms']:.3f}"
                 + (f"; {r['sm_mhz']:.0f} MHz, {r['power_w']:.0f} W" if "sm_mhz" in r else ""))
    for name, ms in sorted(r["kernel_ms"].items(), key=lambda kv: -kv[1]):
      lo, hi = r["kernel_range_ms"][name]
      lines.append(f"  {ms:8.3f} ms ({lo:.3f}-{hi:.3f}) {r['calls'][name]:4.1f}x  {name[:100]}")
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", nargs="+", default=["4x4096x16x128", "2x16384x8x128x4"],
                 help="BxTxHxD or BxTxHxDxK")
  p.add_argument("--causal", choices=("yes", "no", "both"), default="no")
  p.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwdbwd")
  p.add_argument("--impl", nargs="+", default=["mosaic", "cudnn"])
  p.add_argument("--calls", type=int, default=10)
  p.add_argument("--warm-s", type=float, default=0.0,
                 help="seconds of back-to-back calls before the trace (power-capped clocks)")
  p.add_argument("--interleaved", type=int, default=0, metavar="ITERS",
                 help="also time the impls as the benchmark does (ITERS rounds), then trace "
                      "its loops: their kernels' ms per call against the clock's")
  p.add_argument("--repeat", type=int, default=1,
                 help="profile the impls this many times in turn (one compile each)")
  p.add_argument("--keep-traces", action="store_true", help="copy each trace into DIR")
  p.add_argument("--out", default=os.environ.get("OUT", "attention_profile"))
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
  results = []
  for name in args.shapes:
    spec = variants.parse_shape(name)
    for causal in causals:
      rows = [profile(impl, spec, mode=args.mode, causal=causal, calls=args.calls,
                      warm_s=args.warm_s, out_dir=args.out, keep=args.keep_traces)
              for _ in range(args.repeat) for impl in args.impl]
      print(report(name, causal, rows), flush=True)
      results.append(dict(shape=name, causal=causal, mode=args.mode, rows=rows))
      if args.interleaved:
        owners = {k.split("#")[0]: r["impl"] for r in rows for k in r["kernel_ms"]}
        inter = interleaved(spec, args.impl, mode=args.mode, causal=causal, owners=owners,
                            iters=args.interleaved, out_dir=args.out)
        for impl, r in inter.items():
          print(f"  interleaved [{impl}] " + (f"{r:.3f} ms of kernels no impl owns"
                if impl == "other_kernels_ms" else ", ".join(
                    f"{k} {v:.3f}" for k, v in r.items())), flush=True)
        results[-1]["interleaved"] = inter
  with open(os.path.join(args.out, "attention_profile.json"), "w") as f:
    json.dump(dict(args=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
  sys.exit(main())
