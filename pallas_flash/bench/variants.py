"""A/B rows for the tuning scripts (scripts/*_bench.py): variants of one kernel against each
other and cuDNN, checked and then timed in interleaved rounds in one process."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from pallas_flash.bench import checks, flops, shapes, timing


def parse_shape(name: str) -> shapes.ShapeSpec:
  """"BxTxHxD" or "BxTxHxDxK" (K kv heads; default H) -> the ShapeSpec of that shape."""
  dims = [int(x) for x in name.split("x")]
  if len(dims) not in (4, 5):
    raise ValueError(f"shape {name!r}: expected BxTxHxD or BxTxHxDxK")
  b, t, h, d = dims[:4]
  return shapes.ShapeSpec(name=name, batch=b, seq_len=t, num_heads=h, head_dim=d,
                          num_kv_heads=dims[4] if len(dims) == 5 else h)


def compare(steps: dict[str, Callable], args: tuple, spec: shapes.ShapeSpec, *, mode: str,
            is_causal: bool, baseline: str, iters: int = 7, order: str = "balanced",
            min_loop_s: float = 0.05, cudnn_kwargs: dict | None = None,
            flop_count: float | None = None, settle_s: float = 1.0) -> dict:
  """steps: name -> jitted fn(q, k, v, do) of mode "fwd" or "fwdbwd"; cuDNN's is added.

  Compiles each, compares its outputs with `baseline`'s (max relative error, cuDNN's too) and with
  its own second run (bitwise), then times all of them interleaved (timing.time_interleaved, rounds
  in `order`, loops of at least `min_loop_s`, after `settle_s` of untimed rounds). Returns
  err_vs_<baseline>, bitwise_run_to_run, tflops, ratio_vs_cudnn and loop_s (each loop's seconds
  per call, in round order: entry i of every name comes from round i, for paired comparisons),
  each a dict by name.
  cudnn_kwargs go to cuDNN's call (a window the steps share); flop_count replaces the
  dense/causal count where the steps do other work (a band).
  """
  cudnn = timing.make_step("cudnn", mode=mode, is_causal=is_causal, **(cudnn_kwargs or {}))
  steps = {**steps, "cudnn": cudnn}
  compiled = {n: timing.compile_step(f, args)[0] for n, f in steps.items()}
  outs = {n: jax.tree.leaves(c(*args)) for n, c in compiled.items()}
  errs = {n: max(float(checks.rel_err(a, r)) for a, r in zip(o, outs[baseline], strict=True))
          for n, o in outs.items()}
  again = {n: all(bool(jnp.array_equal(a, r))
                  for a, r in zip(jax.tree.leaves(compiled[n](*args)), outs[n], strict=True))
           for n in outs}
  del outs
  times = timing.time_interleaved(compiled, args, iters=iters, order=order, settle_s=settle_s,
                                  min_loop_s=min_loop_s)
  f = flop_count or flops.attention_flops(spec, is_causal=is_causal, mode=mode)
  rate = {n: round(flops.tflops(f, x.median_s), 1) for n, x in times.items()}
  return {f"err_vs_{baseline}": errs, "bitwise_run_to_run": again, "tflops": rate,
          "ratio_vs_cudnn": {n: round(v / rate["cudnn"], 3) for n, v in rate.items()},
          "loop_s": {n: list(x.loop_s) for n, x in times.items()}}
