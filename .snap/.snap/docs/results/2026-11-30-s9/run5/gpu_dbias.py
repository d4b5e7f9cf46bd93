"""Localises the GPU-only dbias mismatch of test_triton_features_against_reference[...-len-window+softcap+dropout+bias+mask]."""
import sys, time
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp, numpy as np
from features_testing import feature_kwargs, run
from testing import Case, make_inputs
case = Case(batch=1, q_len=1537, kv_len=1000, num_heads=4, num_kv_heads=1, head_dim=96, dtype=jnp.float16, lengths=True)
full = ("window", "softcap", "dropout", "bias", "mask")
seed = len(full)
(q, k, v, do), base = make_inputs(case, seed)
kw_full = feature_kwargs(full, case, seed)
up = [x.astype(jnp.float32) for x in (q, k, v, do)]
for drop in [None, None, "dropout", "window", "mask", "softcap"]:
  kw = dict(base); kw.update({k_: v_ for k_, v_ in kw_full.items()})
  if drop == "dropout": kw.pop("dropout_rate"); kw.pop("dropout_rng")
  if drop == "window": kw.pop("local_window_size")
  if drop == "mask": kw.pop("mask")
  if drop == "softcap": kw.pop("logits_soft_cap")
  (o_ref, _), g_ref = run("reference", *up, **kw)
  (o, _), g = run("triton", q, k, v, do, **kw)
  names = ("o", "dq", "dk", "dv", "dbias")
  line = [f"without {drop}:"]
  for n, x, r in zip(names, (o, *g), (o_ref, *g_ref)):
    x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
    err = np.abs(x - r); den = max(np.abs(r).max(), 1e-6)
    bad = np.argwhere(err > 0.05 * den)
    line.append(f"{n} rel {err.max()/den:.2e} nbad {len(bad)} {bad[:6].tolist()}")
  print(" | ".join(line), flush=True)
