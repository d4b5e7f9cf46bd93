"""Where a training step's GPU time goes, per kernel, for each attention side by side.

On the GPU machine, from the repository root:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/train_step_profile.py [--attention ours cudnn]
      [--preset h200-long] [--seq-len 16384] [--batch-size 2] [--steps 3] [--out DIR]

builds the preset's model once per attention (as `python -m train.compare throughput` does),
runs warm-up steps, then traces `--steps` steps with `jax.profiler` and sums the GPU kernels'
time per kernel name and per category (attention, matmul, other fusions, copies/collectives),
per step. The categories are named by pattern (KERNEL_CATEGORIES), so a kernel they miss shows
up under "other" and in the per-kernel table, never silently. `train.compare` says how fast a
step is; this says which kernels make the difference. The raw traces stay in DIR.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import time

# First match wins; applied to the kernel name (GPU stream events) in lower case.
KERNEL_CATEGORIES = (
    ("attention", r"cudnn|fmha|flash|sdpa|mosaic|_fwd_kernel|_bwd_|dkdv|attention|anonymous|body_"),
    ("matmul", r"gemm|nvjet|cutlass|wgmma|xmma|sm90_|cublas|matmul|dot"),
    ("copy/collective", r"memcpy|memset|copy|nccl|all[-_]?reduce|transpose"),
    ("fusion", r"fusion|loop_|input_|reduce|convert|broadcast|select|add|multiply|exp"),
)


def categorise(name: str) -> str:
  low = name.lower()
  for category, pattern in KERNEL_CATEGORIES:
    if re.search(pattern, low):
      return category
  return "other"


def _load(trace_path: str) -> tuple[list[dict], dict, dict]:
  """A perfetto/chrome trace's events, {pid: process name}, {(pid, tid): thread name}."""
  with gzip.open(trace_path, "rt") as f:
    events = json.load(f)["traceEvents"]
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e["pid"]] = e["args"]["name"]
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e["tid"])] = e["args"]["name"]
  return events, procs, threads


def read_trace(trace_path: str) -> tuple[list[tuple[float, float, str]], dict[str, list[float]]]:
  """From one perfetto/chrome trace (`jax.profiler.trace(..., create_perfetto_trace=True)`):
  the GPU kernels as (start µs, end µs, name), sorted, and the host's CUDA API calls as
  {name: [durations µs]}.

  Kernels are the events on the GPU process's stream lines; its derived lines ("XLA Ops",
  "XLA Modules", "Steps") repeat the same time at other granularities and are skipped."""
  events, procs, threads = _load(trace_path)
  kernels, api = [], collections.defaultdict(list)
  for e in events:
    if e.get("ph") != "X":
      continue
    dur = float(e.get("dur", 0.0))
    if "gpu" in procs.get(e.get("pid"), "").lower():
      if "stream" in threads.get((e["pid"], e.get("tid")), "").lower():
        kernels.append((float(e["ts"]), float(e["ts"]) + dur, e["name"]))
    elif re.match(r"cu[A-Z]|cuda[A-Z]", e.get("name", "")):
      api[e["name"]].append(dur)
  return sorted(kernels), dict(api)


def idle_gaps(kernels: list[tuple[float, float, str]], min_us: float = 1.0):
  """GPU idle time between the first kernel's start and the last one's end (no kernel on any
  stream), in µs, and {(kernel before, kernel after): [gaps µs]} for gaps of at least min_us."""
  idle, gaps, end, last = 0.0, collections.defaultdict(list), None, None
  for start, stop, name in kernels:
    if end is not None and start > end:
      idle += start - end
      if start - end >= min_us:
        gaps[(last, name)].append(start - end)
    if end is None or stop >= end:
      end, last = stop, name
  return idle, dict(gaps)


def line_names(trace_path: str) -> list[str]:
  """'process / thread' of every line in the trace (printed when no GPU stream is found)."""
  _, procs, threads = _load(trace_path)
  return sorted(f"{procs.get(pid, pid)} / {name}" for (pid, _), name in threads.items())


def profile_attention(args, attention: str, out_dir: str) -> dict:
  """Builds the model with `attention`, warms up, traces args.steps steps; per-step times."""
  import jax

  from train import compare
  from train.main import _shard_batch, build, check_environment, make_mesh
  from train.step import train_step

  cargs = argparse.Namespace(preset=args.preset, batch_size=args.batch_size,
                             implementation=args.implementation if attention == "ours" else None,
                             steps=args.steps, documents=0,
                             mosaic_config=args.mosaic_config if attention == "ours" else "",
                             remat_keeps_attention=args.remat_keeps_attention)
  cfg = compare._config(cargs, attention, args.seq_len)
  check_environment(cfg)
  mesh = make_mesh(jax.devices())
  model, optimizer = build(cfg, mesh)
  batch = _shard_batch(compare._random_batch(cfg, 0), mesh, accum_axis=True)
  for _ in range(2):  # compile, then one step so that autotuning and allocation are done
    out = train_step(model, optimizer, batch)
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for _ in range(args.steps):
    out = train_step(model, optimizer, batch)
  jax.block_until_ready(out)
  wall_ms = 1e3 * (time.perf_counter() - t0) / args.steps
  trace_dir = os.path.join(out_dir, f"trace_{attention}")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(args.steps):
      out = train_step(model, optimizer, batch)
    jax.block_until_ready(out)
  traces = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
  if not traces:
    raise SystemExit(f"no trace written under {trace_dir}")
  shutil.copy(traces[-1], os.path.join(out_dir, f"{attention}.trace.json.gz"))
  events, api = read_trace(traces[-1])
  if not events:
    print(f"[{attention}] no GPU stream events; lines in the trace:\n  "
          + "\n  ".join(line_names(traces[-1])), flush=True)
  kernels = collections.defaultdict(list)
  for start, stop, name in events:
    kernels[name].append(stop - start)
  idle, gaps = idle_gaps(events)
  n = args.steps
  top_gaps = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:15]
  return dict(attention=attention, wall_ms=wall_ms,
              kernel_ms={k: sum(d) / 1e3 / n for k, d in kernels.items()},
              calls={k: len(d) / n for k, d in kernels.items()},
              span_ms=(events[-1][1] - events[0][0]) / 1e3 / n if events else 0.0,
              idle_ms=idle / 1e3 / n,
              gaps=[dict(before=b, after=a, ms=sum(g) / 1e3 / n, count=len(g) / n,
                         mean_us=sum(g) / len(g)) for (b, a), g in top_gaps],
              cuda_api={k: dict(ms=sum(d) / 1e3 / n, calls=len(d) / n)
                        for k, d in sorted(api.items(), key=lambda kv: -sum(kv[1]))[:12]})


def report(results: list[dict], top: int) -> str:
  lines = []
  cats = [c for c, _ in KERNEL_CATEGORIES] + ["other"]
  head = f"{'ms per step':<22}" + "".join(f"{r['attention']:>12}" for r in results)
  lines += [head, "-" * len(head)]
  lines.append(f"{'wall (unprofiled)':<22}" + "".join(f"{r['wall_ms']:>12.2f}" for r in results))
  lines.append(f"{'traced span':<22}" + "".join(f"{r['span_ms']:>12.2f}" for r in results))
  lines.append(f"{'  GPU idle in it':<22}" + "".join(f"{r['idle_ms']:>12.2f}" for r in results))
  lines.append(f"{'GPU kernels, total':<22}"
               + "".join(f"{sum(r['kernel_ms'].values()):>12.2f}" for r in results))
  for c in cats:
    vals = [sum(v for k, v in r["kernel_ms"].items() if categorise(k) == c) for r in results]
    lines.append(f"{'  ' + c:<22}" + "".join(f"{v:>12.2f}" for v in vals))
  for r in results:
    lines += ["", f"[{r['attention']}] top {top} kernels: ms per step, calls per step, category"]
    ranked = sorted(r["kernel_ms"].items(), key=lambda kv: -kv[1])[:top]
    for name, ms in ranked:
      lines.append(f"  {ms:9.3f} {r['calls'][name]:6.1f}  {categorise(name):<16}{name[:110]}")
    lines += ["", f"[{r['attention']}] largest GPU idle gaps: ms per step, gaps per step, mean µs,"
              " kernel before -> kernel after"]
    for g in r["gaps"]:
      lines.append(f"  {g['ms']:9.3f} {g['count']:6.1f} {g['mean_us']:8.1f}  "
                   f"{str(g['before'])[:60]} -> {str(g['after'])[:60]}")
    lines += ["", f"[{r['attention']}] host CUDA API calls: ms per step, calls per step"]
    for name, c in r["cuda_api"].items():
      lines.append(f"  {c['ms']:9.3f} {c['calls']:8.1f}  {name[:100]}")
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--attention", nargs="+", default=["ours", "cudnn"])
  p.add_argument("--implementation", default=None, help="pallas_flash implementation for ours")
  p.add_argument("--preset", default="h200-long")
  p.add_argument("--mosaic-config", default="", help="ours: overrides of the tuned MosaicConfig")
  p.add_argument("--remat-keeps-attention", action=argparse.BooleanOptionalAction, default=None,
                 help="the rematerialised blocks keep attention's outputs (default: preset's)")
  p.add_argument("--seq-len", type=int, default=16_384)
  p.add_argument("--batch-size", type=int, default=2)
  p.add_argument("--steps", type=int, default=3, help="traced (and timed) steps per attention")
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--out", default=os.environ.get("OUT", "train_profile"))
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  results = []
  for attention in args.attention:
    results.append(profile_attention(args, attention, args.out))
    print(f"[{attention}] {results[-1]['wall_ms']:.2f} ms per step (unprofiled)", flush=True)
  text = report(results, args.top)
  print(text, flush=True)
  with open(os.path.join(args.out, "train_step_profile.json"), "w") as f:
    json.dump(dict(args=vars(args), results=results), f, indent=1)
  with open(os.path.join(args.out, "train_step_profile.txt"), "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  sys.exit(main())
