"""Shared pytest set-up: GPU tests skip themselves on machines without an NVIDIA GPU, and the
Mosaic GPU interpreter gets the XLA flag without which it can deadlock (sm90/common.py says why)."""

import os
import shutil
import tempfile

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

# One persistent compilation cache for the run, every xdist worker's (they inherit the
# controller's environment): tests compile many identical programs (a shape's reference, one
# kernel under several checks). Cold at the start, it took 14-16 % off test_features and off
# the flax, decode and lowering tests, 8 % off the routine run's test time (2026-12-07).
# Programs with host callbacks (the interpreters') are never cached: jax compiles those anew.
_CACHE_ENV = "PALLAS_FLASH_TEST_JAX_CACHE"
_own_cache = _CACHE_ENV not in os.environ
if _own_cache:
  os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="pallas_flash_jax_cache_")
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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


def pytest_unconfigure(config):
  del config
  if _own_cache and "PYTEST_XDIST_WORKER" not in os.environ:
    shutil.rmtree(os.environ[_CACHE_ENV], ignore_errors=True)
