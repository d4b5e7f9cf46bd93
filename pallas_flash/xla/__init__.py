"""Blockwise online-softmax attention in plain jnp/lax: O(N) memory on any platform."""

from pallas_flash.xla.blockwise import (SUPPORTED_FEATURES, XlaConfig, backward, default_config,
                                       forward, unsupported_reason)

CONFIG_TYPE = XlaConfig

__all__ = ["CONFIG_TYPE", "SUPPORTED_FEATURES", "XlaConfig", "backward", "default_config",
           "forward", "unsupported_reason"]
