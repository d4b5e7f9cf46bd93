"""Shared pytest set-up: GPU tests skip themselves on machines without an NVIDIA GPU, and the
Mosaic GPU interpreter gets the XLA flag without which it can deadlock (sm90/common.py says why)."""

import os

import jax
import pytest

from pallas_flash.mosaic_gpu.sm90 import common as mosaic_common
from race_detection import race_detector  # noqa: F401  (the fixture, for every test module)

# Before any test computes (XLA reads XLA_FLAGS when its CPU client starts); subprocesses that
# the tests start inherit it. Tests compile hundreds of small CPU programs and run each once or
# twice: LLVM's optimisations cost more than they save (the suite runs ~20 % faster without).
_flags = mosaic_common.with_interpret_xla_flag(os.environ.get("XLA_FLAGS", ""))
if "--xla_backend_optimization_level" not in _flags:
  _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags


def _has_gpu() -> bool:
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  del config
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
