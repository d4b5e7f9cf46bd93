"""Ring attention: local queries stay, K/V blocks travel around the mesh axis.

Forward (per device, inside shard_map): for each step t of the plan, the block of device
(r - t) mod P is here; the `ppermute` bringing the next block is issued before this step's
kernels run, so XLA's asynchronous collectives overlap the transfer with the compute. Each
kernel call's (out, lse) is merged into float32 running state with `merge_attention_states`,
which is exact: the result equals one attention over all keys.

Backward (exact FlashAttention-2 decomposition): every kernel call runs the backend's backward
with the *global* lse and delta = rowsum(dO·O) - dlse of its query rows, so each step's
dQ, dK, dV are exactly the global gradient's share. dQ accumulates locally; dK/dV accumulate
in float32 buffers that travel with the K/V block, and after the last step go back to the
block's owner in one more `ppermute`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import custom_vjp_primal_tree_values

from pallas_flash import backends
from pallas_flash.call import FeatureArrays, backward_inputs
from pallas_flash.context_parallel.plan import KernelCall, RingPlan
from pallas_flash.merge import merge_attention_states

# jax.ad_checkpoint name of the ring's (out, lse), as pallas_flash.CHECKPOINT_NAME names the
# single-device call's: a remat policy saving that name keeps the ring's forward too.
CHECKPOINT_NAME = "pallas_flash.attention"


def _rows(x, start: int, stop: int, axis: int = 1):
  return None if x is None else lax.slice_in_dim(x, start, stop, axis=axis)


def _shift(tree, axis_name, axis_size: int, hop: int):
  """Device j's `tree` goes to device j + hop (mod P): device r receives that of r - hop."""
  if hop % axis_size == 0 or not jax.tree.leaves(tree):
    return tree
  perm = [(j, (j + hop) % axis_size) for j in range(axis_size)]
  return jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), tree)


def _drive(plan: RingPlan, axis_name, kv, local, travel, step):
  """Runs the plan's steps.

  `step(local, kv, program) -> (local, part)`: one step's compute on the visiting block `kv`;
  `part` is added to `travel`, which moves with the block. Consecutive steps with the same hop
  run as one lax.scan (one compiled step, however many devices). Returns (local, travel) with
  travel still at the last step's device.
  """
  p, steps = plan.axis_size, plan.steps
  r = lax.axis_index(axis_name)
  table = jnp.asarray(plan.table, jnp.int32)  # [len(steps), P]
  kv = _shift(kv, axis_name, p, steps[0])  # the first step run is 0 whenever any key is local

  def compute(local, travel, kv, row):
    local, part = step(local, kv, row[r])
    return local, jax.tree.map(jnp.add, travel, part)

  i, n = 0, len(steps)
  while i < n - 1:
    hop = steps[i + 1] - steps[i]
    j = i
    while j < n - 1 and steps[j + 1] - steps[j] == hop:
      j += 1

    def body(carry, row, hop=hop):
      local, travel, kv = carry
      nxt = _shift(kv, axis_name, p, hop)  # issued first: overlaps this step's kernels
      local, travel = compute(local, travel, kv, row)
      return (local, _shift(travel, axis_name, p, hop), nxt), None

    if j - i == 1:
      (local, travel, kv), _ = body((local, travel, kv), table[i])
    else:
      (local, travel, kv), _ = lax.scan(body, (local, travel, kv), table[i:j])
    i = j
  return compute(local, travel, kv, table[n - 1])


def _switch(plan: RingPlan, program_fn):
  """step(local, kv, index) running plan.programs[index] through lax.switch (directly when the
  plan has one program)."""
  fns = [functools.partial(program_fn, calls) for calls in plan.programs]
  if len(fns) == 1:
    return lambda local, kv, index: fns[0](local, kv)
  return lambda local, kv, index: lax.switch(index, fns, local, kv)


@functools.cache
def ring_attention_fn(plan: RingPlan, axis_name, name: str, configs: tuple):
  """The custom_vjp ring attention (q, k, v, q_seg, kv_seg) -> (o, lse) of local shards.

  configs: ((KernelCall, config), ...): the backend config of each call of the plan.
  """
  backend = backends.load(name)
  config_of = dict(configs)

  def kw(call: KernelCall):
    kwargs = {"params": call.params, "config": config_of[call]}
    if call.params.features:
      kwargs["arrays"] = FeatureArrays()
    return kwargs

  def forward(q, k, v, q_seg, kv_seg):
    b, t, h, _ = q.shape
    o = jnp.zeros_like(q, jnp.float32)
    lse = jnp.full_like(q, -jnp.inf, jnp.float32, shape=(b, h, t))
    if not plan.steps:
      return o.astype(q.dtype), lse

    def program(calls, state, kv):
      o, lse = state
      k, v, ks = kv
      for c in calls:
        (i0, i1), (j0, j1) = c.q_rows, c.kv_rows
        o_c, lse_c = backend.forward(_rows(q, i0, i1), _rows(k, j0, j1), _rows(v, j0, j1),
                                     _rows(q_seg, i0, i1), _rows(ks, j0, j1), **kw(c))
        o_m, lse_m = merge_attention_states([_rows(o, i0, i1), o_c.astype(jnp.float32)],
                                            [_rows(lse, i0, i1, 2), lse_c])
        o = lax.dynamic_update_slice_in_dim(o, o_m, i0, axis=1)
        lse = lax.dynamic_update_slice_in_dim(lse, lse_m, i0, axis=2)
      return (o, lse), ()

    (o, lse), _ = _drive(plan, axis_name, (k, v, kv_seg), (o, lse), (),
                         _switch(plan, program))
    return o.astype(q.dtype), lse

  def backward(res, cotangents):
    q, k, v, q_seg, kv_seg, o, lse = res
    # The global delta (or -dlse for backends computing rowsum(dO·O) themselves from the
    # global O passed to them), as for one device.
    do, delta, lse = backward_inputs(backend.computes_delta, o, lse, cotangents, q.dtype)
    dq = jnp.zeros_like(q, jnp.float32)
    dkv = (jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32))
    if not plan.steps:
      return dq.astype(q.dtype), jnp.zeros_like(k), jnp.zeros_like(v), None, None

    def program(calls, dq, kv):
      k, v, ks = kv
      dk, dv = jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32)
      for c in calls:
        (i0, i1), (j0, j1) = c.q_rows, c.kv_rows
        grads = backend.backward(
            _rows(q, i0, i1), _rows(k, j0, j1), _rows(v, j0, j1), _rows(q_seg, i0, i1),
            _rows(ks, j0, j1), _rows(o, i0, i1), _rows(lse, i0, i1, 2), _rows(do, i0, i1),
            _rows(delta, i0, i1, 2), **kw(c))
        dq_c, dk_c, dv_c = (g.astype(jnp.float32) for g in grads[:3])
        dq = lax.dynamic_update_slice_in_dim(dq, _rows(dq, i0, i1) + dq_c, i0, axis=1)
        dk = lax.dynamic_update_slice_in_dim(dk, _rows(dk, j0, j1) + dk_c, j0, axis=1)
        dv = lax.dynamic_update_slice_in_dim(dv, _rows(dv, j0, j1) + dv_c, j0, axis=1)
      return dq, (dk, dv)

    dq, dkv = _drive(plan, axis_name, (k, v, kv_seg), dq, dkv, _switch(plan, program))
    # The buffers are at the device that held the block at the last step: send them home.
    dk, dv = _shift(dkv, axis_name, plan.axis_size, -plan.steps[-1])
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None

  @jax.custom_vjp
  def ring(q, k, v, q_seg, kv_seg):
    return forward(q, k, v, q_seg, kv_seg)

  def ring_fwd(*primals):
    q, k, v, q_seg, kv_seg = custom_vjp_primal_tree_values(primals)
    o, lse = checkpoint_name(forward(q, k, v, q_seg, kv_seg), CHECKPOINT_NAME)
    return (o, lse), (q, k, v, q_seg, kv_seg, o, lse)

  ring.defvjp(ring_fwd, backward, symbolic_zeros=True)
  return ring
