"""--init-from: a new run starts from another run's parameters, with a fresh optimizer and step."""

import dataclasses
import shutil

import pytest

from models import ModelConfig
from train import metrics as metrics_lib
from train.checkpoint import Checkpointer
from train.config import PRESETS, parse_args
from train.main import run

# Retrieval needs no corpus, so each run is two small compilations.
TINY = dataclasses.replace(
    PRESETS["cpu-demo"], task="retrieval",
    model=ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2),
    seq_len=64, batch_size=2, steps=3, warmup_steps=1, eval_every=3, eval_batches=1,
    log_every=1, checkpoint_every=0)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """A finished 3-step run: (its out_dir, its final eval)."""
  out = tmp_path_factory.mktemp("source")
  return out, run(dataclasses.replace(TINY, out_dir=str(out)))["eval"]


def _evals(out_dir) -> dict[int, dict]:
  return {r["step"]: r for r in metrics_lib.read_jsonl(out_dir / "metrics.jsonl")
          if r["kind"] == "eval"}


def test_init_from_loads_parameters_and_starts_at_step_zero(source, tmp_path):
  src, src_eval = source
  # lr 0 leaves the loaded parameters untouched, so every eval must equal the source's last.
  result = run(dataclasses.replace(TINY, out_dir=str(tmp_path), init_from=str(src), lr=0.0,
                                   steps=2))
  assert sorted(result["train"]) == [0, 1]  # a fresh step counter, not 3, 4
  evals = _evals(tmp_path)
  assert sorted(evals) == [0, 2]
  for step in evals:
    assert evals[step]["val_loss"] == pytest.approx(src_eval["val_loss"], rel=1e-6)
  config = metrics_lib.read_jsonl(tmp_path / "metrics.jsonl")[0]
  assert config["init_from_step"] == 3
  assert Checkpointer(tmp_path).latest_step() == 2


def test_init_from_a_different_model_fails_before_training(source, tmp_path):
  src, _ = source
  wider = dataclasses.replace(TINY.model, d_model=64)
  with pytest.raises(SystemExit, match=r"different model(.|\n)*d_model: 32 there, 64 here"):
    run(dataclasses.replace(TINY, model=wider, out_dir=str(tmp_path), init_from=str(src)))
  # Equal shapes but another rotary period: only the recorded config can tell.
  other_rope = dataclasses.replace(TINY.model, rope_theta=1e6)
  with pytest.raises(SystemExit, match="rope_theta"):
    run(dataclasses.replace(TINY, model=other_rope, out_dir=str(tmp_path), init_from=str(src)))


def test_init_from_checks_shapes_without_the_metrics_log(source, tmp_path):
  src, _ = source
  copy = tmp_path / "copy"
  shutil.copytree(src / "checkpoints", copy / "checkpoints")  # no metrics.jsonl
  deeper = dataclasses.replace(TINY.model, n_layers=3)
  with pytest.raises(SystemExit, match=r"blocks/2/.*missing from the checkpoint"):
    run(dataclasses.replace(TINY, model=deeper, out_dir=str(tmp_path / "new"),
                            init_from=str(copy)))


def test_init_from_without_checkpoint_is_a_clear_error(tmp_path):
  with pytest.raises(SystemExit, match="no checkpoint"):
    run(dataclasses.replace(TINY, out_dir=str(tmp_path / "new"), init_from=str(tmp_path)))


def test_init_from_flags(tmp_path):
  cfg = parse_args(["--task", "retrieval", "--init-from", str(tmp_path / "a"),
                    "--out-dir", str(tmp_path / "b"), "--target-accuracy", "0.9",
                    "--n-heads", "2", "--rope-theta", "1e6"])
  assert (cfg.init_from, cfg.target_accuracy) == (str(tmp_path / "a"), 0.9)
  assert (cfg.model.n_heads, cfg.model.rope_theta) == (2, 1e6)
  with pytest.raises(SystemExit, match="not --out-dir"):
    parse_args(["--init-from", str(tmp_path), "--out-dir", str(tmp_path)])
  with pytest.raises(SystemExit, match="target_accuracy"):
    parse_args(["--target-accuracy", "50"])
