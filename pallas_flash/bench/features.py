"""Features grid (`python -m pallas_flash.bench --features`): what each feature costs.

One row per (feature, mode). Our call runs with `implementation=None` (what a user gets; `--impl`
with one of our implementations forces it instead), and the row names what `explain()` picks
for that call. Three calls are checked and then timed together in interleaved rounds
(timing.time_each), so that their ratios within the run mean something:
  ours      flash_attention with the feature;
  plain     plain attention of the same causality on the grid's shape at its head dim (128 by
            default), by the implementation `explain()` picks for plain attention here (mosaic
            on an H200): the row's `x plain` is ours / plain in TFLOP/s;
  cudnn     cuDNN running the same feature: `jax.nn.dot_product_attention(implementation=
            "cudnn")`, for dropout jax's private cuDNN fused attention (its own dropout mask, so
            that column is timed but not checked); "—" where cuDNN has no such feature (segment
            ids, soft cap, ALiBi) or rejects the call (the error is kept in the JSON).
A BlockMask row (causal & local) is compared with cuDNN's causal sliding window: the same mask.

Every call is checked before it is timed against the float32 reference (flash_attention with
implementation="reference" on float32 copies of the inputs and of the bias): the output (fwd) or
dq, dk, dv and, for the dense bias and the sinks, dbias and dsinks (fwdbwd), at the bench's
tolerances; a row past them is marked FAIL but still timed. The check uses the first two heads
(whole GQA groups) and, past --check-seq-cap, a leading slice rerun with the full call's config
(as the main bench does).

FLOPs: every feature counts the matrix work of plain attention of its causality on its shape
(flops.attention_flops: 4·B·H·T²·D, halved when causal; x3.5 for forward+backward), so `x plain`
is a time ratio, except: the local window and the BlockMask (causal & local) count the band's
exact (query, key) pairs (flops.window_flops); head dims count their own D (hd192v128:
2·B·H·T²·(192 + 128) forward), so their `x plain` compares TFLOP/s with head dim 128. Segment
ids, masks and dropout count the plain work, not the pairs they leave visible.

Features and their causality (causal where a decoder uses them; dense bias and boolean mask as
in an encoder): plain (non-causal), causal, window (causal, left = T/4), window_both
(non-causal, T/8 either side; cuDNN's window is causal only), segments (causal,
packed documents, T/1024 per row at random boundaries), softcap (causal, 50), alibi (causal,
slopes 2^(-8(h+1)/H)), alibi_in_cap (causal, those slopes inside a cap of 50), dropout (causal,
0.1), bias (non-causal, [1, H, T, S], differentiated; bias_causal the same, causal;
bias_fixed the same, not differentiated: an additive mask or a frozen bias), mask
(non-causal, bool [B, 1, T, S], 90 % visible), blockmask (causal & local(T/4), 128x128
blocks), sinks (causal, differentiated), gqa (causal, K kv heads), hd64 hd80 hd96 hd192
hd256 and hd192v128 (query/key head dim 192, value head dim 128, MLA's) (non-causal and
causal).

Default shape bf16 4x4096x32x128x8 (--features-shape BxTxHxD[xK]): every row has as many kv
heads as query heads except gqa, which takes the shape's K (8); --quick: 1x128x4x32 (gqa: 2 kv
heads) and short loops, which runs on CPU with --impl xla in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash
from pallas_flash import masks
from pallas_flash.bench import checks, flops, kernels, shapes, timing

DEFAULT_SHAPE, QUICK_SHAPE = "4x4096x32x128x8", "1x128x4x32x2"
HEAD_DIMS = (64, 80, 96, 192, 256)
SOFT_CAP, DROPOUT_RATE, MASK_VISIBLE = 50.0, 0.1, 0.9
BLOCK_MASK_TILE = 128  # the Mosaic kernels' 128-row tiles (Triton takes any power of two)
TOKENS_PER_DOC = 1024
UNSUPPORTED = "—"
# --quick timing: iters, min loop ms, settle ms (the flags override them).
QUICK_TIMING = (2, 1.0, 0.0)


@dataclasses.dataclass(frozen=True)
class Feature:
  """One row of the grid: flash_attention's keyword arguments on top of plain attention.

  build(spec, seed) returns them (static values and arrays; arrays are jit arguments).
  cudnn: how cuDNN runs the same feature: "nn" (jax.nn with build's bias / mask /
  local_window_size), "window" (jax.nn's causal sliding window of left T/4), "dropout" (jax's
  private cuDNN call) or None (no such feature: "—")."""

  name: str
  causal: bool
  build: Callable[[shapes.ShapeSpec, int], dict] = lambda spec, seed: {}
  cudnn: str | None = "nn"
  head_dim: int | None = None
  value_head_dim: int = 0  # 0: the head dim
  gqa: bool = False
  band: Callable[[shapes.ShapeSpec], tuple[int, int]] | None = None  # (left, right) of a window
  block_masked: bool = False  # a BlockMask, whose mask function carries the causality
  fixed: tuple[str, ...] = ()  # DIFFERENTIATED arrays the row does not differentiate

  @property
  def is_causal(self) -> bool:
    """flash_attention's is_causal (a BlockMask's causality is in its mask function)."""
    return self.causal and not self.block_masked

  @property
  def baseline(self) -> str:
    return "causal" if self.causal else "plain"

  def spec(self, base: shapes.ShapeSpec, gqa_kv_heads: int) -> shapes.ShapeSpec:
    return base.replace(name=self.name, head_dim=self.head_dim or base.head_dim,
                        num_kv_heads=gqa_kv_heads if self.gqa else 0,
                        value_head_dim=self.value_head_dim)

  def flops(self, spec: shapes.ShapeSpec, mode: str) -> float:
    if self.band is not None:
      left, right = self.band(spec)
      return flops.window_flops(spec, left=left, right=right, mode=mode)
    return flops.attention_flops(spec, is_causal=self.causal, mode=mode)


def _window(spec: shapes.ShapeSpec) -> int:
  return max(spec.seq_len // 4, 1)


def _causal_band(spec: shapes.ShapeSpec) -> tuple[int, int]:
  return _window(spec), 0


def _two_sided_band(spec: shapes.ShapeSpec) -> tuple[int, int]:
  """An encoder's local window: T/8 keys either side (as many pairs as the causal T/4)."""
  side = max(spec.seq_len // 8, 1)
  return side, side


def _segments(spec: shapes.ShapeSpec, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  docs = max(2, spec.seq_len // TOKENS_PER_DOC)
  starts = np.zeros((spec.batch, spec.seq_len), np.int32)
  for row in starts:
    row[rng.choice(np.arange(1, spec.seq_len), docs - 1, replace=False)] = 1
  return {"query_segment_ids": jnp.asarray(np.cumsum(starts, axis=1, dtype=np.int32))}


def _alibi(spec: shapes.ShapeSpec, seed: int) -> dict:
  h = spec.num_heads
  return {"alibi_slopes": jnp.asarray([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)],
                                      jnp.float32)}


def _dropout(spec: shapes.ShapeSpec, seed: int) -> dict:
  return {"dropout_rate": DROPOUT_RATE, "dropout_rng": jax.random.key(seed + 13)}


def _bias(spec: shapes.ShapeSpec, seed: int) -> dict:  # cast to the inputs' dtype by _case
  t = spec.seq_len
  return {"bias": jax.random.normal(jax.random.key(seed + 11), (1, spec.num_heads, t, t))}


def _mask(spec: shapes.ShapeSpec, seed: int) -> dict:
  t = spec.seq_len
  return {"mask": jax.random.bernoulli(jax.random.key(seed + 12), MASK_VISIBLE,
                                       (spec.batch, 1, t, t))}


def _block_mask(spec: shapes.ShapeSpec, seed: int) -> dict:
  fn = masks.CausalMask() & masks.LocalMask(_window(spec), 0)
  return {"block_mask": _build_block_mask(fn, spec.seq_len)}


def _build_block_mask(fn: masks.MaskFn, t: int) -> masks.BlockMask:
  tile = min(BLOCK_MASK_TILE, 1 << (t - 1).bit_length())  # a power of two, at most T rounded up
  return masks.BlockMask.build(fn, q_len=t, kv_len=t, block_q=tile, block_kv=tile)


FEATURES: tuple[Feature, ...] = (
    Feature("plain", False),
    Feature("causal", True),
    Feature("window", True, lambda s, _: {"local_window_size": _causal_band(s)},
            band=_causal_band),
    Feature("window_both", False, lambda s, _: {"local_window_size": _two_sided_band(s)},
            cudnn=None, band=_two_sided_band),
    Feature("segments", True, _segments, cudnn=None),
    Feature("softcap", True, lambda s, _: {"logits_soft_cap": SOFT_CAP}, cudnn=None),
    Feature("alibi", True, _alibi, cudnn=None),
    # ALiBi inside the soft cap (logits_soft_cap_order="bias_then_cap").
    Feature("alibi_in_cap", True, lambda s, seed: {**_alibi(s, seed), "logits_soft_cap": SOFT_CAP,
                                                   "logits_soft_cap_order": "bias_then_cap"},
            cudnn=None),
    Feature("sinks", True, lambda s, seed: {"sinks": jax.random.normal(
        jax.random.key(seed + 14), (s.num_heads,))}, cudnn=None),
    Feature("dropout", True, _dropout, cudnn="dropout"),
    Feature("bias", False, _bias),
    Feature("bias_causal", True, _bias),  # a decoder's learned or relative-position bias
    # An additive mask or a frozen bias: nothing differentiates it (no dbias to write).
    Feature("bias_fixed", False, _bias, fixed=("bias",)),
    Feature("mask", False, _mask),
    Feature("blockmask", True, _block_mask, cudnn="window", band=_causal_band,
            block_masked=True),
    # The block mask composed with dropout, and with a dense bias (cuDNN runs neither).
    Feature("blockmask_dropout", True,
            lambda s, seed: {**_block_mask(s, seed), **_dropout(s, seed)},
            cudnn=None, band=_causal_band, block_masked=True),
    Feature("blockmask_bias", True, lambda s, seed: {**_block_mask(s, seed), **_bias(s, seed)},
            cudnn=None, band=_causal_band, block_masked=True),
    Feature("gqa", True, gqa=True),
    *(Feature(f"hd{d}", c, head_dim=d) for d in HEAD_DIMS for c in (False, True)),
    # MLA's query/key head dim 192 with a value head dim of 128.
    *(Feature("hd192v128", c, head_dim=192, value_head_dim=128) for c in (False, True)),
)


def select(names: str) -> list[Feature]:
  """Features named by a comma list ("all", "hd": every head dim), in FEATURES order."""
  wanted = {w.strip() for w in names.split(",") if w.strip()}
  known = {f.name for f in FEATURES} | {"all", "hd"}
  if not wanted or wanted - known:
    raise SystemExit(f"Unknown features {sorted(wanted - known)}; choose from {sorted(known)}.")
  return [f for f in FEATURES if "all" in wanted or f.name in wanted
          or ("hd" in wanted and f.head_dim)]


def add_arguments(p: argparse.ArgumentParser) -> None:
  g = p.add_argument_group("features grid (--features)")
  g.add_argument("--features", nargs="?", const="all", default=None, metavar="LIST",
                 help="the features grid: all, or a comma list of "
                 f"{','.join(dict.fromkeys(f.name for f in FEATURES))} (hd: every head dim)")
  g.add_argument("--features-shape", default=None, metavar="BxTxHxD[xK]",
                 help=f"features: the grid's shape, K the GQA row's kv heads (default "
                 f"{DEFAULT_SHAPE}; {QUICK_SHAPE} with --quick)")
  g.add_argument("--kernels", action="store_true",
                 help="features: under each row, our call's device time per XLA op and kernel "
                 "(bench/kernels.py: a profile of a few calls); decode: each column's GPU "
                 "time per kernel (CUPTI)")


# ---------------------------------------------------------------------------------------------
# Calls and steps


def _split(kw: dict) -> tuple[dict, dict]:
  """(static kwargs, array kwargs): arrays and BlockMasks become jit arguments."""
  is_array = lambda x: isinstance(x, (jax.Array, masks.BlockMask))  # noqa: E731
  return ({k: x for k, x in kw.items() if not is_array(x)},
          {k: x for k, x in kw.items() if is_array(x)})


def _ours(impl: str, feature: Feature, static: dict, config=None) -> Callable:
  def attn(q, k, v, arrays):
    return pallas_flash.flash_attention(q, k, v, is_causal=feature.is_causal, implementation=impl,
                                        config=config, **static, **arrays)
  return attn


def _cudnn(feature: Feature, spec: shapes.ShapeSpec, static: dict) -> Callable:
  """cuDNN's call of the same feature (feature.cudnn says how), attn(q, k, v, arrays)."""
  if feature.cudnn == "dropout":
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa  # private, but the one way

    def attn(q, k, v, arrays):
      del arrays
      return cudnn_fa.dot_product_attention(
          q, k, v, scale=spec.head_dim ** -0.5, seed=7, dropout_rate=DROPOUT_RATE,
          mask_type=cudnn_fa.MaskType.CAUSAL if feature.causal else cudnn_fa.MaskType.NO_MASK)
    return attn
  extra = dict(static)
  if feature.cudnn == "window":
    extra = {"local_window_size": (_window(spec), 0)}

  def attn(q, k, v, arrays):
    nn = {n: x for n, x in arrays.items() if n in ("bias", "mask")}
    return jax.nn.dot_product_attention(q, k, v, is_causal=feature.causal,
                                        implementation="cudnn", **extra, **nn)
  return attn


# The feature arrays a fwdbwd step differentiates (where the feature passes them), in order.
DIFFERENTIATED = ("bias", "sinks")


def _step(attn: Callable, mode: str, grads: tuple[str, ...]) -> Callable:
  """Jitted step(q, k, v, do, arrays): fwd returns (o,); fwdbwd the VJP with cotangent do,
  (dq, dk, dv) and the gradients of the arrays named in `grads` (DIFFERENTIATED's)."""
  def fwd(q, k, v, do, arrays):
    del do
    return (attn(q, k, v, arrays),)

  def fwdbwd(q, k, v, do, arrays):
    diff = {n: arrays[n] for n in grads}
    rest = {n: x for n, x in arrays.items() if n not in diff}
    _, vjp = jax.vjp(lambda q, k, v, d: attn(q, k, v, {**rest, **d}), q, k, v, diff)
    dq, dk, dv, dd = vjp(do)
    return (dq, dk, dv) + tuple(dd[n] for n in grads)

  return jax.jit(fwd if mode == "fwd" else fwdbwd)


def _names(mode: str, grads: tuple[str, ...]) -> tuple[str, ...]:
  return ("o",) if mode == "fwd" else ("dq", "dk", "dv") + tuple(f"d{n}" for n in grads)


# ---------------------------------------------------------------------------------------------
# Checks


def _cut(name: str, x: jax.Array, hc: int, kc: int) -> jax.Array:
  """An output cut to the check's heads: dbias [1, H, T, S] on axis 1, dsinks [H] on axis 0,
  the rest [B, T, H, D]."""
  if name == "dbias":
    return x[:, :hc]
  if name == "dsinks":
    return x[:hc]
  return x[:, :, :kc] if name in ("dk", "dv") else x[:, :, :hc]


def _slice_arrays(arrays: dict, hc: int, tc: int) -> dict:
  """The feature arrays of the leading [.., tc, hc heads ..] slice (the BlockMask rebuilt)."""
  out = {}
  for name, x in arrays.items():
    if name in ("bias", "mask"):
      x = x[:, :hc, :tc, :tc]
    elif name in ("alibi_slopes", "sinks"):
      x = x[:hc]
    elif name.endswith("segment_ids"):
      x = x[:, :tc]
    elif name == "block_mask" and x.q_len != tc:  # the same blocks: they are the kernels'
      x = masks.BlockMask.build(x.mask_fn, q_len=tc, kv_len=tc, block_q=x.block_q,
                                block_kv=x.block_kv)
    out[name] = x
  return out


@dataclasses.dataclass
class _Case:
  """One feature on one mode: its inputs and the float32 reference (computed once)."""

  feature: Feature
  spec: shapes.ShapeSpec
  mode: str
  args: tuple  # (q, k, v, do, arrays)
  static: dict
  small: shapes.ShapeSpec
  _ref: tuple | None = None

  @property
  def grads(self) -> tuple[str, ...]:
    """The feature arrays differentiated in fwdbwd (DIFFERENTIATED's that the call passes)."""
    return tuple(n for n in DIFFERENTIATED if n in self.args[4] and n not in self.feature.fixed)

  def sliced(self, dtype=None) -> tuple:
    s = self.small
    hc, kc, tc = s.num_heads, s.kv_heads, s.seq_len
    q, k, v, do, arrays = self.args
    xs = (q[:, :tc, :hc], k[:, :tc, :kc], v[:, :tc, :kc], do[:, :tc, :hc])
    arrays = _slice_arrays(arrays, hc, tc)
    if dtype is not None:
      xs = tuple(x.astype(dtype) for x in xs)
      arrays = {n: x.astype(dtype) if n == "bias" else x for n, x in arrays.items()}
    return (*xs, arrays)

  def reference(self) -> tuple:
    if self._ref is None:
      attn = _ours("reference", self.feature, self.static)
      self._ref = _step(attn, self.mode, self.grads)(*self.sliced(jnp.float32))
    return self._ref


def _fields(status: str, reason: str | None = None) -> dict:
  """A call's {status, reason, rel_errs, rel_err, compile_s} before (or without) its check."""
  return {"status": status, "reason": reason, "rel_errs": None, "rel_err": None,
          "compile_s": None}


def _prepare(case: _Case, attn: Callable, *, rerun: Callable | None = None,
             checked: bool = True) -> tuple[dict, Callable | None]:
  """Compiles and checks `attn` on `case` (on the leading slice: `rerun`, default attn):
  ({status, reason, rel_errs, rel_err, compile_s}, the compiled call bound to its inputs), or
  (fields, None) where it failed. checked=False: run, but nothing to compare with."""
  fields = _fields("ok")
  try:
    step = _step(attn, case.mode, case.grads)
    compiled, fields["compile_s"] = timing.compile_step(step, case.args)
    if case.small.seq_len == case.spec.seq_len:
      out = compiled(*case.args)
    else:  # rerun on the leading slice, with the full call's kernels (rerun's attn)
      out = _step(rerun or attn, case.mode, case.grads)(*case.sliced())
    s = case.small
    names = _names(case.mode, case.grads)
    if not checked:
      fields.update(status="unchecked", reason="its own dropout mask: not checked")
    else:
      errs = {n: float(checks.rel_err(_cut(n, o, s.num_heads, s.kv_heads), r))
              for n, o, r in zip(names, out, case.reference(), strict=True)}
      rel = max(errs.values())
      tol = checks.TOLERANCE[jnp.dtype(case.args[0].dtype).name]
      fields.update(rel_errs=errs, rel_err=rel, status="ok" if rel <= tol else "FAIL")
  except Exception as e:  # noqa: BLE001 -- one rejected call must not stop the grid
    fields.update(status="error", reason=f"{type(e).__name__}: {str(e).strip()[:300]}")
    return fields, None
  args = case.args
  return fields, lambda: compiled(*args)


# ---------------------------------------------------------------------------------------------
# The grid


def _on_gpu() -> bool:
  return jax.devices()[0].platform == "gpu"


def _impl(opts) -> tuple[str | None, bool]:
  """(our forced implementation or None for implementation=None's pick, whether cuDNN runs)."""
  on_gpu = _on_gpu()
  if opts.impl is None:
    return None, on_gpu
  impls = [i.strip() for i in opts.impl.split(",") if i.strip()]
  ours = [i for i in impls if i in timing.OURS]
  if len(ours) > 1 or set(impls) - set(timing.OURS) - {"cudnn"}:
    raise SystemExit("--features takes --impl with at most one of "
                     f"{timing.OURS} and optionally cudnn.")
  return (ours[0] if ours else None), "cudnn" in impls and on_gpu


def _case(feature: Feature, spec: shapes.ShapeSpec, inputs: tuple, mode: str, opts) -> _Case:
  kw = feature.build(spec, opts.seed)
  if "bias" in kw:
    kw["bias"] = kw["bias"].astype(inputs[0].dtype)
  static, arrays = _split(kw)
  return _Case(feature, spec, mode, (*inputs, arrays), static,
               shapes.check_spec(spec, seq_cap=opts.check_seq_cap))


def _explain(case: _Case):
  q, k, v, _, arrays = case.args
  return pallas_flash.explain(q, k, v, is_causal=case.feature.is_causal, **case.static, **arrays)


def _our_call(case: _Case, forced: str | None) -> tuple[str | None, str | None, Callable | None,
                                                        Callable | None]:
  """(implementation run, explain()'s pick, attn, rerun attn with the full call's config), or
  a skip reason in place of the implementation where it cannot run."""
  how = _explain(case)
  impl = forced or how.chosen
  # The reasons of a named call: explain()'s `reasons` also name what automatic choice avoids
  # but a named call runs (Mosaic head dims not yet measured).
  if impl is None or how.reasons_when_named.get(impl) is not None:
    return None, how.chosen, None, None
  # A BlockMask's blocks are the config's: the slice's rebuilt mask brings them.
  config = how.config if impl == how.chosen and "block_mask" not in case.args[4] else None
  return (impl, how.chosen, _ours(impl, case.feature, case.static),
          _ours(impl, case.feature, case.static, config))


def _variant_calls(case: _Case, impl: str | None, chosen: str | None,
                   variants: dict) -> dict[str, tuple[dict, Callable | None]]:
  """{variant name: (fields, compiled call)} of the --variant configs on `case`: the config
  the row's automatic pick runs it with, with the variant's fields replaced, where the row
  runs the variant's implementation as that pick."""
  out = {}
  row_config = None
  for name, variant in variants.items():
    if impl is None or impl != variant.impl or impl != chosen:
      why = f"the row runs {impl or 'nothing'} ({chosen or 'none'} by automatic choice)"
      out[name] = (_fields("skip", why), None)
      continue
    row_config = row_config or _explain(case).config
    try:
      config = dataclasses.replace(row_config, **dict(variant.fields))
    except (TypeError, ValueError) as e:
      out[name] = (_fields("error", f"{type(e).__name__}: {e}"), None)
      continue
    out[name] = _prepare(case, _ours(impl, case.feature, case.static, config))
  return out


def run_features(opts, dtype, on_rows=lambda rows: None) -> list[dict]:
  """Every selected feature on every mode: checked, timed next to plain attention and cuDNN;
  prints each row as it finishes and the markdown table at the end."""
  base = shapes.parse_shape(opts.features_shape or (QUICK_SHAPE if opts.quick else DEFAULT_SHAPE))
  gqa_kv = base.num_kv_heads if base.num_kv_heads != base.num_heads else base.num_heads // 4
  base = base.replace(num_kv_heads=0)
  forced, with_cudnn = _impl(opts)
  modes = [m.strip() for m in opts.mode.split(",") if m.strip()]
  by_name = {f.name: f for f in FEATURES}
  kw = dict(iters=opts.iters, min_loop_s=opts.min_loop_ms / 1e3, settle_s=opts.settle_ms / 1e3)
  inputs: dict[shapes.ShapeSpec, tuple] = {}
  baselines: dict[tuple, tuple] = {}  # (mode, causal) -> (case, impl, fields, fn)

  def inputs_of(spec):
    if spec not in inputs:
      for other in [s for s in inputs if s != base]:  # keep at most base and one other
        del inputs[other]
      inputs[spec] = shapes.make_inputs(spec, dtype, opts.seed)
    return inputs[spec]

  def prepare_ours(case):
    impl, chosen, attn, rerun = _our_call(case, forced)
    if impl is None:
      how = _explain(case)
      # _our_call runs a forced implementation unless it names a reason, and the automatic
      # pick unless there is none.
      reason = (how.reasons_when_named[forced] if forced
                else "explain() finds no implementation")
      return impl, chosen, _fields("skip", reason), None
    return (impl, chosen, *_prepare(case, attn, rerun=rerun))

  def baseline(mode, causal):
    if (mode, causal) not in baselines:
      feat = by_name["causal" if causal else "plain"]
      case = _case(feat, base, inputs_of(base), mode, opts)
      baselines[(mode, causal)] = (case, *prepare_ours(case))
    return baselines[(mode, causal)]

  rows = []
  print(f"\nfeatures grid on {base.label} (GQA: {gqa_kv} kv heads), "
        f"{jnp.dtype(dtype).name}; ours = {forced or 'implementation=None'}")
  for feature in select(opts.features):
    spec = feature.spec(base, gqa_kv)
    for mode in modes:
      plain_case, plain_impl, _, plain_fields, plain_fn = baseline(mode, feature.causal)
      is_base = feature.name == feature.baseline and spec.label == base.label
      case = plain_case if is_base else _case(feature, spec, inputs_of(spec), mode, opts)
      impl, chosen, fields, fn = (baseline(mode, feature.causal)[1:] if is_base
                                  else prepare_ours(case))
      cudnn_fields, cudnn_fn = {"status": UNSUPPORTED, "reason": "cuDNN has no such feature"}, None
      if not with_cudnn:
        cudnn_fields["reason"] = "cuDNN not run (no GPU or not in --impl)"
      elif feature.cudnn is not None:
        cudnn_fields, cudnn_fn = _prepare(case, _cudnn(feature, spec, case.static),
                                          checked=feature.cudnn != "dropout")
      variant_calls = _variant_calls(case, impl, chosen, getattr(opts, "variants", {}))
      t = timing.time_each({"ours": fn, "cudnn": cudnn_fn,
                            "plain": None if is_base else plain_fn,
                            **{n: f for n, (_, f) in variant_calls.items()}}, (), **kw)
      row = _row(feature, spec, mode, case, impl, chosen, fields, t, cudnn_fields,
                 plain_case, plain_impl, plain_fields, dtype)
      row["variants"] = {n: _variant_entry(row, v, t[n]) for n, (v, _) in variant_calls.items()}
      if getattr(opts, "kernels", False) and fn is not None:
        row["kernels_us"] = kernels.kernel_times(fn)
      _print_row(row)
      rows.append(row)
      on_rows(rows)
  print_table(rows)
  return rows


def _timed(fields: dict, t, flop: float) -> dict:
  """fields with ms, tflops and loop_ms from a Timing (an exception: status error)."""
  out = dict(fields, ms=None, tflops=None, loop_ms=None)
  if isinstance(t, Exception):
    out.update(status="error", reason=f"{type(t).__name__}: {str(t).strip()[:300]}")
  elif t is not None:
    out.update(ms=t.median_s * 1e3, tflops=flops.tflops(flop, t.median_s),
               loop_ms=[s * 1e3 for s in t.loop_s])
  return out


def _variant_entry(row: dict, fields: dict, t) -> dict:
  """A --variant's timing on a row: its fields, TFLOP/s, and its ratio to the row's own call
  (`ratio_ours`, with the rounds it won) timed in the same rounds."""
  out = _timed(fields, t, row["flops"])
  out["ratio_ours"] = None
  if out["tflops"] and row["tflops"]:
    out["ratio_ours"] = out["tflops"] / row["tflops"]
    out["rounds_vs_ours"] = timing.paired_rounds(out["loop_ms"], row["loop_ms"])
  return out


def _row(feature, spec, mode, case, impl, chosen, fields, t, cudnn_fields, plain_case,
         plain_impl, plain_fields, dtype) -> dict:
  flop = feature.flops(spec, mode)
  ours = _timed(fields, t["ours"], flop)
  cudnn = _timed(cudnn_fields, t["cudnn"], flop)
  plain_flop = plain_case.feature.flops(plain_case.spec, mode)
  plain = _timed(plain_fields, t["plain"], plain_flop) if t["plain"] is not None else ours
  row = {"kind": "feature", "feature": feature.name, "mode": mode, "causal": feature.causal,
         "label": spec.label, "batch": spec.batch, "seq_len": spec.seq_len,
         "num_heads": spec.num_heads, "num_kv_heads": spec.kv_heads, "head_dim": spec.head_dim,
         "value_head_dim": spec.dv, "dtype": jnp.dtype(dtype).name, "impl": impl,
         "explain": chosen, "flops": flop,
         "check_shape": case.small.label,
         "tolerance": checks.TOLERANCE[jnp.dtype(dtype).name], **ours,
         "plain_feature": plain_case.feature.name, "plain_label": plain_case.spec.label,
         "plain_impl": plain_impl, "plain_status": plain["status"],
         "plain_tflops": plain["tflops"], "ratio_plain": None,
         **{f"cudnn_{k}": v for k, v in cudnn.items()}, "ratio_cudnn": None}
  for name, other in (("plain", plain), ("cudnn", cudnn)):
    if ours["tflops"] and other["tflops"]:
      row[f"ratio_{name}"] = ours["tflops"] / other["tflops"]
      if other is not ours:
        row[f"rounds_vs_{name}"] = timing.paired_rounds(ours["loop_ms"], other["loop_ms"])
  return row


# ---------------------------------------------------------------------------------------------
# Printing


def _ratio(x: float | None, missing: str) -> str:
  return missing if x is None or math.isnan(x) else f"{x:.2f}"


def _cudnn_cell(r: dict) -> str:
  if r["cudnn_status"] in (UNSUPPORTED, "error", "skip"):
    return UNSUPPORTED
  return flops.format_tflops(r["cudnn_tflops"]) + {"FAIL": "!", "unchecked": "*"}.get(
      r["cudnn_status"], "")


def _print_row(r: dict) -> None:
  print(f"  {r['feature']:<10}{r['mode']:<7}{'causal' if r['causal'] else '':<7}"
        f"{r['label']:<18}{r['explain'] or '-':<9}{r['impl'] or '-':<9}{r['status']:<8}"
        f"{flops.format_tflops(r['tflops']):>8} x plain {_ratio(r['ratio_plain'], '-'):>5}"
        f"  cuDNN {_cudnn_cell(r):>6} x {_ratio(r['ratio_cudnn'], UNSUPPORTED):>5}"
        f"  {r['reason'] or ''}", flush=True)
  for name, v in r.get("variants", {}).items():
    print(f"    {name}: {v['status']} {flops.format_tflops(v['tflops'])} TFLOP/s, "
          f"x ours {_ratio(v['ratio_ours'], '-')}  {v['reason'] or ''}", flush=True)
  if "kernels_us" in r:
    print("\n".join("      " + line for line in kernels.summary(r["kernels_us"])), flush=True)


def print_table(rows: list[dict]) -> None:
  """The grid as markdown: ! marks FAIL, * a cuDNN call not checked (its own dropout mask)."""
  first = rows[0] if rows else {"plain_label": "-", "plain_impl": "-"}
  print(f"\nFeatures: TFLOP/s; × plain = / plain attention of the same causality on "
        f"{first['plain_label']} by {first['plain_impl']} (timed in the same rounds); × cuDNN = "
        "/ cuDNN on the same feature (— where cuDNN cannot run it); ! = FAIL, * = not checked")
  print("| feature | B×T×H×D | causal | mode | explain | ran | status | rel_err | TFLOP/s "
        "| × plain | × cuDNN | cuDNN TFLOP/s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    err = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
    print(f"| {r['feature']} | {r['label']} | {'yes' if r['causal'] else 'no'} | {r['mode']} "
          f"| {r['explain'] or '-'} | {r['impl'] or '-'} | {r['status']} | {err} "
          f"| {flops.format_tflops(r['tflops'])} | {_ratio(r['ratio_plain'], '-')} "
          f"| {_ratio(r['ratio_cudnn'], UNSUPPORTED)} | {_cudnn_cell(r)} |")
