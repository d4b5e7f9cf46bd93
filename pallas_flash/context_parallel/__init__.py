"""Context parallelism: attention over a sequence sharded across the devices of a mesh axis.

Entry point A, `context_parallel_attention`, runs inside the user's `shard_map` on local
shards; entry point B is `flash_attention` itself, which dispatches here when its inputs carry
a sharding that splits the sequence axis (see `sharding`). `context_parallel_explain` says
what runs and why. docs/context_parallel.md describes both, the zig-zag layout and the limits.
"""

from pallas_flash.context_parallel.api import (ContextParallelExplanation,
                                               context_parallel_attention)
from pallas_flash.context_parallel.layout import (contiguous_to_zigzag, from_zigzag, to_zigzag,
                                                  zigzag_to_contiguous)
from pallas_flash.context_parallel.sharding import context_parallel_explain

__all__ = ["ContextParallelExplanation", "context_parallel_attention", "context_parallel_explain",
           "contiguous_to_zigzag", "from_zigzag", "to_zigzag", "zigzag_to_contiguous"]
