"""Diagnostic: SM clock / power / throttle reasons while each backward variant runs in a loop."""
import json, subprocess, sys, time, os, statistics
import jax, jax.numpy as jnp
import pallas_flash
from pallas_flash.bench import variants
from pallas_flash.mosaic_gpu import backward, config as mconfig
from pallas_flash.params import AttentionParams

def bwd_fn(params, config):
  def run(q, k, v, o, lse, do):
    return backward(q, k, v, None, None, o, lse, do, None, params=params, config=config)
  return jax.jit(run)

def sample(fn, inputs, secs=3.0):
  jax.block_until_ready(fn(*inputs))
  p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                        "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
  time.sleep(0.3)
  t0 = time.perf_counter(); n = 0
  while time.perf_counter() - t0 < secs:
    out = fn(*inputs); n += 1
    if n % 8 == 0: jax.block_until_ready(out)
  jax.block_until_ready(out); el = time.perf_counter() - t0
  p.terminate(); lines = p.communicate()[0].strip().splitlines()
  rows = [l.split(", ") for l in lines if l.count(",") == 3]
  rows = rows[len(rows)//4:]  # steady part
  clk = [float(r[0]) for r in rows]; pw = [float(r[1]) for r in rows]
  thr = sorted(set(r[3] for r in rows))
  return dict(ms=round(el / n * 1e3, 3), clock_med=statistics.median(clk), clock_min=min(clk),
              power_med=statistics.median(pw), temp=rows[-1][2], throttle=thr, samples=len(rows))

shape, causal_s, *vs = sys.argv[1:]
spec = variants.parse_shape(shape); causal = causal_s == "yes"
b, t, h, d = spec.batch, spec.seq_len, spec.num_heads, spec.head_dim
kh = spec.num_kv_heads or h
keys = jax.random.split(jax.random.key(1), 4)
q, do = (jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in keys[:2])
k, v = (jax.random.normal(kk, (b, t, kh, d), jnp.bfloat16) for kk in keys[2:])
o, lse = pallas_flash.flash_attention(q, k, v, is_causal=causal, implementation="xla", return_residuals=True)
params = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=False)
base = mconfig.tuned(d, causal, t)
for item in vs:
  name, _, ov = item.partition(":")
  if name == "cudnn":
    f = jax.jit(lambda q, k, v, o, lse, do: jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"), q, k, v)[1](do))
  else:
    f = bwd_fn(params, mconfig.with_overrides(base, ov))
  r = sample(f, (q, k, v, o, lse, do))
  print(json.dumps(dict(shape=shape, causal=causal, variant=name, **r)), flush=True)
