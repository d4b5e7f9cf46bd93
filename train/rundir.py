"""The run directory (--out-dir): which files a run owns there, and what --resume may change.

A run directory holds one run: run.json (the run's id and the config it runs with),
metrics.jsonl, loss.png and checkpoints/<step>/, each checkpoint tagged with the run id. A new
run refuses a directory that holds another run unless --overwrite deletes that run first, so
the checkpoints and logs of two runs never mix. --resume compares run.json's config with its
own: a different model stops it before anything compiles; every other difference is printed
with what it changes, and run.json then records the config the resumed run uses.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import uuid

from train import metrics as metrics_lib
from train.config import TrainConfig

RUN_FILES = ("run.json", "metrics.jsonl", "loss.png", "checkpoints")
# ModelConfig fields that change how the model computes, not what its parameters mean.
COMPUTE_ONLY_FIELDS = ("dtype", "remat", "remat_keeps_attention")
# Where the run is and how it starts, not what it trains.
_NOT_COMPARED = ("out_dir", "resume", "overwrite", "init_from")
# What a changed flag does to a resumed run, from the checkpoint's step on.
_SCHEDULE = "the learning rate differs from the saved run's"
_DATA = "the batches differ from the saved run's"
_COMPUTE = "the model computes differently (same parameters), so rounding differs"
_EFFECTS = {
    "seed": "batches are drawn with the new seed (the parameters and optimizer state are the "
            "checkpoint's)",
    "steps": "the run ends at the new step count and the cosine decay stretches to it, so "
             + _SCHEDULE,
    "lr": _SCHEDULE, "warmup_steps": _SCHEDULE,
    "task": _DATA, "seq_len": _DATA, "batch_size": _DATA, "grad_accum": _DATA,
    "corpus_mb": _DATA, "num_pairs": _DATA, "segment_ids": _DATA,
    "dtype": _COMPUTE, "attention": _COMPUTE, "implementation": _COMPUTE,
}


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


def saved_config(run_dir: str | pathlib.Path) -> dict | None:
  """The config a run in run_dir last ran with: run.json's, else (runs written before run.json
  existed) the last `config` record of its metrics.jsonl; None if neither exists."""
  info = read(run_dir)
  if info is not None:
    return info["config"]
  log = pathlib.Path(run_dir) / "metrics.jsonl"
  records = metrics_lib.read_jsonl(log) if log.exists() else []
  return next((r["config"] for r in reversed(records) if r.get("kind") == "config"), None)


def _flat(config: dict) -> dict:
  """Top-level and model fields in one dict, keyed by their own names (no name is shared)."""
  return {**{k: v for k, v in config.items() if k != "model"}, **config.get("model", {})}


def model_differences(saved: dict, cfg: TrainConfig) -> list[tuple[str, object, object]]:
  """(field, saved value, cfg's value) for each model field that changes what parameters mean
  (fields the saved config predates are not compared)."""
  was = saved.get("model", {})
  return [(k, was[k], v) for k, v in config_json(cfg)["model"].items()
          if k not in COMPUTE_ONLY_FIELDS and k in was and was[k] != v]


def check_out_dir(cfg: TrainConfig) -> None:
  """Fails before compiling where cfg would mix two runs in out_dir or resume another model."""
  found = [] if cfg.resume else previous_run(cfg.out_dir)
  if found and not cfg.overwrite:
    raise SystemExit(
        f"--out-dir {cfg.out_dir} already holds a run ({', '.join(found)}). Pass --resume to "
        "continue it, --overwrite to delete it and start this run there, or choose another "
        "--out-dir.")
  saved = saved_config(cfg.out_dir) if cfg.resume else None
  diffs = [] if saved is None else model_differences(saved, cfg)
  if diffs:
    raise SystemExit(
        f"--resume: the run in {cfg.out_dir} trains a different model; pass its model flags "
        "(--preset, --d-model, ...), or start a new run with --overwrite or another "
        "--out-dir:\n  " + "\n  ".join(f"{k}: {a!r} saved, {b!r} now" for k, a, b in diffs))


def resume_changes(saved: dict | None, cfg: TrainConfig, step: int) -> list[str]:
  """One line per field where cfg differs from the saved run's config, with its effect."""
  if saved is None:
    return []
  old, new = _flat(saved), _flat(config_json(cfg))
  lines = []
  for k in sorted(old.keys() & new.keys()):
    if k in _NOT_COMPARED or old[k] == new[k]:
      continue
    effect = _EFFECTS.get(k)
    lines.append(f"{k}: {old[k]!r} -> {new[k]!r}"
                 + (f"; from step {step} on, {effect}" if effect else ""))
  return lines
