"""Named, tagged benchmark shapes (layout [B, T, H, D], self-attention so S = T; K = H unless
a shape sets num_kv_heads).

Tags:
  anchors  the four 16K-token shapes of shared/ANCHORS.md (the default)
  long     1 x 32768 x 16 x 128 (the 32K row of ANCHORS.md)
  quick    two anchors (seq 4K, head dim 128 and 64) for a fast look
  short    16 x 1024 x 16 x 64 (head dim 64 at 1K)
  train    2 x 16384 x 8 x 128 with 4 kv heads, the h200-long training preset's attention
  ragged   lengths off the 128-row tile grid (1 x 5000 x 16 x 128, 4 x 1000 x 16 x 128,
           4 x 4000 x 8 x 256)
  cpu      tiny shapes for CPU tests and interpret mode (one length is not a block multiple)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShapeSpec:
  """One benchmark shape: q is [batch, seq_len, num_heads, head_dim], k [batch, seq_len,
  kv_heads, head_dim] (num_kv_heads, 0 meaning num_heads), v [batch, seq_len, kv_heads, Dv],
  do and the output [batch, seq_len, num_heads, Dv] (Dv: value_head_dim, 0 meaning head_dim)."""

  name: str
  batch: int
  seq_len: int
  num_heads: int
  head_dim: int
  tags: frozenset[str] = frozenset()
  num_kv_heads: int = 0
  value_head_dim: int = 0

  @property
  def shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.seq_len, self.num_heads, self.head_dim)

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def kv_shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.seq_len, self.kv_heads, self.head_dim)

  @property
  def dv(self) -> int:
    return self.value_head_dim or self.head_dim

  @property
  def v_shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.seq_len, self.kv_heads, self.dv)

  @property
  def out_shape(self) -> tuple[int, int, int, int]:
    """The output's and do's [B, T, H, Dv]."""
    return (self.batch, self.seq_len, self.num_heads, self.dv)

  @property
  def label(self) -> str:
    gqa = f"/K{self.kv_heads}" if self.kv_heads != self.num_heads else ""
    dv = f"/Dv{self.dv}" if self.dv != self.head_dim else ""
    return "x".join(map(str, self.shape)) + gqa + dv

  def replace(self, **changes) -> ShapeSpec:
    return dataclasses.replace(self, **changes)


def _spec(name: str, b: int, t: int, h: int, d: int, *tags: str, kv_heads: int = 0) -> ShapeSpec:
  return ShapeSpec(name=name, batch=b, seq_len=t, num_heads=h, head_dim=d, tags=frozenset(tags),
                   num_kv_heads=kv_heads)


SHAPES: tuple[ShapeSpec, ...] = (
    _spec("b16_t1k_h16_d128", 16, 1024, 16, 128, "anchors"),
    _spec("b4_t4k_h16_d128", 4, 4096, 16, 128, "anchors", "quick"),
    _spec("b1_t16k_h16_d128", 1, 16384, 16, 128, "anchors"),
    _spec("b4_t4k_h32_d64", 4, 4096, 32, 64, "anchors", "quick"),
    _spec("b1_t32k_h16_d128", 1, 32768, 16, 128, "long"),
    # Head dim 64 at 1K, the shortest calls a model makes.
    _spec("b16_t1k_h16_d64", 16, 1024, 16, 64, "short"),
    # Where the features are measured against plain attention (docs/perf.md).
    _spec("b1_t8k_h16_d128", 1, 8192, 16, 128, "features"),
    # The h200-long preset's attention (train/config.py): the shape the training step runs,
    # where the anchors' B=1, H=16 rows have ranked backward variants differently.
    _spec("b2_t16k_h8_k4_d128", 2, 16384, 8, 128, "train", kv_heads=4),
    # Batch 8: the largest the causal fused backward is the default at (mosaic_gpu.config's
    # FUSED_MAX_BATCH; non-causal, FUSED_NONCAUSAL_MAX_BATCH, 16).
    _spec("b8_t4k_h16_d128", 8, 4096, 16, 128, "batch8"),
    # Head dim 256 (Gemma's), 16K tokens per call like the anchors: the Mosaic forward and
    # mosaic_gpu/sm90/hd256.py's backward kernels.
    _spec("b4_t4k_h8_d256", 4, 4096, 8, 256, "d256"),
    # Lengths off the 128-row tile grid (multiples of 8, which cuDNN takes): 1x5000 once ran at
    # 0.69x cuDNN's forward where every anchor, a multiple of 128, looked fine.
    _spec("b1_t5000_h16_d128", 1, 5000, 16, 128, "ragged"),
    _spec("b4_t1000_h16_d128", 4, 1000, 16, 128, "ragged"),
    _spec("b4_t4000_h8_d256", 4, 4000, 8, 256, "ragged"),
    _spec("cpu_t128", 1, 128, 2, 64, "cpu"),
    _spec("cpu_t96", 2, 96, 2, 32, "cpu"),
    _spec("cpu_t80_gqa", 1, 80, 4, 32, "cpu", kv_heads=2),
)
TAGS: frozenset[str] = frozenset().union(*(s.tags for s in SHAPES))

# Memory mode: one causal forward+backward shape whose sequence length doubles.
MEMORY_BATCH, MEMORY_HEADS, MEMORY_HEAD_DIM = 1, 16, 128


def parse_shape(name: str) -> ShapeSpec:
  """"BxTxHxD" or "BxTxHxDxK" (K kv heads; default H) -> the ShapeSpec of that shape."""
  dims = [int(x) for x in name.split("x")]
  if len(dims) not in (4, 5):
    raise ValueError(f"shape {name!r}: expected BxTxHxD or BxTxHxDxK")
  b, t, h, d = dims[:4]
  return ShapeSpec(name=name, batch=b, seq_len=t, num_heads=h, head_dim=d,
                   num_kv_heads=dims[4] if len(dims) == 5 else h)


def _is_shape(word: str) -> bool:
  return word.count("x") in (3, 4) and word.replace("x", "").isdigit()


def select_shapes(selector: str) -> list[ShapeSpec]:
  """Shapes named by a comma list of tags, registry names and BxTxHxD[xK] shapes, registry
  shapes first, in registry order."""
  wanted = {w.strip() for w in selector.split(",") if w.strip()}
  given = [parse_shape(w) for w in sorted(wanted) if _is_shape(w)]
  wanted -= {s.name for s in given}
  names = {s.name for s in SHAPES}
  unknown = wanted - names - TAGS
  if unknown or not (wanted or given):
    raise ValueError(f"Unknown shapes or tags {sorted(unknown)}; tags: {sorted(TAGS)}, "
                     f"names: {sorted(names)}, or BxTxHxD[xK].")
  return [s for s in SHAPES if s.name in wanted or s.tags & wanted] + given


def check_spec(spec: ShapeSpec, *, seq_cap: int, head_cap: int = 2) -> ShapeSpec:
  """The shape on which an implementation is checked against the float32 reference.

  The rule: keep the batch, keep at most `head_cap` heads (whole GQA groups: at least one
  group, and the kv heads they share), cap the sequence at `seq_cap`.
  When the sequence fits under the cap, the benchmarked call itself is checked (its output or
  gradients sliced to the first heads, which are independent of the others); when it does
  not, the implementation is run again on the leading [B, seq_cap, head_cap, D] slice of the
  same inputs. This keeps the materialising reference below B*head_cap*seq_cap^2*4 bytes.
  """
  group = spec.num_heads // spec.kv_heads
  heads = min(spec.num_heads, max(head_cap // group, 1) * group)
  return spec.replace(name=spec.name + "_check", seq_len=min(spec.seq_len, seq_cap),
                      num_heads=heads,
                      num_kv_heads=heads // group if spec.num_kv_heads else 0)


def memory_specs(*, start: int, max_seq: int, heads: int = MEMORY_HEADS,
                 head_dim: int = MEMORY_HEAD_DIM) -> list[ShapeSpec]:
  """[1, T, heads, head_dim] for T = start, 2*start, ... up to max_seq."""
  specs, t = [], start
  while t <= max_seq:
    specs.append(_spec(f"mem_t{t}", MEMORY_BATCH, t, heads, head_dim, "memory"))
    t *= 2
  return specs


def make_inputs(spec: ShapeSpec, dtype, seed: int = 0) -> tuple[jax.Array, ...]:
  """Random normal (q, k, v, do) in `dtype`: q [B, T, H, D], k [B, T, K, D], v [B, T, K, Dv],
  do [B, T, H, Dv]; do is the cotangent."""
  keys = jax.random.split(jax.random.key(seed), 4)
  return tuple(jax.random.normal(k, shape, dtype) for k, shape in
               zip(keys, (spec.shape, spec.kv_shape, spec.v_shape, spec.out_shape)))


def shape_struct(spec: ShapeSpec, dtype) -> jax.ShapeDtypeStruct:
  """q's (and the output's) [B, T, H, D]; `kv_struct` gives k's and v's."""
  return jax.ShapeDtypeStruct(spec.shape, jnp.dtype(dtype))


def kv_struct(spec: ShapeSpec, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(spec.kv_shape, jnp.dtype(dtype))


def arg_structs(spec: ShapeSpec, dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
  """(q, k, v, do) structs, as make_inputs returns them."""
  q, kv = shape_struct(spec, dtype), kv_struct(spec, dtype)
  if spec.dv == spec.head_dim:
    return (q, kv, kv, q)
  dt = jnp.dtype(dtype)
  return (q, kv, jax.ShapeDtypeStruct(spec.v_shape, dt), jax.ShapeDtypeStruct(spec.out_shape, dt))
