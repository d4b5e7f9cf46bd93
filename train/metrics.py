"""Metrics: JSONL logging, model FLOP utilisation, and the loss-curve PNG."""

from __future__ import annotations

import json
import pathlib
import time

import jax

# Dense bf16 peak FLOP/s from the vendors' spec sheets (the MFU denominator).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12}


def peak_flops(device: jax.Device) -> float | None:
  """Per-device bf16 peak, or None where MFU means nothing (CPUs, unknown GPUs)."""
  for name, flops in PEAK_FLOPS.items():
    if name in device.device_kind:
      return flops
  return None


def peak_memory_bytes(device: jax.Device) -> int | None:
  """Peak bytes in use on `device` since the process started (None where not tracked)."""
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return (stats or {}).get("peak_bytes_in_use")


class MetricsLog:
  """Appends one JSON object per line to out_dir/metrics.jsonl.

  A new run starts the file afresh. `resume_at=N` (continuing from checkpoint N) keeps what
  checkpoint N holds: the train records of steps < N (record k is step k's update, which
  checkpoint k + 1 is the first to contain) and the other records at steps <= N; "time" then
  continues from the last record kept, so it counts training time across interruptions.
  """

  def __init__(self, out_dir: str | pathlib.Path, *, resume_at: int | None = None):
    self.path = pathlib.Path(out_dir) / "metrics.jsonl"
    self.path.parent.mkdir(parents=True, exist_ok=True)
    kept = []
    if resume_at is not None and self.path.exists():
      kept = [r for r in read_jsonl(self.path) if _held_by_checkpoint(r, resume_at)]
    self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    self.start = time.time() - (kept[-1].get("time", 0.0) if kept else 0.0)

  def write(self, record: dict) -> None:
    record = {"time": round(time.time() - self.start, 3), **record}
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")


def _held_by_checkpoint(record: dict, step: int) -> bool:
  """Whether checkpoint `step`'s state already contains what `record` reports."""
  if record.get("kind") == "train":
    return record["step"] < step
  return record.get("step", 0) <= step


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
  """The records of a JSONL file; a last line without its newline (a run killed while writing
  it) is not a record."""
  lines = pathlib.Path(path).read_text().split("\n")[:-1]
  return [json.loads(line) for line in lines if line.strip()]


def plot_losses(jsonl: str | pathlib.Path, png: str | pathlib.Path, title: str = "") -> None:
  """Training loss and validation loss against step (bits per byte), saved as a PNG."""
  import matplotlib

  matplotlib.use("Agg")  # no display on servers
  import matplotlib.pyplot as plt

  records = read_jsonl(jsonl)
  train = [(r["step"], r["loss_bpb"]) for r in records if r.get("kind") == "train"]
  val = [(r["step"], r["val_bpb"]) for r in records if r.get("kind") == "eval"]
  fig, ax = plt.subplots(figsize=(7, 4))
  if train:
    ax.plot(*zip(*train), label="train", lw=1)
  if val:
    ax.plot(*zip(*val), "o-", label="validation")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (bits per byte)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(png, dpi=120)
  plt.close(fig)
