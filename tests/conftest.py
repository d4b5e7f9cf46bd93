"""Shared pytest set-up: GPU tests skip themselves on machines without an NVIDIA GPU."""

import jax
import pytest


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
