"""The run directory (--out-dir): which files a run owns there.

A run directory holds one run: run.json (the run's id and the config it runs with),
metrics.jsonl, loss.png and checkpoints/<step>/, each checkpoint tagged with the run id. A new
run refuses a directory that holds another run unless --overwrite deletes that run first, so
the checkpoints and logs of two runs never mix.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import uuid

from train.config import TrainConfig

RUN_FILES = ("run.json", "metrics.jsonl", "loss.png", "checkpoints")


def config_json(cfg: TrainConfig) -> dict:
  """cfg as the plain JSON dict that run.json and metrics.jsonl record."""
  return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def previous_run(out_dir: str | pathlib.Path) -> list[str]:
  """The files of a run already in out_dir (an empty checkpoints/ does not count)."""
  out = pathlib.Path(out_dir)
  return [name for name in RUN_FILES if (out / name).exists()
          and not (name == "checkpoints" and not any((out / name).iterdir()))]


def clear(out_dir: str | pathlib.Path) -> None:
  """Deletes a previous run's files from out_dir (--overwrite); nothing else there."""
  for name in RUN_FILES:
    path = pathlib.Path(out_dir) / name
    if path.is_dir():
      shutil.rmtree(path)
    elif path.exists():
      path.unlink()


def new_run_id() -> str:
  return uuid.uuid4().hex


def read(out_dir: str | pathlib.Path) -> dict | None:
  """run.json's {"run_id", "config"}, or None where out_dir has none (an older run's)."""
  path = pathlib.Path(out_dir) / "run.json"
  return json.loads(path.read_text()) if path.exists() else None


def write(out_dir: str | pathlib.Path, run_id: str, cfg: TrainConfig) -> None:
  """Records the run's identity and config; replaced whole, so a crash leaves the old or new."""
  path = pathlib.Path(out_dir) / "run.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps({"run_id": run_id, "config": config_json(cfg)}, indent=1) + "\n")
  tmp.replace(path)


def check_out_dir(cfg: TrainConfig) -> None:
  """Fails before compiling where a new run would mix with the run already in out_dir."""
  found = [] if cfg.resume else previous_run(cfg.out_dir)
  if found and not cfg.overwrite:
    raise SystemExit(
        f"--out-dir {cfg.out_dir} already holds a run ({', '.join(found)}). Pass --resume to "
        "continue it, --overwrite to delete it and start this run there, or choose another "
        "--out-dir.")
