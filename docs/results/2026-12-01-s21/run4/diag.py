import sys, time, jax, jax.numpy as jnp, dataclasses
import pallas_flash
from pallas_flash.mosaic_gpu.config import tuned, with_overrides
causal = sys.argv[1] == "causal"; over = sys.argv[2] if len(sys.argv) > 2 else ""
t = 2048
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(x, (1, t, 4, 128), jnp.bfloat16) for x in ks)
cfg = with_overrides(tuned(128, causal, t), over) if over else None
win = (255, 0) if causal else (200, 100)
f = lambda q, k, v: pallas_flash.flash_attention(q, k, v, is_causal=causal, local_window_size=win, implementation="mosaic", config=cfg)
t0 = time.time(); o = jax.block_until_ready(jax.jit(f)(q, k, v)); print("fwd ok", time.time() - t0, flush=True)
g = jax.jit(lambda *a: jax.vjp(f, *a)[1](do))
t0 = time.time(); lowered = g.lower(q, k, v).compile(); print("bwd compiled", time.time() - t0, flush=True)
t0 = time.time(); r = jax.block_until_ready(lowered(q, k, v)); print("bwd ok", time.time() - t0, flush=True)
ref = jax.vjp(lambda *a: pallas_flash.flash_attention(*a, is_causal=causal, local_window_size=win, implementation="reference"), *(x.astype(jnp.float32) for x in (q, k, v)))[1](do.astype(jnp.float32))
print("err", [float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(r, ref)], flush=True)
