"""Correctness and timing of the Mosaic GPU kernels on one Hopper GPU, side by side with cuDNN.

Run from the repository root on the GPU machine:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/mosaic_gpu_check.py [--out DIR] [--sweep] [--long]

Writes DIR/mosaic_gpu_check.json (DIR defaults to $OUT or .) and prints a table. FLOPs count the
matmuls only: forward 4·B·H·T·S·D (halved when causal), forward+backward 3.5x that.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench import checks
from pallas_flash.mosaic_gpu import MosaicConfig
from pallas_flash.mosaic_gpu import config as mconfig
from pallas_flash.call import AttentionParams
from pallas_flash.reference import attention_reference

TOL = {"bfloat16": (1e-2, 2e-2), "float16": (2e-3, 4e-3)}

CHECKS = [  # B, T, S, H, K, D, causal, dtype
    (2, 1024, 1024, 4, 4, 128, False, "bfloat16"),
    (2, 1024, 1024, 4, 4, 128, True, "bfloat16"),
    (1, 1000, 1100, 8, 2, 64, True, "bfloat16"),
    (1, 1100, 1000, 4, 4, 128, True, "bfloat16"),
    (1, 777, 777, 4, 1, 128, True, "float16"),
    (1, 2048, 2048, 4, 2, 64, False, "float16"),
    (1, 512, 512, 2, 2, 256, True, "bfloat16"),
    (1, 300, 700, 4, 2, 256, False, "bfloat16"),
    (1, 1, 1, 2, 1, 64, False, "bfloat16"),
]

BENCH = [  # B, T, H, D, causal  (K = H, S = T, bf16)
    (4, 4096, 16, 128, False), (4, 4096, 16, 128, True), (16, 1024, 16, 64, False),
    (16, 1024, 16, 128, False), (16, 1024, 16, 128, True),
    (1, 16384, 16, 128, False), (1, 16384, 16, 128, True),
    (4, 4096, 32, 64, False), (4, 4096, 32, 64, True),
    (1, 32768, 16, 128, False), (1, 32768, 16, 128, True),
]


_PATH = ["mosaic_gpu_check.json"]


def save(results):
  """Rewrites the JSON after every row, so a run cut short keeps what it measured."""
  with open(_PATH[0], "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, results=results),
              f, indent=1)

SWEEP = [(4, 4096, 16, 128, False), (4, 4096, 16, 128, True), (1, 16384, 16, 128, False),
         (1, 16384, 16, 128, True), (4, 4096, 32, 64, False), (16, 1024, 16, 64, False),
         (16, 1024, 16, 128, False), (1, 32768, 16, 128, False), (1, 32768, 16, 128, True),
         (2, 8192, 16, 128, True), (2, 16384, 8, 128, True),
         # Causal 32K with 8 heads and 16K with 32: one head's K/V spans half / twice the
         # address range at the same length (the 16K -> 32K causal drop: length or span?).
         (1, 32768, 8, 128, True), (1, 16384, 32, 128, True)]


def rel_err(x, ref) -> float:
  return float(checks.rel_err(x, ref))


def inputs(b, t, s, h, kh, d, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  dt = jnp.dtype(dtype)
  return (jax.random.normal(ks[0], (b, t, h, d), dt), jax.random.normal(ks[1], (b, s, kh, d), dt),
          jax.random.normal(ks[2], (b, s, kh, d), dt), jax.random.normal(ks[3], (b, t, h, d), dt))


def ours(causal, config=None):
  return lambda q, k, v: pallas_flash.flash_attention(q, k, v, is_causal=causal,
                                                      implementation="mosaic", config=config)


def cudnn(causal):
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                       implementation="cudnn")


def fwd_bwd(attn):
  def f(q, k, v, do):
    o, vjp = jax.vjp(attn, q, k, v)
    return o, *vjp(do)
  return f


def timeit(f, *args, iters=10, reps=5):
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = f(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters)
  return statistics.median(times)


def check(results):
  for b, t, s, h, kh, d, causal, dtype in CHECKS:
    q, k, v, do = inputs(b, t, s, h, kh, d, dtype)
    p = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
    ref = lambda q, k, v: attention_reference(q, k, v, None, None, params=p)[0]  # noqa: E731
    got = jax.jit(fwd_bwd(ours(causal)))(q, k, v, do)
    want = jax.jit(fwd_bwd(ref))(q, k, v, do)
    again = jax.jit(fwd_bwd(ours(causal)))(q, k, v, do)
    errs = [rel_err(a, r) for a, r in zip(got, want)]
    det = all(bool(jnp.array_equal(a, r)) for a, r in zip(got, again))
    tf, tg = TOL[dtype]
    ok = errs[0] <= tf and max(errs[1:]) <= tg and det
    row = dict(kind="check", shape=[b, t, s, h, kh, d], causal=causal, dtype=dtype,
               err_o=errs[0], err_dq=errs[1], err_dk=errs[2], err_dv=errs[3],
               deterministic=det, ok=ok)
    results.append(row)
    print(f"check {b}x{t}x{s} H{h}/K{kh} D{d} causal={causal} {dtype}: o {errs[0]:.1e} "
          f"dq {errs[1]:.1e} dk {errs[2]:.1e} dv {errs[3]:.1e} det={det} "
          f"{'OK' if ok else 'FAIL'}", flush=True)


def bench(results, shapes, configs=None):
  for b, t, h, d, causal in shapes:
    q, k, v, do = inputs(b, t, t, h, h, d, "bfloat16")
    flops = 4 * b * h * t * t * d / (2 if causal else 1)
    for mode in ("fwd", "fwdbwd"):
      if configs and not any(mode in modes for _, _, modes in configs):
        continue
      row = dict(kind="bench", mode=mode, shape=[b, t, h, d], causal=causal)
      impls = [("cudnn", cudnn(causal))]
      for cname, config, modes in configs or [("", None, ("fwd", "fwdbwd"))]:
        if mode in modes:
          impls.append((f"mosaic{':' + cname if cname else ''}", ours(causal, config)))
      for name, attn in impls:
        f = jax.jit(attn if mode == "fwd" else fwd_bwd(attn))
        args = (q, k, v) if mode == "fwd" else (q, k, v, do)
        try:
          sec = timeit(f, *args)
          row[name] = flops * (1 if mode == "fwd" else 3.5) / sec / 1e12
        except Exception as e:  # noqa: BLE001 - report and continue the sweep
          row[name] = None
          print(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
      if mode == "fwd":  # agreement with cuDNN on the large shapes
        row["err_vs_cudnn"] = rel_err(jax.jit(ours(causal))(q, k, v),
                                      jax.jit(cudnn(causal))(q, k, v))
      results.append(row)
      cells = " ".join(f"{n}={x:.0f}" if isinstance(x, float) and n != "err_vs_cudnn"
                       else f"{n}={x}" for n, x in row.items() if n not in ("kind", "mode",
                                                                            "shape", "causal"))
      print(f"{mode:6s} {b}x{t}x{h}x{d} causal={causal}: {cells}", flush=True)
      save(results)


def long_causal(results, t=1 << 20):
  q, k, v, do = inputs(1, t, t, 16, 16, 128, "bfloat16")
  f = jax.jit(fwd_bwd(ours(True)))
  t0 = time.perf_counter()
  out = jax.block_until_ready(f(q, k, v, do))
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  out = jax.block_until_ready(f(q, k, v, do))
  sec = time.perf_counter() - t0
  finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in out)
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use", 0) / 2**30
  tflops = 4 * 16 * t * t * 128 / 2 * 3.5 / sec / 1e12
  results.append(dict(kind="long", tokens=t, seconds=sec, first_call_s=first, tflops=tflops,
                      finite=finite, peak_gib=peak))
  print(f"causal fwd+bwd {t} tokens: {sec:.1f}s ({tflops:.0f} TFLOP/s), first call {first:.1f}s,"
        f" finite={finite}, peak {peak:.1f} GiB", flush=True)


def _pick(shapes, spec):
  """`spec` "" -> all shapes; "N" -> the first N; "i,j,..." -> those indices."""
  if not spec:
    return shapes
  if "," not in spec:
    return shapes[:int(spec)]
  return [shapes[int(i)] for i in spec.split(",")]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--sweep", action="store_true", help="time alternative configs too")
  parser.add_argument("--long", action="store_true", help="causal fwd+bwd at 1M tokens")
  parser.add_argument("--skip-check", action="store_true")
  parser.add_argument("--shapes", default="", help="time only the first N shapes of BENCH "
                      "(of SWEEP with --sweep), or those at the comma-separated indices")
  parser.add_argument("--variants", default="", help="--sweep: only these comma-separated "
                      "config names (e.g. default,overlap); `fwd:` before a name times only fwd")
  args = parser.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  results = []
  _PATH[0] = os.path.join(args.out, "mosaic_gpu_check.json")
  try:
    if not args.skip_check:
      check(results)
    if args.long:
      long_causal(results)
      save(results)
    if args.sweep:
      fwd, fb = ("fwd",), ("fwdbwd",)
      configs = [("default", None, ("fwd", "fwdbwd")),
                 ("heads", MosaicConfig(heads_fastest=True), fwd),
                 ("qtiles", MosaicConfig(heads_fastest=False), fwd),
                 ("s3", MosaicConfig(num_stages=3), fwd),
                 ("kv192", MosaicConfig(block_kv=192), fwd),
                 ("r240", MosaicConfig(compute_registers=240, producer_registers=24), fwd),
                 # The tuned hd128 config in the other forward launch order (eighth session,
                 # run3, as "tuned_hf0" when the flag's values were swapped: 2-7 % slower).
                 ("tuned_heads", dataclasses.replace(mconfig.TUNED[(128, False)],
                                                     heads_fastest=True), ("fwd", "fwdbwd")),
                 # FA3 intra-WG overlap (runs at 240/24 registers unless set otherwise).
                 ("overlap", MosaicConfig(fwd_intra_wg_overlap=True), fwd),
                 ("overlap_s3", MosaicConfig(fwd_intra_wg_overlap=True, num_stages=3), fwd),
                 ("overlap_kv192", MosaicConfig(fwd_intra_wg_overlap=True, block_kv=192), fwd),
                 # One CTA per SM looping over tiles (non-causal; causal rows run the grid).
                 ("persistent", MosaicConfig(fwd_intra_wg_overlap=True, fwd_persistent=True),
                  fwd),
                 ("persistent_plain", MosaicConfig(fwd_persistent=True), fwd),
                 # q tiles fastest: the CTAs working together share one or two heads' K/V,
                 # which stays in L2 at 16K-32K (all 16 heads' K/V does not).
                 ("persistent_qtiles", MosaicConfig(fwd_intra_wg_overlap=True,
                                                    fwd_persistent=True, heads_fastest=False),
                  fwd),
                 ("persistent_plain_qtiles", MosaicConfig(fwd_persistent=True,
                                                          heads_fastest=False), fwd),
                 # Backward schedules, with the hd128 forward of the tuned table.
                 ("bwd_batched", MosaicConfig(fwd_intra_wg_overlap=True,
                                              dkdv_schedule="batched"), fb),
                 ("bwd_pingpong", MosaicConfig(fwd_intra_wg_overlap=True,
                                               dkdv_schedule="batched", dkdv_pingpong=True),
                  fb),
                 ("bwd_pingpong_serial", MosaicConfig(fwd_intra_wg_overlap=True,
                                                      dkdv_pingpong=True), fb),
                 # Registers 240/24 (less spilling in the causal dQ kernel, deviceless SASS)
                 # and the dK/dV "overlap" schedule, which needs them.
                 ("bwd_r240", MosaicConfig(fwd_intra_wg_overlap=True, dkdv_schedule="batched",
                                           compute_registers=240, producer_registers=24), fb),
                 ("bwd_overlap_r240", MosaicConfig(fwd_intra_wg_overlap=True,
                                                   dkdv_schedule="overlap",
                                                   compute_registers=240,
                                                   producer_registers=24), fb),
                 # The single-kernel backward (FA3's split of dQ's columns), as measured in
                 # the third session, and at 240/24 registers (fewer spills, deviceless SASS).
                 ("bwd_fused", MosaicConfig(fwd_intra_wg_overlap=True, fused_backward=True,
                                            fused_dq_shared=True), fb),
                 ("bwd_fused_r240", MosaicConfig(fwd_intra_wg_overlap=True, fused_backward=True,
                                                 fused_dq_shared=True, compute_registers=240,
                                                 producer_registers=24), fb),
                 # Non-causal kv tiles start at different q blocks, so the CTAs running
                 # together reduce-add into different dQ rows (causal tiles already do).
                 ("bwd_fused_stagger_r240", MosaicConfig(
                     fwd_intra_wg_overlap=True, fused_backward=True, fused_dq_shared=True,
                     fused_stagger_q=True, compute_registers=240, producer_registers=24), fb),
                 # dQ_part one step late: the two WGs no longer meet every step (seventh
                 # session: their elementwise phases coincided in the profile).
                 ("bwd_fused_defer_r240", MosaicConfig(
                     fwd_intra_wg_overlap=True, fused_backward=True, fused_dq_shared=True,
                     fused_defer_dq=True, compute_registers=240, producer_registers=24), fb),
                 ("bwd_fused_defer_inline_r240", MosaicConfig(
                     fwd_intra_wg_overlap=True, fused_backward=True, fused_dq_shared=True,
                     fused_defer_dq=True, fused_defer_inline=True, compute_registers=240,
                     producer_registers=24), fb),
                 ("bwd_fused_defer_offset_r240", MosaicConfig(
                     fwd_intra_wg_overlap=True, fused_backward=True, fused_dq_shared=True,
                     fused_defer_dq=True, fused_offset=True, compute_registers=240,
                     producer_registers=24), fb),
                 ("bwd_fused_s3_r240", MosaicConfig(
                     fwd_intra_wg_overlap=True, fused_backward=True, fused_dq_shared=True,
                     fused_stages=3, compute_registers=240, producer_registers=24), fb),
                 # The backward kernels with heads fastest (the tuned hd128 backward otherwise).
                 ("bwd_heads", MosaicConfig(fwd_intra_wg_overlap=True, dkdv_schedule="overlap",
                                            compute_registers=240, producer_registers=24,
                                            bwd_heads_fastest=True), fb),
                 # Heads fastest within groups of G heads (K/V or Q/dO of G heads in flight).
                 *((f"bwd_group{g}", MosaicConfig(
                     fwd_intra_wg_overlap=True, dkdv_schedule="overlap", compute_registers=240,
                     producer_registers=24, bwd_heads_fastest=True, bwd_head_group=g), fb)
                   for g in (2, 4, 8)),
                 ("bwd_tiles", MosaicConfig(fwd_intra_wg_overlap=True, dkdv_schedule="overlap",
                                            compute_registers=240, producer_registers=24,
                                            bwd_heads_fastest=False), fb),
                 ("bwd_serial", MosaicConfig(fwd_intra_wg_overlap=True,
                                             dkdv_schedule="serial"), fb),
                 ("bwd_xla_delta", MosaicConfig(fwd_intra_wg_overlap=True,
                                                dkdv_schedule="batched",
                                                bwd_delta_in_kernel=False), fb),
                 ("bwd_s3", MosaicConfig(bwd_stages=3), fb),
                 ("dq_kv128", MosaicConfig(block_kv_dq=128), fb)]
      if args.variants:
        wanted = {}
        for name in args.variants.split(","):
          only_fwd = name.startswith("fwd:")
          wanted[name.removeprefix("fwd:")] = only_fwd
        configs = [(n, c, fwd if wanted[n] else m) for n, c, m in configs if n in wanted]
      bench(results, _pick(SWEEP, args.shapes), configs)
    else:
      bench(results, _pick(BENCH, args.shapes))
  finally:
    save(results)
  bad = [r for r in results if r["kind"] == "check" and not r["ok"]]
  print(f"{len(bad)} failed checks", flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
