"""Entry point B: `flash_attention` on inputs whose sharding splits the sequence axis (and
`context_parallel_explain`, which explains either entry point).

Detection (`sequence_sharding`) reads the query's sharding:
  * under jit on a mesh with Explicit axes (`jax.sharding.AxisType.Explicit`),
    `jax.typeof(x).sharding.spec` is known while tracing;
  * outside jit, a concrete `jax.Array` carries its `NamedSharding`, whatever the axis types.
Under jit on Auto axes the sharding of a traced value is decided later by the partitioner and is
not visible while tracing, so nothing is detected there: call `context_parallel_attention`
inside shard_map (entry point A), or make the context axis Explicit.

Dispatch (`sharded_attention`) validates the global call (sequence lengths fold into segment
ids here, over global positions), then runs entry point A under `jax.shard_map` with the
inputs' own partition specs: batch and head sharding are kept, the sequence axis becomes the
ring. The inputs are contiguous shards in natural order; a causal call without a window is
moved to the zig-zag layout and back inside the shard_map (two `ppermute`s per array, so that
every device does equal causal work), other calls stay contiguous (a window then needs only the
first ring steps).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_flash import validation
from pallas_flash.context_parallel import layout as layouts
from pallas_flash.context_parallel.api import (ContextParallelExplanation,
                                               context_parallel_attention, decide,
                                               explain_shards)


@dataclasses.dataclass(frozen=True)
class SequenceSharding:
  """How the inputs of a flash_attention call are split: the mesh, the axes holding the
  sequence, and batch-first rank-4 partition specs of q and of k/v."""

  mesh: object  # jax.sharding.Mesh (concrete arrays) or AbstractMesh (traced, explicit axes)
  axes: tuple[str, ...]
  q_spec: P
  kv_spec: P
  traced: bool

  @property
  def axis_name(self):
    return self.axes[0] if len(self.axes) == 1 else self.axes

  @property
  def axis_size(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.axes)


def _names(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _sharding_of(x):
  """(mesh, spec padded to x.ndim, traced) of x's NamedSharding, with only the axes that are
  visible here, or None."""
  if isinstance(x, jax.core.Tracer):
    try:
      sharding = jax.typeof(x).sharding
    except (AttributeError, TypeError):
      return None
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()):
      return None
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
    spec = tuple(tuple(a for a in _names(e) if a in explicit) or None
                 for e in tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec)))
    return mesh, spec, True
  sharding = getattr(x, "sharding", None)  # a jax.Array's, or a ShapeDtypeStruct's
  if not isinstance(sharding, NamedSharding):
    return None
  spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  return sharding.mesh, tuple(_names(e) or None for e in spec), False


def sequence_sharding(query, key, value) -> SequenceSharding | None:
  """How the query's sequence axis is split over mesh axes, or None when it is not (or not
  visibly: see the module docstring). Raises when key/value are split differently."""
  if getattr(query, "ndim", None) not in (3, 4):
    return None
  found = _sharding_of(query)
  if found is None:
    return None
  mesh, q_spec, traced = found
  seq = query.ndim - 3  # [B, T, H, D] or [T, H, D]
  axes = q_spec[seq] or ()
  if not axes or math.prod(mesh.shape[a] for a in axes) == 1:
    return None
  kv = [_sharding_of(x) for x in (key, value)]
  kv_specs = [None if s is None else s[1] for s in kv]
  if (getattr(key, "ndim", None) != query.ndim or kv_specs[0] is None
      or kv_specs[0] != kv_specs[1] or (kv_specs[0][seq] or ()) != axes):
    raise ValueError(
        f"`query` is sharded over {axes} along its sequence axis, so flash_attention runs it "
        f"context-parallel, which needs `key` and `value` split the same way along theirs; got "
        f"specs {kv_specs[0]} and {kv_specs[1]}. Reshard them (jax.sharding.reshard), or "
        "gather the query's sequence axis.")
  if q_spec[-1] is not None or kv_specs[0][-1] is not None:
    raise ValueError("flash_attention cannot split the head_dim axis; reshard it replicated.")
  pad = (None,) if query.ndim == 3 else ()  # specs are batch-first rank 4
  as_spec = lambda s: P(*pad, *(None if e is None else e[0] if len(e) == 1 else e for e in s))
  return SequenceSharding(mesh, axes, as_spec(q_spec), as_spec(kv_specs[0]), traced)


def _layout(info) -> str:
  """Zig-zag balances causal work; a window needs few ring steps when contiguous."""
  p = info.params
  even = info.q_len % 2 == 0 and info.kv_len % 2 == 0
  if p.is_causal and p.local_window is None and info.q_len == info.kv_len and even:
    return "zigzag"
  return "contiguous"


_UNSUPPORTED = ("bias", "mask", "alibi_slopes", "block_mask", "dropout_rng")


def _local_info(info, cp: SequenceSharding):
  return dataclasses.replace(info, q_len=info.q_len // cp.axis_size,
                             kv_len=info.kv_len // cp.axis_size)


def _check(query, key, cp: SequenceSharding, kwargs) -> None:
  used = [n for n in _UNSUPPORTED if kwargs.get(n) is not None]
  if kwargs.get("dropout_rate", 0.0):
    used.append("dropout_rate")
  if used:
    raise NotImplementedError(
        f"The sequence axis of `query` is sharded over {cp.axes}, so flash_attention runs it "
        f"context-parallel, which does not support {', '.join(used)} (they depend on global "
        "positions or dense [T, S] arrays). Gather the sequence axis first.")
  seq = query.ndim - 3
  for name, x in (("query", query), ("key", key)):
    if x.shape[seq] % cp.axis_size:
      raise ValueError(f"The sequence length of `{name}` ({x.shape[seq]}) must divide evenly "
                       f"over the {cp.axis_size} devices of {cp.axes}.")


def sharded_attention(cp: SequenceSharding, query, key, value, bias=None, mask=None, *,
                      return_residuals=False, implementation=None, config=None, **kwargs):
  """flash_attention(query, key, value, ...) for sequence-sharded inputs: entry point A under
  shard_map. Takes flash_attention's arguments."""
  kwargs.update(bias=bias, mask=mask)
  _check(query, key, cp, kwargs)
  for name in _UNSUPPORTED + ("dropout_rate",):
    kwargs.pop(name, None)
  call = validation.canonicalize(query, key, value, **kwargs)
  info = call.info
  layout = _layout(info)
  # Fail before tracing the shard_map, with the global shapes in hand.
  decide(_local_info(info, cp), cp.axis_size, layout=layout, strategy=None,
         implementation=implementation, config=config)
  p = info.params
  b_ax, h_ax = cp.q_spec[0], cp.q_spec[2]
  seq_ax = cp.q_spec[1]
  seg_spec, lse_spec = P(b_ax, seq_ax), P(b_ax, h_ax, seq_ax)
  segs = () if call.q_seg is None else (call.q_seg, call.kv_seg)
  segs = tuple(_place(s, cp, seg_spec) for s in segs)
  zig = layout == "zigzag"

  def local(q, k, v, *segs):
    to = (lambda x, axis=1: layouts.contiguous_to_zigzag(x, cp.axis_name, axis=axis)) if zig \
        else (lambda x, axis=1: x)
    back = (lambda x, axis=1: layouts.zigzag_to_contiguous(x, cp.axis_name, axis=axis)) if zig \
        else (lambda x, axis=1: x)
    qs, ks = (to(s) for s in segs) if segs else (None, None)
    o, lse = context_parallel_attention(
        to(q), to(k), to(v), axis_name=cp.axis_name, scale=p.scale, is_causal=p.is_causal,
        query_segment_ids=qs, key_value_segment_ids=ks, local_window_size=p.local_window,
        logits_soft_cap=p.logits_soft_cap, deterministic=p.deterministic, layout=layout,
        return_residuals=True, implementation=implementation, config=config)
    return back(o), back(lse, axis=2)

  in_specs = (cp.q_spec, cp.kv_spec, cp.kv_spec) + (seg_spec,) * len(segs)
  fn = jax.shard_map(local, mesh=cp.mesh, in_specs=in_specs, out_specs=(cp.q_spec, lse_spec),
                     check_vma=False)
  if not cp.traced:  # concrete arrays outside jit: compile the whole shard_map once
    fn = jax.jit(fn)
  o, lse = fn(call.q, call.k, call.v, *segs)
  if call.unbatched:
    o, lse = o[0], lse[0]
  return (o, lse) if return_residuals else o


def _place(x, cp: SequenceSharding, spec: P):
  """Segment ids (the user's, or built from lengths) placed as the shard_map expects."""
  if cp.traced:
    return jax.sharding.reshard(x, spec)
  return jax.device_put(x, NamedSharding(cp.mesh, spec))


def context_parallel_explain(query, key, value, *, axis_size: int | None = None,
                             **kwargs) -> ContextParallelExplanation:
  """What a context-parallel call runs: strategy and why, the ring's steps and per-device
  programs (skipped steps, kernel calls, load balance), the local backend, bytes sent.

  Two forms, on arrays or jax.ShapeDtypeStructs:
    * local shards and `axis_size` (the arguments of `context_parallel_attention`, without
      axis_name): entry point A;
    * global arrays whose sharding splits the sequence (axis_size None): what
      `flash_attention` runs for them (entry point B, including its layout choice); takes
      `flash_attention`'s keyword arguments.
  """
  if axis_size is None:
    return explain_sharded(query, key, value, **kwargs)
  return explain_shards(query, key, value, axis_size=axis_size, **kwargs)


def explain_sharded(query, key, value, **kwargs):
  """context_parallel_explain for entry point B: global (sharded) inputs."""
  cp = sequence_sharding(query, key, value)
  if cp is None:
    raise ValueError("The query's sequence axis is not sharded (or not visibly: under jit only "
                     "Explicit mesh axes are); pass local shapes and `axis_size` instead.")
  implementation = kwargs.pop("implementation", None)
  config = kwargs.pop("config", None)
  kwargs.pop("return_residuals", None)
  kwargs.pop("sinks", None)  # flash_attention applies them after the plan runs
  info = validation.abstract_call_info(query, key, value, validation.with_defaults(kwargs))
  return decide(_local_info(info, cp), cp.axis_size, layout=_layout(info), strategy=None,
                implementation=implementation, config=config)


# Batch and head splits (no sequence split): each device's shard is a whole attention problem,
# so the call runs per shard under shard_map, with any implementation.

@dataclasses.dataclass(frozen=True)
class BatchHeadSharding:
  """The mesh axes splitting the query's batch and head axes (entries of a PartitionSpec)."""

  mesh: object  # jax.sharding.Mesh (concrete arrays) or AbstractMesh (traced, explicit axes)
  batch: object  # None, an axis name or a tuple of them
  heads: object
  traced: bool


def _entry(names: tuple[str, ...] | None):
  return None if not names else names[0] if len(names) == 1 else names


def batch_head_sharding(query) -> BatchHeadSharding | None:
  """How the query's batch and head axes are split over visible mesh axes (Explicit under jit,
  any on concrete arrays), or None when neither is. Call after `sequence_sharding`."""
  if getattr(query, "ndim", None) not in (3, 4):
    return None
  found = _sharding_of(query)
  if found is None:
    return None
  mesh, spec, traced = found
  b, _, h, d = ((None,) if query.ndim == 3 else ()) + spec
  if d is not None:
    raise ValueError("flash_attention cannot split the head_dim axis; reshard it replicated.")
  size = lambda names: math.prod(mesh.shape[a] for a in names or ())  # noqa: E731
  if size(b) == 1 and size(h) == 1:
    return None
  return BatchHeadSharding(mesh, _entry(b), _entry(h), traced)


def split_attention(flash_attention, split: BatchHeadSharding, query, key, value, bias=None,
                    mask=None, *, return_residuals=False, checked=False, implementation=None,
                    config=None, cp=None, **kwargs):
  """flash_attention(query, key, value, ...) per batch / head shard under shard_map: the
  output is sharded like the query; key, value and the other arrays are resharded to match."""
  del cp
  # Validate the global call first, so errors and checked=True's checks see global shapes.
  sinks = kwargs.pop("sinks", None)
  call = validation.canonicalize(query, key, value, bias=bias, mask=mask, checked=checked,
                                 **kwargs)
  if sinks is not None:
    kwargs["sinks"] = validation.check_sinks(sinks, call.q.shape[2])
  batched = query.ndim == 4
  b_ax = split.batch if batched else None
  kv_h = split.heads if key.shape[-2] > 1 else None  # MQA: the one kv head serves every shard
  shards = math.prod(split.mesh.shape[a] for a in _names(split.heads))
  if kv_h is not None and key.shape[-2] % shards:
    raise ValueError(
        f"The query's heads are split over {shards} devices ({split.heads}), which must also "
        f"split the {key.shape[-2]} heads of `key` and `value` (query head h uses kv head "
        "h // G); shard the heads over a divisor of the kv head count, or repeat the kv heads.")
  lead = (b_ax,) if batched else ()

  def spec_of(name, x):
    if name in ("bias", "mask"):  # right-aligned with [B, H, T, S]; broadcast axes stay whole
      b, h = ((1,) * (4 - x.ndim) + tuple(x.shape))[:2]
      entries = (b_ax if b == query.shape[0] else None,
                 split.heads if h == query.shape[-2] else None, None, None)
      return P(*entries[4 - x.ndim:])
    if name in ("alibi_slopes", "sinks"):  # [H]
      return P(split.heads)
    return P(*lead, *[None] * (x.ndim - len(lead)))  # lengths [B], segment ids [B, T]

  arrays = {n: x for n, x in dict(kwargs, bias=bias, mask=mask).items()
            if hasattr(x, "shape") and hasattr(x, "dtype")}
  statics = {n: x for n, x in kwargs.items() if n not in arrays}
  q_spec = P(*lead, None, split.heads, None)
  kv_spec = P(*lead, None, kv_h, None)
  specs = {n: spec_of(n, x) for n, x in arrays.items()}
  lse_spec = P(*lead, split.heads, None)

  def place(x, spec):
    sharding = NamedSharding(split.mesh, spec)
    return jax.sharding.reshard(x, sharding) if split.traced else jax.device_put(x, sharding)

  def local(q, k, v, arrays):
    return flash_attention(q, k, v, **arrays, **statics, return_residuals=True,
                           implementation=implementation, config=config)

  fn = jax.shard_map(local, mesh=split.mesh, in_specs=(q_spec, kv_spec, kv_spec, specs),
                     out_specs=(q_spec, lse_spec), check_vma=False)
  if not split.traced:  # concrete arrays outside jit: compile the whole shard_map once
    fn = jax.jit(fn)
  o, lse = fn(place(query, q_spec), place(key, kv_spec), place(value, kv_spec),
              {n: place(x, specs[n]) for n, x in arrays.items()})
  return (o, lse) if return_residuals else o
