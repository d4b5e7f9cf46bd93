"""FP8 report (`python -m pallas_flash.bench --fp8 [--quick]`): accuracy, then speed.

Accuracy. For normal inputs (q, k, v ~ N(0, 1)) and inputs with outliers (FA3 §4.3: N(0, 1)
plus, on 0.1 % of the entries, an independent N(0, 10²) term), cast to bfloat16 as a model's
activations would be, each row runs one way of computing the attention and reports RMSE and
max |error| of its output against the float32 reference on those bf16 values:
  bf16             flash_attention on the bf16 inputs (what FP8 has to match)
  fp8 tensor/block pallas_flash.fp8.quantize with one scale per tensor / per block of
                   positions of each head, without and with the Hadamard rotation, then
                   flash_attention on the e4m3 tensors
  cudnn-fp8        cuDNN's FP8 attention (`cudnn_fp8`: jax's private entry, e4m3 output),
                   on a GPU; a skip row elsewhere or where it refuses the call.
"impl" names what produced each row: on a Hopper GPU the per-tensor rows run the Mosaic FP8
forward (P rounded to e4m3 too), the per-block rows and every row elsewhere the reference
semantics (the inputs dequantized to float32: the quantisation of Q, K and V alone).
Shapes: B 1, T = S 4096, 16 heads, D 128 (--quick: T = S 256, 2 heads), non-causal.

Speed (a Hopper GPU only; elsewhere one skip row). At B 1, T = S 16384, 16 heads, D 128 and
256, causal and not: the Mosaic FP8 forward on per-tensor-quantised inputs (its time includes
the XLA transpose of V that feeds it), in its default form and the others of FP8_FORMS, beside
our bf16 Mosaic forward and cuDNN FP8 ("-" where it does not run; the reason is printed),
interleaved (timing.time_interleaved), as TFLOP/s of 4·B·H·T·S·D (halved causal). Each row
also reports the FP8 kernel's own error on the first ACCURACY_ROWS queries: against the
float32 attention of the dequantized inputs (the kernel's arithmetic, P's rounding) and of
the bf16 inputs (with the quantisation), next to the bf16 forward's (and cuDNN FP8's).

Features (--fp8-features, a Hopper GPU only): at B 1, T = S 16384, 16 heads, D 128, the
features grid's window, segments and soft-cap rows (pallas_flash.bench.features: causal) on
the FP8 forward, named "mosaic", against the same FP8 call under implementation=None (what
it chose), the FP8 forward without the feature and our bf16 Mosaic forward with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash import fp8
from pallas_flash.bench import flops as flops_lib
from pallas_flash.bench import shapes, timing
from pallas_flash.mosaic_gpu import MosaicConfig
from pallas_flash.mosaic_gpu.sm90 import fp8_forward


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
  p.add_argument("--fp8-training", action="store_true",
                 help="only the forward+backward rows of --fp8 (gradient accuracy and "
                      "training speed)")
  p.add_argument("--fp8-features", action="store_true",
                 help="only the FP8 forward's feature rows (window, segments, soft cap) "
                      "against its plain call and implementation=None's choice")


def make_inputs(shape: Shape, *, outliers: bool, seed: int) -> tuple[jax.Array, ...]:
  """bf16 q, k, v [B, T, H, D], drawn in float32 (jax's bf16 normals are capped near 2.9)."""
  keys = jax.random.split(jax.random.key(seed), 9)
  dims = (shape.batch, shape.seq_len, shape.num_heads, shape.head_dim)
  out = []
  for i in range(3):
    x = jax.random.normal(keys[i], dims, jnp.float32)
    if outliers:
      # The hits and their values need keys of their own: one key for both would put every
      # hit (uniform < 1e-3) at the normal's far negative tail, about -34, not N(0, 10²).
      hit = jax.random.bernoulli(keys[3 + i], OUTLIER_FRACTION, dims)
      x = x + jnp.where(hit, OUTLIER_STD * jax.random.normal(keys[6 + i], dims), 0.0)
    out.append(x.astype(jnp.bfloat16))
  return tuple(out)


# cuDNN's FP8 attention scales P by this before rounding it to e4m3 (the Mosaic kernel's
# factor, pallas_flash.mosaic_gpu.sm90.fp8_forward.P_SCALE_LOG2).
CUDNN_P_SCALE = 256.0


def cudnn_fp8(q8, k8, v8, scales, *, is_causal: bool = False, out_dtype=jnp.bfloat16):
  """cuDNN's FP8 attention on the same e4m3 inputs (per-tensor scales), through jax's private
  `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(..., use_fp8=True)` (jax
  0.11.2 has no public FP8 entry). Its output is e4m3 too: quantised with the scale that maps
  max|v| · v_descale (a bound of |o|) to 448, then dequantized to `out_dtype`. Raises
  NotImplementedError off GPUs or where the private API is missing or refuses the call."""
  if jax.devices()[0].platform != "gpu":
    raise NotImplementedError("needs a GPU")
  try:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415
  except ImportError as e:
    raise NotImplementedError(f"jax has no cuDNN FP8 attention here: {e}") from e
  one = lambda x: jnp.asarray(x, jnp.float32).reshape(1, 1, 1, 1)  # noqa: E731
  v_max = jnp.max(jnp.abs(v8.astype(jnp.float32))) * scales.v
  scale_o = fp8.E4M3_MAX / jnp.maximum(v_max, 1e-30)
  params = {key: one(1.0) for key in cudnn.fp8_params_keys}
  params.update(descale_q=one(scales.q), descale_k=one(scales.k), descale_v=one(scales.v),
                descale_s=one(1.0 / CUDNN_P_SCALE), scale_s=one(CUDNN_P_SCALE),
                scale_o=one(scale_o))
  mask = cudnn.MaskType.CAUSAL if is_causal else cudnn.MaskType.NO_MASK
  o8, _, _ = cudnn.dot_product_attention(q8, k8, v8, fp8_params=params,
                                         scale=q8.shape[-1] ** -0.5, mask_type=mask,
                                         qkv_layout="BTNH", use_fp8=True)
  return (o8.astype(jnp.float32) / scale_o).astype(out_dtype)


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
    impl = ("mosaic (FP8 kernel)" if impl == "mosaic" else
            f"{impl} (dequantized to float32)")
    o = jax.jit(pallas_flash.flash_attention)(q8, k8, v8, descale=scales)
    rmse, max_err = _errors(o, ref)
    rows.append({**base, "row": name, "impl": impl,
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
    except Exception as e:  # noqa: BLE001 -- a private API: report why, keep the table
      row["reason"] = f"{type(e).__name__}: {e}"[:300]
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


# ---------------------------------------------------------------------------------------------
# Speed

SPEED_SHAPES = ((1, 16384, 16, 128), (1, 16384, 16, 256))  # (B, T = S, H, D)
ACCURACY_ROWS = 2048  # queries whose output the speed rows check (a [B, H, 2048, S] reference)
# max|o - ref| / max|ref| of the FP8 kernel against the reference semantics: the tests' bound
# (tests/testing.py: FP8_KERNEL_TOLERANCE), which P's rounding to e4m3 sets.
KERNEL_TOLERANCE = 0.05


def _on_hopper() -> bool:
  dev = jax.devices()[0]
  return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def _timed(name: str, median_s: float, work: float) -> dict:
  """A row's `<name>_ms` and `<name>_tflops` fields for one timed call doing `work` FLOPs."""
  return {f"{name}_ms": median_s * 1e3, f"{name}_tflops": flops_lib.tflops(work, median_s)}


def _printed_skip(rows: list[dict]) -> bool:
  """Prints a section's skip row (the section ran nothing here) and says whether it did."""
  if rows and rows[0]["status"] == "skip":
    print(f"  skip: {rows[0]['reason']}")
    return True
  return False


def _flops(dims, *, is_causal: bool, mode: str) -> float:
  """flops.attention_flops of self-attention on q, k, v of shape dims = (B, T, H, D)."""
  b, t, h, d = dims
  spec = shapes.ShapeSpec(name="fp8", batch=b, seq_len=t, num_heads=h, head_dim=d)
  return flops_lib.attention_flops(spec, is_causal=is_causal, mode=mode)


def speed_row(dims, *, is_causal: bool, opts: argparse.Namespace) -> dict:
  """One speed row: FP8 and bf16 Mosaic forwards timed together, the FP8 kernel's errors."""
  b, t, h, d = dims
  keys = jax.random.split(jax.random.key(opts.seed), 3)
  q, k, v = (jax.random.normal(key, dims, jnp.float32).astype(jnp.bfloat16) for key in keys)
  (q8, k8, v8), scales = fp8.quantize(q, k, v)
  args = (q, k, v, q8, k8, v8, scales)

  def fp8_fn(config):
    def fn(q, k, v, q8, k8, v8, s):
      return pallas_flash.flash_attention(q8, k8, v8, descale=s, is_causal=is_causal,
                                          implementation="mosaic", config=config)
    return fn

  def bf16_fn(q, k, v, q8, k8, v8, s):
    return pallas_flash.flash_attention(q, k, v, is_causal=is_causal, implementation="mosaic")

  def cudnn_fn(q, k, v, q8, k8, v8, s):
    return cudnn_fp8(q8, k8, v8, s, is_causal=is_causal)

  # "fp8": the default form at this head dim; "fp8 <label>": the other forms of FP8_FORMS.
  forms = {"fp8": None, **{f"fp8 {label}": config for label, config in FP8_FORMS.get(d, ())}}
  fns = {name: jax.jit(fp8_fn(config)).lower(*args).compile() for name, config in forms.items()}
  fns["bf16"] = jax.jit(bf16_fn).lower(*args).compile()
  cudnn_reason = None
  try:
    fns["cudnn_fp8"] = jax.jit(cudnn_fn).lower(*args).compile()
    jax.block_until_ready(fns["cudnn_fp8"](*args))
  except Exception as e:  # noqa: BLE001 -- a private API: report why, keep the row
    fns.pop("cudnn_fp8", None)
    cudnn_reason = f"{type(e).__name__}: {e}"[:300]
  timings = timing.time_interleaved(fns, args, iters=opts.iters,
                                    min_loop_s=opts.min_loop_ms / 1e3,
                                    settle_s=opts.settle_ms / 1e3)
  work = _flops(dims, is_causal=is_causal, mode="fwd")
  row = {"kind": "fp8_speed", "batch": b, "seq_len": t, "num_heads": h, "head_dim": d,
         "is_causal": is_causal, "status": "ok", "reason": None, "cudnn_fp8_reason": cudnn_reason,
         "cudnn_fp8_tflops": None,
         "fp8_form": _form_label(d, None)}
  for name, tm in timings.items():
    if name.startswith("fp8 "):
      row.setdefault("fp8_other_forms", {})[name[4:]] = flops_lib.tflops(work, tm.median_s)
      continue
    row.update(_timed(name, tm.median_s, work))
  # Accuracy on the first ACCURACY_ROWS queries (top-left causal alignment: the same keys).
  n = min(ACCURACY_ROWS, t)
  deq = [fp8.dequantize(x, sc) for x, sc in ((q8, scales.q), (k8, scales.k), (v8, scales.v))]
  ref_deq = pallas_flash.flash_attention(deq[0][:, :n], *deq[1:], is_causal=is_causal,
                                         implementation="reference")
  ref = pallas_flash.flash_attention(*(x.astype(jnp.float32) for x in (q[:, :n], k, v)),
                                     is_causal=is_causal, implementation="reference")
  o8, o16 = fns["fp8"](*args)[:, :n], fns["bf16"](*args)[:, :n]
  row["fp8_rmse_deq"], row["fp8_max_err_deq"] = _errors(o8, ref_deq)
  row["fp8_rmse"], row["fp8_max_err"] = _errors(o8, ref)
  row["bf16_rmse"], row["bf16_max_err"] = _errors(o16, ref)
  if "cudnn_fp8" in fns:
    row["cudnn_fp8_rmse"], row["cudnn_fp8_max_err"] = _errors(fns["cudnn_fp8"](*args)[:, :n], ref)
  return row


# Other forms of the FP8 forward the speed rows time beside the default, per head dim: (label,
# MosaicConfig). Head dim 128: 128-key tiles (MosaicConfig.fp8_block_kv) against the default's 256
# (docs/fp8.md has the measured numbers). Head dim 256 has no other form: 256-key tiles do not
# fit in shared memory there.
FP8_FORMS = {128: (("128 keys", MosaicConfig(fp8_block_kv=128)),)}


def _form_label(d: int, config) -> str:
  """'<key tile> keys' of the FP8 forward at head dim d with `config`."""
  return f"{fp8_forward.block_kv(d, config)} keys"


def run_speed(opts: argparse.Namespace) -> list[dict]:
  if not _on_hopper():
    return [{"kind": "fp8_speed", "status": "skip",
             "reason": "the Mosaic FP8 forward needs a Hopper GPU"}]
  return [speed_row(dims, is_causal=causal, opts=opts)
          for dims in SPEED_SHAPES for causal in (False, True)]


def print_speed(rows: list[dict]) -> None:
  print("\nFP8 forward speed (TFLOP/s; the FP8 time includes the V transpose) and the FP8 "
        f"kernel's error on the first {ACCURACY_ROWS} queries")
  if _printed_skip(rows):
    return
  print(f"  {'shape':<20}{'causal':<8}{'fp8 (form)':>18}{'bf16':>8}{'cudnn-fp8':>11}"
        f"{'rmse/max vs deq':>20}{'rmse/max vs f32':>20}{'bf16 rmse/max':>20}")
  for r in rows:
    shape = f"{r['batch']}x{r['seq_len']}x{r['num_heads']} d{r['head_dim']}"
    pair = lambda a, b: f"{r[a]:.1e}/{r[b]:.1e}"  # noqa: E731
    fp8_col = f"{flops_lib.format_tflops(r['fp8_tflops'])} ({r['fp8_form']})"
    print(f"  {shape:<20}{str(r['is_causal']):<8}{fp8_col:>18}"
          f"{flops_lib.format_tflops(r['bf16_tflops']):>8}"
          f"{flops_lib.format_tflops(r['cudnn_fp8_tflops']):>11}"
          f"{pair('fp8_rmse_deq', 'fp8_max_err_deq'):>20}{pair('fp8_rmse', 'fp8_max_err'):>20}"
          f"{pair('bf16_rmse', 'bf16_max_err'):>20}", flush=True)
    others = ", ".join(f"{label} {flops_lib.format_tflops(x)}"
                       for label, x in r.get("fp8_other_forms", {}).items())
    if others:
      print(f"  {'':<28}other FP8 forms: {others}", flush=True)
  for r in rows:
    if r["cudnn_fp8_reason"]:
      print(f"  cudnn-fp8 d{r['head_dim']} causal={r['is_causal']}: {r['cudnn_fp8_reason']}")
    elif "cudnn_fp8_rmse" in r:
      print(f"  cudnn-fp8 d{r['head_dim']} causal={r['is_causal']}: rmse/max vs f32 "
            f"{r['cudnn_fp8_rmse']:.1e}/{r['cudnn_fp8_max_err']:.1e} (e4m3 output)")


# ---------------------------------------------------------------------------------------------
# Features: the FP8 forward with a window, segment ids or a soft cap


FEATURE_ROWS = ("window", "segments", "softcap")  # bench.features' rows, their causality
FEATURE_SHAPE = SPEED_SHAPES[0]


def feature_speed_row(name: str, opts: argparse.Namespace) -> dict:
  """One feature row: the FP8 forward with the feature (named "mosaic"), the same FP8 call
  under implementation=None, the FP8 forward without the feature and the bf16 Mosaic forward
  with it, timed together; the FP8 kernel's output checked first (KERNEL_TOLERANCE of
  max|o - ref| / max|ref| against the reference semantics, on the first ACCURACY_ROWS queries)."""
  from pallas_flash.bench import features  # noqa: PLC0415 -- features imports this module's peers

  feature = next(f for f in features.FEATURES if f.name == name)
  b, t, h, d = FEATURE_SHAPE
  spec = shapes.ShapeSpec(name=name, batch=b, seq_len=t, num_heads=h, head_dim=d)
  keys = jax.random.split(jax.random.key(opts.seed), 3)
  q, k, v = (jax.random.normal(key, FEATURE_SHAPE, jnp.float32).astype(jnp.bfloat16)
             for key in keys)
  (q8, k8, v8), scales = fp8.quantize(q, k, v)
  kw = feature.build(spec, opts.seed)
  arrays = {n: x for n, x in kw.items() if isinstance(x, jax.Array)}
  static = {n: x for n, x in kw.items() if n not in arrays}
  causal = feature.is_causal

  def call(impl, *, fp8_inputs=True, with_feature=True):
    def fn(q, k, v, q8, k8, v8, s, arrays):
      extra = {**static, **arrays} if with_feature else {}
      if fp8_inputs:
        return pallas_flash.flash_attention(q8, k8, v8, descale=s, is_causal=causal,
                                            implementation=impl, **extra)
      return pallas_flash.flash_attention(q, k, v, is_causal=causal, implementation=impl,
                                          **extra)
    return fn

  args = (q, k, v, q8, k8, v8, scales, arrays)
  default = pallas_flash.explain(q8, k8, v8, descale=scales, is_causal=causal, **kw).chosen
  fns = {"fp8": call("mosaic"), "fp8_default": call(None),
         "fp8_plain": call("mosaic", with_feature=False),
         "bf16": call("mosaic", fp8_inputs=False)}
  fns = {n: jax.jit(fn).lower(*args).compile() for n, fn in fns.items()}
  n = min(ACCURACY_ROWS, t)
  deq = [fp8.dequantize(x, sc) for x, sc in ((q8, scales.q), (k8, scales.k), (v8, scales.v))]
  ref_kw = {**static, **arrays}
  if "query_segment_ids" in arrays:  # the first n queries against every key
    seg = arrays["query_segment_ids"]
    ref_kw.update(query_segment_ids=seg[:, :n], key_value_segment_ids=seg)
  ref = pallas_flash.flash_attention(deq[0][:, :n], *deq[1:], is_causal=causal,
                                     implementation="reference", **ref_kw)
  o8 = fns["fp8"](*args)[:, :n].astype(jnp.float32)
  rel_err = float(jnp.max(jnp.abs(o8 - ref)) / jnp.max(jnp.abs(ref)))
  timings = timing.time_interleaved(fns, args, iters=opts.iters,
                                    min_loop_s=opts.min_loop_ms / 1e3,
                                    settle_s=opts.settle_ms / 1e3)
  work = feature.flops(spec, "fwd")
  row = {"kind": "fp8_feature", "feature": name, "batch": b, "seq_len": t, "num_heads": h,
         "head_dim": d, "is_causal": causal, "default_impl": default, "rel_err": rel_err,
         "status": "ok" if rel_err <= KERNEL_TOLERANCE else "FAIL"}
  for fn_name, tm in timings.items():
    row.update(_timed(fn_name, tm.median_s, work))
  return row


def run_feature_speed(opts: argparse.Namespace) -> list[dict]:
  if not _on_hopper():
    return [{"kind": "fp8_feature", "status": "skip",
             "reason": "the Mosaic FP8 forward needs a Hopper GPU"}]
  return [feature_speed_row(name, opts) for name in FEATURE_ROWS]


def print_feature_speed(rows: list[dict]) -> None:
  print("\nFP8 forward with features (TFLOP/s of the feature's own work; x plain: / the FP8 "
        "forward without it, same causality; x default: / the same FP8 call under "
        "implementation=None, which ran `default`)")
  if _printed_skip(rows):
    return
  f = flops_lib.format_tflops
  print(f"  {'feature':<10}{'shape':<20}{'status':<8}{'rel_err':>9}{'fp8':>7}{'x plain':>9}"
        f"{'default':>9}{'x default':>11}{'bf16':>7}{'x bf16':>8}")
  for r in rows:
    shape = f"{r['batch']}x{r['seq_len']}x{r['num_heads']} d{r['head_dim']}"
    ratio = lambda other: r["fp8_tflops"] / r[f"{other}_tflops"]  # noqa: E731
    print(f"  {r['feature']:<10}{shape:<20}{r['status']:<8}{r['rel_err']:>9.1e}"
          f" {f(r['fp8_tflops']):>6}{ratio('fp8_plain'):>9.2f} {f(r['fp8_default_tflops']):>8}"
          f"{ratio('fp8_default'):>11.2f} {f(r['bf16_tflops']):>6}{ratio('bf16'):>8.2f}"
          f"  default: {r['default_impl']}", flush=True)


# ---------------------------------------------------------------------------------------------
# Training: forward + backward (pallas_flash.quantized_attention against bf16)

# (row name, rotate): pallas_flash.quantized_attention on the bf16 inputs (per-tensor scales),
# beside flash_attention's bf16 gradient.
GRAD_ROWS = (("fp8 tensor", False), ("fp8 tensor +rot", True))


def _grad_errors(grads, ref) -> dict:
  """Per gradient (dq, dk, dv): RMSE / RMS(ref) and max |error| / max |ref|."""
  out = {}
  for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
    err = g.astype(jnp.float32) - r
    out[f"{name}_rel_rmse"] = float(jnp.sqrt(jnp.mean(err * err) / jnp.mean(r * r)))
    out[f"{name}_rel_max"] = float(jnp.max(jnp.abs(err)) / jnp.max(jnp.abs(r)))
  return out


def training_impl(q, k, v, **kwargs) -> str:
  """What runs pallas_flash.quantized_attention(q, k, v, **kwargs), in words."""
  _, scales = jax.eval_shape(fp8.quantize, q, k, v)
  plan = fp8._training_plan([q, k, v], scales, jnp.dtype(jnp.bfloat16), kwargs)
  if plan is None:
    return "flash_attention on the dequantized values"
  if plan.fp8_kernel:
    return "mosaic FP8 forward + bf16 mosaic backward"
  return f"{plan.name} forward + backward (dequantized to float32)"


def _grad_fn(attention, do):
  """jit(grad of sum(attention(q, k, v) · do)) with respect to q, k, v."""
  return jax.jit(jax.grad(lambda *xs: jnp.sum(attention(*xs).astype(jnp.float32) * do),
                          argnums=(0, 1, 2)))


def run_grad_rows(shape: Shape, *, outliers: bool, seed: int) -> list[dict]:
  """Gradients (dq, dk, dv) of sum(o · do) of one input kind against the float32 reference's
  on the bf16 inputs: bf16 flash_attention, then each of GRAD_ROWS."""
  q, k, v = make_inputs(shape, outliers=outliers, seed=seed)
  do = jax.random.normal(jax.random.key(seed + 1), q.shape, jnp.float32)
  ref = _grad_fn(functools.partial(pallas_flash.flash_attention, implementation="reference"),
                 do)(*(x.astype(jnp.float32) for x in (q, k, v)))
  base = {"kind": "fp8_grad_accuracy", "inputs": "outliers" if outliers else "normal",
          "batch": shape.batch, "seq_len": shape.seq_len, "num_heads": shape.num_heads,
          "head_dim": shape.head_dim, "status": "ok"}
  grads = _grad_fn(pallas_flash.flash_attention, do)(q, k, v)
  rows = [{**base, "row": "bf16", "impl": pallas_flash.explain(q, k, v).chosen,
           **_grad_errors(grads, ref)}]
  for name, rotate in GRAD_ROWS:
    fn = functools.partial(pallas_flash.quantized_attention, rotate=rotate)
    grads = _grad_fn(fn, do)(q, k, v)
    rows.append({**base, "row": name, "impl": training_impl(q, k, v), "rotate": rotate,
                 **_grad_errors(grads, ref)})
  return rows


def print_grad_rows(rows: list[dict]) -> None:
  r0 = rows[0]
  print(f"\nFP8 training gradients vs the float32 reference: B{r0['batch']} T=S={r0['seq_len']}"
        f" H{r0['num_heads']} D{r0['head_dim']}, non-causal; RMSE/RMS(ref) and max err/max|ref|"
        " of the gradients of sum(o·do)")
  print(f"  {'inputs':<10}{'row':<17}{'dq':>18}{'dk':>18}{'dv':>18}  impl")
  for r in rows:
    cols = "".join(f"{r[f'{g}_rel_rmse']:.1e}/{r[f'{g}_rel_max']:.1e}".rjust(18)
                   for g in ("dq", "dk", "dv"))
    print(f"  {r['inputs']:<10}{r['row']:<17}{cols}  {r['impl']}", flush=True)


def training_speed_row(dims, *, is_causal: bool, opts: argparse.Namespace) -> dict:
  """One forward+backward speed row: the bf16 Mosaic fwd+bwd and pallas_flash.quantized_attention's
  (quantisation included), without and with the rotation, on the same bf16 inputs, timed
  interleaved as TFLOP/s of 3.5 · 4·B·H·T·S·D (halved causal)."""
  b, t, h, d = dims
  keys = jax.random.split(jax.random.key(opts.seed), 4)
  q, k, v, do = (jax.random.normal(key, dims, jnp.float32).astype(jnp.bfloat16)
                 for key in keys)
  args = (q, k, v, do)

  def step(attention):
    def fwdbwd(q, k, v, do):
      _, vjp = jax.vjp(attention, q, k, v)
      return vjp(do)
    return jax.jit(fwdbwd).lower(*args).compile()

  fns = {"bf16": step(functools.partial(pallas_flash.flash_attention, is_causal=is_causal,
                                        implementation="mosaic")),
         **{"fp8" + label: step(functools.partial(
                pallas_flash.quantized_attention, is_causal=is_causal, rotate=rotate,
                implementation="mosaic"))
            for label, rotate in (("", False), (" +rot", True))}}
  timings = timing.time_interleaved(fns, args, iters=opts.iters,
                                    min_loop_s=opts.min_loop_ms / 1e3,
                                    settle_s=opts.settle_ms / 1e3)
  work = _flops(dims, is_causal=is_causal, mode="fwdbwd")
  row = {"kind": "fp8_training_speed", "batch": b, "seq_len": t, "num_heads": h,
         "head_dim": d, "is_causal": is_causal, "status": "ok", "reason": None,
         "impl": training_impl(q, k, v, is_causal=is_causal)}
  for name, tm in timings.items():
    row.update(_timed(name.replace(" +rot", "_rot"), tm.median_s, work))
  row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
  row["speedup_rot"] = row["bf16_ms"] / row["fp8_rot_ms"]
  return row


def run_training_speed(opts: argparse.Namespace) -> list[dict]:
  if not _on_hopper():
    return [{"kind": "fp8_training_speed", "status": "skip",
             "reason": "the Mosaic FP8 forward and bf16 backward need a Hopper GPU"}]
  return [training_speed_row(dims, is_causal=causal, opts=opts)
          for dims in SPEED_SHAPES for causal in (False, True)]


def print_training_speed(rows: list[dict]) -> None:
  print("\nFP8 forward+backward speed (TFLOP/s of 3.5x the forward's matmuls): "
        "pallas_flash.quantized_attention (quantisation included) vs the bf16 Mosaic fwd+bwd")
  if _printed_skip(rows):
    return
  print(f"  {'shape':<20}{'causal':<8}{'bf16':>8}{'fp8':>8}{'x bf16':>8}{'fp8 +rot':>10}"
        f"{'x bf16':>8}  impl")
  for r in rows:
    shape = f"{r['batch']}x{r['seq_len']}x{r['num_heads']} d{r['head_dim']}"
    f = flops_lib.format_tflops
    print(f"  {shape:<20}{str(r['is_causal']):<8}{f(r['bf16_tflops']):>8}{f(r['fp8_tflops']):>8}"
          f"{r['speedup']:>8.2f}{f(r['fp8_rot_tflops']):>10}{r['speedup_rot']:>8.2f}"
          f"  {r['impl']}", flush=True)


def run_fp8(opts: argparse.Namespace) -> list[dict]:
  if opts.fp8_features:
    rows = run_feature_speed(opts)
    print_feature_speed(rows)
    return rows
  shape = SHAPES["quick" if opts.quick else "full"]
  rows = []
  if not opts.fp8_training:
    rows = [r for outliers in (False, True)
            for r in run_rows(shape, outliers=outliers, seed=opts.seed)]
    print_rows(rows)
  grads = [r for outliers in (False, True)
           for r in run_grad_rows(shape, outliers=outliers, seed=opts.seed)]
  print_grad_rows(grads)
  speed = []
  if not opts.fp8_training:
    speed = run_speed(opts)
    print_speed(speed)
  training = run_training_speed(opts)
  print_training_speed(training)
  return rows + grads + speed + training
