"""`python -m pallas_flash.bench --features` on CPU (--quick shapes, --impl xla): every row of
the grid checked against the reference, then timed next to plain attention; cuDNN's column
degrades to "—" (never asserting on speed)."""

import argparse
import json
import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import use_abstract_mesh

from pallas_flash.bench import __main__ as bench
from pallas_flash.bench import features, flops, kernels, shapes
from testing import H200, export_for_h200

FAST = ["--quick", "--iters", "1"]
FIELDS = ("feature", "mode", "causal", "label", "impl", "explain", "status", "rel_errs",
          "rel_err", "check_shape", "tflops", "ms", "flops", "ratio_plain", "plain_impl",
          "plain_label", "ratio_cudnn", "cudnn_status", "cudnn_tflops", "device_kind")


def _run(tmp_path, *argv: str) -> list[dict]:
  out = tmp_path / "rows.json"
  bench.main(["--features", *argv, *FAST, "--json", str(out)])
  return json.loads(out.read_text())


def _assert_checked_and_timed(row: dict, outputs: set[str]) -> None:
  assert all(k in row for k in FIELDS), sorted(set(FIELDS) - set(row))
  assert row["status"] == "ok" and row["impl"] == row["explain"] == "xla", row
  assert set(row["rel_errs"]) == outputs, row
  assert 0 <= row["rel_err"] < row["tolerance"], row
  assert math.isfinite(row["tflops"]) and row["tflops"] > 0, row
  assert row["ratio_plain"] > 0 and row["plain_impl"] == "xla", row


@pytest.mark.slow  # 30 rows, ~14 s on 2 cores; the test below runs three rows end to end
def test_the_whole_grid(tmp_path):
  """One run of the grid (a module fixture would run once per xdist worker)."""
  grid = _run(tmp_path, "--impl", "xla", "--mode", "fwd")
  _every_feature_has_a_checked_and_timed_row(grid)
  _ratios_to_plain_compare_with_the_same_causality_at_the_grids_head_dim(grid)
  _flops_count_plain_work_and_the_band_for_windows(grid)


def _every_feature_has_a_checked_and_timed_row(grid):
  assert [(r["feature"], r["causal"]) for r in grid] == [
      (f.name, f.causal) for f in features.FEATURES]
  for row in grid:
    _assert_checked_and_timed(row, {"o"})
    assert row["cudnn_status"] == "—" and row["ratio_cudnn"] is None  # no GPU here
    assert row["check_shape"] == row["label"].replace("x4x", "x2x").split("/K")[0] + (
        "/K1" if row["feature"] == "gqa" else "")


def _ratios_to_plain_compare_with_the_same_causality_at_the_grids_head_dim(grid):
  base = shapes.parse_shape(features.QUICK_SHAPE)
  by = {(r["feature"], r["causal"]): r for r in grid}
  assert by[("plain", False)]["ratio_plain"] == by[("causal", True)]["ratio_plain"] == 1.0
  for row in grid:
    assert row["plain_feature"] == ("causal" if row["causal"] else "plain")
    assert row["plain_label"] == "x".join(map(str, base.shape))
  assert by[("gqa", True)]["num_kv_heads"] == 2 and by[("hd80", True)]["head_dim"] == 80


def _flops_count_plain_work_and_the_band_for_windows(grid):
  # (left, right) of each window's band: causal T/4, or T/8 either side.
  bands = {"window": (4, 0), "window_both": (8, 8), "blockmask": (4, 0),
           "blockmask_dropout": (4, 0), "blockmask_bias": (4, 0)}
  assert bands.keys() == {f.name for f in features.FEATURES if f.band is not None}
  for row in grid:
    spec = shapes.ShapeSpec(name="x", batch=row["batch"], seq_len=row["seq_len"],
                            num_heads=row["num_heads"], head_dim=row["head_dim"],
                            value_head_dim=row["value_head_dim"])
    if row["feature"] in bands:
      left, right = (row["seq_len"] // n if n else 0 for n in bands[row["feature"]])
      want = flops.window_flops(spec, left=left, right=right, mode="fwd")
    else:
      want = flops.attention_flops(spec, is_causal=row["causal"], mode="fwd")
    assert row["flops"] == want, row["feature"]
  # A value head dim of its own: P·V counts Dv, Q·Kᵀ D (192 + 128 against 2 x 192).
  by = {(r["feature"], r["causal"]): r for r in grid}
  assert by[("hd192v128", True)]["value_head_dim"] == 128
  assert by[("hd192v128", True)]["flops"] / by[("hd192", True)]["flops"] == 320 / 384


def test_gradients_incl_dbias_and_dsinks_are_checked_on_a_leading_slice(tmp_path):
  rows = _run(tmp_path, "--features", "bias,sinks,blockmask", "--impl", "xla",
              "--mode", "fwdbwd", "--check-seq-cap", "64")
  assert [r["feature"] for r in rows] == ["sinks", "bias", "blockmask"]
  extra = {"bias": {"dbias"}, "sinks": {"dsinks"}}
  for row in rows:
    grads = {"dq", "dk", "dv"} | extra.get(row["feature"], set())
    _assert_checked_and_timed(row, grads)
    assert row["check_shape"] == "1x64x2x32"


def test_kernels_lists_the_device_time_of_each_op_under_the_row(tmp_path, capsys):
  (row,) = _run(tmp_path, "--features", "softcap", "--impl", "xla", "--mode", "fwd",
                "--kernels")
  times = row["kernels_us"]
  assert times and all(us >= 0 for us in times.values()) and sum(times.values()) > 0, times
  assert list(times.values()) == sorted(times.values(), reverse=True)
  out = capsys.readouterr().out
  assert next(iter(times))[:70] in out and "total device time per call" in out


def test_cudnn_rejecting_a_call_prints_a_dash(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(features, "_on_gpu", lambda: True)  # cuDNN then fails on the CPU
  rows = _run(tmp_path, "--features", "bias,softcap", "--impl", "xla,cudnn", "--mode", "fwd")
  by = {r["feature"]: r for r in rows}
  assert by["bias"]["cudnn_status"] == "error" and by["bias"]["cudnn_reason"]
  assert by["softcap"]["cudnn_status"] == "—"  # no such feature in cuDNN
  for row in rows:
    _assert_checked_and_timed(row, {"o"})
    assert row["ratio_cudnn"] is None
  table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| bias ")]
  assert table and table[0].endswith("| — | — |")


def test_feature_selection():
  assert [f.name for f in features.select("hd")] == (
      [f"hd{d}" for d in features.HEAD_DIMS for _ in range(2)]
      + ["hd192v128"] * 2)
  assert len(features.select("all")) == len(features.FEATURES)
  with pytest.raises(SystemExit, match="Unknown features"):
    features.select("nope")


@pytest.mark.parametrize("feature", features.FEATURES, ids=lambda f: f"{f.name}-{f.causal}")
def test_every_row_runs_mosaic_on_an_h200(feature):
  """Issue 43's mark: on an (abstract) H200 implementation=None picks mosaic for every call of
  the grid, and names no reason a named call would refuse (the grid's head dims at a short
  length)."""
  opts = argparse.Namespace(seed=0, check_seq_cap=4096)
  spec = feature.spec(shapes.parse_shape("1x512x4x128x2"), 2)
  case = features._case(feature, spec, shapes.make_inputs(spec, jnp.bfloat16), "fwd", opts)
  with use_abstract_mesh(H200):
    how = features._explain(case)
  assert how.chosen == "mosaic" and how.reasons_when_named.get("mosaic") is None, str(how)


@pytest.mark.parametrize("forced", [None, "xla"])
def test_value_head_dim_row_runs_v_at_its_own_width_on_mosaic(forced):
  """hd192v128 on an (abstract) H200: implementation=None's pick, mosaic, whose default config
  takes V and dO at 128 columns (lowered for the H200: the row builds its call; the bench
  times Mosaic kernels on a GPU only). Another implementation (--impl) runs the same call."""
  opts = argparse.Namespace(seed=0, check_seq_cap=4096)
  base = shapes.parse_shape(features.QUICK_SHAPE).replace(num_kv_heads=0)
  feature = next(f for f in features.FEATURES if f.name == "hd192v128" and f.causal)
  spec = feature.spec(base, 2)
  case = features._case(feature, spec, shapes.make_inputs(spec, jnp.bfloat16), "fwdbwd", opts)
  with use_abstract_mesh(H200):
    impl, chosen, attn, _ = features._our_call(case, forced)
  assert chosen == "mosaic" and impl == (forced or "mosaic") and attn is not None
  if forced:
    return
  q, k, v, do = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in case.args[:4])
  text = export_for_h200(features._step(attn, "fwdbwd", ()), q, k, v, do, {}).mlir_module()
  calls = re.findall(r"custom_call @mosaic_gpu_v2\(.* : \((.*?)\) -> ", text)
  v_type = f"x{spec.kv_heads}x128xbf16"  # [B, T, K, 128]
  assert len(calls) == 3 and all(v_type in c for c in calls), calls


def test_a_variant_is_checked_and_timed_beside_each_rows_own_call(tmp_path):
  """--variant on the grid: each row's config (implementation=None's) with the variant's
  fields replaced, checked and timed in the row's rounds (x ours); a variant of an
  implementation the row does not run is skipped with the reason."""
  rows = _run(tmp_path, "causal,alibi", "--impl", "xla", "--mode", "fwd",
              "--variant", "xla:b32:block_q=32,block_kv=32",
              "--variant", "triton:k32:block_kv=32")
  for row in rows:
    small, other = row["variants"]["xla:b32"], row["variants"]["triton:k32"]
    assert small["status"] == "ok" and 0 <= small["rel_err"] < row["tolerance"], small
    assert small["ratio_ours"] > 0
    assert len(small["rounds_vs_ours"]["round_ratios"]) == len(row["loop_ms"])
    assert other["status"] == "skip" and "runs xla" in other["reason"] and not other["tflops"]


def test_kernel_times_tell_apart_the_launches_that_share_a_name():
  """Three kernels under one op (a command buffer of Mosaic kernels, one name) over two calls:
  each launch of a call keeps its own time, by its order within the call."""
  from types import SimpleNamespace as Obj

  def event(start, us, op="command_buffer_1", name="body_mosaic_gpu_kernel"):
    return Obj(start_ns=start, duration_ns=us * 1e3, name=name, stats=[("hlo_op", op)])

  calls = [event(t0 + i, us) for t0 in (0, 100) for i, us in enumerate((30.0, 50.0, 20.0))]
  line = Obj(name="Stream #13(compute)", events=[*calls, event(7, 4.0, "fusion", "fusion")])
  summary = Obj(name="XLA Ops", events=[event(0, 999.0)])  # derived: never counted
  profile = Obj(planes=[Obj(name="/device:GPU:0", lines=[line, summary])])
  times = kernels.op_times(profile, calls=2)
  kernel = "command_buffer_1 (body_mosaic_gpu_kernel)"
  assert times == {f"{kernel} #2": 50.0, f"{kernel} #1": 30.0, f"{kernel} #3": 20.0,
                   "fusion": 2.0}
