"""train.compare's synthetic batches: packed documents for --documents."""

import types

import numpy as np
import pytest

from train.compare import _random_batch

CFG = types.SimpleNamespace(model=types.SimpleNamespace(vocab_size=256), batch_size=3,
                            seq_len=200)


@pytest.mark.parametrize("documents", [0, 1, 7])
def test_random_batch_packs_documents(documents):
  batch = _random_batch(CFG, seed=documents, documents=documents)
  shape = (1, CFG.batch_size, CFG.seq_len)
  assert batch["tokens"].shape == batch["positions"].shape == shape
  np.testing.assert_array_equal(batch["tokens"][..., 1:], batch["targets"][..., :-1])
  if documents <= 1:
    assert "segment_ids" not in batch
    np.testing.assert_array_equal(batch["positions"][0, 1], np.arange(CFG.seq_len))
    return
  seg, pos = batch["segment_ids"], batch["positions"]
  steps = np.diff(seg, axis=-1)
  assert set(np.unique(steps)) <= {0, 1}
  np.testing.assert_array_equal(seg[..., -1], documents - 1)  # every document non-empty
  # positions restart at 0 at each document start and count up inside it
  starts = np.concatenate([np.ones(shape[:2] + (1,), bool), steps == 1], -1)
  np.testing.assert_array_equal(pos == 0, starts)
  np.testing.assert_array_equal(np.diff(pos, axis=-1)[steps == 0], 1)


@pytest.mark.parametrize("times, expected", [
    # run(1), run(3) pairs in call order -> (step, latency)
    ([0.5, 1.1], (0.3, 0.2)),
    # a slow one-step run (0.9 > 0.8) is retried; the minima separate on the second attempt
    ([0.9, 0.8, 0.4, 1.0], (0.2, 0.2)),
    # never separated: the mean of the fastest 1 + 2 step run, no latency
    ([0.9, 0.6, 0.9, 0.6, 0.9, 0.6], (0.2, None)),
])
def test_steady_step_seconds_never_goes_negative(times, expected):
  from train import compare

  calls = iter(times)
  ns = []

  def run(n):
    ns.append(n)
    return next(calls)

  step_s, latency_s = compare.steady_step_seconds(run, steps=2)
  assert ns == [1, 3] * (len(times) // 2)
  assert step_s == pytest.approx(expected[0]) and step_s > 0
  assert latency_s == (None if expected[1] is None else pytest.approx(expected[1]))


@pytest.mark.slow  # four training processes, about a minute; -m slow runs it
def test_throughput_rows_alternate_rounds(capsys):
  from train import compare

  rows = compare.main(["throughput", "--preset", "cpu-demo", "--attention", "ours", "xla",
                       "--seq-len", "128", "--batch-size", "2", "--steps", "2", "--rounds", "2"])
  assert [r["attention"] for r in rows] == ["ours", "xla", "ours", "xla"]
  for r in rows:
    assert r["status"] == "ok", r
    assert r["step_ms"] > 0 and np.isfinite(r["first_loss"]), r
    assert r["tokens_per_s"] == pytest.approx(128 * 2 / (r["step_ms"] / 1e3)), r
  assert capsys.readouterr().out.count("\nours ") == 2
