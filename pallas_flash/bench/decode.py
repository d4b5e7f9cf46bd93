"""Decode benchmark (`python -m pallas_flash.bench --decode`): KV-cache attention bandwidth.

Per point (batch B x cache length L, contiguous or paged cache, uniform, ragged or skewed
lengths, see _lengths):
every implementation is checked against the float32 reference on its own output (the first and
last sequence), then timed in interleaved rounds together with a jnp copy of the same bytes.
Reported: microseconds per call, bandwidth = bytes of K and V the call must read (2 * sum of
lengths * K * D * itemsize) / time, and that bandwidth as a fraction of the copy's
(2 * bytes / time: a copy reads and writes them). Anchors: `jax.nn.dot_product_attention` with
`key_value_seq_lengths` (cudnn, xla), jax's Pallas ops `decode_attention.gqa` and (paged)
`paged_attention`, torch `scaled_dot_product_attention` (uniform lengths, when importable);
each anchor cell gives its microseconds and our speed-up over it. `--impl` may also name
decode_attention's kernels, "mosaic" (Hopper) and "triton", to time them side by side: the
first implementation named is the column the others are compared with (`--impl
mosaic,triton,cudnn --prefill no`); and "ours_fp8": ours on float8_e4m3fn copies of the same
caches (per-tensor descales, quantised once, untimed), checked against the reference on those
copies, its bandwidth counted in e4m3 bytes (`--impl ours_fp8,ours --prefill no`: the ours
cell's ratio is then FP8's speed-up over the bf16 cache). `--variant IMPL:LABEL:FIELD=VALUE,...`
(IMPL ours, ours_fp8, triton, interpret, mosaic or xla) adds a column running IMPL's call with
a config of VARIANT_CONFIGS[IMPL]'s type and those fields, the rest its defaults (`--impl
ours_fp8,ours --variant ours_fp8:bk256:block_kv=256`: a tile change decided in one run);
`num_splits=N` sets the call's split count instead of the heuristic's (with no other field the
config stays the call's default). `--loop-calls N` also times each column as N calls chained
in one jitted `fori_loop` (`looped`): a generation loop's cost per step, which jax's per-call
dispatch (tens of µs) hides at short caches, beside the same loop's step without the call
('empty': the loop's own cost, which a model's step pays once for all its layers); the run
then has XLA capture CUDA graphs of any size (GRAPH_FLAG), as a model's step would be. Every
column's GPU time (CUPTI, the sum of its kernels' durations: 'dev') stands beside its per-call
time; `--kernels` prints each kernel's share under the row (ours: the split kernel and the
merge; `mosaic` adds its prepare launch).

Chunked prefill rows: Tq new tokens (B = 1) against a 32K cache, end-aligned causal, in TFLOP/s
(4 * H * D * visible pairs): ours (the default path: on Hopper from FLASH_SPLIT_MIN_Q_LEN
tokens the "flash" route, two flash_attention calls merged; the row names the path) next to
split_kv (the split-KV kernel: implementation "triton" on GPU, "xla" off it), `flash_attention`
running the same mask in one call (a window (n, n - Tq) over the n cached keys) and cuDNN's;
each anchor cell gives ours / anchor.

Shapes: 32 query / 8 kv heads, D 128 (Llama-3-8B's attention), page 64. --quick: four
points and one prefill row. The full grid compiles each point's executables in parallel and
times 3 interleaved rounds of 20 ms loops, to finish in about 3-4 minutes on one H200.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import functools
import math
import os
import time

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

import pallas_flash
from pallas_flash import fp8
from pallas_flash.bench import checks, flops, timing

# Our implementations (pallas_flash.decode_attention; "ours" = implementation=None) and the
# anchors.
# "mosaic" and "triton" name decode_attention's kernels, to time them side by side
# (`--impl mosaic,triton,cudnn`: the first is the column the others are compared with).
OURS = ("ours", "ours_fp8", "mosaic", "triton", "xla", "interpret")
ANCHORS = ("cudnn", "jax_xla", "jaxops_gqa", "jaxops_paged", "torch")
DECODE_IMPLS = OURS + ANCHORS
PREFILL_ANCHORS = ("split_kv", "flash", "cudnn")
PREFILL_ONLY = ("split_kv", "flash")  # anchors of the prefill rows only
# --variant IMPL:LABEL:FIELDS: IMPL's call with a config of these fields (the others None:
# decode_attention's defaults), whose type picks the kernel as decode_attention does.
VARIANT_CONFIGS = {"ours": pallas_flash.TritonDecodeConfig,
                   "ours_fp8": pallas_flash.TritonDecodeConfig,
                   "triton": pallas_flash.TritonDecodeConfig,
                   "interpret": pallas_flash.TritonDecodeConfig,
                   "mosaic": pallas_flash.MosaicDecodeConfig,
                   "xla": pallas_flash.XlaDecodeConfig}
# decode_attention's keyword arguments a --variant may set beside its config's fields
# (`--variant ours:s2:num_splits=2`: a split count timed against the heuristic's).
VARIANT_CALL_FIELDS = ("num_splits",)
# --loop-calls: the name prefix of a column's looped call among the timed functions, and the
# name of the same loop without attention (its steps' own cost: the trip count's compare, the
# query update).
LOOP = "loop:"
EMPTY_LOOP = "loop:empty"
# max|x - ref| / max|ref| above which a row is FAIL (the attention benchmark's tolerances).
TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}
# Decode-mode timing defaults (the flags override them): short loops, few rounds.
ITERS, MIN_LOOP_MS, SETTLE_MS = 3, 20.0, 0.0
COPY_CAP_BYTES = 4 << 30  # the copy's bandwidth saturates far below this
TILE_KEYS = 4096  # random keys generated per sequence, tiled along L (no 32 GiB RNG buffers)


@dataclasses.dataclass(frozen=True)
class Grid:
  """Points of one benchmark run."""

  batches: tuple[int, ...]
  caches: tuple[int, ...]
  num_heads: int = 32
  num_kv_heads: int = 8
  head_dim: int = 128
  page_size: int = 64
  prefill_q_lens: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
  prefill_cache: int = 32768
  lengths: tuple[str, ...] = ("uniform", "ragged")


LENGTH_MODES = ("uniform", "ragged", "skewed")
GRIDS = {
    "full": Grid(batches=(1, 8, 32, 64, 128), caches=(1024, 8192, 32768, 131072)),
    "quick": Grid(batches=(1, 32), caches=(1024, 32768), prefill_q_lens=(1024,),
                  lengths=("uniform",)),
    "cpu": Grid(batches=(1, 3), caches=(64, 96), num_heads=4, num_kv_heads=2, head_dim=32,
                page_size=16, prefill_q_lens=(8,), prefill_cache=96),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
  g = p.add_argument_group("decode mode (--decode)")
  g.add_argument("--decode", action="store_true", help="the decode / KV-cache benchmark")
  g.add_argument("--quick", action="store_true",
                 help="decode: a few points (grid 'quick'); features: a tiny shape and short "
                 "loops (a CPU smoke run)")
  g.add_argument("--grid", default=None, choices=sorted(GRIDS),
                 help="decode: point grid (default full; cpu: tiny shapes for tests)")
  g.add_argument("--batches", default=None, help="decode: comma list overriding the grid's")
  g.add_argument("--caches", default=None, help="decode: comma list of cache lengths")
  g.add_argument("--layouts", default="contiguous,paged", help="decode: contiguous,paged")
  g.add_argument("--lengths", default=None, help="decode: uniform,ragged,skewed")
  g.add_argument("--prefill", default="yes", choices=("yes", "no", "only"),
                 help="decode: the chunked-prefill rows")
  g.add_argument("--max-cache-gib", type=float, default=32.0,
                 help="decode: skip points whose K+V cache exceeds this")
  g.add_argument("--loop-calls", type=int, default=0, metavar="N",
                 help="decode: also time each column as N calls chained in one jitted "
                 "fori_loop (a generation loop's cost per step, without jax's dispatch)")
  for name in ("block-kv", "block-m", "num-warps", "num-stages", "num-splits"):
    g.add_argument(f"--{name}", type=int, default=None,
                   help=f"decode: {name.replace('-', '_')} of ours (Triton) for sweeps, and "
                   "of 'triton' when --impl names it; block-kv, num-stages and num-splits "
                   "also of 'mosaic'")


def _grid(opts) -> Grid:
  grid = GRIDS[opts.grid or ("quick" if opts.quick else "full")]
  ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
  if opts.batches:
    grid = dataclasses.replace(grid, batches=ints(opts.batches))
  if opts.caches:
    grid = dataclasses.replace(grid, caches=ints(opts.caches))
  if opts.lengths:
    modes = tuple(opts.lengths.split(","))
    if set(modes) - set(LENGTH_MODES):
      raise SystemExit(f"Unknown --lengths {opts.lengths!r}; choose from {LENGTH_MODES}.")
    grid = dataclasses.replace(grid, lengths=modes)
  return grid


def _impls(opts) -> list[str]:
  """The --impl list (default: ours and the anchors that run here), then the --variant
  columns."""
  variant_names = list(getattr(opts, "variants", {}))
  if opts.impl:
    impls = [i.strip() for i in opts.impl.split(",") if i.strip()]
    unknown = set(impls) - set(DECODE_IMPLS) - set(PREFILL_ANCHORS)
    if unknown:
      raise SystemExit(f"Unknown decode implementations {sorted(unknown)}; choose from "
                       f"{DECODE_IMPLS + PREFILL_ONLY}.")
    return impls + variant_names
  if jax.devices()[0].platform == "gpu":
    return ["ours", *ANCHORS, *variant_names, *PREFILL_ONLY]
  return ["ours", "jax_xla", *variant_names, *PREFILL_ONLY]


def _base(impl: str) -> str:
  """The implementation a column runs: a --variant column's (IMPL:LABEL), else itself."""
  return impl.split(":", 1)[0]


def _ours_kwargs(opts) -> dict:
  """implementation / config / num_splits of 'ours' (the flags force the Triton kernel)."""
  fields = {f: getattr(opts, f) for f in ("block_kv", "block_m", "num_warps", "num_stages")}
  kw = {"num_splits": opts.num_splits}
  if any(v is not None for v in fields.values()):
    kw.update(implementation="triton", config=pallas_flash.TritonDecodeConfig(**fields))
  return kw


def _mosaic_kwargs(ours_kw: dict) -> dict:
  """num_splits and the tiles (--block-kv, --num-stages) of the Mosaic kernel, named by --impl."""
  kw = {"num_splits": ours_kw.get("num_splits")}
  config = ours_kw.get("config")
  if config is not None and (config.block_kv or config.num_stages):
    kw["config"] = pallas_flash.MosaicDecodeConfig(block_kv=config.block_kv,
                                                   num_stages=config.num_stages)
  return kw


# ---------------------------------------------------------------------------------------------
# Inputs


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _random_cache(key, *, shape, dtype):
  """[B, L, K, D] normal values: TILE_KEYS random keys per sequence, tiled along L."""
  b, length, kh, d = shape
  block = min(length, TILE_KEYS)
  x = jax.random.normal(key, (b, block, kh, d), dtype)
  return jnp.tile(x, (1, -(-length // block), 1, 1))[:, :length]


def _lengths(mode: str, batch: int, cache: int, seed: int) -> np.ndarray:
  """uniform: every sequence full; ragged: uniform draws in [1, L]; skewed: the first
  sequence full and the others at L / 32 (one long conversation beside short ones)."""
  if mode == "uniform":
    return np.full(batch, cache, np.int32)
  if mode == "ragged":
    return np.random.default_rng(seed).integers(1, cache + 1, batch).astype(np.int32)
  assert mode == "skewed", mode
  return np.array([cache] + [max(1, cache // 32)] * (batch - 1), np.int32)


def _page_table(batch: int, cache: int, page_size: int, seed: int) -> np.ndarray:
  """Every sequence gets cache / page_size pages of the pool in a random order."""
  pages = batch * (cache // page_size)
  return np.random.default_rng(seed).permutation(pages).astype(np.int32).reshape(batch, -1)


# ---------------------------------------------------------------------------------------------
# The calls (each returns out [B, 1, H, D] or [B, H, D]; `lens` is traced)


def _call(impl: str, layout: str, *, ours_kw: dict, page_size: int, kv_descale=None,
          variant=None):
  """fn(q, k, v, lens, table) for one implementation, or None where it does not apply;
  `variant` (a bench.variants.Variant of `impl`) passes its num_splits and a config of its
  other fields.

  k and v come as contiguous [B, L, K, D] caches; paged calls view them as a pool
  [B * L / page, page, K, D] inside the jitted function (a free bitcast there: eagerly,
  a reshape would copy GiBs), read through a shuffled page table. jaxops_paged gets its own
  layout [K, pages, page, D], copied once outside the timed calls.
  """
  pool = lambda x: x.reshape(-1, page_size, *x.shape[2:])  # noqa: E731
  if impl in OURS:
    kw = dict(ours_kw) if impl in ("ours", "ours_fp8") else {"implementation": impl}
    if impl == "ours_fp8":
      kw["kv_descale"] = kv_descale
    if impl == "mosaic":
      kw.update(_mosaic_kwargs(ours_kw))
    elif impl == "triton":  # the Triton kernel by name: the same flags as ours
      kw.update({k: v for k, v in ours_kw.items() if k != "implementation"})
    fields = {} if variant is None else dict(variant.fields)
    kw.update({name: fields.pop(name) for name in VARIANT_CALL_FIELDS if name in fields})
    if fields:  # the config's type picks its kernel
      kw["config"] = VARIANT_CONFIGS[impl](**fields)
      if impl in ("ours", "ours_fp8") and jax.devices()[0].platform != "gpu":
        kw["implementation"] = "interpret"  # the Triton kernel's form off-GPU
    if layout == "paged":
      return lambda q, k, v, lens, table: pallas_flash.decode_attention(
          q, pool(k), pool(v), lens, page_table=table, **kw)
    return lambda q, k, v, lens, table: pallas_flash.decode_attention(q, k, v, lens, **kw)
  if layout == "paged":
    if impl != "jaxops_paged":
      return None
    from jax.experimental.pallas.ops.gpu import paged_attention as paged

    def run(q, k, v, lens, table):
      pages_per_seq = table.shape[1]
      k_splits = math.gcd(16, pages_per_seq)  # it needs pages_per_seq % k_splits == 0
      return paged.paged_attention(q[:, 0], k, v, table, lens, k_splits=k_splits,
                                   pages_per_compute_block=min(8, pages_per_seq // k_splits))

    return run
  if impl in ("cudnn", "jax_xla"):
    name = "cudnn" if impl == "cudnn" else "xla"
    return lambda q, k, v, lens, table: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=lens, implementation=name)
  if impl == "jaxops_gqa":
    from jax.experimental.pallas.ops.gpu import decode_attention as ops_decode
    return lambda q, k, v, lens, table: ops_decode.gqa(q[:, 0], k, v, kv_seq_len=lens)
  return None


@jax.jit
def _fp8_copies(k, v):
  """((k8, v8), (k_descale, v_descale)): e4m3 copies of the caches, each tensor's max |x| at
  448 (fp8.to_e4m3), and their per-tensor descales."""
  descale = tuple(jnp.max(jnp.abs(x.astype(jnp.float32))) / fp8.E4M3_MAX for x in (k, v))
  return tuple(fp8.to_e4m3(x, s) for x, s in zip((k, v), descale)), descale


@functools.partial(jax.jit, static_argnames=("page_size",))
def _sequences(x, table, idx, *, page_size):
  """Sequences idx of a cache [B, L, K, D] read through the paged view and `table` (None:
  directly): [len(idx), L, K, D], what the reference checks against."""
  if table is None:
    return x[idx]
  pool = x.reshape(-1, page_size, *x.shape[2:])
  j = jnp.arange(x.shape[1])
  return pool[table[idx][:, j // page_size], j % page_size]


class _TorchDone:
  """What the torch anchor returns per call: jax.block_until_ready syncs the CUDA stream."""

  def block_until_ready(self):
    import torch
    torch.cuda.synchronize()
    return self


def _torch_call(q, k, v):
  """torch SDPA on zero-copy views of the jax arrays ([B, H|K, T|L, D] by transposes)."""
  import torch
  import torch.nn.functional as F  # noqa: N812

  qt, kt, vt = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))

  def run(*_):
    out = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    return out

  def timed():
    run()
    return _TorchDone()

  def result():
    return jnp.asarray(run().transpose(1, 2).float().cpu().numpy())

  return timed, result


# XLA runs a loop body of at least this many ops as one CUDA graph (its default is 5): a
# model's decode step is always one, the bench's loop of two to five ops is not unless asked,
# and then its launches, not its kernels, set the step's time (one H100, 2026-12-07: the Triton
# call 15-26 µs a step at B = 1, 1K, as a graph 11.5; the empty loop 21 µs, as a graph 4.9).
GRAPH_FLAG = "--xla_gpu_graph_min_graph_size=1"


def capture_small_graphs() -> None:
  """Adds GRAPH_FLAG to XLA_FLAGS for --loop-calls; it takes effect if the GPU client has not
  started yet (python -m pallas_flash.bench sets it before anything runs)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_gpu_graph_min_graph_size" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {GRAPH_FLAG}".strip()


def looped(fn, calls: int):
  """fn(q, k, v, lens, table) run `calls` times in one lax.fori_loop, as a generation loop
  runs its decode steps: each call's query takes a 1e-6 share of one element of the previous
  output, so no call can be hoisted out of the loop or overlap the next. Returns the last q."""
  def run(q, k, v, lens, table):
    def step(_, q):
      out = fn(q, k, v, lens, table)
      out = out[0] if isinstance(out, tuple) else out
      return q + (out.reshape(-1)[0] * 1e-6).astype(q.dtype)
    return lax.fori_loop(0, calls, step, q)
  return run


def _compile_all(fns: dict, args: dict) -> dict:
  """{name: compiled or Exception}: each fn jitted and compiled for its args, in parallel
  (XLA and Triton compile in C++ off the GIL)."""
  def one(name):
    try:
      return jax.jit(fns[name]).lower(*args[name]).compile()
    except Exception as e:  # noqa: BLE001 -- a failing anchor only marks its row
      return e

  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(fns))) as pool:
    return dict(zip(fns, pool.map(one, fns)))


# ---------------------------------------------------------------------------------------------
# One point


def _row(kind: str, impl: str, **fields) -> dict:
  return {"kind": kind, "impl": impl, "status": "skip", "reason": None, "us": None,
          "device_us": None, "rel_err": None, **fields}


def _check(out, ref, idx, dtype) -> tuple[float, str]:
  out = jnp.asarray(out)
  out = out.reshape(out.shape[0], 1, *out.shape[-2:])[idx]
  err = float(checks.rel_err(out, ref))
  return err, "ok" if err <= TOLERANCE[jnp.dtype(dtype).name] else "FAIL"


def _device_times(exe, args: tuple, iterations: int = 5) -> tuple[float | None, dict]:
  """(median GPU time per call of a compiled executable, {kernel: median µs} in launch order)
  by CUPTI: the sum of its kernels' durations, without launch gaps; (None, {}) off-GPU or
  without CUPTI. A kernel name launched k times a call is told apart as "name #i"."""
  if jax.devices()[0].platform != "gpu":
    return None, {}
  try:
    from jax.experimental.mosaic.gpu import profiler
    _, per_iter = profiler.measure(exe, aggregate=False, iterations=iterations)(*args)
  except Exception:  # noqa: BLE001 -- CUPTI missing or busy: wall time only
    return None, {}
  if not per_iter:
    return None, {}
  return kernel_medians(per_iter)


def kernel_medians(per_iter: list[list[tuple[str, float]]]) -> tuple[float, dict]:
  """(median total µs, {kernel: median µs}) of CUPTI's per-iteration (name, ms) lists."""
  totals = [sum(ms for _, ms in kernels) for kernels in per_iter]
  launches = collections.Counter(name for name, _ in per_iter[0])
  seen, names = collections.Counter(), []
  for name, _ in per_iter[0]:
    seen[name] += 1
    names.append(f"{name} #{seen[name]}" if launches[name] > 1 else name)
  return (float(np.median(totals)) * 1e3,
          {n: float(np.median([kernels[i][1] for kernels in per_iter])) * 1e3
           for i, n in enumerate(names)})


def _time(fns: dict, opts) -> dict:
  """timing.time_interleaved over zero-argument closures."""
  return timing.time_interleaved(fns, (), iters=opts.iters, min_loop_s=opts.min_loop_ms / 1e3,
                                 settle_s=opts.settle_ms / 1e3)


def run_point(grid: Grid, batch: int, cache: int, layout: str, impls: list[str], dtype,
              opts, inputs) -> list[dict]:
  """Rows of one (B, L, layout) for every lengths mode in the grid."""
  q, k, v = inputs
  kh, d, h = grid.num_kv_heads, grid.head_dim, grid.num_heads
  itemsize = jnp.dtype(dtype).itemsize
  table = None
  if layout == "paged":
    table = jnp.asarray(_page_table(batch, cache, grid.page_size, opts.seed))
  kv, descale = {}, None
  if "ours_fp8" in map(_base, impls):  # e4m3 copies of the caches, max |x| -> 448 per tensor
    kv["ours_fp8"], descale = _fp8_copies(k, v)
  variants = getattr(opts, "variants", {})
  calls = {i: _call(_base(i), layout, ours_kw=_ours_kwargs(opts), page_size=grid.page_size,
                    kv_descale=descale, variant=variants.get(i))
           for i in impls if i != "torch"}
  calls = {i: f for i, f in calls.items() if f is not None}
  if "jaxops_paged" in calls:  # its layout [K, pages, page, D]: a copy made once, not timed
    move = jax.jit(lambda x: jnp.moveaxis(x.reshape(-1, grid.page_size, kh, d), 2, 0))
    try:
      kv["jaxops_paged"] = (move(k), move(v))
    except jax.errors.JaxRuntimeError:  # no room for the copy beside the cache: no anchor row
      del calls["jaxops_paged"]
  lens_spec = jax.ShapeDtypeStruct((batch,), jnp.int32)
  args = {i: (q, *kv.get(_base(i), (k, v)), lens_spec, table) for i in calls}
  n_loop = getattr(opts, "loop_calls", 0)
  if n_loop:  # compiled with the plain calls, timed in the same rounds as LOOP + impl
    calls.update({LOOP + i: looped(f, n_loop) for i, f in list(calls.items())})
    args.update({LOOP + i: args[i] for i in list(args)})
    calls[EMPTY_LOOP] = looped(lambda q, *_: q, n_loop)
    args[EMPTY_LOOP] = (q, k, v, lens_spec, table)
  start = time.perf_counter()
  compiled = _compile_all(calls, args)
  compile_s = time.perf_counter() - start
  rows = []
  idx = jnp.asarray(sorted({0, batch - 1}))
  ref_kv = [_sequences(x, table, idx, page_size=grid.page_size).astype(jnp.float32)
            for x in (k, v)]
  fp8_kv = ([_sequences(x, table, idx, page_size=grid.page_size) for x in kv["ours_fp8"]]
            if "ours_fp8" in kv else None)
  for mode in grid.lengths:
    lens = jnp.asarray(_lengths(mode, batch, cache, opts.seed + batch))
    read = 2 * int(np.asarray(lens, np.int64).sum()) * kh * d * itemsize
    base = dict(layout=layout, lengths=mode, batch=batch, cache=cache, num_heads=h,
                num_kv_heads=kh, head_dim=d, dtype=jnp.dtype(dtype).name, bytes_read=read,
                compile_s=compile_s)
    ref = pallas_flash.decode_reference(q[idx].astype(jnp.float32), *ref_kv, lens[idx])[0]
    fp8_ref = None if fp8_kv is None else pallas_flash.decode_reference(
        q[idx].astype(jnp.float32), *fp8_kv, lens[idx], kv_descale=descale)[0]
    fns, group = {}, []
    for impl in impls:
      row = _row("decode", impl, **base)
      if _base(impl) == "ours_fp8":
        row.update(bytes_read=read // itemsize, dtype="float8_e4m3fn")
      group.append(row)
      if impl == "torch":
        if layout != "contiguous" or mode != "uniform":
          row["reason"] = "uniform contiguous caches only (SDPA has no lengths)"
          continue
        try:
          timed, result = _torch_call(q, k, v)
          row["rel_err"], row["status"] = _check(result(), ref, idx, dtype)
          fns[impl] = timed
        except Exception as e:  # noqa: BLE001 -- no torch, or a torch error
          row.update(status="error", reason=f"{type(e).__name__}: {str(e)[:200]}")
        continue
      if impl not in compiled:
        row["reason"] = f"not a {layout}-cache implementation"
        continue
      exe = compiled[impl]
      if isinstance(exe, Exception):
        row.update(status="error", reason=f"{type(exe).__name__}: {str(exe).strip()[:300]}")
        continue
      call_args = (*args[impl][:3], lens, table)
      try:
        row["rel_err"], row["status"] = _check(exe(*call_args),
                                               fp8_ref if _base(impl) == "ours_fp8" else ref,
                                               idx,
                                               dtype)
      except Exception as e:  # noqa: BLE001
        row.update(status="error", reason=f"{type(e).__name__}: {str(e).strip()[:300]}")
        continue
      fns[impl] = functools.partial(exe, *call_args)
      if not isinstance(loop_exe := compiled.get(LOOP + impl), (Exception, type(None))):
        fns[LOOP + impl] = functools.partial(loop_exe, *call_args)
      row["device_us"], row["device_kernels"] = _device_times(exe, call_args)
      if row["device_us"]:
        row["device_tbs"] = row["bytes_read"] / row["device_us"] / 1e6
    if not isinstance(empty := compiled.get(EMPTY_LOOP), (Exception, type(None))):
      fns[EMPTY_LOOP] = functools.partial(empty, q, k, v, lens, table)
    copy_elems = min(read, COPY_CAP_BYTES, k.size * itemsize) // itemsize
    copy = jax.jit(lambda x, n=copy_elems: x.reshape(-1)[:n] + jnp.ones((), x.dtype))
    copy = copy.lower(k).compile()
    fns["copy"] = functools.partial(copy, k)
    times = _time(fns, opts)
    copy_bw = 2 * copy_elems * itemsize / times["copy"].median_s
    copy_dev, _ = _device_times(copy, (k,))
    for row in group:
      row["copy_tbs"] = copy_bw / 1e12
      nbytes = row["bytes_read"]
      if copy_dev and row.get("device_us"):  # the same fraction in GPU time
        row["device_copy_fraction"] = (nbytes / row["device_us"]) / (2 * copy_elems * itemsize
                                                                     / copy_dev)
      if (t := times.get(row["impl"])) is not None:
        row.update(us=t.median_s * 1e6, tbs=nbytes / t.median_s / 1e12,
                   copy_fraction=nbytes / t.median_s / copy_bw)
      if (t := times.get(LOOP + row["impl"])) is not None:
        row["loop_us"] = t.median_s * 1e6 / n_loop
        if (empty_t := times.get(EMPTY_LOOP)) is not None:
          row["empty_loop_us"] = empty_t.median_s * 1e6 / n_loop
    ours = next((r for r in group if r["impl"] == impls[0] and r["us"]), None)
    for row in group:
      row["ours_speedup"] = ours["us"] and row["us"] and row["us"] / ours["us"] if ours else None
    rows += group
  return rows


def run_prefill(grid: Grid, impls: list[str], dtype, opts) -> list[dict]:
  """Chunked prefill: B = 1, Tq tokens, no append, n = the cache length (end-aligned)."""
  h, kh, d, n = grid.num_heads, grid.num_kv_heads, grid.head_dim, grid.prefill_cache
  keys = jax.random.split(jax.random.key(opts.seed + 7), 3)
  k = _random_cache(keys[1], shape=(1, n, kh, d), dtype=dtype)
  v = _random_cache(keys[2], shape=(1, n, kh, d), dtype=dtype)
  lens = jnp.full((1,), n, jnp.int32)
  g = h // kh
  rows = []
  for tq in grid.prefill_q_lens:
    q = jax.random.normal(keys[0], (1, tq, h, d), dtype)
    pairs = tq * (n - tq) + tq * (tq + 1) // 2
    flop = 4.0 * h * d * pairs
    window = (n, n - tq)  # query i (at n - tq + i) sees keys 0 .. n - tq + i
    ours_kw = _ours_kwargs(opts)
    calls = {"ours": lambda q, k, v: pallas_flash.decode_attention(q, k, v, lens, **ours_kw)}
    path = pallas_flash.decode_explain(q, k, v, lens, **ours_kw).chosen
    if "split_kv" in impls:
      split_kv = "triton" if jax.devices()[0].platform == "gpu" else "xla"
      calls["split_kv"] = functools.partial(pallas_flash.decode_attention,
                                            cache_seqlens=lens, implementation=split_kv)
    if "flash" in impls:
      calls["flash"] = functools.partial(pallas_flash.flash_attention, local_window_size=window)
    if "cudnn" in impls and jax.devices()[0].platform == "gpu":
      calls["cudnn"] = functools.partial(jax.nn.dot_product_attention, local_window_size=window,
                                         implementation="cudnn")
    compiled = _compile_all(calls, {i: (q, k, v) for i in calls})
    ref = pallas_flash.decode_reference(q[:, :, :g].astype(jnp.float32),
                                        k[:, :, :1].astype(jnp.float32),
                                        v[:, :, :1].astype(jnp.float32), lens)[0]
    fns, group = {}, []
    for impl, exe in compiled.items():
      row = _row("prefill", impl, q_len=tq, cache=n, batch=1, num_heads=h, num_kv_heads=kh,
                 head_dim=d, dtype=jnp.dtype(dtype).name, flops=flop,
                 path=path if impl == "ours" else None)
      group.append(row)
      if isinstance(exe, Exception):
        row.update(status="error", reason=f"{type(exe).__name__}: {str(exe).strip()[:300]}")
        continue
      out = exe(q, k, v)[:, :, :g]
      row["rel_err"] = float(checks.rel_err(out, ref))
      row["status"] = "ok" if row["rel_err"] <= TOLERANCE[jnp.dtype(dtype).name] else "FAIL"
      fns[impl] = functools.partial(exe, q, k, v)
    times = _time(fns, opts) if fns else {}
    for row in group:
      if (t := times.get(row["impl"])) is not None:
        row.update(us=t.median_s * 1e6, tflops=flop / t.median_s / 1e12)
    ours = group[0]
    for row in group:
      row["ours_ratio"] = (ours.get("tflops") and row.get("tflops")
                           and ours["tflops"] / row["tflops"])
    rows += group
    print_prefill(group)
  return rows


# ---------------------------------------------------------------------------------------------
# Printing


def _tokens(n: int) -> str:
  return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _f(x, spec: str) -> str:
  return "-" if x is None else format(x, spec)


def _anchor_cell(r: dict) -> str:
  """us (our speed-up), and its kernels' GPU time where CUPTI gave one: at short caches a call
  is launch-bound, and only GPU times compare the kernels."""
  if r["status"] in ("skip", "error"):
    return r["status"]
  cell = f"{r['us']:.1f} ({r['ours_speedup']:.2f}x)" if r["us"] and r["ours_speedup"] else "-"
  if r.get("device_us"):
    cell += f" dev {r['device_us']:.1f}"
  if r.get("loop_us"):
    cell += f" loop {r['loop_us']:.1f}"
  return cell + ("!" if r["status"] == "FAIL" else "")


def print_header(impls: list[str], grid: Grid, dtype) -> None:
  anchors = impls[1:]
  print(f"\ndecode, {jnp.dtype(dtype).name}, H {grid.num_heads} / K {grid.num_kv_heads}, "
        f"D {grid.head_dim}, page {grid.page_size}. TB/s = K+V bytes read / time; %copy = that"
        " / (2 x bytes / a jnp copy's time); us: per call, back to back; dev us: its kernels'"
        " GPU time (CUPTI); anchors and variants: us (our speed-up) dev us; loop: us per call"
        " chained in one jitted loop run as a CUDA graph (--loop-calls), empty: that loop's step"
        " without the call; ! = FAIL")
  print(f"| layout | lengths | B | cache | MiB read | copy TB/s | {impls[0]} us | dev us | TB/s "
        "| %copy | err | " + " | ".join(anchors) + " |")
  print("|---" * (11 + len(anchors)) + "|")


def print_rows(rows: list[dict], impls: list[str], kernels: bool = False) -> None:
  """One table line per (layout, lengths, B, cache); with `kernels`, under it each column's
  GPU time per kernel."""
  anchors = impls[1:]
  by_key: dict[tuple, dict[str, dict]] = {}
  for r in rows:
    by_key.setdefault((r["layout"], r["lengths"], r["batch"], r["cache"]), {})[r["impl"]] = r
  for (layout, mode, b, cache), group in by_key.items():
    ours = group.get(impls[0])
    if ours is None:
      continue
    pct = ours.get("copy_fraction") and 100 * ours["copy_fraction"]
    cells = [layout, mode, str(b), _tokens(cache), f"{ours['bytes_read'] / 2**20:.4g}",
             _f(ours.get("copy_tbs"), ".2f"),
             _f(ours["us"], ".1f") + ("!" if ours["status"] == "FAIL" else "")
             + (f" (loop {ours['loop_us']:.1f}, empty {_f(ours.get('empty_loop_us'), '.1f')})"
                if ours.get("loop_us") else ""),
             _f(ours.get("device_us"), ".1f"), _f(ours.get("tbs"), ".2f"), _f(pct, ".0f"),
             _f(ours["rel_err"], ".0e")]
    cells += [_anchor_cell(group[a]) if a in group else "" for a in anchors]
    print("| " + " | ".join(cells) + " |", flush=True)
    for impl in impls if kernels else ():
      if times := group.get(impl, {}).get("device_kernels"):
        print(f"    {impl}: " + ", ".join(f"{name} {us:.1f}" for name, us in times.items()))


def print_prefill(group: list[dict]) -> None:
  r0 = group[0]
  cells = []
  for r in group:
    name = f"{r['impl']} [{r['path']}]" if r.get("path") else r["impl"]
    cell = f"{name} {flops.format_tflops(r.get('tflops'))} TFLOP/s"
    if r is not r0 and r.get("ours_ratio"):
      cell += f" (ours {r['ours_ratio']:.2f}x)"
    if r["status"] != "ok":
      cell += f" {r['status']}"
    cells.append(cell)
  print(f"prefill Tq={r0['q_len']} cache {_tokens(r0['cache'])}: " + ", ".join(cells),
        flush=True)


# ---------------------------------------------------------------------------------------------
# Main


def run_decode(opts, dtype, on_rows=lambda rows: None) -> list[dict]:
  """Every decode point and prefill row; prints as it goes and passes rows to `on_rows`."""
  grid, impls = _grid(opts), _impls(opts)
  decode_impls = [i for i in impls if i not in PREFILL_ONLY]
  layouts = [x.strip() for x in opts.layouts.split(",") if x.strip()]
  rows: list[dict] = []
  if opts.prefill != "only":
    print_header(decode_impls, grid, dtype)
    for cache in grid.caches:
      for batch in grid.batches:
        gib = 2 * batch * cache * grid.num_kv_heads * grid.head_dim * jnp.dtype(dtype).itemsize
        if gib / 2**30 > opts.max_cache_gib:
          print(f"| skip B={batch} cache {cache}: K+V {gib / 2**30:.0f} GiB > "
                f"--max-cache-gib {opts.max_cache_gib:g} |")
          continue
        keys = jax.random.split(jax.random.key(opts.seed), 3)
        shape = (batch, cache, grid.num_kv_heads, grid.head_dim)
        inputs = (jax.random.normal(keys[0], (batch, 1, grid.num_heads, grid.head_dim), dtype),
                  _random_cache(keys[1], shape=shape, dtype=dtype),
                  _random_cache(keys[2], shape=shape, dtype=dtype))
        for layout in layouts:
          point = run_point(grid, batch, cache, layout, decode_impls, dtype, opts, inputs)
          print_rows(point, decode_impls, kernels=opts.kernels)
          rows += point
          on_rows(rows)
        del inputs
  if opts.prefill != "no" and grid.prefill_q_lens:
    print(f"\nchunked prefill, B 1, cache {_tokens(grid.prefill_cache)} (end-aligned causal), "
          f"TFLOP/s = 4 H D x visible pairs / time; ours [the path it ran]; split_kv = the "
          f"split-KV kernel; flash = flash_attention with the same mask in one call; "
          f"(ours Nx) = ours / anchor")
    rows += run_prefill(grid, [i for i in impls if i in PREFILL_ANCHORS], dtype, opts)
    on_rows(rows)
  return rows
