"""FlashAttention kernels through Pallas' Triton lowering (Ampere and newer; interpretable)."""

from pallas_flash.triton.backward import backward
from pallas_flash.triton.common import SUPPORTED_FEATURES, unsupported_reason
from pallas_flash.triton.config import TritonConfig
from pallas_flash.triton.forward import forward

CONFIG_TYPE = TritonConfig

__all__ = ["CONFIG_TYPE", "SUPPORTED_FEATURES", "TritonConfig", "backward", "forward",
           "unsupported_reason"]
