"""FlashAttention kernels through Pallas' Triton lowering (Ampere and newer; interpretable)."""

from pallas_flash.call import CallInfo
from pallas_flash.triton.backward import backward
from pallas_flash.triton.common import (SUPPORTED_FEATURES, call_config, fitted_config,
                                        unsupported_reason)
from pallas_flash.triton.config import TritonConfig
from pallas_flash.triton.forward import forward

CONFIG_TYPE = TritonConfig


def default_config(call: CallInfo) -> TritonConfig:
  """The config `call` runs with (common.fitted_config)."""
  return fitted_config(call)


__all__ = ["CONFIG_TYPE", "SUPPORTED_FEATURES", "TritonConfig", "backward", "call_config",
           "default_config", "forward", "unsupported_reason"]
