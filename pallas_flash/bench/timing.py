"""What is timed and how: one jitted step per (implementation, mode, causal), compiled ahead of
time so compilation is never timed, then the median of loops of back-to-back calls, the
implementations of one row taking turns loop by loop (time_interleaved)."""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable

import jax

import pallas_flash
from pallas_flash.bench.shapes import ShapeSpec, kv_struct, shape_struct

# pallas_flash implementations the benchmark can run, and the jax.nn baselines.
OURS: tuple[str, ...] = ("mosaic", "triton", "xla", "interpret", "reference")
BASELINES: tuple[str, ...] = ("cudnn", "jax_xla")
ALL_IMPLS: tuple[str, ...] = OURS + BASELINES


def attention_fn(impl: str, *, is_causal: bool, **kwargs) -> Callable:
  """o = attention(q, k, v) for one implementation; q, k, v, o are [B, T, H, D]. kwargs (e.g.
  local_window_size) go to the attention call; jax.nn's baselines take only the ones it shares."""
  if impl == "cudnn":
    return functools.partial(jax.nn.dot_product_attention, is_causal=is_causal,
                             implementation="cudnn", **kwargs)
  if impl == "jax_xla":  # materialises the [B, H, T, S] scores
    return functools.partial(jax.nn.dot_product_attention, is_causal=is_causal,
                             implementation="xla", **kwargs)
  if impl in OURS:
    return functools.partial(pallas_flash.flash_attention, is_causal=is_causal,
                             implementation=impl, **kwargs)
  raise ValueError(f"Unknown implementation {impl!r}; choose from {ALL_IMPLS}.")


def default_impls(spec: ShapeSpec, dtype) -> list[str]:
  """Our implementations that explain() says run `spec` here, then the baselines."""
  s, kv = shape_struct(spec, dtype), kv_struct(spec, dtype)
  reasons = pallas_flash.explain(s, kv, kv).reasons
  ours = [n for n in ("mosaic", "triton", "xla") if reasons.get(n) is None]
  gpu = jax.devices()[0].platform == "gpu"
  return ours + (["cudnn"] if gpu else []) + ["jax_xla"]


def skip_reason(impl: str, spec: ShapeSpec, dtype, *, is_causal: bool,
                xla_cap_gib: float = math.inf) -> str | None:
  """Why `impl`, asked for by name, cannot run `spec` here, or None.

  jax_xla is skipped where its float32 [B, H, T, T] score matrix exceeds `xla_cap_gib`.
  """
  if impl == "cudnn":
    return None if jax.devices()[0].platform == "gpu" else "cuDNN needs a GPU"
  if impl == "jax_xla":
    b, t, h, _ = spec.shape
    gib = b * h * t * t * 4 / 2**30
    return None if gib <= xla_cap_gib else f"score matrix {gib:.0f} GiB > {xla_cap_gib:g} GiB"
  s, kv = shape_struct(spec, dtype), kv_struct(spec, dtype)
  return pallas_flash.explain(s, kv, kv, is_causal=is_causal).reasons_when_named.get(impl)


@functools.cache
def make_step(impl: str, *, mode: str, is_causal: bool, **kwargs) -> Callable:
  """The jitted benchmark step, step(q, k, v, do): q, do [B, T, H, D], k, v [B, T, K, D].

  fwd returns o; fwdbwd returns (dq, dk, dv) = grad of sum(o * do) w.r.t. (q, k, v), i.e. the
  VJP with cotangent do (the forward runs inside it, as in training). kwargs: attention_fn's.
  """
  attn = attention_fn(impl, is_causal=is_causal, **kwargs)

  def fwd(q, k, v, do):
    del do
    return attn(q, k, v)

  def fwdbwd(q, k, v, do):
    _, vjp = jax.vjp(attn, q, k, v)
    return vjp(do)

  if mode not in ("fwd", "fwdbwd"):
    raise ValueError(f"Unknown mode {mode!r}.")
  return jax.jit(fwd if mode == "fwd" else fwdbwd)


def compile_step(step: Callable, args: tuple) -> tuple[jax.stages.Compiled, float]:
  """Lowers and compiles `step` for `args`; returns the executable and the seconds it took."""
  start = time.perf_counter()
  compiled = step.lower(*args).compile()
  return compiled, time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Timing:
  """Seconds per call: the median over loops, each loop `calls_per_loop` back-to-back calls."""

  median_s: float
  loop_s: tuple[float, ...]
  calls_per_loop: int


def seconds_per_call(fn: Callable, args: tuple, calls: int) -> float:
  """Seconds per call of `calls` back-to-back calls, synchronised once at the end."""
  start = time.perf_counter()
  out = None
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls


def sign_test_p(wins: int, rounds: int) -> float:
  """Two-sided exact sign test: the probability, were each round a fair coin, of a split at
  least as uneven as `wins` of `rounds` (1.0 for none). Interleaved rounds are paired samples,
  so this says whether "faster in 2 of 13 rounds" is a real deficit (p = 0.022) or noise."""
  if rounds <= 0:
    return 1.0
  k = min(wins, rounds - wins)
  tail = sum(math.comb(rounds, i) for i in range(k + 1)) / 2 ** rounds
  return min(1.0, 2 * tail)


def round_orders(n: int, order: str = "balanced") -> list[list[int]]:
  """The orders in which rounds of time_interleaved run n fns, used in turn.

  "balanced": a Williams design. Over its n rounds (2n for odd n) every fn runs at every
  position equally often and directly after every other fn equally often. "rotating": the
  order shifted by one per round, which keeps each fn's predecessor: whichever fn follows
  the hottest one (cuDNN's kernels, say) then runs at a lower clock every round.
  """
  if order == "rotating":
    return [[(i + r) % n for i in range(n)] for r in range(n)]
  if order != "balanced":
    raise ValueError(f"order must be 'balanced' or 'rotating', got {order!r}")
  first, lo, hi = [0], 1, n - 1
  while lo <= hi:  # 0, 1, n-1, 2, n-2, ...
    first.append(lo)
    lo += 1
    if lo <= hi:
      first.append(hi)
      hi -= 1
  rows = [[(i + r) % n for i in first[:n]] for r in range(n)]
  return rows + ([row[::-1] for row in rows] if n % 2 and n > 1 else [])


def time_interleaved(fns: dict[str, Callable], args: tuple, *, iters: int = 5,
                     min_loop_s: float = 0.05, order: str = "balanced",
                     settle_s: float = 0.0) -> dict[str, Timing]:
  """Times several compiled `fn(*args)` in rounds: each round runs one loop of every fn, in
  the order of round_orders(len(fns), order)'s next row, and each fn's median over its
  `iters` loops is returned (the design is balanced over a multiple of its length).

  A GPU's clock drifts under sustained load (an H200 at its power limit runs the same kernel
  10-20 % slower within a second of heavy work), so timing one implementation after another
  would credit the drift to whichever ran first; interleaved, every implementation sees the
  same conditions, and in a balanced order the same predecessors.

  settle_s: untimed rounds (each fn's loop in turn) for at least this long first, so that the
  first timed loop does not run at the boost clock of a GPU that idled through compiling and
  checking (at the H200's 700 W cap the first loop of a run read 8-9 % faster than the rest).
  """
  calls = {}
  for name, fn in fns.items():
    jax.block_until_ready(fn(*args))  # warm-up
    estimate = seconds_per_call(fn, args, 1)
    calls[name] = max(1, math.ceil(min_loop_s / max(estimate, 1e-7)))
  names, loops = list(fns), {name: [] for name in fns}
  rows = round_orders(len(names), order)
  start = time.perf_counter()
  while time.perf_counter() - start < settle_s:
    for name in names:
      seconds_per_call(fns[name], args, calls[name])
  for i in range(iters):
    for j in rows[i % len(rows)]:
      loops[names[j]].append(seconds_per_call(fns[names[j]], args, calls[names[j]]))
  return {name: Timing(statistics.median(ls), tuple(ls), calls[name])
          for name, ls in loops.items()}


def time_each(fns: dict[str, Callable | None], args: tuple,
              **kw) -> dict[str, Timing | Exception | None]:
  """time_interleaved over the fns that are not None; where the interleaved rounds raise,
  each fn is timed on its own to find the failing one. Returns per name its Timing, the
  exception it raised, or None (no fn)."""
  named = {name: fn for name, fn in fns.items() if fn is not None}
  try:
    timings: dict = time_interleaved(named, args, **kw)
  except Exception:  # noqa: BLE001 -- find the failing one: time each on its own
    timings = {}
    for name, fn in named.items():
      try:
        timings.update(time_interleaved({name: fn}, args, **kw))
      except Exception as e:  # noqa: BLE001 -- one broken fn must not stop the table
        timings[name] = e
  return {name: timings.get(name) for name in fns}


def paired_rounds(loop_ms: list[float], base_loop_ms: list[float]) -> dict:
  """Round by round of one interleaved timing: round_ratios = the base's loop time / this
  one's (above 1: faster than the base in that round), rounds_faster (how many are above 1)
  and rounds_p, the sign test's p-value of that split (sign_test_p)."""
  ratios = [b / a for a, b in zip(loop_ms, base_loop_ms)]
  faster = sum(x > 1 for x in ratios)
  return {"round_ratios": ratios, "rounds_faster": faster,
          "rounds_p": sign_test_p(faster, len(ratios))}
