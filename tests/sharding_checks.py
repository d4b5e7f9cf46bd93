"""Batch- and head-sharded flash_attention on 4 host CPU devices, against the unsharded reference.

Run by `test_sharding.py` in a fresh subprocess (XLA fixes the host device count when its CPU
client starts):

  python tests/sharding_checks.py   ->  one JSON line {case id: error or null}

Every case jits the forward and the gradients (dq, dk, dv) of a random cotangent on inputs
placed with a NamedSharding, compares them with the reference on the gathered arrays, and
checks that the output is sharded like the query (on Auto axes for the implementations the
partitioner can split: see `auto_splits`).
"""

from __future__ import annotations

import dataclasses
import os
import sys

DEVICES = 4


@dataclasses.dataclass(frozen=True)
class ShardCase:
  axis_types: str  # "explicit" | "auto" | "eager" (concrete arrays, no jit, explicit axes)
  split: str  # "batch" | "heads" | "both" (a 2 x 2 mesh)
  implementation: str
  kv_heads: int = 4
  # "segments", "lengths", "bias", "window", "alibi", "sinks"; "refused": kv heads that cannot split
  features: tuple[str, ...] = ()

  @property
  def id(self) -> str:
    return "_".join([self.axis_types, self.split, self.implementation, f"kv{self.kv_heads}",
                     *self.features])


CASES = [
    # Explicit heads on the Triton kernels: the MQA and features cases below.
    *[ShardCase("explicit", split, impl) for split, impl in
      (("batch", "xla"), ("batch", "interpret"), ("heads", "xla"))],
    ShardCase("explicit", "heads", "reference"),
    ShardCase("auto", "batch", "xla"),
    ShardCase("auto", "heads", "interpret"),
    ShardCase("explicit", "both", "xla", kv_heads=2),
    ShardCase("explicit", "heads", "interpret", kv_heads=1),  # MQA: the kv head replicated
    ShardCase("eager", "batch", "xla"),
    ShardCase("explicit", "batch", "xla", kv_heads=2,
              features=("segments", "lengths", "bias", "window", "alibi")),
    ShardCase("explicit", "heads", "interpret", features=("bias", "alibi", "lengths", "sinks")),
    ShardCase("explicit", "heads", "xla", kv_heads=2, features=("refused",)),
]


def auto_splits(implementation: str) -> bool:
  """Whether the partitioner splits the call on Auto axes: jnp code yes; a pallas_call is a
  custom call it runs whole on every device (replicated output)."""
  return implementation in ("xla", "reference")


def check(case: ShardCase) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import pallas_flash
  from testing import assert_close_to_ref, tolerance

  types = AxisType.Auto if case.axis_types == "auto" else AxisType.Explicit
  if case.split == "both":
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(types, types))
    spec = P("data", None, "model")
  else:
    mesh = jax.make_mesh((4,), ("x",), axis_types=(types,))
    spec = P("x") if case.split == "batch" else P(None, None, "x")
  b, t, h, d = 4, 16, 8, 16
  keys = jax.random.split(jax.random.key(len(case.id)), 8)
  q = jax.random.normal(keys[0], (b, t, h, d))
  k, v = (jax.random.normal(kk, (b, t, case.kv_heads, d)) for kk in keys[1:3])
  do = jax.random.normal(keys[3], q.shape)
  kwargs = {"is_causal": True}
  if "segments" in case.features:
    kwargs["query_segment_ids"] = (jnp.arange(t)[None] >= jnp.array([[3], [8], [0], [12]])
                                   ).astype(jnp.int32)
  if "lengths" in case.features:
    kwargs["key_value_seq_lengths"] = jnp.array([16, 5, 9, 1], jnp.int32)
  if "bias" in case.features:
    kwargs["bias"] = jax.random.normal(keys[4], (b, 1, t, t))
  if "window" in case.features:
    kwargs["local_window_size"] = (5, 0)
  if "alibi" in case.features:
    kwargs["alibi_slopes"] = 2.0 ** -jnp.arange(1, h + 1, dtype=jnp.float32)
  if "sinks" in case.features:
    kwargs["sinks"] = jnp.linspace(-1.0, 2.0, h)

  def loss(q, k, v, impl):
    o = pallas_flash.flash_attention(q, k, v, implementation=impl, **kwargs)
    return jnp.sum(o * do), o

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  if "refused" in case.features:
    try:
      pallas_flash.flash_attention(jax.device_put(q, NamedSharding(mesh, spec)), k, v)
    except ValueError as e:
      assert "heads of `key` and `value`" in str(e), e
      return
    raise AssertionError("kv heads that cannot split like the query's were accepted")
  (_, o_ref), g_ref = jax.jit(grad, static_argnums=3)(q, k, v, "reference")  # op by op is slower
  kv_spec = P(*spec[:2], None) if case.kv_heads == 1 else spec
  placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in ((q, spec), (k, kv_spec),
                                                                     (v, kv_spec))]
  with jax.set_mesh(mesh):
    if case.axis_types == "eager":
      o = pallas_flash.flash_attention(*placed, implementation=case.implementation, **kwargs)
      (_, o), g = grad(*placed, case.implementation)
    else:
      (_, o), g = jax.jit(grad, static_argnums=3)(*placed, case.implementation)
  tol = tolerance(jnp.float32)
  assert_close_to_ref("out", np.asarray(o), o_ref, tol)
  for name, x, ref in zip(("dq", "dk", "dv"), g, g_ref):
    assert_close_to_ref(name, np.asarray(x), ref, 2 * tol)
  if case.axis_types != "auto" or auto_splits(case.implementation):
    want = NamedSharding(mesh, spec)
    assert o.sharding.is_equivalent_to(want, 4), f"out sharded {o.sharding.spec}, not {spec}"
    assert g[0].sharding.is_equivalent_to(want, 4), f"dq sharded {g[0].sharding.spec}"


def main() -> None:
  from context_parallel_checks import run_on_host_devices
  run_on_host_devices(CASES, check, DEVICES)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main()
