"""Batch- and head-sharded inputs on 4 host CPU devices, Explicit and Auto mesh axes, every CPU
implementation, forward and gradients (sharding_checks.py lists the cases)."""

from __future__ import annotations

import sharding_checks as checks
from context_parallel_checks import assert_all_pass_in_subprocess


def test_batch_and_head_sharding_on_4_devices():
  assert_all_pass_in_subprocess("sharding_checks.py", checks.CASES)
