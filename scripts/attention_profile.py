"""Where one attention call's GPU time goes, per kernel, ours against cuDNN.

On the GPU machine, from the repository root:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/attention_profile.py
      [--shapes 4x4096x16x128 2x16384x8x128x4] [--causal no] [--mode fwdbwd]
      [--impl mosaic cudnn] [--calls 10] [--out DIR]

For each shape and implementation: compiles the benchmark's step (`bench.timing.make_step`,
bf16 random inputs), runs it twice, then traces `--calls` back-to-back calls with
`jax.profiler` and sums the GPU kernels' time per kernel name, per call. The kernels of the
attention itself sit beside their helpers (our memset of the dQ buffer, dot(dO, O), dQ's scale
and cast; cuDNN's own), so the table shows which of them makes a difference in the ratio the
benchmark prints. Also the traced span per call and the GPU idle time inside it. The raw
traces stay in DIR; DIR/attention_profile.json has the numbers.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shutil
import sys

import jax

from pallas_flash.bench import flops, timing, variants

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step_profile import idle_gaps, read_trace  # noqa: E402


def profile(impl: str, spec, *, mode: str, causal: bool, calls: int, out_dir: str) -> dict:
  """Per-call kernel times (ms) of `calls` traced calls of impl's step at spec."""
  import jax.numpy as jnp
  from pallas_flash.bench import shapes

  args = shapes.make_inputs(spec, jnp.bfloat16)
  step = timing.compile_step(timing.make_step(impl, mode=mode, is_causal=causal), args)[0]
  for _ in range(2):
    out = step(*args)
  jax.block_until_ready(out)
  trace_dir = os.path.join(out_dir, f"trace_{spec.name}_{impl}_{'c' if causal else 'nc'}")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(calls):
      out = step(*args)
    jax.block_until_ready(out)
  traces = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
  if not traces:
    raise SystemExit(f"no trace written under {trace_dir}")
  shutil.copy(traces[-1], trace_dir + ".trace.json.gz")
  events, _ = read_trace(traces[-1])
  per_kernel = collections.defaultdict(list)
  for start, stop, name in events:
    per_kernel[name].append(stop - start)
  idle, _ = idle_gaps(events)
  span_ms = (events[-1][1] - events[0][0]) / 1e3 / calls if events else 0.0
  f = flops.attention_flops(spec, is_causal=causal, mode=mode)
  kernel_ms = {k: sum(d) / 1e3 / calls for k, d in per_kernel.items()}
  return dict(impl=impl, span_ms=span_ms, idle_ms=idle / 1e3 / calls,
              kernels_ms=sum(kernel_ms.values()),
              tflops_span=flops.tflops(f, span_ms / 1e3) if span_ms else None,
              kernel_ms=kernel_ms,
              calls={k: len(d) / calls for k, d in per_kernel.items()})


def report(spec_name: str, causal: bool, rows: list[dict]) -> str:
  lines = [f"== {spec_name} {'causal' if causal else 'non-causal'}"]
  for r in rows:
    rate = f"{r['tflops_span']:.0f}" if r["tflops_span"] else "-"
    lines.append(f"[{r['impl']}] span {r['span_ms']:.3f} ms per call ({rate} TFLOP/s), "
                 f"kernels {r['kernels_ms']:.3f}, idle {r['idle_ms']:.3f}")
    for name, ms in sorted(r["kernel_ms"].items(), key=lambda kv: -kv[1]):
      lines.append(f"  {ms:8.3f} ms {r['calls'][name]:4.1f}x  {name[:110]}")
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", nargs="+", default=["4x4096x16x128", "2x16384x8x128x4"],
                 help="BxTxHxD or BxTxHxDxK")
  p.add_argument("--causal", choices=("yes", "no", "both"), default="no")
  p.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwdbwd")
  p.add_argument("--impl", nargs="+", default=["mosaic", "cudnn"])
  p.add_argument("--calls", type=int, default=10)
  p.add_argument("--out", default=os.environ.get("OUT", "attention_profile"))
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
  results = []
  for name in args.shapes:
    spec = variants.parse_shape(name)
    for causal in causals:
      rows = [profile(impl, spec, mode=args.mode, causal=causal, calls=args.calls,
                      out_dir=args.out) for impl in args.impl]
      print(report(name, causal, rows), flush=True)
      results.append(dict(shape=name, causal=causal, mode=args.mode, rows=rows))
  with open(os.path.join(args.out, "attention_profile.json"), "w") as f:
    json.dump(dict(args=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
  sys.exit(main())
