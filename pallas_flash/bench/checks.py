"""The benchmarks' error measure."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# max|x - ref| / max|ref| above which a row is FAIL (outputs and gradients alike).
TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}


@jax.jit
def rel_err(x: jax.Array, ref: jax.Array) -> jax.Array:
  """max|x - ref| / max|ref| in float32 (a scalar array; 1e-30 keeps an all-zero ref finite)."""
  x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
  return jnp.max(jnp.abs(x - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30)
