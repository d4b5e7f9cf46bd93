"""Long-context models built on pallas_flash's Flax layer."""

from models.attention import ATTENTION_KINDS, make_attention
from models.config import ModelConfig
from models.generate import generate, sample_logits
from models.transformer import Transformer

__all__ = ["ATTENTION_KINDS", "ModelConfig", "Transformer", "generate", "make_attention",
           "sample_logits"]
