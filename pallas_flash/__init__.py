"""pallas_flash: exact, IO-aware FlashAttention for JAX as Pallas GPU kernels."""

from pallas_flash.api import IMPLEMENTATIONS, Explanation, explain, flash_attention
from pallas_flash.xla import XlaConfig

__all__ = ["IMPLEMENTATIONS", "Explanation", "XlaConfig", "explain", "flash_attention"]
