"""Memory mode: peak device memory of causal forward+backward against sequence length.

For each implementation the sequence doubles (B=1, H=16, D=128 by default) until a length fails
(out of memory, an error, non-finite gradients) or the cap is reached. Two numbers per length:

  est_peak   what XLA planned for the compiled step: compiled.memory_analysis()'s
             peak_memory_in_bytes, or temp + arguments + outputs - aliased if that is larger.
             Known before running, so a step that cannot fit is reported, not attempted.
  live_peak  the allocator's peak_bytes_in_use after the call minus bytes_in_use before it.
             The peak cannot be reset, so this is only reported when the call set a new peak.

Linear-memory kernels grow ~2x per doubling; the materialising jax_xla path ~4x.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from pallas_flash.bench import flops, shapes, timing

_GIB = 2**30


def estimated_peak(compiled) -> dict[str, int]:
  """Planned bytes of a compiled step: {"est_peak_bytes", "temp_bytes", "arg_bytes", ...}."""
  ma = compiled.memory_analysis()
  if ma is None:
    return {"est_peak_bytes": None}
  parts = {"temp_bytes": ma.temp_size_in_bytes, "arg_bytes": ma.argument_size_in_bytes,
           "out_bytes": ma.output_size_in_bytes, "alias_bytes": ma.alias_size_in_bytes}
  total = parts["temp_bytes"] + parts["arg_bytes"] + parts["out_bytes"] - parts["alias_bytes"]
  return {"est_peak_bytes": max(total, getattr(ma, "peak_memory_in_bytes", 0) or 0), **parts}


def _stats() -> dict:
  return jax.devices()[0].memory_stats() or {}


def _is_oom(e: Exception) -> bool:
  text = str(e).lower()
  return "resource_exhausted" in text or "out of memory" in text


def _run_once(compiled, spec: shapes.ShapeSpec, dtype, seed: int) -> dict:
  """Runs the step once on fresh random inputs; time, finiteness and the live peak."""
  args = shapes.make_inputs(spec, dtype, seed)
  jax.block_until_ready(args)
  before = _stats()
  start = time.perf_counter()
  grads = jax.block_until_ready(compiled(*args))
  seconds = time.perf_counter() - start
  after = _stats()
  finite = all(bool(jnp.isfinite(g).all()) for g in grads)
  live = None
  if "peak_bytes_in_use" in after and after["peak_bytes_in_use"] > before["peak_bytes_in_use"]:
    live = after["peak_bytes_in_use"] - before["bytes_in_use"]
  return {"seconds": seconds, "finite": finite, "live_peak_bytes": live}


def measure(impl: str, spec: shapes.ShapeSpec, dtype, *, seed: int = 0) -> dict:
  """One memory row: compile causal fwd+bwd for `spec`, check it fits, run it once."""
  row = {"kind": "memory", "mode": "fwdbwd", "causal": True, "impl": impl, "shape": spec.name,
         "label": spec.label, "batch": spec.batch, "seq_len": spec.seq_len,
         "num_heads": spec.num_heads, "head_dim": spec.head_dim,
         "dtype": jnp.dtype(dtype).name, "status": "skip", "reason": None,
         "est_peak_bytes": None, "live_peak_bytes": None, "ms": None, "tflops": None,
         "finite": None, "compile_s": None}
  row["reason"] = timing.skip_reason(impl, spec, dtype, is_causal=True)
  if row["reason"] is not None:
    return row
  limit = _stats().get("bytes_limit")
  try:
    step = timing.make_step(impl, mode="fwdbwd", is_causal=True)
    compiled, row["compile_s"] = timing.compile_step(step, shapes.arg_structs(spec, dtype))
    row.update(estimated_peak(compiled))
    if limit and row["est_peak_bytes"] and row["est_peak_bytes"] > limit:
      row.update(status="oom", reason=f"planned {row['est_peak_bytes'] / _GIB:.1f} GiB > "
                 f"device limit {limit / _GIB:.1f} GiB")
      return row
    run = _run_once(compiled, spec, dtype, seed)
  except Exception as e:  # noqa: BLE001 -- the failure is the measurement
    row.update(status="oom" if _is_oom(e) else "error",
               reason=f"{type(e).__name__}: {str(e).strip()[:300]}")
    return row
  f = flops.attention_flops(spec, is_causal=True, mode="fwdbwd")
  row.update(status="ok" if run["finite"] else "nonfinite", finite=run["finite"],
             live_peak_bytes=run["live_peak_bytes"], ms=run["seconds"] * 1e3,
             tflops=flops.tflops(f, run["seconds"]))
  return row


def run_memory(impls: list[str], specs: list[shapes.ShapeSpec], dtype, *,
               seed: int = 0) -> list[dict]:
  """Rows for every implementation, lengths in order, stopping each at its first failure."""
  rows = []
  for impl in impls:
    for spec in specs:
      row = measure(impl, spec, dtype, seed=seed)
      rows.append(row)
      _print_row(row, rows)
      if row["status"] != "ok":
        break
  return rows


def longest_ok(rows: list[dict]) -> dict[str, int | None]:
  """The longest sequence that ran (status ok) per implementation."""
  out: dict[str, int | None] = {}
  for r in rows:
    out.setdefault(r["impl"], None)
    if r["status"] == "ok":
      out[r["impl"]] = max(out[r["impl"]] or 0, r["seq_len"])
  return out


def _size(x: int | None) -> str:
  if x is None:
    return "-"
  return f"{x / _GIB:.2f} GiB" if x >= _GIB // 4 else f"{x / 2**20:.1f} MiB"


def _growth(row: dict, rows: list[dict]) -> str:
  """est_peak divided by that of the previous length of the same implementation."""
  prev = [r for r in rows if r["impl"] == row["impl"] and r["seq_len"] < row["seq_len"]
          and r.get("est_peak_bytes")]
  if not prev or not row.get("est_peak_bytes"):
    return "-"
  return f"{row['est_peak_bytes'] / prev[-1]['est_peak_bytes']:.2f}x"


_HEADER = (f"  {'impl':<9}{'seq_len':>9} {'status':<10}{'est_peak':>12}{'growth':>8}"
           f"{'live_peak':>12}{'ms':>10}{'TFLOP/s':>9}  reason")


def _print_row(row: dict, rows: list[dict]) -> None:
  if len(rows) == 1:
    print(f"\nMemory: causal fwd+bwd, B={row['batch']} H={row['num_heads']} "
          f"D={row['head_dim']} {row['dtype']} (one call per length; ms includes first run)")
    print(_HEADER)
  ms = "-" if row["ms"] is None else f"{row['ms']:.1f}"
  tf = flops.format_tflops(row["tflops"])
  print(f"  {row['impl']:<9}{row['seq_len']:>9} {row['status']:<10}"
        f"{_size(row['est_peak_bytes']):>12}{_growth(row, rows):>8}"
        f"{_size(row['live_peak_bytes']):>12}{ms:>10}{tf:>9}  {row['reason'] or ''}", flush=True)


def print_memory(rows: list[dict]) -> None:
  """The longest length per implementation (the table itself prints as rows arrive)."""
  print("\nLongest sequence that ran (causal fwd+bwd):")
  for impl, t in longest_ok(rows).items():
    print(f"  {impl:<9} {t if t is not None else 'none'}")
