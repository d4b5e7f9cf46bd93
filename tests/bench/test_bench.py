"""End-to-end tests of `python -m pallas_flash.bench` on CPU at tiny shapes: they assert on the
JSON rows (never on speed)."""

import collections
import dataclasses
import json
import math
import statistics
import subprocess
import sys

import jax.numpy as jnp
import pytest

from pallas_flash.bench import __main__ as bench
import pallas_flash
from pallas_flash.bench import flops, shapes, timing, variants

FAST = ["--iters", "2", "--min-loop-ms", "1", "--settle-ms", "0"]
META = ("device_kind", "jax_version", "git_commit", "date")

# One worker runs the module: its module-scoped rows fixture then runs once, not once per
# xdist worker (scripts/test.sh passes --dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)


def _run(tmp_path, *argv: str) -> list[dict]:
  out = tmp_path / "rows.json"
  bench.main([*argv, *FAST, "--json", str(out)])
  return json.loads(out.read_text())


def _assert_timed_and_correct(row: dict) -> None:
  assert row["status"] == "ok", row
  assert math.isfinite(row["tflops"]) and row["tflops"] > 0, row
  assert math.isfinite(row["ms"]) and row["ms"] > 0, row
  assert 0 <= row["rel_err"] < row["tolerance"], row


@pytest.fixture(scope="module")
def speed_rows(tmp_path_factory) -> list[dict]:
  return _run(tmp_path_factory.mktemp("speed"), "--shapes", "cpu_t96",
              "--impl", "xla,interpret,cudnn,jax_xla")


def test_every_case_has_a_row(speed_rows):
  keys = {(r["mode"], r["causal"], r["impl"]) for r in speed_rows}
  assert len(keys) == len(speed_rows) == 2 * 2 * 4


def test_rows_are_checked_then_timed(speed_rows):
  for row in speed_rows:
    if row["impl"] == "cudnn":
      assert row["status"] == "skip" and row["tflops"] is None and row["ratio_cudnn"] is None
    elif row["status"] != "skip":  # interpret skips itself where explain() says it cannot run
      _assert_timed_and_correct(row)
      assert set(row["rel_errs"]) == ({"o"} if row["mode"] == "fwd" else {"dq", "dk", "dv"})
      assert row["check_shape"] == "2x96x2x32"
  assert {r["impl"] for r in speed_rows if r["status"] == "ok"} >= {"xla", "jax_xla"}


def test_rows_carry_flops_and_metadata(speed_rows):
  for row in speed_rows:
    spec = shapes.ShapeSpec(name="x", batch=row["batch"], seq_len=row["seq_len"],
                            num_heads=row["num_heads"], head_dim=row["head_dim"])
    assert row["flops"] == flops.attention_flops(spec, is_causal=row["causal"], mode=row["mode"])
    assert all(row[k] for k in META)
    assert row["kind"] == "speed" and row["dtype"] == "bfloat16"


def test_long_sequences_are_checked_on_a_leading_slice(tmp_path):
  rows = _run(tmp_path, "--shapes", "cpu_t128", "--impl", "xla", "--mode", "fwdbwd",
              "--causal", "yes", "--check-seq-cap", "64")
  assert [r["check_shape"] for r in rows] == ["1x64x2x64"]
  for row in rows:
    _assert_timed_and_correct(row)


def test_a_sliced_mosaic_check_runs_the_benchmarked_calls_config():
  """At 2x16384 causal the benchmarked call runs the fused backward, which a 4096-long call
  would not: the check's rerun on the slice gets the full call's config."""
  spec = shapes.ShapeSpec(name="x", batch=2, seq_len=16384, num_heads=8, head_dim=128,
                          num_kv_heads=4)
  config = bench.slice_kwargs("mosaic", spec, is_causal=True)["config"]
  assert config.fused_backward
  small = shapes.check_spec(spec, seq_cap=4096)
  assert not bench.slice_kwargs("mosaic", small, is_causal=True)["config"].fused_backward
  assert bench.slice_kwargs("xla", spec, is_causal=True) == {}


def test_a_variant_column_runs_each_calls_default_config_with_fields_replaced(tmp_path):
  rows = _run(tmp_path, "--shapes", "cpu_t128", "--impl", "xla", "--mode", "fwdbwd",
              "--causal", "yes", "--check-seq-cap", "64",
              "--variant", "xla:small:block_q=32,block_kv=64")
  assert [r["impl"] for r in rows] == ["xla", "xla:small"]
  for row in rows:
    _assert_timed_and_correct(row)  # the variant is checked on the slice with its config too
  assert rows[1]["config"] == repr(pallas_flash.XlaConfig(block_q=32, block_kv=64))
  # Mosaic: the config implementation="mosaic" takes for the full call, one field replaced.
  spec = shapes.ShapeSpec(name="x", batch=2, seq_len=16384, num_heads=8, head_dim=128,
                          num_kv_heads=4)
  variant = variants.parse("mosaic:tail:fwd_split_tail=True")
  default = bench.slice_kwargs("mosaic", spec, is_causal=True)["config"]
  assert default.fused_backward and not default.fwd_split_tail
  assert variant.config(spec, jnp.bfloat16, is_causal=True) == dataclasses.replace(
      default, fwd_split_tail=True)


@pytest.mark.parametrize("text, match", [
    ("xla", "expected IMPL:LABEL"), ("cudnn:a:block_q=1", "IMPL must be one of"),
    ("xla:a:nope=1", "'nope' is not a field of XlaConfig"),
    ("xla:a:block_q=foo", "must be a Python literal")])
def test_a_bad_variant_exits_naming_the_problem(text, match):
  with pytest.raises(SystemExit, match=match):
    variants.parse(text)


def test_a_row_above_tolerance_is_marked_fail_but_still_timed(tmp_path, monkeypatch):
  monkeypatch.setitem(bench.TOLERANCE, "bfloat16", 1e-9)
  rows = _run(tmp_path, "--shapes", "cpu_t96", "--impl", "xla", "--mode", "fwd",
              "--causal", "no")
  assert [r["status"] for r in rows] == ["FAIL"]
  assert rows[0]["tflops"] > 0


def test_memory_mode_grows_linearly_for_blockwise_and_quadratically_for_jax_xla(tmp_path):
  rows = _run(tmp_path, "--memory", "--impl", "xla,jax_xla", "--start-seq", "256",
              "--max-seq", "512", "--heads", "1", "--head-dim", "16")
  assert [(r["impl"], r["seq_len"]) for r in rows] == [
      (i, t) for i in ("xla", "jax_xla") for t in (256, 512)]
  for row in rows:
    assert row["kind"] == "memory" and row["status"] == "ok" and row["finite"], row
    assert row["est_peak_bytes"] > 0 and row["tflops"] > 0
  peak = {(r["impl"], r["seq_len"]): r["est_peak_bytes"] for r in rows}
  assert peak[("xla", 512)] / peak[("xla", 256)] < 2.5
  assert peak[("jax_xla", 512)] / peak[("jax_xla", 256)] > 3


def test_shape_registry():
  anchors = shapes.select_shapes("anchors")
  assert [s.label for s in anchors] == ["16x1024x16x128", "4x4096x16x128", "1x16384x16x128",
                                        "4x4096x32x64"]
  assert all(s.batch * s.seq_len == 16384 for s in anchors)
  assert [s.label for s in shapes.select_shapes("long")] == ["1x32768x16x128"]
  assert shapes.check_spec(anchors[2], seq_cap=4096).shape == (1, 4096, 2, 128)
  with pytest.raises(ValueError, match="Unknown shapes"):
    shapes.select_shapes("nope")


@pytest.mark.parametrize("seq_cap", [4096, 32], ids=["whole_call", "leading_slice"])
def test_gqa_shapes_are_checked_on_whole_groups(tmp_path, seq_cap):
  """k and v have fewer heads: the check keeps whole groups (dk, dv of a kv head sum over all
  of its query heads), on the call itself or on a leading slice."""
  rows = _run(tmp_path, "--shapes", "cpu_t80_gqa", "--impl", "xla,jax_xla",
              "--check-seq-cap", str(seq_cap))
  assert len(rows) == 2 * 2 * 2
  for row in rows:
    _assert_timed_and_correct(row)
    assert row["num_kv_heads"] == 2 and row["label"] == "1x80x4x32/K2"
    assert row["check_shape"] == f"1x{min(80, seq_cap)}x2x32/K1"


def test_gqa_check_spec_keeps_whole_groups():
  (train,) = shapes.select_shapes("train")
  assert train.label == "2x16384x8x128/K4" and train.kv_shape == (2, 16384, 4, 128)
  small = shapes.check_spec(train, seq_cap=4096)
  assert (small.shape, small.kv_heads) == ((2, 4096, 2, 128), 1)
  group4 = train.replace(num_kv_heads=2)
  assert shapes.check_spec(group4, seq_cap=4096).label == "2x4096x4x128/K1"
  mha = shapes.check_spec(shapes.select_shapes("b1_t16k_h16_d128")[0], seq_cap=4096)
  assert mha.label == "1x4096x2x128" and mha.num_kv_heads == 0


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_balanced_round_orders(n):
  rows = timing.round_orders(n)
  assert len(rows) == (2 * n if n % 2 and n > 1 else n)
  assert all(sorted(row) == list(range(n)) for row in rows)
  for i in range(n):  # every fn at every position equally often
    assert len({sum(row[p] == i for row in rows) for p in range(n)}) == 1
  follows = collections.Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
  assert len(set(follows.values())) <= 1 and len(follows) == n * (n - 1)  # every pair, equally
  rotating = timing.round_orders(n, "rotating")
  # each fn always follows the same one: n ordered pairs of the n·(n-1)
  assert len({(a, b) for row in rotating for a, b in zip(row, row[1:])}) == (n if n > 1 else 0)


def _logging_fns(names: str, log: list[str]) -> dict:
  """{name: fn(x)} for each letter of names, each appending its name to log when called."""
  def fn(name):
    def call(x):
      log.append(name)
      return x + 1
    return call

  return {n: fn(n) for n in names}


def test_implementations_are_timed_in_balanced_rounds():
  log = []
  x = jnp.ones((4,))
  out = timing.time_interleaved(_logging_fns("abc", log), (x,), iters=6, min_loop_s=0.0)
  assert log[:6] == ["a", "a", "b", "b", "c", "c"]  # warm-up and sizing call each, in turn
  rounds = ["".join(log[6 + 3 * i:9 + 3 * i]) for i in range(6)]
  assert rounds == ["abc", "bca", "cab", "cba", "acb", "bac"]  # one loop each per round
  for name, t in out.items():
    assert t.calls_per_loop == 1 and len(t.loop_s) == 6, name
    assert t.median_s == statistics.median(t.loop_s) > 0, name


def test_settling_rounds_run_every_implementation_before_the_timed_ones():
  log = []
  x = jnp.ones((4,))
  out = timing.time_interleaved(_logging_fns("ab", log), (x,), iters=2, min_loop_s=0.0,
                                settle_s=0.05)
  settling = log[4:-4]  # after the warm-up and sizing calls, before the 2 timed rounds
  assert len(settling) >= 2 and settling == ["a", "b"] * (len(settling) // 2)
  assert all(len(t.loop_s) == 2 for t in out.values())


def test_a_call_failing_in_the_timing_rounds_marks_only_its_row(tmp_path, monkeypatch):
  real = timing.time_interleaved

  def boom(*args):
    raise RuntimeError("boom")

  def flaky(fns, args, **kw):  # the real rounds, with jax_xla's calls raising
    return real({n: boom if n == "jax_xla" else f for n, f in fns.items()}, args, **kw)

  monkeypatch.setattr(timing, "time_interleaved", flaky)
  rows = _run(tmp_path, "--shapes", "cpu_t96", "--impl", "xla,jax_xla", "--mode", "fwd",
              "--causal", "no")
  by_impl = {r["impl"]: r for r in rows}
  _assert_timed_and_correct(by_impl["xla"])
  assert by_impl["jax_xla"]["status"] == "error" and "boom" in by_impl["jax_xla"]["reason"]


def test_shapes_parse_with_optional_kv_heads():
  spec = shapes.parse_shape("2x16384x8x128x4")
  assert (spec.batch, spec.seq_len, spec.num_heads, spec.head_dim, spec.num_kv_heads) == \
      (2, 16384, 8, 128, 4)
  assert shapes.parse_shape("1x4096x16x64").num_kv_heads == 16
  with pytest.raises(ValueError, match="BxTxHxD"):
    shapes.parse_shape("4096x16x64")
  (given,) = shapes.select_shapes("1x4096x16x64")
  assert given.name == "1x4096x16x64" and given.num_heads == 16


def test_flop_convention():
  spec = shapes.select_shapes("b4_t4k_h16_d128")[0]
  fwd = 4 * 4 * 16 * 4096 * 4096 * 128
  assert flops.attention_flops(spec, is_causal=False, mode="fwd") == fwd
  assert flops.attention_flops(spec, is_causal=True, mode="fwdbwd") == fwd / 2 * 3.5


def test_window_flops_count_the_band():
  spec = shapes.parse_shape("2x1000x4x64")
  per_pair = 4 * 2 * 4 * 64
  assert flops.window_flops(spec, left=0, mode="fwd") == per_pair * 1000
  assert flops.window_flops(spec, left=999, mode="fwd") == per_pair * 1000 * 1001 / 2
  # left = 10: the first 10 queries see i + 1 keys, the other 990 see 11.
  assert flops.window_flops(spec, left=10, mode="fwdbwd") == per_pair * (55 + 990 * 11) * 3.5
  # Two-sided: the first 990 queries see 10 keys ahead, the last 10 see 9 .. 0.
  assert flops.window_flops(spec, left=10, right=10, mode="fwd") == per_pair * (
      55 + 990 * 11 + 990 * 10 + 45)
  assert flops.window_flops(spec, left=999, right=999, mode="fwd") == per_pair * 1000 ** 2


def test_cli_writes_json(tmp_path):
  out = tmp_path / "cli.json"
  proc = subprocess.run(
      [sys.executable, "-m", "pallas_flash.bench", "--shapes", "cpu_t96", "--impl", "xla",
       "--mode", "fwd", "--causal", "no", *FAST, "--json", str(out)],
      capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr
  assert "Summary" in proc.stdout
  (row,) = json.loads(out.read_text())
  _assert_timed_and_correct(row)


@pytest.mark.parametrize("wins,rounds,p", [(2, 13, 2 * (1 + 13 + 78) / 8192),
                                           (11, 13, 2 * (1 + 13 + 78) / 8192),
                                           (13, 13, 2 / 8192), (6, 13, 1.0), (7, 13, 1.0),
                                           (0, 5, 2 / 32), (1, 1, 1.0), (0, 0, 1.0)])
def test_sign_test_p(wins, rounds, p):
  assert timing.sign_test_p(wins, rounds) == pytest.approx(p)


def test_ratios_to_cudnn_also_count_the_rounds_won():
  rows = [dict(impl="mosaic", tflops=100.0, loop_ms=[1.0, 2.0, 3.0, 1.5]),
          dict(impl="cudnn", tflops=90.0, loop_ms=[2.0, 1.0, 3.3, 1.2]),
          dict(impl="triton", tflops=None, loop_ms=None)]
  bench._add_ratios(rows)
  ours, cudnn, triton = rows
  assert ours["ratio_cudnn"] == pytest.approx(100 / 90)
  assert ours["round_ratios"] == pytest.approx([2.0, 0.5, 1.1, 0.8])
  assert ours["rounds_faster"] == 2 and bench._rounds(ours) == "2/4 0.50-2.00 p=1"
  assert "round_ratios" not in cudnn and cudnn["ratio_cudnn"] == 1.0
  assert "ratio_cudnn" not in triton and bench._rounds(triton) == "-"


def test_git_commit_marks_a_tree_that_differs_from_its_commit(tmp_path, monkeypatch):
  """The rows' git_commit: HEAD, "-dirty" when tracked files differ from it (untracked ones do
  not count), and $PALLAS_FLASH_COMMIT as given."""

  def git(*args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=tmp_path, capture_output=True, text=True, check=True).stdout
  git("init", "-q")
  (tmp_path / "f.py").write_text("a = 1\n")
  git("add", "f.py")
  git("commit", "-qm", "one")
  head = git("rev-parse", "HEAD").strip()
  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv("PALLAS_FLASH_COMMIT", raising=False)
  (tmp_path / "new.py").write_text("b = 2\n")
  assert bench.git_commit() == head
  (tmp_path / "f.py").write_text("a = 2\n")
  assert bench.git_commit() == head + "-dirty"
  monkeypatch.setenv("PALLAS_FLASH_COMMIT", "abc1234")
  assert bench.git_commit() == "abc1234"
