"""Times sliding windows, packed documents, soft-capping, ALiBi and dropout against their targets.

Correctness first: every configuration is run once at a reduced size against the reference
(output and gradients) before it is timed; a failing one is reported and not timed. Then each is
timed (median of loops, compiled ahead of time), forward and forward+backward, and compared
with its baseline on the same implementation (targets in docs/features.md):

  window 4K over 32K / 128K   TFLOP/s over the band's work >= 0.85 x plain causal at that length
  packed documents (32K)      time / time(one 32K document) <= 1.15 x sum(len^2) / 32K^2
  softcap, ALiBi              time(plain) / time >= 0.9;  dropout 0.1: >= 0.8

Run from the repository root on one GPU (about 2-3 minutes on an H200):

  PYTHONPATH=. python3 scripts/features_bench.py --json features.json

`--impl` takes a comma-separated list, timed in one process row by row; `cudnn` (jax.nn's
dot_product_attention) runs the rows whose only feature it has, the causal and sliding-window
ones; listed first, each of our rows after it also prints our speed against it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash
from pallas_flash.bench.__main__ import git_commit
from pallas_flash.bench.flops import window_pairs
from pallas_flash.bench.timing import compile_step, time_compiled

HEADS, HEAD_DIM = 16, 128
DOC_LENGTHS = (8192, 512, 4096, 1024, 2048, 6144, 512, 3072, 2048, 1536, 1024, 512, 2048, 768,
               256)  # sum 32768: a packed batch of mixed lengths


@dataclasses.dataclass(frozen=True)
class Config:
  name: str
  seq_len: int
  kwargs: dict  # static feature arguments (arrays are made by `feature_arrays`)
  pairs: int  # visible (query, key) pairs of one head: the matrix work
  baseline: str | None = None  # name of the config this one is compared with
  target: str = ""
  check_len: int = 2048  # sequence length of the correctness check


def causal_pairs(n: int) -> int:
  return n * (n + 1) // 2


def segments(lengths, total: int) -> jax.Array:
  ids = np.repeat(np.arange(len(lengths)), lengths)
  assert ids.size == total, (ids.size, total)
  return jnp.asarray(ids[None], jnp.int32)


def configs(quick: bool, shrink: int = 1) -> list[Config]:
  """The benchmark rows; `shrink` divides every length (a CPU smoke test of the script)."""
  w = 4096 // shrink
  docs = tuple(m // shrink for m in DOC_LENGTHS)
  out = []
  for n in ((32768,) if quick else (32768, 131072)):
    n //= shrink
    k = n * shrink // 1024
    out.append(Config(f"causal {k}K", n, {}, causal_pairs(n)))
    out.append(Config(f"window 4K / {k}K", n, {"local_window_size": (w - 1, 0)},
                      window_pairs(n, w - 1), f"causal {k}K", "TFLOP/s ratio >= 0.85"))
  out.append(Config("packed docs 32K", 32768 // shrink, {"segments": docs},
                    sum(causal_pairs(n) for n in docs), "causal 32K",
                    "time ratio <= 1.15 x work ratio", check_len=2048 // shrink))
  n = 8192 // shrink
  out.append(Config("causal 8K", n, {}, causal_pairs(n)))
  out.append(Config("softcap 8K", n, {"logits_soft_cap": 30.0}, causal_pairs(n), "causal 8K",
                    "speed ratio >= 0.9"))
  out.append(Config("alibi 8K", n, {"alibi": True}, causal_pairs(n), "causal 8K",
                    "speed ratio >= 0.9"))
  out.append(Config("dropout 0.1 8K", n, {"dropout_rate": 0.1}, causal_pairs(n), "causal 8K",
                    "speed ratio >= 0.8"))
  return out


def call_kwargs(cfg: Config, n: int) -> dict:
  """flash_attention keyword arguments of `cfg` at sequence length n (n < cfg.seq_len scales
  windows and documents down for the correctness check)."""
  kw = {"is_causal": True}
  for name, value in cfg.kwargs.items():
    if name == "segments":
      scaled = [max(1, m * n // cfg.seq_len) for m in value]
      scaled[int(np.argmax(scaled))] += n - sum(scaled)
      kw["query_segment_ids"] = segments(scaled, n)
    elif name == "alibi":
      kw["alibi_slopes"] = 2.0 ** (-8.0 * jnp.arange(1, HEADS + 1) / HEADS)
    elif name == "local_window_size":
      left = value[0] if n == cfg.seq_len else max(1, value[0] * n // cfg.seq_len)
      kw["local_window_size"] = (left, 0)
    elif name == "dropout_rate":
      kw.update(dropout_rate=value, dropout_rng=jax.random.key(0))
    else:
      kw[name] = value
  return kw


def inputs(n: int, dtype=jnp.bfloat16):
  keys = jax.random.split(jax.random.key(n), 4)
  return tuple(jax.random.normal(key, (1, n, HEADS, HEAD_DIM), dtype) for key in keys)


def mosaic_config(overrides: str, seq_len: int):
  """The tuned causal MosaicConfig at seq_len with 'key=value,...' overrides, or None."""
  if not overrides:
    return None
  from pallas_flash.mosaic_gpu.config import tuned, with_overrides

  return with_overrides(tuned(HEAD_DIM, True, seq_len), overrides)


# The flash_attention arguments jax.nn.dot_product_attention(implementation="cudnn") shares.
CUDNN_KWARGS = frozenset({"is_causal", "local_window_size"})


def step(impl: str, mode: str, kw: dict, config=None):
  def attn(q, k, v):
    if impl == "cudnn":
      return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
    return pallas_flash.flash_attention(q, k, v, implementation=impl, config=config, **kw)

  def fwd(q, k, v, do):
    del do
    return attn(q, k, v)

  def fwdbwd(q, k, v, do):
    return jax.vjp(attn, q, k, v)[1](do)

  return jax.jit(fwd if mode == "fwd" else fwdbwd)


def rel_err(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 0.05))


def check(impl: str, cfg: Config, overrides: str = "") -> float:
  """Worst relative error of output and gradients against the reference at cfg.check_len."""
  n = cfg.check_len
  q, k, v, do = inputs(n)
  kw = call_kwargs(cfg, n)
  up = [x.astype(jnp.float32) for x in (q, k, v, do)]
  config = mosaic_config(overrides, n)
  got = [step(impl, m, kw, config)(q, k, v, do) for m in ("fwd", "fwdbwd")]
  want = [step("reference", m, kw)(*up) for m in ("fwd", "fwdbwd")]
  errs = [rel_err(got[0], want[0])] + [rel_err(g, w) / 2 for g, w in zip(got[1], want[1])]
  return max(errs)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--impl", default="triton",
                      help="comma-separated implementations (flash_attention's, or cudnn)")
  parser.add_argument("--modes", default="fwd,fwdbwd")
  parser.add_argument("--iters", type=int, default=3)
  parser.add_argument("--quick", action="store_true", help="skip the 128K rows")
  parser.add_argument("--only", default=None,
                      help="comma-separated row names to run, e.g. 'causal 8K,softcap 8K' "
                           "(include each row's baseline)")
  parser.add_argument("--tol", type=float, default=1.5e-2, help="bf16 relative error budget")
  parser.add_argument("--json", default=None)
  parser.add_argument("--config", default="",
                      help="--impl mosaic: 'key=value,...' overriding the tuned causal "
                           "MosaicConfig of every row, e.g. block_kv_dq=64")
  parser.add_argument("--shrink", type=int, default=1,
                      help="divide every length by this (smoke-test the script on CPU)")
  args = parser.parse_args()

  rows, times = [], {}
  only = None if args.only is None else set(args.only.split(","))
  impls = args.impl.split(",")
  for cfg in configs(args.quick, args.shrink):
    if only is not None and cfg.name not in only:
      continue
    cfg = dataclasses.replace(cfg, check_len=min(cfg.check_len, cfg.seq_len))
    for impl in impls:
      rows += _run_row(cfg, impl, args, times)

  if args.json:
    meta = dict(device_kind=jax.devices()[0].device_kind, jax=jax.__version__,
                python=platform.python_version(), date=time.strftime("%Y-%m-%d"),
                commit=git_commit(), config=args.config, heads=HEADS, head_dim=HEAD_DIM,
                dtype="bfloat16")
    with open(args.json, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)


def _reason(cfg: Config, impl: str) -> str | None:
  """Why `impl` cannot run cfg's row, or None."""
  kw = call_kwargs(cfg, cfg.check_len)
  if impl == "cudnn":
    extra = sorted(set(kw) - CUDNN_KWARGS)
    return f"cudnn: not compared with {', '.join(extra)}" if extra else None
  spec = jax.ShapeDtypeStruct((1, cfg.check_len, HEADS, HEAD_DIM), jnp.bfloat16)
  return pallas_flash.explain(spec, spec, spec, **kw).reasons.get(impl)


def _run_row(cfg: Config, impl: str, args, times: dict) -> list[dict]:
  """Checks and times cfg with impl in each mode of args.modes; times[impl, name, mode] gets
  (seconds, pairs), and the row our speed against cuDNN's where cuDNN's ran before it."""
  reason, err = _reason(cfg, impl), None
  if reason is None:
    try:
      err = check(impl, cfg, args.config)
    except Exception as e:  # noqa: BLE001  a baseline that refuses the call (no GPU, say)
      if impl != "cudnn":
        raise
      reason = f"cudnn failed: {type(e).__name__}: {str(e).splitlines()[0]}"
  ok = reason is None and err <= args.tol
  rows = []
  for mode in args.modes.split(","):
    row = dict(name=cfg.name, mode=mode, impl=impl, seq_len=cfg.seq_len, error=err,
               skipped=reason or (None if ok else f"error {err:.3g} > {args.tol}"))
    if ok:
      q, k, v, do = inputs(cfg.seq_len)
      config = mosaic_config(args.config, cfg.seq_len) if impl == "mosaic" else None
      compiled, compile_s = compile_step(
          step(impl, mode, call_kwargs(cfg, cfg.seq_len), config), (q, k, v, do))
      t = time_compiled(compiled, (q, k, v, do), iters=args.iters).median_s
      flops = 4 * HEADS * HEAD_DIM * cfg.pairs * (3.5 if mode == "fwdbwd" else 1.0)
      times[impl, cfg.name, mode] = (t, cfg.pairs)
      row.update(ms=t * 1e3, tflops=flops / t / 1e12, compile_s=compile_s)
      row.update(_against_target(cfg, impl, mode, times))
      if impl != "cudnn" and ("cudnn", cfg.name, mode) in times:
        row["vs_cudnn"] = times["cudnn", cfg.name, mode][0] / t
    rows.append(row)
    _print_row(row)
  return rows


def _against_target(cfg: Config, impl: str, mode: str, times: dict) -> dict:
  if cfg.baseline is None or (impl, cfg.baseline, mode) not in times:
    return {}
  t, pairs = times[impl, cfg.name, mode]
  t0, pairs0 = times[impl, cfg.baseline, mode]
  if cfg.name.startswith("window"):  # TFLOP/s over the band vs the plain causal kernel's
    ratio = (pairs / t) / (pairs0 / t0)
    return dict(ratio=ratio, met=ratio >= 0.85)
  if cfg.name.startswith("packed"):  # time ratio vs work ratio: <= 1.15 means time ∝ Σ len²
    ratio = (t / t0) / (pairs / pairs0)
    return dict(ratio=ratio, met=ratio <= 1.15)
  ratio = t0 / t
  return dict(ratio=ratio, met=ratio >= (0.8 if cfg.name.startswith("dropout") else 0.9))


def _print_row(row: dict) -> None:
  if row.get("ms") is None:
    print(f"{row['name']:<20} {row['mode']:<7} {row['impl']:<7} skipped: {row['skipped']}",
          flush=True)
    return
  target = "" if "ratio" not in row else \
      f"ratio {row['ratio']:.3f} {'met' if row['met'] else 'MISSED'}"
  if "vs_cudnn" in row:
    target += f"  {row['vs_cudnn']:.3f}x cudnn"
  print(f"{row['name']:<20} {row['mode']:<7} {row['impl']:<7} {row['ms']:9.3f} ms "
        f"{row['tflops']:7.1f} TFLOP/s err {row['error']:.2e}  {target}", flush=True)


if __name__ == "__main__":
  main()
