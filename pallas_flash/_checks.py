"""Argument checks that modules below `validation` need too (masks: validation imports it, so
the rule lives here, imported by both)."""

from __future__ import annotations

import numpy as np


def is_int(value) -> bool:
  """A Python or NumPy integer, not a bool (True would pass for 1)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_positive_int(name: str, value, *, none: str | None = None) -> None:
  """ValueError naming `name` unless `value` is an int >= 1, or None where `none` says what
  None means there (e.g. "a contiguous cache")."""
  if value is None and none is not None:
    return
  if not is_int(value) or value < 1:
    alt = f"None ({none}) or " if none is not None else ""
    raise ValueError(f"`{name}` must be {alt}a positive Python int, got {value!r}.")
