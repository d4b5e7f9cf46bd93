"""ModelConfig: the sizes of the decoder-only language model."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """A decoder-only transformer (RMSNorm, rotary, SwiGLU, GQA) over bytes.

  Attributes:
    vocab_size: 256 for byte-level text.
    d_model: residual width; n_layers: blocks; n_heads: H query heads; n_kv_heads: K (GQA).
    d_ff: SwiGLU hidden width (default 8/3 * d_model rounded up to a multiple of 64).
    rope_theta: rotary base period (raise it for very long context).
    dtype: compute dtype ("float32" or "bfloat16"); parameters are always float32.
    remat: recompute each block in the backward pass (saves activation memory at long context).
    remat_keeps_attention: with remat, keep the attention kernels' outputs (o and the softmax
      statistics, B·T·H·(D·2 + 4) bytes per layer in bf16) rather than running the attention
      forward a second time in the backward pass (models.transformer.keep_attention_outputs).
    tie_embeddings: share the input embedding with the output projection.
  """

  vocab_size: int = 256
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 2
  d_ff: int | None = None
  rope_theta: float = 10_000.0
  dtype: str = "float32"
  remat: bool = False
  remat_keeps_attention: bool = False
  tie_embeddings: bool = False

  def __post_init__(self):
    if self.d_model % self.n_heads:
      raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}).")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads "
                       f"({self.n_kv_heads}).")
    if (self.d_model // self.n_heads) % 2:
      raise ValueError(f"head_dim ({self.d_model // self.n_heads}) must be even for rotary.")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}.")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def hidden_dim(self) -> int:
    if self.d_ff is not None:
      return self.d_ff
    return -(-(8 * self.d_model // 3) // 64) * 64

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  def num_params(self, *, embedding: bool = True) -> int:
    """Parameter count (biases-free projections, RMSNorm scales included)."""
    d, kv = self.d_model, self.n_kv_heads * self.head_dim
    attn = d * d * 2 + d * kv * 2  # q, out; k, v
    mlp = 3 * d * self.hidden_dim
    per_layer = attn + mlp + 2 * d
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.n_layers * per_layer + d + (emb if embedding else 0)

  def flops_per_token(self, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward), as in PaLM's MFU definition.

    6 per weight (matmuls incl. the output projection) plus attention's two T x S matmuls:
    12 * L * d * T for full attention, halved for causal (remat's recompute is not counted).
    """
    matmul_params = self.num_params(embedding=False) + self.vocab_size * self.d_model
    return 6.0 * matmul_params + 6.0 * self.n_layers * self.d_model * seq_len
