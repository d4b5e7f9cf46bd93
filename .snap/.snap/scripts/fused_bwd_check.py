"""Fused (FA3-style, 5-GEMM) vs split (7-GEMM) Mosaic GPU backward vs cuDNN on one Hopper GPU.

Run from the repository root on the GPU machine (about 3 minutes on an H200):

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/fused_bwd_check.py --json $OUT/fused_bwd.json

For each shape it compiles forward+backward (jax.vjp of attention, cotangent dO) once per
implementation, checks dq/dk/dv of the fused backward against the split backward and against
cuDNN (rel err max|x - ref| / max|ref| < 2e-2), runs the fused step twice more to see whether
dk/dv are bitwise stable (they should be; dq may differ in the last bits: float32 atomics),
then times the same compiled step: median of loops, TFLOP/s (forward+backward = 3.5 x
4·B·H·T²·D, halved when causal) and the ratio to cuDNN. Fused config variants run in a second
pass while the time budget lasts. Every configuration is wrapped so one failure does not stop
the run; failures print the first 300 characters of the exception.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash
from pallas_flash.bench import flops, shapes, timing
from pallas_flash.mosaic_gpu import TUNED

TOL = 2e-2
SHAPES = [  # B, T, H, D, causal (K = H, S = T, bf16)
    (4, 4096, 16, 128, False), (4, 4096, 16, 128, True),
    (1, 16384, 16, 128, False), (1, 16384, 16, 128, True),
    (4, 4096, 32, 64, False), (4, 4096, 32, 64, True),
]
GQA_CHECK = (2, 2048, 16, 4, 128, True)  # B, T, H, K, D, causal: fused vs split only
# Second pass, per head dim; each dict is applied to the fused config.
# fused_overlap with fused_dq_shared (2 stages) is the one configuration with both the matmul
# overlap and the double-buffered dQ staging at head_dim 128; without dq_shared it keeps one slot.
OVERLAP = dict(fused_dq_shared=True, fused_overlap=True)
VARIANTS = {
    128: [OVERLAP, dict(fused_dq_shared=True), dict(fused_overlap=True),
          dict(fused_dq_shared=True, fused_stages=3),
          dict(fused_dq_blocks=2),
          dict(fused_dq_shared=True, fused_stagger_q=True), dict(fused_stagger_q=True),
          dict(compute_registers=240, producer_registers=24)],
    64: [dict(fused_overlap=True), dict(block_q_fused=128), dict(block_kv_fused=128),
         dict(fused_stages=3)],
}


def _spec(b, t, h, d):
  return shapes.ShapeSpec(name=f"b{b}_t{t}_h{h}_d{d}", batch=b, seq_len=t, num_heads=h,
                          head_dim=d)


def _inputs(b, t, h, kh, d, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, h, d), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, t, kh, d), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, t, kh, d), jnp.bfloat16)
  do = jax.random.normal(ks[3], (b, t, h, d), jnp.bfloat16)
  return q, k, v, do


def _attention(impl, causal, config=None):
  if impl == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation="cudnn")
  return lambda q, k, v: pallas_flash.flash_attention(q, k, v, is_causal=causal,
                                                      implementation="mosaic", config=config)


def _compiled_step(attn, args):
  def step(q, k, v, do):
    _, vjp = jax.vjp(attn, q, k, v)
    return vjp(do)

  compiled, _ = timing.compile_step(jax.jit(step), args)
  return compiled


def _rel(x, ref):
  x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
  return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-30))


def _errors(grads, ref):
  return {n: _rel(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref)}


def _fmt_err(errs):
  if errs is None:
    return "-"
  ok = all(e < TOL for e in errs.values()) and all(np.isfinite(list(errs.values())))
  return ("PASS " if ok else "FAIL ") + " ".join(f"{n}={e:.2e}" for n, e in errs.items())


def _fail(what, e):
  msg = f"{type(e).__name__}: {str(e)[:300]}"
  print(f"  FAILED {what}: {msg}", flush=True)
  return msg


class Run:
  """Collects result rows and rewrites the JSON after each, so a cut-short run keeps them."""

  def __init__(self, path):
    self.path, self.rows = path, []

  def add(self, **row):
    self.rows.append(row)
    if self.path:
      with open(self.path, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                       results=self.rows), f, indent=1)


def _time(compiled, args, spec, causal):
  t = timing.time_compiled(compiled, args, iters=5)
  return t.median_s, flops.tflops(flops.attention_flops(spec, is_causal=causal, mode="fwdbwd"),
                                  t.median_s)


def check_and_time_shape(run, b, t, h, d, causal, cache):
  """cuDNN, split and fused default on one shape: gradients compared, then timed."""
  spec, label = _spec(b, t, h, d), f"{b}x{t}x{h}x{d}{' causal' if causal else ''}"
  args = _inputs(b, t, h, h, d)
  split_cfg = TUNED[(d, causal)]
  fused_cfg = dataclasses.replace(split_cfg, fused_backward=True)
  grads, times = {}, {}
  for impl, cfg in (("cudnn", None), ("split", split_cfg), ("fused", fused_cfg)):
    try:
      compiled = _compiled_step(_attention("cudnn" if impl == "cudnn" else "mosaic", causal,
                                           cfg), args)
      grads[impl] = jax.block_until_ready(compiled(*args))
      row = dict(shape=label, causal=causal, impl=impl, variant="default")
      if impl == "fused":
        again = [jax.block_until_ready(compiled(*args)) for _ in range(2)]
        row["dkdv_bitwise_stable"] = all(
            bool((np.asarray(a[i]) == np.asarray(grads[impl][i])).all())
            for a in again for i in (1, 2))
        row["dq_bitwise_stable"] = all(
            bool((np.asarray(a[0]) == np.asarray(grads[impl][0])).all()) for a in again)
      for ref in ("split", "cudnn"):
        if ref != impl and ref in grads:
          row[f"err_vs_{ref}"] = _errors(grads[impl], grads[ref])
      sec, tf = _time(compiled, args, spec, causal)
      times[impl] = sec
      row.update(ms=sec * 1e3, tflops=tf)
      if "cudnn" in times:
        row["vs_cudnn"] = times["cudnn"] / sec
      run.add(**row)
      print(f"{label:24s} {impl:6s} {tf:7.1f} TFLOP/s  {sec * 1e3:8.3f} ms  "
            f"x{row.get('vs_cudnn', float('nan')):.3f} cuDNN  "
            f"vs split: {_fmt_err(row.get('err_vs_split'))}  "
            f"vs cudnn: {_fmt_err(row.get('err_vs_cudnn'))}"
            + (f"  dk/dv stable={row['dkdv_bitwise_stable']} dq stable="
               f"{row['dq_bitwise_stable']}" if impl == "fused" else ""), flush=True)
    except Exception as e:  # noqa: BLE001 (a config that fails is a result)
      run.add(shape=label, causal=causal, impl=impl, variant="default",
              error=_fail(f"{label} {impl}", e))
  cache[(b, t, h, d, causal)] = (args, grads.get("split"), times.get("cudnn"))


def check_gqa(run):
  b, t, h, kh, d, causal = GQA_CHECK
  label = f"gqa {b}x{t}x{h}:{kh}x{d}{' causal' if causal else ''}"
  args = _inputs(b, t, h, kh, d, seed=1)
  try:
    split_cfg = TUNED[(d, causal)]
    out = {}
    for name, cfg in (("split", split_cfg),
                      ("fused", dataclasses.replace(split_cfg, fused_backward=True)),
                      ("overlap", dataclasses.replace(split_cfg, fused_backward=True,
                                                      **OVERLAP))):
      out[name] = jax.block_until_ready(_compiled_step(_attention("mosaic", causal, cfg),
                                                       args)(*args))
    for name, variant in (("fused", "gqa-check"), ("overlap", "gqa-check-overlap")):
      errs = _errors(out[name], out["split"])
      run.add(shape=label, causal=causal, impl="fused", variant=variant, err_vs_split=errs)
      print(f"{label:24s} {name} vs split: {_fmt_err(errs)}", flush=True)
  except Exception as e:  # noqa: BLE001
    run.add(shape=label, causal=causal, impl="fused", variant="gqa-check",
            error=_fail(label, e))


def time_variants(run, cache, deadline):
  # Variant-major, in VARIANTS order: the most promising variant is measured on every shape
  # before the budget can run out.
  todo = sorted(((rank, key, kw) for key in cache
                 for rank, kw in enumerate(VARIANTS.get(key[3], []))), key=lambda x: x[0])
  for _, (b, t, h, d, causal), kw in todo:
    args, split_grads, cudnn_s = cache[(b, t, h, d, causal)]
    spec, label = _spec(b, t, h, d), f"{b}x{t}x{h}x{d}{' causal' if causal else ''}"
    if time.monotonic() > deadline:
      print("time budget spent, skipping the remaining variants", flush=True)
      return
    if kw.get("fused_stagger_q") and causal:
      continue  # stagger applies to non-causal only
    variant = ",".join(f"{k}={v}" for k, v in kw.items())
    try:
      cfg = dataclasses.replace(TUNED[(d, causal)], fused_backward=True, **kw)
      compiled = _compiled_step(_attention("mosaic", causal, cfg), args)
      grads = jax.block_until_ready(compiled(*args))
      errs = None if split_grads is None else _errors(grads, split_grads)
      sec, tf = _time(compiled, args, spec, causal)
      ratio = None if cudnn_s is None else cudnn_s / sec
      run.add(shape=label, causal=causal, impl="fused", variant=variant, ms=sec * 1e3,
              tflops=tf, vs_cudnn=ratio, err_vs_split=errs)
      print(f"{label:24s} fused[{variant}] {tf:7.1f} TFLOP/s  x{ratio or float('nan'):.3f}"
            f" cuDNN  vs split: {_fmt_err(errs)}", flush=True)
    except Exception as e:  # noqa: BLE001
      run.add(shape=label, causal=causal, impl="fused", variant=variant,
              error=_fail(f"{label} fused[{variant}]", e))


def _give_up(seconds):
  print(f"watchdog: still running after {seconds:.0f} s (hung kernel?), exiting", flush=True)
  os._exit(124)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="write the result rows here")
  parser.add_argument("--budget-s", type=float, default=200.0,
                      help="start no config variant after this many seconds")
  parser.add_argument("--no-variants", action="store_true")
  parser.add_argument("--kill-after-s", type=float, default=230.0,
                      help="exit (code 124) after this many seconds, e.g. on a kernel deadlock")
  args = parser.parse_args()
  start = time.monotonic()
  # A barrier mismatch on the GPU hangs the kernel forever; the JSON already holds every row
  # finished before it.
  watchdog = threading.Timer(args.kill_after_s, _give_up, args=(args.kill_after_s,))
  watchdog.daemon = True
  watchdog.start()
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  run, cache = Run(args.json), {}
  for shape in SHAPES:
    check_and_time_shape(run, *shape, cache)
  check_gqa(run)
  if not args.no_variants:
    time_variants(run, cache, start + args.budget_s)
  watchdog.cancel()
  print(f"done in {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
  main()
