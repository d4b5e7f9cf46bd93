"""Shared pytest set-up: GPU tests skip themselves on machines without an NVIDIA GPU, the
Mosaic GPU interpreter gets the XLA flag without which it can deadlock (sm90/common.py says why)
and its host callbacks skip jax's device_put of their arguments; the run's workers share one
persistent compilation cache."""

import inspect
import os
import shutil
import tempfile
import warnings

import jax
import numpy as np
import pytest
from jax._src import callback as jax_callback

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


def _host_io_callback_impl(*args, result_avals, callback, sharding, ordered):
  """jax's io_callback_impl without its device_put of every argument: the callback gets the
  host buffers as numpy arrays, integer scalars as Python ints (what the Mosaic GPU
  interpreter's callbacks, this suite's only io_callback users, accept besides jax arrays)."""
  del result_avals, sharding, ordered
  args = [np.asarray(a) for a in args]
  args = [int(a) if a.ndim == 0 and a.dtype.kind in "iu" else a for a in args]
  return jax.tree.map(np.asarray, callback(*args))


# The Mosaic GPU interpreter runs each of a kernel's memory, barrier and wgmma operations as an
# io_callback, whose jax implementation first device_puts every argument onto the CPU. Without
# that, on the same values, one split-tail case ran in 7 s instead of 16 and test_interpret.py's
# routine cases in 145 s instead of 182 at two workers (2026-12-07). Patched only for the jax
# that the tests pin (pyproject.toml's `test`); tests/mosaic/test_races.py passes with it.
if (jax.__version__ == "0.11.2" and list(inspect.signature(jax_callback.io_callback_impl)
                                         .parameters) == ["args", "result_avals", "callback",
                                                          "sharding", "ordered"]):
  jax_callback.io_callback_impl = _host_io_callback_impl
else:
  warnings.warn(f"tests/conftest.py: io_callback_impl left as jax {jax.__version__} has it (the "
                "patch was written for 0.11.2): the Mosaic interpreter cases run ~2x slower")


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
