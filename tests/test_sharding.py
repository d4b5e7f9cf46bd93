"""Batch- and head-sharded inputs on 4 host CPU devices, Explicit and Auto mesh axes, every CPU
implementation, forward and gradients (sharding_checks.py lists the cases)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import sharding_checks as checks

HERE = pathlib.Path(__file__).resolve().parent


def test_batch_and_head_sharding_on_4_devices():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent),
                                                      os.environ.get("PYTHONPATH")])))
  proc = subprocess.run([sys.executable, str(HERE / "sharding_checks.py")], capture_output=True,
                        text=True, cwd=HERE.parent, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = json.loads(proc.stdout.strip().splitlines()[-1])
  assert set(results) == {case.id for case in checks.CASES}
  failed = {name: why for name, why in results.items() if why is not None}
  assert not failed, "\n".join(f"{name}: {why}" for name, why in failed.items())
