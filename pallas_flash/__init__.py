"""pallas_flash: exact, IO-aware FlashAttention for JAX as Pallas GPU kernels.

Needs only jax: the Flax layers are in `pallas_flash.flax`, the benchmark in
`pallas_flash.bench`.
"""

from pallas_flash import dropout, masks
from pallas_flash.api import (CHECKPOINT_NAME, IMPLEMENTATIONS, Explanation, explain,
                              flash_attention, quantized_attention)
from pallas_flash.context_parallel import (ContextParallelExplanation, context_parallel_attention,
                                           context_parallel_explain, from_zigzag, to_zigzag)
from pallas_flash.decode import (DecodeExplanation, FlashSplitConfig, MosaicDecodeConfig,
                                 TritonDecodeConfig, XlaDecodeConfig, decode_attention,
                                 decode_explain, decode_reference)
from pallas_flash.merge import merge_attention_states
from pallas_flash.masks import BlockMask, CausalMask, LocalMask, PrefixLMMask, SegmentMask
from pallas_flash.mosaic_gpu.config import MosaicConfig, MosaicDebug
from pallas_flash.reference import attention_reference
from pallas_flash.triton.config import TritonConfig
from pallas_flash.xla import XlaConfig

__version__ = "0.2.0"

__all__ = ["CHECKPOINT_NAME", "IMPLEMENTATIONS", "BlockMask", "CausalMask",
           "ContextParallelExplanation", "DecodeExplanation", "Explanation", "FlashSplitConfig",
           "LocalMask", "MosaicConfig", "MosaicDebug", "MosaicDecodeConfig", "PrefixLMMask",
           "SegmentMask", "TritonConfig", "TritonDecodeConfig", "XlaConfig", "XlaDecodeConfig",
           "__version__",
           "attention_reference", "context_parallel_attention", "context_parallel_explain",
           "decode_attention", "decode_explain", "decode_reference", "dropout", "explain",
           "flash_attention", "from_zigzag", "masks", "merge_attention_states",
           "quantized_attention", "to_zigzag"]
