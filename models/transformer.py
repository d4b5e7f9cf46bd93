"""A decoder-only byte-level language model: RMSNorm, rotary, SwiGLU, GQA on flash attention.

Packed sequences carry `segment_ids` so documents never attend to each other, and `positions`
that restart at every document so each sees the same rotary angles wherever it was packed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_flash
from models.config import ModelConfig
from pallas_flash.flax import AttentionFn, FlashMultiHeadAttention

_init = nnx.initializers.normal(stddev=0.02)


class SwiGLU(nnx.Module):
  """out = W_down (silu(W_gate x) * W_up x), no biases."""

  def __init__(self, d_model: int, hidden: int, *, dtype, rngs: nnx.Rngs):
    linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype,  # noqa: E731
                                     kernel_init=_init, rngs=rngs)
    self.gate, self.up, self.down = linear(d_model, hidden), linear(d_model, hidden), \
        linear(hidden, d_model)

  def __call__(self, x: jax.Array) -> jax.Array:
    """[B, T, d_model] -> [B, T, d_model]."""
    return self.down(nnx.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, config: ModelConfig, attention_fn: AttentionFn | None, *, rngs: nnx.Rngs):
    dtype = config.compute_dtype
    self.attn_norm = nnx.RMSNorm(config.d_model, dtype=dtype, rngs=rngs)
    self.attn = FlashMultiHeadAttention(
        config.n_heads, config.d_model, num_kv_heads=config.n_kv_heads, is_causal=True,
        rope_theta=config.rope_theta, use_bias=False, dtype=dtype, kernel_init=_init,
        attention_fn=attention_fn, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(config.d_model, dtype=dtype, rngs=rngs)
    self.mlp = SwiGLU(config.d_model, config.hidden_dim, dtype=dtype, rngs=rngs)

  def __call__(self, x, segment_ids, positions, decode: bool = False):
    """x [B, T, d_model] (float32 residual stream); segment_ids, positions [B, T] or None;
    decode: attend through the layer's KV cache (FlashMultiHeadAttention.init_cache)."""
    h = self.attn(self.attn_norm(x), segment_ids=segment_ids, positions=positions,
                  decode=decode)
    x = x + h.astype(x.dtype)
    return x + self.mlp(self.mlp_norm(x)).astype(x.dtype)


def _call_block(block: Block, x, segment_ids, positions):
  return block(x, segment_ids, positions)


def _cudnn_attention_forward(prim, *_, **__) -> bool:
  """jax.nn's cuDNN forward primitive, whose outputs are o and the softmax statistics."""
  return prim.name == "dot_product_attention_fwd_wrapper"


# A jax.checkpoint policy: save the attention forward's outputs, recompute everything else. The
# backward of a rematerialised block then reruns its projections, norms and MLP but not the
# attention forward, the most expensive part of a block at long context, since the attention
# backward needs only o and the softmax statistics besides q, k, v. Ours names them
# (pallas_flash.CHECKPOINT_NAME, any implementation); jax.nn's cuDNN path is matched by its
# primitive; the materialising XLA baseline has neither and is recomputed whole.
keep_attention_outputs = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.save_only_these_names(pallas_flash.CHECKPOINT_NAME),
    _cudnn_attention_forward)


# Recomputes a block in the backward pass instead of storing its activations: at 128K tokens
# a block's activations are tens of GB, its input only T * d_model floats.
_call_block_remat = nnx.remat(_call_block)
_call_block_remat_keep_attention = nnx.remat(_call_block, policy=keep_attention_outputs)


class Transformer(nnx.Module):
  """tokens [B, T] int -> logits [B, T, vocab] float32."""

  def __init__(self, config: ModelConfig, *, attention_fn: AttentionFn | None = None,
               rngs: nnx.Rngs):
    """Builds the model; `attention_fn` (see models.attention) defaults to pallas_flash's."""
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.d_model, embedding_init=_init, rngs=rngs)
    self.blocks = nnx.List([Block(config, attention_fn, rngs=rngs)
                            for _ in range(config.n_layers)])
    self.final_norm = nnx.RMSNorm(config.d_model, dtype=config.compute_dtype, rngs=rngs)
    self.lm_head = None if config.tie_embeddings else nnx.Linear(
        config.d_model, config.vocab_size, use_bias=False, dtype=config.compute_dtype,
        kernel_init=_init, rngs=rngs)

  def init_cache(self, batch_size: int, max_length: int, *, page_size: int | None = None,
                 dtype=None) -> None:
    """Empty KV caches in every block for generation (`models.generate`): contiguous, or paged
    with `page_size` (see FlashMultiHeadAttention.init_cache), in `dtype`: the compute dtype
    by default, or jnp.float8_e4m3fn (FP8 caches, descales 1.0)."""
    for block in self.blocks:
      block.attn.init_cache(batch_size, max_length, dtype=dtype or self.config.compute_dtype,
                            page_size=page_size)

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None, *, decode: bool = False) -> jax.Array:
    """Next-token logits.

    Args:
      tokens: [B, T] int32 bytes.
      segment_ids: [B, T] int32 document ids of packed sequences, or None (one document).
      positions: [B, T] int32 position within each document; default arange(T).
      decode: append the T tokens to the KV caches (`init_cache`) and attend over them: the
        prompt once, then one token per step (no segment ids or positions then).

    Returns:
      [B, T, vocab_size] float32 logits (the softmax runs in float32 whatever the compute dtype).
    """
    x = self.embed(tokens).astype(jnp.float32)  # [B, T, d_model]
    if decode:
      for block in self.blocks:
        x = block(x, segment_ids, positions, decode=True)
      return self._logits(x)
    call = _call_block
    if self.config.remat:
      call = (_call_block_remat_keep_attention if self.config.remat_keeps_attention
              else _call_block_remat)
    for block in self.blocks:
      x = call(block, x, segment_ids, positions)
    return self._logits(x)

  def _logits(self, x: jax.Array) -> jax.Array:
    """[B, T, d_model] residual stream -> [B, T, vocab] float32 logits."""
    x = self.final_norm(x)
    if self.lm_head is None:
      logits = self.embed.attend(x.astype(self.config.compute_dtype))
    else:
      logits = self.lm_head(x)
    return logits.astype(jnp.float32)
