"""Attention benchmarks on the training model: throughput side by side, and the longest context.

  python -m train.compare throughput --attention ours cudnn xla --seq-len 16384 --json out.json
  python -m train.compare max-context --attention ours --start 16384 --json out.json

Every attention runs in its own subprocess, so that `peak_bytes_in_use` (a per-process high-water
mark) and any out-of-memory failure belong to that attention alone. Each row is printed (and the
--json file rewritten, with "complete": false until the end) as soon as its child reports it, so a
run cut off by an outer time limit still shows every length it reached. Data is random bytes with
plain causal attention (no segment ids): the jax.nn baselines have no segment ids, and a dense
document mask would make them slower for a reason that is not attention itself. `--documents N`
packs N documents of random lengths into each sequence (segment ids and per-document positions,
as packed text trains), to compare our implementations on that:

  python -m train.compare throughput --attention ours --implementation triton --documents 8

A throughput step time is the steady state of a training loop: (time of 1 + N steps − time of
1 step) / N, each run dispatched back to back and synchronised once, so the host's latency
before the first step (NNX's graph traversal, the CUDA graph's update and launch: 25-40 ms per
synchronised run at 16K on the H200, where a step takes ~180 ms) cancels instead of being
spread over N steps (`steady_step_seconds`: minima over up to three attempts, since host noise
can push a single difference below zero). `--rounds R` repeats the attentions in turn (ours,
cudnn, ours, cudnn, ...), since the GPU's clock drifts with its temperature; each row records
the SM clock, temperature and power draw after its timed steps (nvidia-smi, if present).
`scripts/train_step_profile.py` shows where a step's GPU time goes, kernel by kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

_RESULT = "RESULT "
_STARTED = "STARTED "  # a child begins a length (the parent echoes it to stderr)


def _config(args, attention: str, seq_len: int):
  from train.config import PRESETS

  cfg = PRESETS[args.preset]
  if args.remat_keeps_attention is not None:
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, remat_keeps_attention=args.remat_keeps_attention))
  return dataclasses.replace(
      cfg, attention=attention, seq_len=seq_len, batch_size=args.batch_size, grad_accum=1,
      segment_ids=args.documents > 1, task="retrieval",
      implementation=(args.implementation if attention == "ours" else None),
      steps=max(cfg.steps, 2 * args.steps + 4), warmup_steps=1)


def _random_batch(cfg, seed: int, documents: int = 0) -> dict:
  """Random tokens [1, B, T]; with `documents`, that many packed documents of random lengths
  per row (sorted segment ids, positions restarting at each document)."""
  import numpy as np

  rng = np.random.default_rng(seed)
  tok = rng.integers(0, cfg.model.vocab_size, (1, cfg.batch_size, cfg.seq_len + 1), np.int32)
  shape = tok[..., 1:].shape
  pos = np.arange(cfg.seq_len, dtype=np.int32)
  batch = dict(tokens=tok[..., :-1], targets=tok[..., 1:], loss_mask=np.ones(shape, np.float32),
               positions=np.broadcast_to(pos, shape))
  if documents > 1:
    starts = np.sort(rng.choice(np.arange(1, cfg.seq_len), (*shape[:2], documents - 1),
                                replace=False), axis=-1)
    seg = (pos[None, None, :, None] >= starts[..., None, :]).sum(-1).astype(np.int32)
    first = np.concatenate([np.zeros((*shape[:2], 1), np.int32), starts], -1)
    batch.update(segment_ids=seg,
                 positions=(pos - np.take_along_axis(first, seg, -1)).astype(np.int32))
  return batch


def _measure(cfg, steps: int, model=None, optimizer=None, documents: int = 0) -> dict:
  """Compiles and runs `steps` train steps; tokens/s, MFU and peak memory of this process."""
  import jax

  from train import metrics
  from train.main import _shard_batch, build, check_environment, make_mesh
  from train.step import train_step

  devices = jax.devices()
  mesh = make_mesh(devices)
  if model is None:
    check_environment(cfg)
    model, optimizer = build(cfg, mesh)
  batch = _shard_batch(_random_batch(cfg, 0, documents), mesh, accum_axis=True)
  t0 = time.perf_counter()
  loss = float(train_step(model, optimizer, batch)["loss"])  # compile + first step
  compile_s = time.perf_counter() - t0

  def run(n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
      out = train_step(model, optimizer, batch)
    jax.block_until_ready(out)
    return time.perf_counter() - t0

  latency_s = None
  if steps > 1:  # steady state: the latency before the first step cancels (module docstring)
    step_s, latency_s = steady_step_seconds(run, steps)
  else:
    step_s = run(1)
  tokens_per_s = cfg.seq_len * cfg.batch_size / step_s
  peak = metrics.peak_flops(devices[0])
  flops = cfg.model.flops_per_token(cfg.seq_len) * tokens_per_s
  mem = metrics.peak_memory_bytes(devices[0])
  return dict(attention=cfg.attention, implementation=cfg.implementation,
              remat_keeps_attention=cfg.model.remat_keeps_attention, seq_len=cfg.seq_len,
              batch_size=cfg.batch_size, step_ms=1e3 * step_s, tokens_per_s=tokens_per_s,
              mfu=None if peak is None else flops / (peak * len(devices)),
              peak_gib=None if mem is None else mem / 2**30, compile_s=compile_s,
              first_loss=loss, status="ok", device=devices[0].device_kind, gpu=_gpu_state(),
              sync_latency_ms=None if latency_s is None else 1e3 * latency_s)


def steady_step_seconds(run, steps: int, attempts: int = 3) -> tuple[float, float | None]:
  """(seconds per steady-state step, synchronisation latency in seconds or None).

  `run(n)` times n steps dispatched back to back and synchronised once. The step time is
  (min over attempts of run(1 + steps) − min of run(1)) / steps: a single pair can come out
  negative when something else on the host slows the one-step run (seen on a loaded 2-core CI
  machine), and the minimum is what interference cannot push down. Where no attempt separates
  the two, the latency cannot be told from the noise: the mean over 1 + steps steps, and None.
  """
  ones, manys = [], []
  for _ in range(attempts):
    ones.append(run(1))
    manys.append(run(1 + steps))
    one, many = min(ones), min(manys)
    if many > one:
      step_s = (many - one) / steps
      return step_s, one - step_s
  return min(manys) / (1 + steps), None


def _gpu_state() -> str | None:
  """'SM clock MHz, temperature C, power W' from nvidia-smi, or None without one."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,temperature.gpu,power.draw",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() \
      else None


def _child_throughput(args, attention: str) -> list[dict]:
  return [_measure(_config(args, attention, args.seq_len), args.steps,
                   documents=args.documents)]


def _child_max_context(args, attention: str) -> list[dict]:
  """Doubles seq_len from --start until one training step fails or --time-limit is spent."""
  import jax

  from train.main import build, check_environment, make_mesh

  results, seq_len, t0 = [], args.start, time.time()
  model = optimizer = None
  while seq_len <= args.max and time.time() - t0 < args.time_limit:
    cfg = _config(args, attention, seq_len)
    print(_STARTED + json.dumps(dict(attention=attention, seq_len=seq_len)), flush=True)
    try:
      if model is None:  # parameters do not depend on seq_len: build once
        check_environment(cfg)
        model, optimizer = build(cfg, make_mesh(jax.devices()))
      results.append(_measure(cfg, 1, model, optimizer))
    except Exception as e:  # noqa: BLE001  (out of memory surfaces as several error types)
      results.append(dict(attention=attention, seq_len=seq_len, status="failed",
                          error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
      print(_RESULT + json.dumps(results[-1]), flush=True)
      break
    print(_RESULT + json.dumps(results[-1]), flush=True)
    seq_len *= 2
  return results


def _run_child(args, attention: str, on_row=lambda row: None, cmd=None) -> list[dict]:
  """Runs one attention in a fresh process; streams its RESULT lines to `on_row` as they come.

  The child is killed after --time-limit + 300 s (a length already started may run past
  --time-limit), and when this process is interrupted or terminated.
  """
  cmd = cmd or [sys.executable, "-m", "train.compare", args.mode, "--child", "--attention",
                attention, *_forward_flags(args)]
  rows, timed_out = [], threading.Event()
  with tempfile.TemporaryFile("w+") as err_file:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, text=True, bufsize=1)

    def kill():
      timed_out.set()
      proc.kill()

    timer = threading.Timer(args.time_limit + 300, kill)
    timer.start()
    try:
      for line in proc.stdout:
        if line.startswith(_RESULT):
          rows.append(json.loads(line[len(_RESULT):]))
          on_row(rows[-1])
        elif line.startswith(_STARTED):
          started = json.loads(line[len(_STARTED):])
          print(f"[{started['attention']}] seq_len {started['seq_len']}: started "
                f"(compile + one step)", file=sys.stderr, flush=True)
      rc = proc.wait()
    finally:
      timer.cancel()
      if proc.poll() is None:  # interrupted: do not leave the child holding the GPU
        proc.kill()
        proc.wait()
    err_file.seek(0)
    err = "timeout" if timed_out.is_set() else err_file.read()
  if rc != 0 and not any(r["status"] == "failed" for r in rows):
    rows.append(dict(attention=attention, seq_len=None, status="failed",
                     error=f"exit {rc}: {_error_line(err)}"))
    on_row(rows[-1])
  return rows


def _error_line(stderr: str | None) -> str:
  """The line of a child's stderr that names the error (not JAX's traceback-filter notice)."""
  lines = [ln for ln in (stderr or "").strip().splitlines() if ln.strip()]
  named = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b", ln)
           or "cannot run" in ln]
  return ((named or lines or ["no output"])[-1])[:300]


def _forward_flags(args) -> list[str]:
  flags = ["--preset", args.preset, "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--start", str(args.start),
           "--max", str(args.max), "--time-limit", str(args.time_limit),
           "--documents", str(args.documents)]
  if args.implementation:
    flags += ["--implementation", args.implementation]
  if args.remat_keeps_attention is not None:
    flags += ["--remat-keeps-attention" if args.remat_keeps_attention
              else "--no-remat-keeps-attention"]
  return flags


def format_header() -> str:
  head = f"{'attention':<18}{'seq_len':>9}{'tokens/s':>11}{'MFU':>7}{'step ms':>10}" \
         f"{'peak GiB':>10}{'compile s':>11}  status"
  return head + "\n" + "-" * len(head)


def format_row(r: dict) -> str:
  fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
  name = r["attention"] + (f"({r['implementation']})" if r.get("implementation") else "")
  return (f"{name:<18}{fmt(r.get('seq_len'), 'd'):>9}{fmt(r.get('tokens_per_s'), ',.0f'):>11}"
          f"{fmt(r.get('mfu') and 100 * r['mfu'], '.1f'):>7}{fmt(r.get('step_ms'), '.1f'):>10}"
          f"{fmt(r.get('peak_gib'), '.2f'):>10}{fmt(r.get('compile_s'), '.1f'):>11}  "
          f"{r['status']}{' ' + r['error'] if r.get('error') else ''}"
          f"{'  [GPU ' + r['gpu'] + ']' if r.get('gpu') else ''}")


def _write_json(path: str, mode: str, rows: list[dict], complete: bool) -> None:
  """Rewrites the whole file atomically, so that a reader never sees half of it."""
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump({"mode": mode, "complete": complete, "rows": rows}, f, indent=1)
  os.replace(tmp, path)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m train.compare", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("mode", choices=("throughput", "max-context"))
  p.add_argument("--attention", nargs="+", default=["ours", "cudnn", "xla"])
  p.add_argument("--preset", default="h200-long")
  p.add_argument("--implementation", default=None, help="pallas_flash implementation for ours")
  p.add_argument("--remat-keeps-attention", action=argparse.BooleanOptionalAction, default=None,
                 help="the rematerialised blocks keep attention's outputs (ModelConfig; "
                      "default: the preset's)")
  p.add_argument("--seq-len", type=int, default=16_384, help="throughput: tokens per sequence")
  p.add_argument("--batch-size", type=int, default=1)
  p.add_argument("--steps", type=int, default=5,
                 help="throughput: steady-state steps timed after compile (module docstring)")
  p.add_argument("--rounds", type=int, default=1,
                 help="throughput: run the --attention list this many times in turn")
  p.add_argument("--documents", type=int, default=0,
                 help="throughput: packed documents per sequence (segment ids); 0: one stream")
  p.add_argument("--start", type=int, default=16_384, help="max-context: first length")
  p.add_argument("--max", type=int, default=1 << 20, help="max-context: last length tried")
  p.add_argument("--time-limit", type=float, default=180.0,
                 help="seconds per attention before no new length is started")
  p.add_argument("--json", default=None, help="also write the rows to this JSON file")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  return p


def main(argv=None) -> list[dict]:
  args = _parser().parse_args(argv)
  if args.child:
    run = _child_throughput if args.mode == "throughput" else _child_max_context
    rows = run(args, args.attention[0])
    if args.mode == "throughput":
      print(_RESULT + json.dumps(rows[0]), flush=True)
    return rows
  if threading.current_thread() is threading.main_thread():
    # `timeout` and job schedulers send SIGTERM: unwind so that the child is killed (finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
  rows: list[dict] = []

  def on_row(row: dict) -> None:
    rows.append(row)
    print(format_row(row), flush=True)
    if args.json:
      _write_json(args.json, args.mode, rows, complete=False)

  print(format_header(), flush=True)
  for _ in range(args.rounds if args.mode == "throughput" else 1):
    for attention in args.attention:
      _run_child(args, attention, on_row)
  if args.json:
    _write_json(args.json, args.mode, rows, complete=True)
  return rows


if __name__ == "__main__":
  main()
