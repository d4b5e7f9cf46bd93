"""Which of the attention backward's five matmuls tolerate FP8 (e4m3) operands: an emulation.

  PYTHONPATH=. python scripts/fp8_backward_precision.py [--seq 1024] [--heads 2] [--head-dim 128]

Dense float32 arithmetic on the CPU (or any device), no kernel: inputs drawn as in
`python -m pallas_flash.bench --fp8` (bf16, normal or with outliers), quantised per tensor
(`fp8.quantize`), the forward as the Mosaic FP8 forward computes it (P rounded to e4m3 as
2⁸·P for O; lse exact), then the backward with each matmul's operands rounded either to
bfloat16 (what fp8.quantized_attention runs today: the bf16 backward on the dequantized
values) or to e4m3 with a scale that maps the operand's amax to 448:

  S  = Q·Kᵀ     (recomputed)  FP8: the e4m3 q, k themselves (the forward's S, exactly)
  dP = dO·Vᵀ                  FP8: dO per tensor (an XLA amax pass before the kernels), e4m3 v
  dV = Pᵀ·dO                  FP8: 2⁸·P (the forward's rounding) and dO per tensor
  dQ = dS·K, dK = dSᵀ·Q       FP8: dS per 64 x 128 tile (its amax known only inside a tile)
                              and the e4m3 k, q

Each row prints max |error| / max |ref| and RMSE / RMS(ref) of dq, dk, dv against the
float32 gradient of the same dequantized attention (so only the backward's rounding, and
the FP8 forward's O through rowsum(dO∘O), differ). The per-tile scale of dS is emulated as
arithmetic only: what it costs in a kernel is not assessed here.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp

from pallas_flash import fp8
from pallas_flash.bench import fp8 as fp8_report

E4M3 = jnp.float8_e4m3fn
HI = jax.lax.Precision.HIGHEST
TILE = (64, 128)  # (queries, keys) of a dS tile's scale


def e4m3(x, scale):
  """x rounded to e4m3 at `scale` (x / scale rounded, times scale), float32."""
  return jnp.clip(x / scale, -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(E4M3).astype(
      jnp.float32) * scale


def per_tensor(x):
  return e4m3(x, jnp.maximum(jnp.max(jnp.abs(x)), 1e-30) / fp8.E4M3_MAX)


def per_tile(x):
  """x [..., T, S] rounded to e4m3 with one scale per TILE block of its last two axes."""
  *lead, t, s = x.shape
  bt, bs = TILE
  pt, ps = -t % bt, -s % bs
  xp = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pt), (0, ps)])
  blocks = xp.reshape(*lead, (t + pt) // bt, bt, (s + ps) // bs, bs)
  amax = jnp.max(jnp.abs(blocks), axis=(-3, -1), keepdims=True)
  out = e4m3(blocks, jnp.maximum(amax, 1e-30) / fp8.E4M3_MAX)
  return out.reshape(*xp.shape)[..., :t, :s]


def bf16(x):
  return x.astype(jnp.bfloat16).astype(jnp.float32)


def mm(a, b, spec):
  return jnp.einsum(spec, a, b, precision=HI)


def grads(q, k, v, do, *, causal: bool, fp8_ops: frozenset, q8=None, k8=None, v8=None):
  """(dq, dk, dv) [H, T, D] of one head-batched attention; fp8_ops: which of "S", "dP",
  "dV", "dQK" run on e4m3 operands (the rest on bf16 ones); q8/k8/v8: the e4m3 values
  dequantized (for FP8 operands); None: the exact float32 gradient."""
  exact = q8 is None
  d = q.shape[-1]
  scale = d ** -0.5
  t, s = q.shape[1], k.shape[1]
  mask = jnp.tril(jnp.ones((t, s), bool)) if causal else jnp.ones((t, s), bool)

  def softmax_parts(qq, kk):
    logits = jnp.where(mask, scale * mm(qq, kk, "htd,hsd->hts"), -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return jnp.exp(logits - lse)

  p = softmax_parts(q, k)  # the forward's probabilities, exact (its lse is)
  if exact:
    o = mm(p, v, "hts,hsd->htd")
  else:  # the FP8 forward: 2⁸·P rounded to e4m3 for P·V
    o = mm(e4m3(p * 256.0, 1.0) / 256.0, v8, "hts,hsd->htd")
  op = (lambda x: x) if exact else bf16
  p_b = p if exact or "S" in fp8_ops else softmax_parts(bf16(q), bf16(k))
  if exact or "dP" not in fp8_ops:
    dp = mm(op(do), op(v), "htd,hsd->hts")
  else:
    dp = mm(per_tensor(do), v8, "htd,hsd->hts")
  if exact or "dV" not in fp8_ops:
    dv = mm(op(p_b), op(do), "hts,htd->hsd")
  else:
    dv = mm(e4m3(p_b * 256.0, 1.0) / 256.0, per_tensor(do), "hts,htd->hsd")
  delta = jnp.sum(do * o, axis=-1, keepdims=True)
  ds = p_b * (dp - delta)
  if exact or "dQK" not in fp8_ops:
    dq = scale * mm(op(ds), op(k), "hts,hsd->htd")
    dk = scale * mm(op(ds), op(q), "hts,htd->hsd")
  else:
    ds8 = per_tile(ds)
    dq = scale * mm(ds8, k8, "hts,hsd->htd")
    dk = scale * mm(ds8, q8, "hts,htd->hsd")
  return dq, dk, dv


def errors(got, ref) -> str:
  cols = []
  for g, r in zip(got, ref):
    err = g - r
    rmse = jnp.sqrt(jnp.mean(err * err) / jnp.mean(r * r))
    cols.append(f"{float(jnp.max(jnp.abs(err)) / jnp.max(jnp.abs(r))):.1e}/{float(rmse):.1e}")
  return "".join(c.rjust(18) for c in cols)


FORMS = {  # name -> the matmuls on e4m3 operands
    "bf16 (today)": frozenset(),
    "S": frozenset({"S"}),
    "S, dV": frozenset({"S", "dV"}),
    "S, dP": frozenset({"S", "dP"}),
    "S, dQ, dK": frozenset({"S", "dQK"}),
    "S, dV, dP": frozenset({"S", "dV", "dP"}),
    "all five": frozenset({"S", "dV", "dP", "dQK"}),
}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--seed", type=int, default=0)
  opts = p.parse_args(argv)
  shape = fp8_report.Shape(1, opts.seq, opts.heads, opts.head_dim, 128)
  print(f"B1 T=S={opts.seq} H{opts.heads} D{opts.head_dim}, per-tensor q/k/v scales; "
        "max err / max|ref| and RMSE / RMS(ref) vs the float32 gradient of the dequantized "
        "attention")
  print(f"  {'inputs':<10}{'causal':<8}{'FP8 matmuls':<14}{'dq':>18}{'dk':>18}{'dv':>18}")
  for outliers, causal in itertools.product((False, True), (False, True)):
    q, k, v = fp8_report.make_inputs(shape, outliers=outliers, seed=opts.seed)
    (q8, k8, v8), sc = fp8.quantize(q, k, v)
    deq = [fp8.dequantize(x, s) for x, s in zip((q8, k8, v8), (sc.q, sc.k, sc.v))]
    heads = lambda x: jnp.swapaxes(x[0], 0, 1)  # noqa: E731  [H, N, D]
    qh, kh, vh = map(heads, deq)
    do = heads(jax.random.normal(jax.random.key(opts.seed + 1), q.shape, jnp.float32))
    ref = jax.jit(lambda *a: grads(*a, causal=causal, fp8_ops=frozenset()))(qh, kh, vh, do)
    for name, ops in FORMS.items():
      got = jax.jit(lambda *a, ops=ops: grads(*a[:4], causal=causal, fp8_ops=ops, q8=a[4],
                                              k8=a[5], v8=a[6]))(qh, kh, vh, do, qh, kh, vh)
      print(f"  {'outliers' if outliers else 'normal':<10}{str(causal):<8}{name:<14}"
            f"{errors(got, ref)}", flush=True)


if __name__ == "__main__":
  main()
