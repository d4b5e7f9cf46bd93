"""Entry point A: context-parallel attention inside the user's shard_map, and its explanation."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax import lax

from pallas_flash import backends, validation
from pallas_flash.call import CallInfo
from pallas_flash.context_parallel import layout as layouts
from pallas_flash.context_parallel import plan as plans
from pallas_flash.context_parallel.all_gather import all_gather_attention
from pallas_flash.context_parallel.ring import ring_attention_fn

# The optional features context parallelism passes to the local kernels: they depend on the
# logits alone, not on a query's or key's global position or on dense [T, S] arrays.
SUPPORTED_FEATURES = frozenset({"local_window_size", "logits_soft_cap"})


@dataclasses.dataclass(frozen=True)
class ContextParallelExplanation:
  """What `context_parallel_attention` runs for a call, and why.

  Attributes:
    axis_size: devices on the context axis (P).
    layout: token placement, "zigzag" or "contiguous" (pallas_flash.context_parallel.layout).
    strategy: "ring" or "all_gather", and `why` the rule chose it.
    implementation: the local backend every kernel call runs (None: none can), and `reasons`
      why each other one cannot (None: it could).
    ring: the ring's static schedule (steps run, per-device programs), for strategy "ring".
    all_gather: the gathered call's geometry, for strategy "all_gather".
    configs: the backend config of each kernel call: ((KernelCall, config), ...).
    bytes_sent: per device, forward and backward (dK/dV travel in float32), excluding the
      sharding entry point's zigzag relayout.
  """

  axis_size: int
  layout: str
  strategy: str
  why: str
  implementation: str | None
  reasons: dict[str, str | None]
  ring: plans.RingPlan | None = None
  all_gather: plans.AllGatherPlan | None = None
  configs: tuple = ()
  bytes_sent: tuple[int, int] = (0, 0)

  def __str__(self) -> str:
    lines = [(f"context parallel over {self.axis_size} devices, layout {self.layout!r}: "
              f"{self.strategy} ({self.why})"),
             f"  local kernels: {self.implementation!r}",
             (f"  bytes sent per device: forward {self.bytes_sent[0] / 2**20:.2f} MiB, "
              f"backward {self.bytes_sent[1] / 2**20:.2f} MiB")]
    if self.ring is not None:
      ring = self.ring
      lines.append(f"  ring steps run: {list(ring.steps)} of {self.axis_size}; load balance "
                   f"{ring.balance():.1%} (mean work / slowest device, step by step)")
      for i, calls in enumerate(ring.programs):
        users = sorted({(t, r) for t, row in zip(ring.steps, ring.table)
                        for r, p in enumerate(row) if p == i})
        if users:
          body = "; ".join(c.describe() for c in calls) or "nothing"
          lines.append(f"  program {i} ({len(users)} device-steps): {body}")
    if self.all_gather is not None:
      ag = self.all_gather
      lines.append(f"  one call per device: {ag.call.describe()}"
                   + (f" for each of {self.all_gather_chunks()} stacked chunks (K/V windows "
                      f"of {ag.window} keys)" if ag.rotate else ""))
    for name, why in self.reasons.items():
      if name != self.implementation:
        lines.append(f"  {name}: " + ("can run, but a faster implementation applies"
                                      if why is None else why))
    return "\n".join(lines)

  def all_gather_chunks(self) -> int:
    return layouts.chunks_per_device(self.layout) if self.all_gather.rotate else 1


def _check_features(info: CallInfo) -> None:
  if info.value_head_dim != info.head_dim:
    raise NotImplementedError(
        f"context parallelism takes one head dim for query, key and value, got "
        f"{info.head_dim} and a value head dim of {info.value_head_dim}.")
  unsupported = info.params.features - SUPPORTED_FEATURES
  if unsupported:
    raise NotImplementedError(
        f"context parallelism does not support {', '.join(sorted(unsupported))}: they depend "
        "on global positions or dense [T, S] arrays the local kernels do not see. Supported: "
        "causal, segment ids, local_window_size, logits_soft_cap, GQA.")


def _bytes_sent(info: CallInfo, p: int, strategy: str, ring: plans.RingPlan | None):
  block = 2 * info.batch * info.kv_len * info.num_kv_heads * info.head_dim
  seg = 4 * info.batch * info.kv_len if info.params.has_segments else 0
  kv = block * info.dtype.itemsize + seg
  if strategy == "all_gather":
    gathered = (p - 1) * kv
    return gathered, gathered + (p - 1) * block * 4  # reduce-scatter of float32 dK/dV
  hops = max(len(ring.steps) - 1, 0)
  home = 1 if ring.steps and ring.steps[-1] % p else 0
  return hops * kv, hops * kv + (hops + home) * block * 4


def decide(info: CallInfo, axis_size: int, *, layout: str, strategy: str | None,
           implementation: str | None, config) -> ContextParallelExplanation:
  """The plan for local shards described by `info` (canonical [B, T_local, ...])."""
  layouts.check_layout(layout)
  _check_features(info)
  m = layouts.chunks_per_device(layout)
  if info.q_len % m or info.kv_len % m:
    raise ValueError(f"The {layout} layout splits each local shard into {m} equal chunks, but "
                     f"the local lengths are q {info.q_len}, k/v {info.kv_len}.")
  if strategy is None and implementation == "reference":
    strategy, why = "all_gather", "the reference has no per-step backward; it runs gathered"
  else:
    strategy, why = plans.choose_strategy(info, axis_size, strategy)
  ring = gathered = None
  if strategy == "ring":
    ring = plans.ring_plan(info.params, layout, axis_size, info.q_len, info.kv_len)
    calls = list(dict.fromkeys(c for program in ring.programs for c in program))
    infos = [plans.sub_info(info, c) for c in calls]
  else:
    gathered = plans.all_gather_plan(info.params, layout, axis_size, info.q_len, info.kv_len)
    calls = [gathered.call]
    infos = [plans.sub_info(info, gathered.call,
                            batch=info.batch * (m if gathered.rotate else 1))]
  name, reasons = plans.choose_backend(infos, implementation, config, ring=strategy == "ring")
  configs = ()
  if name is not None and reasons[name] is None:
    configs = tuple((c, backends.resolve_config(name, i, config)) for c, i in zip(calls, infos))
  return ContextParallelExplanation(axis_size, layout, strategy, why, name, reasons, ring,
                                    gathered, configs,
                                    _bytes_sent(info, axis_size, strategy, ring))


def _runnable(explanation: ContextParallelExplanation) -> str:
  name = explanation.implementation
  if name is None or explanation.reasons[name] is not None:
    detail = "\n".join(f"  {n}: {r}" for n, r in explanation.reasons.items())
    raise NotImplementedError(f"No implementation can run this context-parallel call "
                              f"({explanation.strategy}):\n{detail}")
  return name


def context_parallel_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    axis_name,
    scale: float | None = None,
    is_causal: bool = False,
    query_segment_ids: jax.Array | None = None,
    key_value_segment_ids: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    deterministic: bool = False,
    layout: layouts.Layout = "zigzag",
    strategy: str | None = None,
    return_residuals: bool = False,
    implementation: str | None = None,
    config: Any = None,
):
  """Exact attention over a sequence sharded on mesh axis `axis_name`; call inside shard_map.

  Each device passes its local shards; masks use global positions, given by `layout`:
  "zigzag" (default): the global sequence is 2P equal chunks and device r holds chunks r and
  2P-1-r, in that order (causal work is then equal on every device; put data in this order
  with `pallas_flash.to_zigzag`); "contiguous": device r holds chunk r of P.

  Args:
    query: local [B, T_local, H, D] (or [T_local, H, D] together with key and value).
    key, value: local [B, S_local, K, D], H % K == 0. K/V move between devices with K heads.
    axis_name: the shard_map mesh axis (or tuple of axes) the sequence is split over.
    scale, is_causal, local_window_size, logits_soft_cap, deterministic: as in
      `flash_attention`, over global positions (causal: global query i sees global keys
      0..i; top-left alignment when the global lengths differ).
    query_segment_ids, key_value_segment_ids: local int32 [B, T_local] / [B, S_local] ids
      (packed documents may cross device boundaries: key ids travel with their K/V). There
      are no sequence lengths here: give padded queries and keys ids that match nothing
      (pallas_flash.call.Q_PAD_SEGMENT / KV_PAD_SEGMENT), as flash_attention does with them.
    layout: "zigzag" or "contiguous", how the global sequence is placed (see above).
    strategy: "ring", "all_gather" or None for the rule in `context_parallel_explain`.
    return_residuals: also return the float32 log-sum-exp [B, H, T_local] over all keys.
    implementation: the local backend ("mosaic", "triton", "interpret", "xla"; "reference"
      only with all-gather), None for the fastest that runs every kernel call.
    config: a backend config for every local kernel call.

  Returns:
    The local output [B, T_local, H, D] (and lse), equal to the rows of unsharded attention
    over the whole sequence. Fully masked queries get zeros and zero gradients.
  """
  call = validation.canonicalize(
      query, key, value, scale=scale, is_causal=is_causal, query_seq_lengths=None,
      key_value_seq_lengths=None, query_segment_ids=query_segment_ids,
      key_value_segment_ids=key_value_segment_ids, local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap, deterministic=deterministic)
  axis_size = lax.axis_size(axis_name)
  explanation = decide(call.info, axis_size, layout=layout, strategy=strategy,
                       implementation=implementation, config=config)
  name = _runnable(explanation)
  args = (call.q, call.k, call.v, call.q_seg, call.kv_seg)
  if explanation.strategy == "ring":
    o, lse = ring_attention_fn(explanation.ring, axis_name, name, explanation.configs)(*args)
  else:
    o, lse = all_gather_attention(*args, axis_name=axis_name, plan=explanation.all_gather,
                                  params=call.info.params, implementation=name,
                                  config=explanation.configs[0][1])
  if call.unbatched:
    o, lse = o[0], lse[0]
  return (o, lse) if return_residuals else o


def explain_shards(query, key, value, *, axis_size: int,
                   **kwargs) -> ContextParallelExplanation:
  """context_parallel_explain for entry point A: local shards and `axis_size`."""
  lengths = [n for n in ("query_seq_lengths", "key_value_seq_lengths") if n in kwargs]
  if lengths:
    raise TypeError(f"context_parallel_attention takes no {lengths[0]}: fold lengths into "
                    "segment ids (see its docstring).")
  layout = kwargs.pop("layout", "zigzag")
  strategy = kwargs.pop("strategy", None)
  implementation = kwargs.pop("implementation", None)
  config = kwargs.pop("config", None)
  kwargs.pop("return_residuals", None)
  kwargs.pop("sinks", None)  # flash_attention applies them after the plan runs
  info = validation.abstract_call_info(query, key, value, validation.with_defaults(kwargs))
  return decide(info, axis_size, layout=layout, strategy=strategy,
                implementation=implementation, config=config)
