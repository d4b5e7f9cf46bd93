"""Decode attention against a KV cache: `decode_attention`, `decode_explain`, the reference."""

from pallas_flash.decode.api import (
                                     IMPLEMENTATIONS,
                                     DecodeExplanation,
                                     decode_attention,
                                     decode_explain,
)
from pallas_flash.decode.config import (
                                        FlashSplitConfig,
                                        MosaicDecodeConfig,
                                        TritonDecodeConfig,
                                        XlaDecodeConfig,
)
from pallas_flash.decode.reference import decode_reference

__all__ = ["IMPLEMENTATIONS", "DecodeExplanation", "FlashSplitConfig", "MosaicDecodeConfig",
           "TritonDecodeConfig", "XlaDecodeConfig", "decode_attention", "decode_explain",
           "decode_reference"]
