"""ptxas' view of the Mosaic GPU kernels: registers, spills and wgmma serialisation per variant.

Run from the repository root on the GPU machine:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/mosaic_ptxas.py [--out DIR] [VARIANT ...]

Each variant is compiled and run once (plus a short timing) in its own process with
MOSAIC_GPU_DUMP_PTXAS / _PTX / _SASS set and MOSAIC_GPU_DUMP_TO=DIR/<variant>, since the
dumps are keyed by kernel and the environment is read by the compiler. The parent prints, per
variant, ptxas' register count, spill bytes and every "wgmma ... serialized" warning, so a slow
variant can be told apart from a register-starved one before any tuning. Without arguments it
runs every variant in VARIANTS.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

# name -> (mode, causal, MosaicConfig keyword arguments). 1x4096x16x128, bf16.
VARIANTS = {
    "fwd": ("fwd", False, {}),
    "fwd_causal": ("fwd", True, {}),
    "fwd_overlap": ("fwd", False, dict(fwd_intra_wg_overlap=True)),
    "fwd_overlap_causal": ("fwd", True, dict(fwd_intra_wg_overlap=True)),
    "bwd_split": ("fwdbwd", False, {}),
    "bwd_fused_shared": ("fwdbwd", False, dict(fused_backward=True, fused_dq_shared=True)),
    "bwd_fused_overlap": ("fwdbwd", False, dict(fused_backward=True, fused_dq_shared=True,
                                                 fused_overlap=True)),
}
SHAPE = (1, 4096, 16, 128)


def variant(spec: str) -> tuple[str, bool, dict]:
  """'NAME' or 'NAME@key=value,...' (MosaicConfig overrides, ints or True/False)."""
  name, _, extra = spec.partition("@")
  mode, causal, kw = VARIANTS[name]
  kw = dict(kw)
  for item in filter(None, extra.split(",")):
    key, value = item.split("=")
    kw[key] = {"True": True, "False": False}.get(value) if value in ("True", "False") else int(value)
  return mode, causal, kw


def child(name: str) -> None:
  """Compiles, checks against the reference and times one variant (in the dumping process)."""
  import time

  import jax
  import jax.numpy as jnp

  import pallas_flash
  from pallas_flash.mosaic_gpu import MosaicConfig

  mode, causal, kw = variant(name)
  b, t, h, d = SHAPE
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in ks)
  config = MosaicConfig(**kw)

  def attn(q, k, v, impl="mosaic"):
    return pallas_flash.flash_attention(q, k, v, is_causal=causal, implementation=impl,
                                        config=config if impl == "mosaic" else None)

  if mode == "fwd":
    f = jax.jit(attn)
    ref = lambda: attn(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                       impl="reference")
  else:
    def grads(q, k, v, do, impl="mosaic"):
      _, vjp = jax.vjp(lambda *a: attn(*a, impl=impl), q, k, v)
      return vjp(do)
    ref = lambda: grads(*(x.astype(jnp.float32) for x in (q, k, v, do)), impl="reference")
    f = jax.jit(grads)
  args = (q, k, v) if mode == "fwd" else (q, k, v, do)
  out = jax.block_until_ready(f(*args))
  want = ref()
  errs = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
          for x, r in zip(jax.tree.leaves(out), jax.tree.leaves(want))]
  reps = 20
  for _ in range(2):
    jax.block_until_ready(f(*args))
  t0 = time.perf_counter()
  for _ in range(reps):
    out = f(*args)
  jax.block_until_ready(out)
  ms = (time.perf_counter() - t0) / reps * 1e3
  flops = 4 * b * h * t * t * d * (0.5 if causal else 1.0) * (3.5 if mode == "fwdbwd" else 1.0)
  print(json.dumps(dict(variant=name, ms=ms, tflops=flops / ms / 1e9, max_rel_err=max(errs))),
        flush=True)


_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")


def summarize(log: str) -> dict:
  """Pulls ptxas' figures out of a child's combined output."""
  lines = log.splitlines()
  return dict(
      registers=[int(x) for x in _REGS.findall(log)],
      spills=[(int(a), int(b)) for a, b in _SPILL.findall(log)],
      stack=[int(x) for x in _STACK.findall(log)],
      serialized=sorted({ln.strip() for ln in lines if "serializ" in ln.lower()}),
      timing=[json.loads(ln) for ln in lines if ln.startswith('{"variant"')],
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("variants", nargs="*", default=list(VARIANTS))
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    child(args.child)
    return
  out = pathlib.Path(args.out) / "ptxas"
  report = {}
  for name in args.variants:
    dump = out / re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    dump.mkdir(parents=True, exist_ok=True)
    root = str(pathlib.Path(__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1",
               MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_TO=str(dump))
    proc = subprocess.run([sys.executable, __file__, "--child", name], env=env,
                          capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    (dump / "log.txt").write_text(log)
    # The dumps may land in files rather than on stderr: read those too.
    files = "\n".join(p.read_text(errors="replace") for p in sorted(dump.iterdir())
                      if p.is_file() and p.name != "log.txt" and "ptxas" in p.name.lower())
    report[name] = dict(rc=proc.returncode, **summarize(log + "\n" + files))
    r = report[name]
    print(f"{name}: rc={r['rc']} regs={r['registers']} spills={r['spills']} "
          f"stack={r['stack']} timing={r['timing']}", flush=True)
    for ln in r["serialized"][:8]:
      print(f"    {ln[:240]}", flush=True)
    for p in sorted(dump.glob("*.ptxas")):  # one file per kernel: which of them spills
      spills = _SPILL.findall(p.read_text(errors="replace"))
      print(f"    {p.stem}: spill stores/loads {spills}", flush=True)
  (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
