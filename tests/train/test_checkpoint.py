"""Checkpoints: an interrupted run resumed with --resume continues with the identical losses;
the loop's progress bar, throughput and Ctrl-C handling around them (tests/train/test_cli.py
runs the same through `python -m train`)."""

import dataclasses
import json
import re
import signal
import time
import types

import jax
import pytest

from models import ModelConfig
from train.checkpoint import Checkpointer
from train.config import PRESETS
from train.main import build, make_mesh, run

TINY = dataclasses.replace(
    PRESETS["cpu-demo"], model=ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2),
    seq_len=128, batch_size=2, steps=5, warmup_steps=1, corpus_mb=1.0, eval_every=5,
    eval_batches=1, log_every=1, checkpoint_every=0)


@pytest.mark.slow  # the CLI runs of tests/train/test_cli.py cover it in the routine run
def test_resume_continues_with_identical_losses(tmp_path):
  full = run(dataclasses.replace(TINY, out_dir=str(tmp_path / "full")))
  stopped_dir = str(tmp_path / "stopped")
  # max_minutes=0 stops after the first step, as an interruption would, leaving a checkpoint.
  first = run(dataclasses.replace(TINY, out_dir=stopped_dir, max_minutes=0.0))
  assert sorted(first["train"]) == [0]
  resumed = run(dataclasses.replace(TINY, out_dir=stopped_dir, resume=True))
  assert sorted(resumed["train"]) == [1, 2, 3, 4]
  for step in range(5):  # same data order, same state: bit-identical on one CPU
    loss = first["train"].get(step, resumed["train"].get(step))
    assert loss == full["train"][step], (step, loss, full["train"][step])
  assert resumed["eval"]["val_loss"] == pytest.approx(full["eval"]["val_loss"], rel=1e-6)
  steps = [json.loads(line)["step"] for line in
           (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()
           if json.loads(line)["kind"] == "train"]
  assert steps == list(range(5))  # the log has each step once, across the interruption


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
  with pytest.raises(SystemExit, match="no checkpoint"):
    run(dataclasses.replace(TINY, out_dir=str(tmp_path), resume=True))


def test_resume_never_restores_another_runs_checkpoint(tmp_path):
  model, optimizer = build(TINY, make_mesh(jax.devices()))
  Checkpointer(tmp_path, run_id="first").save(3, model, optimizer)
  with pytest.raises(SystemExit, match="checkpoint 3: written by another run"):
    Checkpointer(tmp_path, run_id="second").restore_newest(model, optimizer)


def test_lagged_logging_records_every_step_once_in_order(tmp_path):
  # log_every 2 logs one step behind the newest (its device work still queued); evaluation and
  # checkpoint steps (6; 4, 8) and the last log everything: every step appears once, in order.
  cfg = dataclasses.replace(TINY, out_dir=str(tmp_path), steps=9, log_every=2, eval_every=6,
                            checkpoint_every=4)
  out = run(cfg)
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train = [r["step"] for r in records if r["kind"] == "train"]
  assert train == list(range(9)) and sorted(out["train"]) == train
  assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 6, 9]
  # step 5 (the 6th) is logged before its evaluation, at the evaluation step
  kinds = [(r["kind"], r["step"]) for r in records if r["kind"] in ("train", "eval")]
  assert kinds.index(("train", 5)) < kinds.index(("eval", 6))
  assert any("tokens_per_s" in r for r in records if r["kind"] == "train")


def test_progress_bar_ends_at_the_step_a_time_limit_stopped_at(tmp_path, capsys):
  run(dataclasses.replace(TINY, out_dir=str(tmp_path), max_minutes=0.0))  # stops after step 1
  shown = re.findall(r"(\d+)/5 \[", capsys.readouterr().err)
  assert shown and shown[-1] == "1", shown


def test_tokens_per_s_leaves_out_checkpoint_time(tmp_path, monkeypatch):
  """A save that takes 1000 s on the loop's clock must not make the next steps look slow."""
  from train import main

  clock = types.SimpleNamespace(offset=0.0)
  monkeypatch.setattr(main, "time", types.SimpleNamespace(
      perf_counter=lambda: time.perf_counter() + clock.offset,
      time=lambda: time.time() + clock.offset))
  save = main.Checkpointer.save

  def slow_save(self, *args):
    save(self, *args)
    clock.offset += 1000.0

  monkeypatch.setattr(main.Checkpointer, "save", slow_save)
  run(dataclasses.replace(TINY, out_dir=str(tmp_path), steps=7, checkpoint_every=2,
                          eval_every=7))
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  rates = {r["step"]: r["tokens_per_s"] for r in records if "tokens_per_s" in r}
  assert {2, 4, 6} <= rates.keys(), rates  # the first steps after each checkpoint
  assert min(rates.values()) > 10, rates  # one step's 256 tokens in under 25 s


def test_first_ctrl_c_asks_to_stop_and_a_second_aborts():
  from train.main import _StopOnCtrlC

  before = signal.getsignal(signal.SIGINT)
  with _StopOnCtrlC() as ctrl_c:
    assert not ctrl_c.requested
    signal.raise_signal(signal.SIGINT)
    assert ctrl_c.requested
    with pytest.raises(KeyboardInterrupt):
      signal.raise_signal(signal.SIGINT)
  assert signal.getsignal(signal.SIGINT) is before
