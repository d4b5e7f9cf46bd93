"""Flax integration: an `attention_fn` for Flax's attention layers and a native NNX layer."""

from pallas_flash.flax.attention_fn import flash_attention_fn, make_attention_fn
from pallas_flash.flax.nnx_attention import AttentionFn, FlashMultiHeadAttention, alibi_slopes
from pallas_flash.flax.rotary import apply_rotary, rotary_angles

__all__ = ["AttentionFn", "FlashMultiHeadAttention", "alibi_slopes", "apply_rotary",
           "flash_attention_fn", "make_attention_fn", "rotary_angles"]
