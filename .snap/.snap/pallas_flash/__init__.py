"""pallas_flash: exact, IO-aware FlashAttention for JAX as Pallas GPU kernels."""

from pallas_flash import block_sparse, dropout, masks
from pallas_flash.api import CHECKPOINT_NAME, IMPLEMENTATIONS, Explanation, explain, flash_attention
from pallas_flash.block_sparse import (BlockMask, CausalMask, LocalMask, PrefixLMMask,
                                       SegmentMask)
from pallas_flash.flax import FlashMultiHeadAttention, flash_attention_fn, make_attention_fn
from pallas_flash.mosaic_gpu import MosaicConfig
from pallas_flash.reference import attention_reference
from pallas_flash.triton import TritonConfig
from pallas_flash.xla import XlaConfig

__all__ = ["CHECKPOINT_NAME", "IMPLEMENTATIONS", "BlockMask", "CausalMask", "Explanation",
           "FlashMultiHeadAttention", "LocalMask", "MosaicConfig", "PrefixLMMask", "SegmentMask",
           "TritonConfig", "XlaConfig",
           "attention_reference", "block_sparse", "dropout", "explain", "flash_attention",
           "flash_attention_fn", "make_attention_fn", "masks"]
