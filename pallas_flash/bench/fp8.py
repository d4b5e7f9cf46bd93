"""FP8 accuracy report (`python -m pallas_flash.bench --fp8 [--quick]`): error, not speed.

For normal inputs (q, k, v ~ N(0, 1)) and inputs with outliers (FA3 §4.3: N(0, 1) plus, on
0.1 % of the entries, an independent N(0, 10²) term), cast to bfloat16 as a model's
activations would be, each row runs one way of computing the attention and reports RMSE and
max |error| of its output against the float32 reference on those bf16 values:
  bf16             flash_attention on the bf16 inputs (what FP8 has to match)
  fp8 tensor/block pallas_flash.fp8.quantize with one scale per tensor / per block of
                   positions of each head, without and with the Hadamard rotation, then
                   flash_attention on the e4m3 tensors
  cudnn-fp8        cuDNN's FP8 attention: not wired yet (`cudnn_fp8` is the hook), a skip row.
Every FP8 row today runs the reference semantics (no FP8 kernel exists: the inputs are
dequantized to float32), so it measures the quantisation of Q, K and V alone; a kernel that
also rounds P to e4m3 for P·V will add its own error. "impl" names what produced each row.

Shapes: B 1, T = S 4096, 16 heads, D 128 (--quick: T = S 256, 2 heads), non-causal.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash import fp8


@dataclasses.dataclass(frozen=True)
class Shape:
  batch: int
  seq_len: int
  num_heads: int
  head_dim: int
  block: int  # positions per scale of the per-block rows (the kernels' block_q / block_kv)


SHAPES = {"full": Shape(1, 4096, 16, 128, 128), "quick": Shape(1, 256, 2, 128, 64)}
OUTLIER_FRACTION, OUTLIER_STD = 1e-3, 10.0  # FA3 §4.3
# (row name, quantize's block, rotate)
FP8_ROWS = (("fp8 tensor", None, False), ("fp8 tensor +rot", None, True),
            ("fp8 block", "block", False), ("fp8 block +rot", "block", True))


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--fp8", action="store_true",
                 help="FP8 accuracy report (bench/fp8.py); --quick: small shapes")


def make_inputs(shape: Shape, *, outliers: bool, seed: int) -> tuple[jax.Array, ...]:
  """bf16 q, k, v [B, T, H, D], drawn in float32 (jax's bf16 normals are capped near 2.9)."""
  keys = jax.random.split(jax.random.key(seed), 6)
  dims = (shape.batch, shape.seq_len, shape.num_heads, shape.head_dim)
  out = []
  for i in range(3):
    x = jax.random.normal(keys[i], dims, jnp.float32)
    if outliers:
      hit = jax.random.bernoulli(keys[3 + i], OUTLIER_FRACTION, dims)
      x = x + jnp.where(hit, OUTLIER_STD * jax.random.normal(keys[3 + i], dims), 0.0)
    out.append(x.astype(jnp.bfloat16))
  return tuple(out)


def cudnn_fp8(q8, k8, v8, scales):
  """cuDNN's FP8 attention on the same e4m3 inputs: the hook for the cudnn-fp8 row on a GPU.

  Not wired: jax reaches it only through the private
  `jax._src.cudnn.fused_attention_stablehlo._dot_product_attention_fp8` (per-tensor scales,
  head dim 128, lengths divisible by 128). Until someone wires and checks it on an H200, the
  row is a skip, never a number."""
  raise NotImplementedError("not wired yet (hook: pallas_flash.bench.fp8.cudnn_fp8)")


def _errors(o, ref) -> tuple[float, float]:
  err = o.astype(jnp.float32) - ref
  return float(jnp.sqrt(jnp.mean(err * err))), float(jnp.max(jnp.abs(err)))


def run_rows(shape: Shape, *, outliers: bool, seed: int) -> list[dict]:
  """The rows of one input kind (normal / outliers)."""
  q, k, v = make_inputs(shape, outliers=outliers, seed=seed)
  ref = pallas_flash.flash_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                     implementation="reference")
  base = {"kind": "fp8_accuracy", "inputs": "outliers" if outliers else "normal",
          "batch": shape.batch, "seq_len": shape.seq_len, "num_heads": shape.num_heads,
          "head_dim": shape.head_dim, "rmse": None, "max_err": None, "reason": None}
  impl = pallas_flash.explain(q, k, v).chosen
  rmse, max_err = _errors(jax.jit(pallas_flash.flash_attention)(q, k, v), ref)
  rows = [{**base, "row": "bf16", "impl": impl, "status": "ok", "rmse": rmse,
           "max_err": max_err}]
  for name, block, rotate in FP8_ROWS:
    (q8, k8, v8), scales = fp8.quantize(q, k, v, rotate=rotate,
                                        block=shape.block if block else None)
    impl = pallas_flash.explain(q8, k8, v8, descale=scales).chosen
    o = jax.jit(pallas_flash.flash_attention)(q8, k8, v8, descale=scales)
    rmse, max_err = _errors(o, ref)
    rows.append({**base, "row": name, "impl": f"{impl} (dequantized to float32)",
                 "status": "ok", "rmse": rmse, "max_err": max_err,
                 "block": shape.block if block else None, "rotate": rotate})
  row = {**base, "row": "cudnn-fp8", "impl": "cudnn", "status": "skip"}
  if jax.devices()[0].platform != "gpu":
    row["reason"] = "needs a GPU"
  else:
    (q8, k8, v8), scales = fp8.quantize(q, k, v)
    try:
      row.update(zip(("rmse", "max_err"), _errors(cudnn_fp8(q8, k8, v8, scales), ref)),
                 status="ok")
    except NotImplementedError as e:
      row["reason"] = str(e)
  return rows + [row]


def print_rows(rows: list[dict]) -> None:
  r0 = rows[0]
  print(f"\nFP8 accuracy vs the float32 reference: B{r0['batch']} T=S={r0['seq_len']} "
        f"H{r0['num_heads']} D{r0['head_dim']}, non-causal, output bf16")
  print(f"  {'inputs':<10}{'row':<17}{'RMSE':>10}{'max err':>10}  impl")
  for r in rows:
    rmse = "-" if r["rmse"] is None else f"{r['rmse']:.2e}"
    max_err = "-" if r["max_err"] is None else f"{r['max_err']:.2e}"
    impl = r["impl"] + (f" [{r['status']}: {r['reason']}]" if r["reason"] else "")
    print(f"  {r['inputs']:<10}{r['row']:<17}{rmse:>10}{max_err:>10}  {impl}", flush=True)


def run_fp8(opts: argparse.Namespace) -> list[dict]:
  shape = SHAPES["quick" if opts.quick else "full"]
  rows = [r for outliers in (False, True)
          for r in run_rows(shape, outliers=outliers, seed=opts.seed)]
  print_rows(rows)
  return rows
