"""All-gather context parallelism: gather K/V once, then one local attention call per device.

For short local sequences (or small K/V under GQA) a ring step's compute cannot hide its
transfer; one all-gather moves the same bytes with one collective, and each device runs a
single kernel call. The local query chunks see K/V windows placed at their global offsets
(`plan.AllGatherPlan`), stacked along the batch axis. Gradients come from autodiff: the
all-gather transposes to a float32 reduce-scatter of dK/dV, and the call is `core.attention`
with its own custom_vjp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash import core
from pallas_flash.call import KV_PAD_SEGMENT, AttentionParams
from pallas_flash.context_parallel import layout as layouts
from pallas_flash.context_parallel.plan import AllGatherPlan


@functools.cache
def _gather_fn(axis_name):
  """[B, n, ...] local shard -> [B, n·P, ...] float32; its transpose reduce-scatters the
  cotangent in float32, so that dK/dV are summed over the devices without rounding."""

  @jax.custom_vjp
  def gather(x):
    return lax.all_gather(x, axis_name, axis=1, tiled=True).astype(jnp.float32)

  def gather_fwd(x):
    return gather(x), jnp.zeros((0,), x.dtype)  # only the dtype is needed

  def gather_bwd(like, ct):
    return (lax.psum_scatter(ct, axis_name, scatter_dimension=1, tiled=True).astype(like.dtype),)

  gather.defvjp(gather_fwd, gather_bwd)
  return gather


def _gather(x, axis_name, plan: AllGatherPlan):
  """[B, n, ...] local shard -> [B, n·P, ...] in global sequence order (float32 for floats)."""
  if jnp.issubdtype(x.dtype, jnp.floating):
    x = _gather_fn(axis_name)(x)
  else:
    x = lax.all_gather(x, axis_name, axis=1, tiled=True)
  return layouts.natural_order(x, plan.layout, plan.axis_size)


def all_gather_attention(q, k, v, q_seg, kv_seg, *, axis_name, plan: AllGatherPlan,
                         params: AttentionParams, implementation: str, config):
  """(o [B, T, H, D], lse [B, H, T]) of local shards in `plan.layout`, inside shard_map."""
  k_all, v_all = _gather(k, axis_name, plan), _gather(v, axis_name, plan)
  ks_all = None if kv_seg is None else _gather(kv_seg, axis_name, plan)
  call = plan.call.params

  def attend(q, k, v, qs, ks):
    # K/V were gathered in float32 so that the gradient sums (windows, devices) stay float32.
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    return core.attention(
        q, k, v, scale=params.scale, is_causal=call.is_causal,
        local_window_size=call.local_window, logits_soft_cap=params.logits_soft_cap,
        query_segment_ids=qs, key_value_segment_ids=ks, deterministic=params.deterministic,
        implementation=implementation, config=config)

  if not plan.rotate:
    return attend(q, k_all, v_all, q_seg, ks_all)
  b, t = q.shape[:2]
  m, cq = t // plan.chunk, plan.chunk
  if ks_all is None:  # segment ids mark the padding of the windows
    ks_all = jnp.zeros(k_all.shape[:2], jnp.int32)
    q_seg = jnp.zeros((b, t), jnp.int32)
  pad = ((0, 0), (plan.left, plan.right_pad))
  k_pad = jnp.pad(k_all, pad + ((0, 0),) * 2)
  v_pad = jnp.pad(v_all, pad + ((0, 0),) * 2)
  ks_pad = jnp.pad(ks_all, pad, constant_values=KV_PAD_SEGMENT)
  chunk_ids = jnp.asarray(layouts.chunk_table(plan.layout, plan.axis_size))[
      lax.axis_index(axis_name)]  # [m] global chunk of each local slot
  # Window of chunk a: global keys [qo - left, qo + cq + right) = padded rows [qo, qo + width).
  window = lambda x, a: lax.dynamic_slice_in_dim(x, chunk_ids[a] * cq, plan.window, axis=1)
  stack = lambda xs: jnp.concatenate(xs, axis=0)
  chunks = lambda x: [lax.slice_in_dim(x, a * cq, (a + 1) * cq, axis=1) for a in range(m)]
  o, lse = attend(stack(chunks(q)), stack([window(k_pad, a) for a in range(m)]),
                  stack([window(v_pad, a) for a in range(m)]), stack(chunks(q_seg)),
                  stack([window(ks_pad, a) for a in range(m)]))
  # [m·B, cq, ...] -> [B, m·cq, ...]
  o = jnp.concatenate(jnp.split(o, m, axis=0), axis=1)
  lse = jnp.concatenate(jnp.split(lse, m, axis=0), axis=2)
  return o, lse
