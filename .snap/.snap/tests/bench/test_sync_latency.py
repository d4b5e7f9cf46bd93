"""scripts/sync_latency.py on CPU: its rows (per mode, implementation and round) and the
outputs check, with the blockwise XLA implementation against the reference."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sync_latency_rows(tmp_path):
  done = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "sync_latency.py"), "--shape",
       "1,128,2,32", "--impls", "xla,reference", "--calls", "2", "--rounds", "2", "--gap-ms",
       "0", "--out", str(tmp_path)],
      env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT, capture_output=True, text=True,
      timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads((tmp_path / "sync_latency.json").read_text())
  assert [(r["mode"], r["impl"], r["round"]) for r in rows] == [
      ("fwd", "xla", 0), ("fwd", "reference", 0), ("fwd", "reference", 1), ("fwd", "xla", 1),
      ("fwdbwd", "xla", 0), ("fwdbwd", "reference", 0), ("fwdbwd", "reference", 1),
      ("fwdbwd", "xla", 1)]
  for r in rows:
    assert r["err_vs_last"] < 2e-2  # bf16 outputs of two implementations agree
    assert r["steady_ms"] > 0 and r["sync_ms"] > 0 and r["dispatch_ms"] > 0
    assert abs(r["latency_ms"] - (r["sync_ms"] - r["steady_ms"])) < 1e-9
