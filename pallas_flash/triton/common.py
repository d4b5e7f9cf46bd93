"""Pieces shared by the Triton forward and backward kernels and their wrappers."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

from pallas_flash import _blocking
from pallas_flash.params import AttentionParams, CallInfo
from pallas_flash.triton.config import TritonConfig, default_config

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelParams:
  """Static facts a kernel body needs besides its refs."""

  scale: float
  is_causal: bool
  has_segments: bool
  kv_len: int  # true key length; keys at or past it are padding and are masked
  block_q: int
  block_kv: int
  num_kv_blocks: int
  num_q_blocks: int
  group_size: int

  @property
  def scale_log2(self) -> float:
    """softmax scale with log2(e) folded in, so exp(x * scale) == exp2(x * scale_log2)."""
    return self.scale * LOG2E

  @property
  def kv_tail(self) -> bool:
    return self.kv_len % self.block_kv != 0


def unsupported_reason(call: CallInfo, *, interpret: bool) -> str | None:
  if call.head_dim > MAX_HEAD_DIM:
    return f"head_dim {call.head_dim} > {MAX_HEAD_DIM} is not supported by the Triton kernels"
  if interpret:
    return None
  if call.platform != "gpu":
    return f"needs an NVIDIA GPU (platform is {call.platform!r}); 'interpret' runs it anywhere"
  if call.compute_capability is not None and call.compute_capability < (8, 0):
    return f"needs compute capability >= 8.0 (Ampere), this GPU is {call.compute_capability}"
  return None


def padded_head_dim(d: int) -> int:
  return max(16, pl_next_pow2(d))


def pl_next_pow2(n: int) -> int:
  return 1 << (n - 1).bit_length()


def fit_block(block: int, n: int) -> int:
  """Shrinks a block to the (power-of-two) sequence length; Triton tiles need >= 16 rows."""
  return max(16, min(block, pl_next_pow2(n)))


def resolve_config(q: jax.Array, params: AttentionParams, config: TritonConfig | None):
  """The config to run with, blocks shrunk to fit short sequences."""
  return config or default_config(padded_head_dim(q.shape[-1]), params.is_causal, q.dtype)


def pad_inputs(q, k, v, q_seg, kv_seg, *, q_multiple: int, kv_multiple: int):
  """Pads sequences to block multiples and the head dim to a power of two (zeros change no dot)."""
  t, s, d = q.shape[1], k.shape[1], q.shape[3]
  t_pad, s_pad, d_pad = (_blocking.round_up(t, q_multiple), _blocking.round_up(s, kv_multiple),
                         padded_head_dim(d))
  q = _blocking.pad_axis(_blocking.pad_axis(q, 1, t_pad), 3, d_pad)
  k = _blocking.pad_axis(_blocking.pad_axis(k, 1, s_pad), 3, d_pad)
  v = _blocking.pad_axis(_blocking.pad_axis(v, 1, s_pad), 3, d_pad)
  q_seg, kv_seg = _blocking.pad_segments(q_seg, kv_seg, t_pad, s_pad)
  return q, k, v, q_seg, kv_seg


def dot(a, b, *, trans_b: bool = False):
  """a @ b (or a @ b.T) with float32 accumulation; float32 inputs get full precision, not tf32."""
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return pltriton.dot(a, b, trans_b=trans_b, precision=precision)


def block_mask(q_pos, kv_pos, q_seg, kv_seg, p: KernelParams):
  """[len(q_pos), len(kv_pos)] bool: which scores of a block pair are visible.

  Args:
    q_pos, kv_pos: int32 positions of the block's rows / columns.
    q_seg, kv_seg: their segment ids (ignored unless p.has_segments).
  """
  mask = kv_pos[None, :] < p.kv_len
  if p.is_causal:
    mask = mask & (q_pos[:, None] >= kv_pos[None, :])
  if p.has_segments:
    mask = mask & (q_seg[:, None] == kv_seg[None, :])
  return mask


def causal_kv_limit(q_block, p: KernelParams):
  """Key blocks [0, limit) that query block `q_block` may see."""
  if not p.is_causal:
    return p.num_kv_blocks
  return jnp.minimum(p.num_kv_blocks, lax.div((q_block + 1) * p.block_q + p.block_kv - 1,
                                              p.block_kv))


def unmasked_kv_limit(q_block, p: KernelParams):
  """Key blocks [0, limit) that need no element mask for query block `q_block`.

  Only blocks wholly below the causal diagonal, before the padded tail and without segment ids
  qualify; the remaining visible blocks take the masked path.
  """
  if p.has_segments:
    return 0
  full = p.num_kv_blocks - (1 if p.kv_tail else 0)
  if p.is_causal:
    # Block j is wholly visible iff its last key (j + 1) * bk - 1 <= the first row q_block * bq.
    return jnp.minimum(full, lax.div(q_block * p.block_q + 1, p.block_kv))
  return full
