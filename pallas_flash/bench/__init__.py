"""Benchmarks for pallas_flash: `python -m pallas_flash.bench --help`.

shapes.py (named, tagged shapes), flops.py (FLOP convention), timing.py (what is timed and how),
checks.py (the error measure), memory.py (peak memory
against sequence length), decode.py (--decode), features.py (--features: each feature against
plain attention and cuDNN), __main__.py (the CLI, checks and tables).
See docs/perf.md for how the numbers are produced.
"""

from pallas_flash.bench.flops import attention_flops as attention_flops
from pallas_flash.bench.shapes import SHAPES as SHAPES
from pallas_flash.bench.shapes import ShapeSpec as ShapeSpec
from pallas_flash.bench.shapes import select_shapes as select_shapes

__all__ = ["SHAPES", "ShapeSpec", "attention_flops", "select_shapes"]
