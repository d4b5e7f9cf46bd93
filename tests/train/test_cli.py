"""`python -m train` as a user runs it: killed, damaged checkpoints, reused --out-dirs, changed
flags on --resume, Ctrl-C.

Every case starts the real command line in a subprocess on CPU with a 12K-parameter model
(~4 ms a step; a run costs its start-up and compilation, ~6 s from a warm compilation cache),
and compares what it leaves in --out-dir with one uninterrupted run of the same flags.
"""

import json
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from train import metrics as metrics_lib

# One worker runs the module: the module-scoped reference run and compilation cache then
# exist once, not once per xdist worker (scripts/test.sh passes --dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 60  # checkpoints every 10 steps, the last two kept: 50 and 60
TINY = ["--seq-len", "64", "--batch-size", "1", "--steps", str(STEPS), "--warmup-steps", "1",
        "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1",
        "--corpus-mb", "0.1", "--eval-every", "30", "--eval-batches", "1", "--log-every", "1",
        "--checkpoint-every", "10"]


def _command(out_dir, *flags) -> list[str]:
  return [sys.executable, "-m", "train", *TINY, "--out-dir", str(out_dir), *flags]


def _train(out_dir, *flags) -> subprocess.CompletedProcess:
  return subprocess.run(_command(out_dir, *flags), cwd=ROOT, capture_output=True, text=True,
                        timeout=300, check=False)


def _start(out_dir, *flags) -> tuple[subprocess.Popen, pathlib.Path]:
  """The run in the background, its output going to a file (a pipe nobody reads can fill up
  and stall it); returns the process and that file."""
  output = pathlib.Path(out_dir).parent / "output.txt"
  with output.open("w") as f:
    proc = subprocess.Popen(_command(out_dir, *flags), cwd=ROOT, stdout=f,
                            stderr=subprocess.STDOUT, text=True)
  return proc, output


def _wait_for(condition, proc: subprocess.Popen, what: str, timeout_s: float = 240) -> None:
  """Polls `condition` every 2 ms while `proc` runs (a tiny step takes ~4 ms)."""
  deadline = time.monotonic() + timeout_s
  while not condition():
    if proc.poll() is not None or time.monotonic() > deadline:
      proc.kill()
      pytest.fail(f"no sign that {what} (run status {proc.wait()})")
    time.sleep(0.002)


def _records(out_dir, kind: str) -> list[dict]:
  return [r for r in metrics_lib.read_jsonl(pathlib.Path(out_dir) / "metrics.jsonl")
          if r["kind"] == kind]


def _steps(out_dir) -> list[int]:
  directory = pathlib.Path(out_dir) / "checkpoints"
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _checkpoint(out_dir, step: int) -> dict:
  path = pathlib.Path(out_dir) / "checkpoints" / str(step) / "default"
  return ocp.StandardCheckpointer().restore(path.absolute())


def _assert_same_run(got, want) -> None:
  """Every train and eval record in order, and the last checkpoint's parameters and optimizer
  state, bit for bit: no record missing or twice, nothing rounded away."""
  def train(d):
    return [(r["step"], r["loss"], r["accuracy"], r["grad_norm"]) for r in _records(d, "train")]

  assert train(got) == train(want)
  evals = lambda d: [(r["step"], r["val_loss"], r["val_accuracy"]) for r in _records(d, "eval")]  # noqa: E731
  assert evals(got) == evals(want)
  times = [r["time"] for r in metrics_lib.read_jsonl(pathlib.Path(got) / "metrics.jsonl")]
  assert times == sorted(times), "time must keep counting across the interruption"
  assert _steps(got)[-1] == _steps(want)[-1] == STEPS
  leaves = jax.tree_util.tree_leaves_with_path
  for (path, a), (_, b) in zip(leaves(_checkpoint(got, STEPS)),
                               leaves(_checkpoint(want, STEPS)), strict=True):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def _no_traceback(proc) -> str:
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  return proc.stdout + proc.stderr


@pytest.fixture(scope="module", autouse=True)
def _shared_compilation_cache(tmp_path_factory):
  """Every run here compiles the same functions: a persistent cache shared by the subprocesses
  halves their start-up (~14 s to ~6 s on 2 busy cores) and runs the same executables."""
  with pytest.MonkeyPatch.context() as env:
    env.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("jax_cache")))
    env.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> pathlib.Path:
  """One uninterrupted run of TINY: its --out-dir."""
  out = tmp_path_factory.mktemp("reference") / "run"
  proc = _train(out)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert _steps(out) == [50, 60]
  return out


@pytest.fixture
def copy_of_reference(reference, tmp_path) -> pathlib.Path:
  shutil.copytree(reference, tmp_path / "run")
  return tmp_path / "run"


def test_killed_during_a_checkpoint_write_resumes_bit_identically(reference, tmp_path):
  out = tmp_path / "run"
  proc, _ = _start(out)
  checkpoints = out / "checkpoints"

  def writing_a_later_checkpoint() -> bool:  # orbax writes <step>.orbax-checkpoint-tmp first
    names = [p.name for p in checkpoints.iterdir()] if checkpoints.is_dir() else []
    return any(n.isdigit() for n in names) and any("tmp" in n for n in names)

  _wait_for(writing_a_later_checkpoint, proc, "a second checkpoint was being written")
  proc.kill()
  proc.wait()
  # The log has the steps since the last finished checkpoint; the resumed run redoes them.
  assert _records(out, "train")[-1]["step"] >= _steps(out)[-1]
  resumed = _train(out, "--resume")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  _assert_same_run(out, reference)


@pytest.mark.parametrize("damage", ["truncated", "no-metadata", "empty"])
def test_resume_skips_a_damaged_latest_checkpoint(copy_of_reference, reference, damage):
  out, latest = copy_of_reference, copy_of_reference / "checkpoints" / str(STEPS)
  if damage == "truncated":
    largest = max((p for p in latest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:100])
  elif damage == "no-metadata":
    (latest / "default" / "_METADATA").unlink()
  else:
    shutil.rmtree(latest)
    latest.mkdir()
  proc = _train(out, "--resume")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"skipped checkpoint {STEPS}: " in _no_traceback(proc)
  assert "resuming at step 50" in proc.stdout
  assert (out / "checkpoints" / f"{STEPS}.skipped").is_dir()  # kept aside, not deleted
  _assert_same_run(out, reference)


def test_resume_with_no_checkpoint_that_restores_is_one_clear_error(copy_of_reference):
  for step in (50, STEPS):
    shutil.rmtree(copy_of_reference / "checkpoints" / str(step) / "default")
  proc = _train(copy_of_reference, "--resume")
  assert proc.returncode == 1
  assert "no checkpoint under" in _no_traceback(proc)
  assert "checkpoint 60: " in proc.stderr and "checkpoint 50: " in proc.stderr


def test_a_new_run_refuses_an_out_dir_that_holds_a_run(copy_of_reference):
  before = (copy_of_reference / "metrics.jsonl").read_text()
  proc = _train(copy_of_reference, "--steps", "30", "--seed", "1")
  assert proc.returncode == 1
  message = _no_traceback(proc)
  assert "already holds a run" in message
  assert "--resume" in message and "--overwrite" in message
  assert (copy_of_reference / "metrics.jsonl").read_text() == before
  assert _steps(copy_of_reference) == [50, 60]


def test_overwrite_replaces_the_run_in_out_dir(copy_of_reference):
  proc = _train(copy_of_reference, "--steps", "12", "--seed", "1", "--overwrite")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert _steps(copy_of_reference) == [10, 12]  # none of the old run's 50 and 60
  assert [r["step"] for r in _records(copy_of_reference, "train")] == list(range(12))
  configs = _records(copy_of_reference, "config")
  assert len(configs) == 1 and configs[0]["config"]["seed"] == 1
  run_json = json.loads((copy_of_reference / "run.json").read_text())
  assert run_json["run_id"] == configs[0]["run_id"] and run_json["config"]["steps"] == 12


def test_resume_with_another_model_names_the_fields(copy_of_reference):
  proc = _train(copy_of_reference, "--resume", "--d-model", "32")
  assert proc.returncode == 1
  assert "d_model: 16 saved, 32 now" in _no_traceback(proc)


def test_resume_says_what_a_changed_seed_lr_and_steps_change(copy_of_reference):
  proc = _train(copy_of_reference, "--resume", "--steps", "62", "--seed", "1", "--lr", "0.01")
  assert proc.returncode == 0, proc.stderr[-3000:]
  for line in ("steps: 60 -> 62; from step 60 on, the run ends at the new step count",
               "seed: 0 -> 1; from step 60 on, batches are drawn with the new seed",
               "lr: 0.003 -> 0.01; from step 60 on, the learning rate differs"):
    assert line in proc.stdout
  # What the resumed run uses is recorded: in run.json and in the log's config record.
  saved = json.loads((copy_of_reference / "run.json").read_text())["config"]
  assert (saved["steps"], saved["seed"], saved["lr"]) == (62, 1, 0.01)
  last = _records(copy_of_reference, "config")[-1]
  assert last["resumed_from"] == STEPS and last["config"]["seed"] == 1
  assert [r["step"] for r in _records(copy_of_reference, "train")] == list(range(62))


def test_ctrl_c_saves_a_checkpoint_of_the_last_step_and_exits_cleanly(tmp_path):
  out = tmp_path / "run"
  # Long enough never to finish; checkpoints only at the end, so the one saved is Ctrl-C's.
  proc, output = _start(out, "--steps", "100000", "--checkpoint-every", "0")
  log = out / "metrics.jsonl"
  _wait_for(lambda: log.exists() and '"kind": "train", "step": 3' in log.read_text(), proc,
            "step 3 was logged")
  proc.send_signal(signal.SIGINT)
  proc.wait(timeout=120)
  text = output.read_text()
  assert proc.returncode == 130, text[-3000:]
  assert "Traceback" not in text, text[-3000:]
  trained = [r["step"] for r in _records(out, "train")]
  assert trained == list(range(len(trained)))
  assert _steps(out) == [len(trained)]  # every step trained is in the checkpoint
  assert f"saved checkpoint {len(trained)}" in text
