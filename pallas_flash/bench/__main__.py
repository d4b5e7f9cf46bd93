"""Benchmark: correctness against the float32 reference, then TFLOP/s next to cuDNN and XLA.

Usage (from the repository root; see docs/perf.md for how numbers are produced):

  python -m pallas_flash.bench                                  # anchors, default impls
  python -m pallas_flash.bench --impl triton,mosaic,cudnn,jax_xla --json bench.json
  python -m pallas_flash.bench --memory --impl mosaic --max-seq 1048576
  python -m pallas_flash.bench --shapes cpu --impl xla,reference --iters 2 --settle-ms 0  # CPU
  python -m pallas_flash.bench --decode [--quick]   # KV-cache decode bandwidth (bench/decode.py)
  python -m pallas_flash.bench --fp8 [--quick]      # FP8 accuracy report (bench/fp8.py)
  python -m pallas_flash.bench --fp8-training       # its forward+backward rows only
  python -m pallas_flash.bench --fp8-features       # the FP8 forward with window/segments/cap
  python -m pallas_flash.bench --features [LIST] --json features.json  # bench/features.py
  python -m pallas_flash.bench --features bias --kernels  # each row's time per kernel / XLA op
  python -m pallas_flash.bench --impl mosaic,cudnn --variant mosaic:ovl:fwd_intra_wg_overlap=True
      # a column "mosaic:ovl": each call's default Mosaic config with that field replaced

Implementations: mosaic, triton, xla (blockwise), interpret, reference (pallas_flash), cudnn and
jax_xla (jax.nn.dot_product_attention with implementation="cudnn" / "xla", materialising).
Every row is checked before it is timed; a row whose relative error exceeds the dtype's
tolerance is marked FAIL but still timed and printed. The implementations are timed in
interleaved rounds; "rounds" says in how many of them a row beat cuDNN, the range of the
per-round ratios (at the H200's power cap one loop moves by a few per cent) and the sign
test's p-value of that split (below 0.05: the row is really ahead, or behind).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from pallas_flash.bench import checks, decode, features, flops, memory, shapes, timing, variants
from pallas_flash.bench import fp8 as fp8_report
from pallas_flash.mosaic_gpu import config as mosaic_config
from pallas_flash.call import AttentionParams

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
TOLERANCE = checks.TOLERANCE
_CAUSAL = {"both": (False, True), "no": (False,), "yes": (True,)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m pallas_flash.bench", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--impl", default=None, help=f"comma list of {timing.ALL_IMPLS}; default: "
                 "what explain() says runs here among mosaic,triton,xla, plus cudnn, jax_xla")
  p.add_argument("--shapes", default="anchors", help=f"tags {sorted(shapes.TAGS)} or names")
  p.add_argument("--mode", default="fwd,fwdbwd", help="comma list of fwd, fwdbwd")
  p.add_argument("--causal", default="both", choices=sorted(_CAUSAL))
  p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
  p.add_argument("--iters", type=int, default=None,
                 help=f"timed loops (median is reported); default 5 ({decode.ITERS} --decode)")
  p.add_argument("--min-loop-ms", type=float, default=None,
                 help=f"minimum duration of a loop; default 50 ({decode.MIN_LOOP_MS:g} --decode)")
  p.add_argument("--settle-ms", type=float, default=None,
                 help="untimed interleaved loops before the timed ones (clocks settle under "
                 f"load); default 1000 ({decode.SETTLE_MS:g} --decode)")
  p.add_argument("--check-seq-cap", type=int, default=4096,
                 help="longest sequence checked against the reference (see shapes.check_spec)")
  p.add_argument("--xla-cap-gib", type=float, default=32.0,
                 help="skip jax_xla where its B*H*T*T*4-byte score matrix exceeds this")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--variant", action="append", default=[], metavar="IMPL:LABEL:FIELD=VALUE,...",
                 help="also time IMPL with each call's default config with these fields "
                 "replaced, as column IMPL:LABEL (repeatable; bench/variants.py; --decode: "
                 "IMPL one of bench/decode.py's VARIANT_CONFIGS, fields of that config)")
  p.add_argument("--json", default=None, metavar="FILE", help="write all rows as JSON")
  p.add_argument("--memory", action="store_true", help="memory mode (causal fwd+bwd, B=1)")
  p.add_argument("--start-seq", type=int, default=1024, help="memory mode: first length")
  p.add_argument("--max-seq", type=int, default=1 << 20, help="memory mode: longest length")
  p.add_argument("--heads", type=int, default=shapes.MEMORY_HEADS, help="memory mode: H")
  p.add_argument("--head-dim", type=int, default=shapes.MEMORY_HEAD_DIM, help="memory mode: D")
  decode.add_arguments(p)
  fp8_report.add_arguments(p)
  features.add_arguments(p)
  opts = p.parse_args(argv)
  types, extra = ((decode.VARIANT_CONFIGS, decode.VARIANT_CALL_FIELDS) if opts.decode
                  else (None, ()))
  opts.variants = {v.name: v for v in (variants.parse(t, types, extra) for t in opts.variant)}
  if opts.variants and (opts.memory or opts.fp8 or opts.fp8_training or opts.fp8_features):
    p.error("--variant adds columns to the speed table, the features grid and the decode "
            "table only (no --memory or --fp8*)")
  defaults = ((decode.ITERS, decode.MIN_LOOP_MS, decode.SETTLE_MS) if opts.decode
              else features.QUICK_TIMING if opts.features and opts.quick else (5, 50.0, 1000.0))
  for name, default in zip(("iters", "min_loop_ms", "settle_ms"), defaults):
    if getattr(opts, name) is None:
      setattr(opts, name, default)
  return opts


def _git(*args: str) -> str:
  return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                        check=True).stdout.strip()


def git_commit() -> str | None:
  """The commit being measured (best effort, None when unknown), "-dirty" appended when tracked
  files differ from it: a copied tree whose repository lags behind it (a GPU machine's copy of
  a checkout) then does not pass for that commit.

  $PALLAS_FLASH_COMMIT names it when set: a `git archive` snapshot has no repository of its
  own, and `git rev-parse` would report whatever checkout encloses it."""
  if commit := os.environ.get("PALLAS_FLASH_COMMIT", ""):
    return commit
  try:
    commit = _git("rev-parse", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
      commit += "-dirty"
  except (OSError, subprocess.SubprocessError):
    pass
  return commit or None


def run_metadata() -> dict:
  """Where and when: device kind, jax version, git commit (git_commit), UTC date."""
  dev = jax.devices()[0]
  return {"device_kind": dev.device_kind, "platform": dev.platform,
          "jax_version": jax.__version__, "git_commit": git_commit() or "unknown",
          "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


# ---------------------------------------------------------------------------------------------
# Correctness


def _names(mode: str) -> tuple[str, ...]:
  return ("o",) if mode == "fwd" else ("dq", "dk", "dv")


def _as_tuple(out) -> tuple:
  return out if isinstance(out, tuple) else (out,)


def _heads(xs: tuple, counts: tuple[int, ...]) -> tuple:
  """Each x [B, T, heads, D] cut to its first `count` heads."""
  return tuple(x[:, :, :n] for x, n in zip(xs, counts, strict=True))


def reference_outputs(args: tuple, *, mode: str, is_causal: bool) -> tuple[jax.Array, ...]:
  """The float32 reference's o (fwd) or (dq, dk, dv) (fwdbwd) on upcast `args` (q, k, v, do:
  [B, T, H, D], k and v [B, T, K, D])."""
  step = timing.make_step("reference", mode=mode, is_causal=is_causal)
  return _as_tuple(step(*(x.astype(jnp.float32) for x in args)))


def slice_kwargs(impl: str, spec: shapes.ShapeSpec, *, is_causal: bool) -> dict:
  """What the rerun on a leading slice passes so that it runs the benchmarked call's kernels:
  for "mosaic", the config chosen for the full shape (the choice depends on length and batch:
  e.g. the fused backward from 8K keys causal, which the slice's own call would not run)."""
  if impl != "mosaic":
    return {}
  params = AttentionParams(scale=spec.head_dim ** -0.5, is_causal=is_causal, has_segments=False)
  head_dim = mosaic_config.config_head_dim(spec.head_dim, spec.dv)
  return {"config": mosaic_config.call_config(head_dim, params, spec.seq_len, spec.batch)}


def check(impl: str, compiled, args: tuple, spec: shapes.ShapeSpec, *, mode: str,
          is_causal: bool, seq_cap: int, reference,
          kwargs: dict | None = None) -> tuple[dict[str, float], str]:
  """Relative error per output of `impl` on the check shape (shapes.check_spec's rule).

  `reference(check_args)` returns the reference outputs (cached by the caller per group);
  `kwargs` those of the benchmarked call (a variant's config), which a rerun on a leading
  slice takes too (else `slice_kwargs`).
  Returns ({"o": err} or {"dq": .., "dk": .., "dv": ..}, label of the shape checked).
  """
  small = shapes.check_spec(spec, seq_cap=seq_cap)
  hc, kc, tc = small.num_heads, small.kv_heads, small.seq_len
  # Whole GQA groups: the first hc query heads are exactly those of the first kc kv heads.
  arg_heads, out_heads = (hc, kc, kc, hc), ((hc,) if mode == "fwd" else (hc, kc, kc))
  if tc == spec.seq_len:  # check the benchmarked call itself, on its first heads
    out = _heads(_as_tuple(compiled(*args)), out_heads)
  else:  # rerun the implementation on the leading slice
    args = _heads(tuple(x[:, :tc] for x in args), arg_heads)
    step = timing.make_step(impl, mode=mode, is_causal=is_causal,
                            **(kwargs or slice_kwargs(impl, spec, is_causal=is_causal)))
    out = _as_tuple(step(*args))
  small_args = _heads(args, arg_heads)
  ref = reference(small_args)
  errs = {n: float(checks.rel_err(o, r)) for n, o, r in zip(_names(mode), out, ref, strict=True)}
  return errs, small.label


# ---------------------------------------------------------------------------------------------
# One row


def prepare_case(impl: str, spec: shapes.ShapeSpec, args: tuple, *, mode: str, is_causal: bool,
                 opts: argparse.Namespace, reference) -> tuple[dict, object]:
  """Compiles and checks `impl` on one (shape, mode, causal): its JSON row (errors filled in)
  and the compiled step to time, or None where it is skipped or failed."""
  dtype = args[0].dtype
  row = {"kind": "speed", "mode": mode, "shape": spec.name, "label": spec.label,
         "batch": spec.batch, "seq_len": spec.seq_len, "num_heads": spec.num_heads,
         "num_kv_heads": spec.kv_heads,
         "head_dim": spec.head_dim, "dtype": jnp.dtype(dtype).name, "causal": is_causal,
         "impl": impl, "status": "skip", "reason": None, "ms": None, "tflops": None,
         "ratio_cudnn": None, "round_ratios": None, "rounds_faster": None, "rounds_p": None,
         "rel_err": None, "rel_errs": None, "check_shape": None,
         "tolerance": TOLERANCE[jnp.dtype(dtype).name], "compile_s": None,
         "flops": flops.attention_flops(spec, is_causal=is_causal, mode=mode)}
  variant = opts.variants.get(impl)
  base = variant.impl if variant else impl
  row["reason"] = timing.skip_reason(base, spec, dtype, is_causal=is_causal,
                                     xla_cap_gib=opts.xla_cap_gib)
  if row["reason"] is not None:
    return row, None
  try:
    kwargs = {}
    if variant:
      kwargs["config"] = variant.config(spec, dtype, is_causal=is_causal)
      row["config"] = repr(kwargs["config"])
    step = timing.make_step(base, mode=mode, is_causal=is_causal, **kwargs)
    compiled, row["compile_s"] = timing.compile_step(step, args)
    errs, row["check_shape"] = check(base, compiled, args, spec, mode=mode, is_causal=is_causal,
                                     seq_cap=opts.check_seq_cap, reference=reference,
                                     kwargs=kwargs)
  except Exception as e:  # noqa: BLE001 -- one broken row must not stop the table
    row.update(status="error", reason=f"{type(e).__name__}: {str(e).strip()[:300]}")
    return row, None
  rel = max(errs.values())
  row.update(rel_errs=errs, rel_err=rel, status="ok" if rel <= row["tolerance"] else "FAIL")
  return row, compiled


def run_group(impls: list[str], spec: shapes.ShapeSpec, args: tuple, *, mode: str,
              is_causal: bool, opts: argparse.Namespace, reference) -> list[dict]:
  """Checks every implementation on one (shape, mode, causal), then times those that ran in
  interleaved rounds (timing.time_interleaved); returns their JSON rows in `impls` order."""
  prepared = [prepare_case(i, spec, args, mode=mode, is_causal=is_causal, opts=opts,
                           reference=reference) for i in impls]
  kw = dict(iters=opts.iters, min_loop_s=opts.min_loop_ms / 1e3, settle_s=opts.settle_ms / 1e3)
  timings = timing.time_each({row["impl"]: compiled for row, compiled in prepared}, args, **kw)
  for row, _ in prepared:
    t = timings[row["impl"]]
    if isinstance(t, Exception):
      row.update(status="error", reason=f"{type(t).__name__}: {str(t).strip()[:300]}")
    elif t is not None:
      row.update(ms=t.median_s * 1e3, tflops=flops.tflops(row["flops"], t.median_s),
                 loop_ms=[s * 1e3 for s in t.loop_s], calls_per_loop=t.calls_per_loop)
  return [row for row, _ in prepared]


def _add_ratios(rows: list[dict]) -> None:
  """ratio_cudnn = tflops / cuDNN's tflops on the same (mode, shape, causal); and, round by
  round of the interleaved timing, round_ratios = cuDNN's loop time / this row's (above 1:
  faster than cuDNN in that round), rounds_faster, how many of them are above 1, and
  rounds_p, the sign test's p-value of that split (timing.sign_test_p). At the H200's power
  cap one loop moves by a few per cent, so a median ratio within ~1 % of 1 is only as good
  as the rounds that agree with it."""
  cudnn = next((r for r in rows if r["impl"] == "cudnn" and r["tflops"]), None)
  for r in rows:
    if cudnn is None or not r["tflops"]:
      continue
    r["ratio_cudnn"] = r["tflops"] / cudnn["tflops"]
    if r is not cudnn and r.get("loop_ms") and cudnn.get("loop_ms"):
      r.update(timing.paired_rounds(r["loop_ms"], cudnn["loop_ms"]))


# ---------------------------------------------------------------------------------------------
# Printing


def _fmt(x, spec: str, none: str = "-") -> str:
  return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_group(rows: list[dict]) -> None:
  r0 = rows[0]
  print(f"\n{r0['mode']} {r0['shape']} ({r0['label']}) causal={'yes' if r0['causal'] else 'no'}"
        f" {r0['dtype']}  {r0['flops']:.3e} FLOP")
  w = max(10, *(len(r["impl"]) + 1 for r in rows))  # --variant columns have longer names
  print(f"  {'impl':<{w}}{'status':<7}{'ms':>10}{'TFLOP/s':>9}{'/cuDNN':>8}{'rounds':>28}"
        f"{'rel_err':>9}{'compile_s':>10}  check")
  for r in rows:
    print(f"  {r['impl']:<{w}}{r['status']:<7}{_fmt(r['ms'], '.3f'):>10}"
          f"{flops.format_tflops(r['tflops']):>9}{_fmt(r['ratio_cudnn'], '.2f'):>8}"
          f"{_rounds(r):>28}{_fmt(r['rel_err'], '.1e'):>9}{_fmt(r['compile_s'], '.1f'):>10}  "
          f"{r['check_shape'] or r['reason'] or ''}", flush=True)


def _rounds(r: dict) -> str:
  """'won/rounds lo-hi p=P': the rounds faster than cuDNN, the range of round_ratios and the
  sign test's p-value."""
  ratios = r.get("round_ratios")
  if not ratios:
    return "-"
  return (f"{r['rounds_faster']}/{len(ratios)} {min(ratios):.2f}-{max(ratios):.2f} "
          f"p={r['rounds_p']:.2g}")


def _cell(r: dict) -> str:
  if r["status"] in ("skip", "error"):
    return r["status"]
  ratio = f" ({r['ratio_cudnn']:.2f})" if r["ratio_cudnn"] else ""
  cell = flops.format_tflops(r["tflops"]) + ratio
  return cell + ("!" if r["status"] == "FAIL" else "")


def print_summary(rows: list[dict], impls: list[str]) -> None:
  """TFLOP/s (ratio to cuDNN) per (mode, shape, causal) and implementation; ! marks FAIL."""
  print("\nSummary: TFLOP/s (ratio to cuDNN); ! = FAIL (rel_err above tolerance)")
  print(f"| mode | B×T×H×D | causal | {' | '.join(impls)} |")
  print("|---|---|---|" + "---|" * len(impls))
  groups: dict[tuple, dict[str, dict]] = {}
  for r in rows:
    groups.setdefault((r["mode"], r["label"], r["causal"]), {})[r["impl"]] = r
  for (mode, label, causal), by_impl in groups.items():
    cells = [_cell(by_impl[i]) if i in by_impl else "" for i in impls]
    print(f"| {mode} | {label} | {'yes' if causal else 'no'} | {' | '.join(cells)} |")


# ---------------------------------------------------------------------------------------------
# Main


def _impls(opts: argparse.Namespace, first: shapes.ShapeSpec, dtype) -> list[str]:
  """The --impl list (default: timing.default_impls), then the --variant columns."""
  if opts.impl is None:
    return timing.default_impls(first, dtype) + list(opts.variants)
  impls = [i.strip() for i in opts.impl.split(",") if i.strip()]
  unknown = set(impls) - set(timing.ALL_IMPLS)
  if unknown:
    raise SystemExit(f"Unknown implementations {sorted(unknown)}; choose from "
                     f"{timing.ALL_IMPLS}.")
  return impls + list(opts.variants)


def run_speed(opts: argparse.Namespace, specs: list[shapes.ShapeSpec], impls: list[str],
              dtype, on_group=lambda rows: None) -> list[dict]:
  """All rows of the speed table, printing each (mode, shape, causal) group as it finishes and
  passing the rows so far to `on_group`."""
  modes = [m.strip() for m in opts.mode.split(",") if m.strip()]
  rows = []
  for spec in specs:
    args = shapes.make_inputs(spec, dtype, opts.seed)
    for mode in modes:
      for is_causal in _CAUSAL[opts.causal]:
        reference = _cached_reference(mode, is_causal)
        group = run_group(impls, spec, args, mode=mode, is_causal=is_causal, opts=opts,
                          reference=reference)
        _add_ratios(group)
        print_group(group)
        rows += group
        on_group(rows)
    del args
  return rows


def _cached_reference(mode: str, is_causal: bool):
  """reference(args) for one group: computed once, reused by every implementation."""
  cache: dict[tuple, tuple] = {}

  def reference(args: tuple) -> tuple:
    key = tuple(x.shape for x in args)
    if key not in cache:
      cache[key] = reference_outputs(args, mode=mode, is_causal=is_causal)
    return cache[key]

  return reference


def main(argv: list[str] | None = None) -> list[dict]:
  opts = parse_args(argv)
  if opts.decode and getattr(opts, "loop_calls", 0):
    decode.capture_small_graphs()  # before the GPU client starts
  start = time.perf_counter()
  dtype = DTYPES[opts.dtype]
  meta = run_metadata()
  print(" ".join(f"{k}={v}" for k, v in meta.items()))
  if opts.fp8 or opts.fp8_training or opts.fp8_features:
    rows = fp8_report.run_fp8(opts)
  elif opts.decode:
    rows = decode.run_decode(opts, dtype, on_rows=lambda r: _write_json(opts, r, meta))
  elif opts.features:
    rows = features.run_features(opts, dtype, on_rows=lambda r: _write_json(opts, r, meta))
  elif opts.memory:
    specs = shapes.memory_specs(start=opts.start_seq, max_seq=opts.max_seq, heads=opts.heads,
                                head_dim=opts.head_dim)
    if not specs:
      raise SystemExit(f"--start-seq {opts.start_seq} exceeds --max-seq {opts.max_seq}.")
    impls = _impls(opts, specs[0], dtype)
    rows = memory.run_memory(impls, specs, dtype, seed=opts.seed)
    memory.print_memory(rows)
  else:
    specs = shapes.select_shapes(opts.shapes)
    impls = _impls(opts, specs[0], dtype)
    # Rewritten after every group, so that a run cut off by a time limit keeps what it measured.
    rows = run_speed(opts, specs, impls, dtype, on_group=lambda r: _write_json(opts, r, meta))
    print_summary(rows, impls)
  rows = _write_json(opts, rows, meta)
  if opts.json:
    print(f"\nwrote {len(rows)} rows to {opts.json}")
  print(f"total {time.perf_counter() - start:.0f} s")
  return rows


def _write_json(opts: argparse.Namespace, rows: list[dict], meta: dict) -> list[dict]:
  """The rows with the run's metadata, also written to --json when given."""
  rows = [{**r, **meta} for r in rows]
  if opts.json:
    with open(opts.json, "w") as f:
      json.dump(rows, f, indent=1)
  return rows


if __name__ == "__main__":
  main(sys.argv[1:])
