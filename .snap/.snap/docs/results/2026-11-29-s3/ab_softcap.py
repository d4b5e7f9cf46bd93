"""A/B of the soft-cap backward order: times plain and soft-cap causal 8K (features_bench rows)."""
import sys, json, os
sys.path.insert(0, "scripts")
import jax, jax.numpy as jnp
import features_bench as fb
from pallas_flash.bench.timing import compile_step, time_compiled
tag, modes = sys.argv[1], sys.argv[2].split(",")
cfgs = {c.name: c for c in fb.configs(quick=True)}
rows = []
for name in sys.argv[3].split(","):
  cfg = cfgs[name]
  err = fb.check("triton", cfg) if name != "causal 8K" else None
  for mode in modes:
    q, k, v, do = fb.inputs(cfg.seq_len)
    compiled, _ = compile_step(fb.step("triton", mode, fb.call_kwargs(cfg, cfg.seq_len)),
                               (q, k, v, do))
    t = time_compiled(compiled, (q, k, v, do), iters=5).median_s
    rows.append(dict(variant=tag, name=name, mode=mode, ms=t * 1e3, err=err))
    print(f"{tag:8s} {name:12s} {mode:6s} {t*1e3:7.3f} ms err={err}", flush=True)
with open(os.path.join(os.environ.get("OUT", "."), f"ab_{tag}.json"), "w") as f:
  json.dump(rows, f, indent=1)
