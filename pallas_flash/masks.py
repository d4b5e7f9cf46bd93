"""Block-sparse masks: mask functions and the per-block tables the kernels iterate.

A mask function says which keys each query sees, elementwise:

  CausalMask()              j <= i
  LocalMask(left, right)    i - left <= j <= i + right
  SegmentMask(q_seg, kv_seg)  q_seg[b, i] == kv_seg[b, j]   (packed documents)
  PrefixLMMask(prefix_len)  j < prefix_len[b] or j <= i    (bidirectional prefix, causal rest)

and they combine with `&` and `|`, e.g. `CausalMask() & SegmentMask(ids, ids)`.

`BlockMask.build(mask_fn, q_len=T, kv_len=S, block_q=..., block_kv=...)` evaluates the function
block row by block row (never a [T, S] array) and keeps, for every block pair, whether it is
skipped, partly visible (needs the element mask) or wholly visible. For each query block it lists
the active key blocks, partial ones first (`kv_blocks[b, i, :kv_count[b, i]]`, the first
`kv_num_partial[b, i]` of them partial), and the transposed lists for the dK/dV pass. The
kernels loop over those lists only and evaluate the mask function on partial blocks only.

A BlockMask is a pytree (arrays as leaves, block sizes and the mask function's structure as aux
data): build it once, on the host or under jit, and pass it to every layer.

Mask functions are evaluated on *tiles*: their array leaves hold the values at the tile's
positions (q_seg [bq], kv_seg [bk], prefix_len a scalar), so the same `tile` method runs in
XLA and inside Pallas kernels. Leaves are batched ([B|1, T], [B|1, S], [B|1]).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_flash._checks import check_positive_int

# Kinds of array leaves: indexed by query position, by key position, or one value per batch.
Q, KV, BATCH = "q", "kv", "batch"


class MaskFn:
  """Base of mask functions: `a & b`, `a | b`, and evaluation on tiles."""

  def __and__(self, other: MaskFn) -> MaskFn:
    return AndMask(self, other)

  def __or__(self, other: MaskFn) -> MaskFn:
    return OrMask(self, other)

  def tile(self, q_pos, kv_pos):
    """bool [len(q_pos), len(kv_pos)]; array leaves already hold the tile's values."""
    raise NotImplementedError

  def leaf_kinds(self) -> tuple[str, ...]:
    """Kind (Q, KV or BATCH) of each array leaf, in pytree flattening order."""
    return ()

  def dense(self, q_len: int, kv_len: int) -> jax.Array:
    """bool [B|1, T, S]: the whole mask (for references and tests)."""
    fn = _batched(self, q_len, kv_len)
    return evaluate(fn, jnp.arange(q_len), jnp.arange(kv_len))


def _register(cls, data=(), meta=()):
  return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))


@dataclasses.dataclass(frozen=True)
class CausalMask(MaskFn):
  """Key j visible to query i iff j <= i (top-left aligned, as jax.nn)."""

  def tile(self, q_pos, kv_pos):
    return kv_pos[None, :] <= q_pos[:, None]


@dataclasses.dataclass(frozen=True)
class LocalMask(MaskFn):
  """Key j visible to query i iff i - left <= j <= i + right (jax.nn's local_window_size)."""

  left: int
  right: int

  def tile(self, q_pos, kv_pos):
    d = kv_pos[None, :] - q_pos[:, None]
    return (d >= -self.left) & (d <= self.right)


@dataclasses.dataclass(frozen=True, eq=False)
class SegmentMask(MaskFn):
  """Key j visible to query i iff q_seg[b, i] == kv_seg[b, j]; int [B|1, T] and [B|1, S]."""

  q_seg: jax.Array
  kv_seg: jax.Array

  def tile(self, q_pos, kv_pos):
    return self.q_seg[:, None] == self.kv_seg[None, :]

  def leaf_kinds(self):
    return (Q, KV)


@dataclasses.dataclass(frozen=True, eq=False)
class PrefixLMMask(MaskFn):
  """Prefix-LM: key j visible to query i iff j < prefix_len[b] or j <= i; int [B|1] or int."""

  prefix_len: jax.Array

  def tile(self, q_pos, kv_pos):
    return (kv_pos[None, :] < self.prefix_len) | (kv_pos[None, :] <= q_pos[:, None])

  def leaf_kinds(self):
    return (BATCH,)


@dataclasses.dataclass(frozen=True, eq=False)
class AndMask(MaskFn):
  a: MaskFn
  b: MaskFn

  def tile(self, q_pos, kv_pos):
    return self.a.tile(q_pos, kv_pos) & self.b.tile(q_pos, kv_pos)

  def leaf_kinds(self):
    return self.a.leaf_kinds() + self.b.leaf_kinds()


@dataclasses.dataclass(frozen=True, eq=False)
class OrMask(AndMask):
  def tile(self, q_pos, kv_pos):
    return self.a.tile(q_pos, kv_pos) | self.b.tile(q_pos, kv_pos)


for _cls, _data, _meta in ((CausalMask, (), ()), (LocalMask, (), ("left", "right")),
                           (SegmentMask, ("q_seg", "kv_seg"), ()),
                           (PrefixLMMask, ("prefix_len",), ()), (AndMask, ("a", "b"), ()),
                           (OrMask, ("a", "b"), ())):
  _register(_cls, _data, _meta)


def _batched(fn: MaskFn, q_len: int, kv_len: int, batch: int | None = None) -> MaskFn:
  """`fn` with every leaf int32 and broadcast to a common batch: [B, T], [B, S] or [B]."""
  leaves, treedef = jax.tree_util.tree_flatten(fn)
  kinds = fn.leaf_kinds()
  lengths = {Q: q_len, KV: kv_len}
  shaped = []
  for kind, x in zip(kinds, leaves):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"Mask function arrays must be integers, got {x.dtype}.")
    x = x.astype(jnp.int32)
    want = (lengths[kind],) if kind != BATCH else ()
    if x.ndim == len(want):
      x = x[None]
    if x.ndim != len(want) + 1 or x.shape[1:] != want:
      raise ValueError(f"A {kind}-indexed mask array must have shape [batch{', ' if want else ''}"
                       f"{', '.join(map(str, want))}], got {x.shape}.")
    shaped.append(x)
  b = max([x.shape[0] for x in shaped] + [1 if batch is None else batch])
  for x in shaped:
    if x.shape[0] not in (1, b):
      raise ValueError(f"Mask function arrays disagree on the batch size: {x.shape[0]} vs {b}.")
  return treedef.unflatten([jnp.broadcast_to(x, (b, *x.shape[1:])) for x in shaped])


def node_types(fn: MaskFn) -> tuple[type, ...]:
  """The classes of the nodes of mask function `fn`, depth first (AndMask / OrMask, then their
  operands'): what a kernel that evaluates mask functions itself checks it knows."""
  if isinstance(fn, AndMask):  # OrMask too
    return (type(fn), *node_types(fn.a), *node_types(fn.b))
  return (type(fn),)


def batch_size(fn: MaskFn) -> int:
  leaves = jax.tree_util.tree_leaves(fn)
  return leaves[0].shape[0] if leaves else 1


def tiles(fn: MaskFn, q_start, q_size: int, kv_start, kv_size: int) -> MaskFn:
  """`fn` (batched leaves) with its leaves cut to a tile: [B, q_size], [B, kv_size], [B]."""
  leaves, treedef = jax.tree_util.tree_flatten(fn)
  cut = []
  for kind, x in zip(fn.leaf_kinds(), leaves):
    if kind == Q:
      x = lax.dynamic_slice_in_dim(x, q_start, q_size, axis=1)
    elif kind == KV:
      x = lax.dynamic_slice_in_dim(x, kv_start, kv_size, axis=1)
    cut.append(x)
  return treedef.unflatten(cut)


def evaluate(fn_tiles: MaskFn, q_pos, kv_pos) -> jax.Array:
  """bool [B, len(q_pos), len(kv_pos)] from a function whose leaves are batched tiles."""
  if not jax.tree_util.tree_leaves(fn_tiles):
    return fn_tiles.tile(q_pos, kv_pos)[None]
  return jax.vmap(lambda f: f.tile(q_pos, kv_pos))(fn_tiles)


def pad_leaves(fn: MaskFn, t_pad: int, s_pad: int) -> MaskFn:
  """Batched leaves padded (with their last value) to whole blocks; padded positions are masked
  elsewhere (key tail) or never read back (query rows)."""
  leaves, treedef = jax.tree_util.tree_flatten(fn)
  out = []
  for kind, x in zip(fn.leaf_kinds(), leaves):
    if kind != BATCH:
      n = t_pad if kind == Q else s_pad
      x = jnp.pad(x, ((0, 0), (0, n - x.shape[1])), mode="edge")
    out.append(x)
  return treedef.unflatten(out)


# Block states in BlockMask.block_state.
SKIPPED, PARTIAL, FULL = 0, 1, 2


def block_tables(state):
  """From state [B, n, m]: (blocks [B, n, m] int32, partial first then full, each ascending;
  count [B, n] active; num_partial [B, n])."""
  m = state.shape[-1]
  j = jnp.arange(m, dtype=jnp.int32)
  order = jnp.where(state == PARTIAL, j, jnp.where(state == FULL, m + j, 2 * m + j))
  blocks = (jnp.sort(order, axis=-1) % m).astype(jnp.int32)
  count = (state != SKIPPED).sum(-1).astype(jnp.int32)
  num_partial = (state == PARTIAL).sum(-1).astype(jnp.int32)
  return blocks, count, num_partial


# One program per mask structure and shape: on the host, op by op, each of its operations would
# be compiled on its own (~14 programs, 0.3-0.5 s of compiling on a CPU for a first build).
@functools.partial(jax.jit, static_argnames=("q_len", "kv_len", "block_q", "block_kv", "batch"))
def _tables(mask_fn: MaskFn, *, q_len: int, kv_len: int, block_q: int, block_kv: int,
            batch: int | None):
  """(mask_fn batched, state int8 [B, nq, nk], block_tables(state), block_tables of its
  transpose [B, nk, nq]), one block row at a time."""
  fn = _batched(mask_fn, q_len, kv_len, batch)
  nq, nk = -(-q_len // block_q), -(-kv_len // block_kv)
  padded = pad_leaves(fn, nq * block_q, nk * block_kv)
  kv_pos = jnp.arange(nk * block_kv)

  def row_state(i):  # [B, nk] state of query block i
    q_pos = i * block_q + jnp.arange(block_q)
    vis = evaluate(tiles(padded, i * block_q, block_q, 0, nk * block_kv), q_pos, kv_pos)
    vis = vis & (kv_pos < kv_len)[None, None, :]  # key padding is never visible
    real = (q_pos < q_len)[None, :, None]  # padded query rows do not count
    vis = vis.reshape(vis.shape[0], block_q, nk, block_kv)
    any_ = (vis & real[..., None]).any((1, 3))
    all_ = (vis | ~real[..., None]).all((1, 3))
    return jnp.where(all_, FULL, jnp.where(any_, PARTIAL, SKIPPED)).astype(jnp.int8)

  state = jnp.moveaxis(lax.map(row_state, jnp.arange(nq)), 0, 1)  # [B, nq, nk]
  return fn, state, block_tables(state), block_tables(jnp.swapaxes(state, 1, 2))


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
  """A mask function and its block-sparsity tables at one (block_q, block_kv) tiling.

  Attributes:
    mask_fn: the mask function, leaves batched ([B, T], [B, S], [B]; B may be 1).
    block_state: int8 [B, nq, nk]: SKIPPED (0), PARTIAL (1) or FULL (2).
    kv_blocks, kv_count, kv_num_partial: per query block, the active key blocks
      [B, nq, nk] (padded past the count; partial ones first), how many, how many are partial.
    q_blocks, q_count, q_num_partial: the same per key block over query blocks (dK/dV pass).
    q_len, kv_len, block_q, block_kv: static; nq = cdiv(T, block_q), nk = cdiv(S, block_kv).
  """

  mask_fn: MaskFn
  block_state: jax.Array
  kv_blocks: jax.Array
  kv_count: jax.Array
  kv_num_partial: jax.Array
  q_blocks: jax.Array
  q_count: jax.Array
  q_num_partial: jax.Array
  q_len: int
  kv_len: int
  block_q: int
  block_kv: int

  @classmethod
  def build(cls, mask_fn: MaskFn, *, q_len: int, kv_len: int, block_q: int = 64,
            block_kv: int = 64, batch: int | None = None) -> BlockMask:
    """Evaluates `mask_fn` per block pair. Works on the host or under jit.

    Memory is O(B · block_q · S) per step (one block row at a time, through lax.map), never
    [T, S]. For the Triton backend the blocks must be powers of two >= 16; they are then used
    by the forward and both backward kernels.
    """
    if not isinstance(mask_fn, MaskFn):
      raise TypeError(f"`mask_fn` must be a pallas_flash mask function (CausalMask(), ...), got "
                      f"{type(mask_fn).__name__}.")
    for name, value in (("q_len", q_len), ("kv_len", kv_len), ("block_q", block_q),
                        ("block_kv", block_kv)):
      check_positive_int(name, value)
    fn, state, kv_tables, q_tables = _tables(mask_fn, q_len=int(q_len), kv_len=int(kv_len),
                                             block_q=int(block_q), block_kv=int(block_kv),
                                             batch=batch)
    return cls(fn, state, *kv_tables, *q_tables, q_len=int(q_len), kv_len=int(kv_len),
               block_q=int(block_q), block_kv=int(block_kv))

  @property
  def batch(self) -> int:
    return self.block_state.shape[0]

  @property
  def kv_partial(self) -> jax.Array:
    """bool [B, nq, nk]: kv_blocks[b, i, n] is partial (valid for n < kv_count[b, i])."""
    n = jnp.arange(self.kv_blocks.shape[-1])
    return n[None, None, :] < self.kv_num_partial[..., None]

  @property
  def q_partial(self) -> jax.Array:
    n = jnp.arange(self.q_blocks.shape[-1])
    return n[None, None, :] < self.q_num_partial[..., None]

  def fraction_computed(self) -> float:
    """Fraction of (query block, key block) pairs the kernels compute (needs concrete tables;
    read on the host, so that explain() works under any mesh, an abstract one included)."""
    return float(np.mean(np.asarray(self.block_state) != SKIPPED))

  def dense(self) -> jax.Array:
    """bool [B, T, S], the element mask (materialised: for tests and the reference)."""
    return self.mask_fn.dense(self.q_len, self.kv_len)


jax.tree_util.register_dataclass(
    BlockMask,
    data_fields=["mask_fn", "block_state", "kv_blocks", "kv_count", "kv_num_partial", "q_blocks",
                 "q_count", "q_num_partial"],
    meta_fields=["q_len", "kv_len", "block_q", "block_kv"])
