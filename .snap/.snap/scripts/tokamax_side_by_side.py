"""Our Mosaic kernels, tokamax's Mosaic GPU attention and cuDNN, timed in one process.

ANCHORS.md's tokamax figures were measured on another day; this puts the three side by side
on the same GPU state. tokamax is not installed on the GPU machine: carry its wheels (and the
small pure-Python dependencies it imports) unpacked into a folder and pass it as --tokamax-path;
it is appended to sys.path, so packages the machine has win.

  PYTHONPATH=. python3 scripts/tokamax_side_by_side.py --tokamax-path .tk [--out DIR]

Building .tk on the CPU machine (tenth session): `pip download --no-deps` of tokamax==0.0.17,
absl-py, einshape, jaxtyping, wadler_lindig, pydantic, pydantic-core (cp312 manylinux),
typing-inspection, annotated-types, typing-extensions, qwix, immutabledict, tensorboardx and
protobuf, `pip install --no-deps --target .tk` of those wheels, and a stub
`.tk/xprof/cli/tools.py` (`get_kernel_stats_tool = None`: only tokamax's benchmarking helpers
use xprof, whose wheel alone is 22 MB); about 27 MB, carried with the run.

Each shape is timed in two rounds of (cuDNN, ours, tokamax), so that a clock drift during the
run shows as a difference between rounds rather than between implementations. Outputs are
compared with cuDNN's first (relative error of the forward); an implementation further than
TOLERANCE from it is reported and not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))
import mosaic_gpu_check as mgc  # noqa: E402  (the shared timing and input helpers)

TOLERANCE = 2e-2  # bf16 forward, max-abs error relative to cuDNN's max-abs output

SHAPES = [  # B, T, H, D, causal
    (1, 32768, 16, 128, True), (1, 16384, 16, 128, True), (1, 32768, 16, 128, False),
    (4, 4096, 16, 128, True),
]


def tokamax_attention(causal):
  import tokamax  # noqa: PLC0415 - only where --tokamax-path made it importable
  return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                                       implementation="mosaic")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--tokamax-path", required=True)
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--modes", default="fwd,fwdbwd")
  parser.add_argument("--rounds", type=int, default=2)
  args = parser.parse_args()
  sys.path.append(os.path.abspath(args.tokamax_path))
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  results = []
  for b, t, h, d, causal in SHAPES:
    q, k, v, do = mgc.inputs(b, t, t, h, h, d, "bfloat16")
    flops = 4 * b * h * t * t * d / (2 if causal else 1)
    impls = dict(cudnn=mgc.cudnn(causal), ours=mgc.ours(causal),
                 tokamax=tokamax_attention(causal))
    ref = jax.jit(impls["cudnn"])(q, k, v)
    errs = {n: mgc.rel_err(jax.jit(f)(q, k, v), ref) for n, f in impls.items() if n != "cudnn"}
    for name, err in errs.items():
      if err > TOLERANCE:
        print(f"{name} at {b}x{t}x{h}x{d} causal={causal}: error {err:.2e} vs cuDNN, not timed",
              flush=True)
        del impls[name]
    for mode in args.modes.split(","):
      row = dict(mode=mode, shape=[b, t, h, d], causal=causal, err_vs_cudnn=errs, tflops={})
      fns = {n: jax.jit(f if mode == "fwd" else mgc.fwd_bwd(f)) for n, f in impls.items()}
      call_args = (q, k, v) if mode == "fwd" else (q, k, v, do)
      for _ in range(args.rounds):
        for name, f in fns.items():
          sec = mgc.timeit(f, *call_args)
          row["tflops"].setdefault(name, []).append(
              round(flops * (1 if mode == "fwd" else 3.5) / sec / 1e12, 1))
      results.append(row)
      cells = " ".join(f"{n}={'/'.join(f'{x:.0f}' for x in xs)}"
                       for n, xs in row["tflops"].items())
      print(f"{mode:6s} {b}x{t}x{h}x{d} causal={causal}: {cells} "
            f"err_vs_cudnn={ {n: f'{e:.1e}' for n, e in errs.items()} }", flush=True)
      with open(os.path.join(args.out, "tokamax_side_by_side.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, results=results), f, indent=1)


if __name__ == "__main__":
  main()
