"""`python -m pallas_flash.bench --decode` on CPU at tiny shapes: rows checked, then timed, with
bandwidth, the copy fraction and the anchors' ratios (never asserting on speed)."""

import json
import math
import os

import pytest

from pallas_flash.bench import __main__ as bench

FAST = ["--iters", "1", "--min-loop-ms", "1", "--settle-ms", "0"]

# One worker runs the module: its module-scoped rows fixture then runs once, not once per
# xdist worker (scripts/test.sh passes --dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
  out = tmp_path_factory.mktemp("decode") / "rows.json"
  bench.main(["--decode", "--grid", "cpu", "--dtype", "f32", "--batches", "3", "--caches",
              "96", "--impl", "ours,ours_fp8,jax_xla,torch,split_kv,flash", *FAST, "--json",
              str(out)])
  return json.loads(out.read_text())


def test_every_point_has_checked_and_timed_rows(rows):
  decode = [r for r in rows if r["kind"] == "decode"]
  points = {(r["layout"], r["lengths"]) for r in decode}
  assert points == {(lay, mode) for lay in ("contiguous", "paged")
                    for mode in ("uniform", "ragged")}
  for r in decode:
    if r["impl"] in ("ours", "ours_fp8") or (r["impl"] == "jax_xla"
                                               and r["layout"] == "contiguous"):
      assert r["status"] == "ok" and r["rel_err"] < 1e-4, r
      assert r["us"] > 0 and r["tbs"] > 0 and math.isfinite(r["copy_fraction"]), r
      assert r["ours_speedup"] > 0 and r["copy_tbs"] > 0
    elif r["impl"] == "torch":  # SDPA has no lengths; without torch installed, an error row
      assert r["status"] in ("ok", "error", "skip")
    else:
      assert r["status"] == "skip", r  # jax.nn takes no page table


def test_bytes_read_count_the_valid_tokens(rows):
  """float32 caches: 4 bytes per element; ours_fp8's e4m3 copies: 1."""
  for r in rows:
    if r["kind"] != "decode":
      continue
    itemsize = 1 if r["impl"] == "ours_fp8" else 4
    full = 2 * r["batch"] * r["cache"] * r["num_kv_heads"] * 32 * itemsize
    if r["lengths"] == "uniform":
      assert r["bytes_read"] == full
    else:
      assert 0 < r["bytes_read"] <= full


def test_prefill_rows_compare_with_flash_attention(rows):
  prefill = {r["impl"]: r for r in rows if r["kind"] == "prefill"}
  assert set(prefill) == {"ours", "split_kv", "flash"}
  assert prefill["ours"]["path"] == "xla"  # off-GPU and Tq = 8: the split-KV path
  n, tq = prefill["ours"]["cache"], prefill["ours"]["q_len"]
  assert prefill["ours"]["flops"] == 4.0 * 4 * 32 * (tq * (n - tq) + tq * (tq + 1) // 2)
  for r in prefill.values():
    assert r["status"] == "ok" and r["tflops"] > 0, r
  assert prefill["flash"]["ours_ratio"] > 0 and prefill["split_kv"]["ours_ratio"] > 0


def test_points_over_the_memory_cap_are_skipped(tmp_path, capsys):
  out = tmp_path / "rows.json"
  bench.main(["--decode", "--grid", "cpu", "--dtype", "f32", "--batches", "3", "--caches",
              "96", "--max-cache-gib", "0", "--prefill", "no", *FAST, "--json", str(out)])
  assert json.loads(out.read_text()) == []
  assert "skip B=3 cache 96" in capsys.readouterr().out


def _checked_variant_rows(tmp_path, layout: str, impl: str, variant: str) -> dict:
  """{impl: row} of one ragged B=3 point of `layout` run by `impl` and the --variant column
  `variant` (IMPL:LABEL:FIELDS), each asserted checked (ok, rel_err < 1e-4) and timed."""
  out = tmp_path / "rows.json"
  bench.main(["--decode", "--grid", "cpu", "--dtype", "f32", "--batches", "3", "--caches", "96",
              "--layouts", layout, "--lengths", "ragged", "--prefill", "no", "--impl", impl,
              "--variant", variant, *FAST, "--json", str(out)])
  rows = {r["impl"]: r for r in json.loads(out.read_text())}
  assert set(rows) == {impl, variant.rsplit(":", 1)[0]}
  for r in rows.values():
    assert r["status"] == "ok" and r["rel_err"] < 1e-4 and r["us"] > 0, r
  return rows


def test_variant_columns_time_a_config_change(tmp_path):
  """--variant ours_fp8:bk16:block_kv=16 adds a column: ours_fp8's FP8 caches with 16-key tiles,
  checked against the same reference and timed beside ours_fp8 (its bytes in e4m3)."""
  rows = _checked_variant_rows(tmp_path, "paged", "ours_fp8", "ours_fp8:bk16:block_kv=16")
  assert rows["ours_fp8:bk16"]["bytes_read"] == rows["ours_fp8"]["bytes_read"]
  assert rows["ours_fp8:bk16"]["ours_speedup"] > 0
  with pytest.raises(SystemExit, match="block_kvv"):
    bench.main(["--decode", "--variant", "ours:x:block_kvv=16"])


def test_a_variant_sets_the_split_count(tmp_path, monkeypatch):
  """--variant ours:s3:num_splits=3 passes num_splits=3 to decode_attention (no config: the
  call's default tiles), checked and timed beside ours, which passes the flag's None."""
  import pallas_flash
  from pallas_flash.bench import decode

  seen = []
  real = pallas_flash.decode_attention

  def spy(*args, **kwargs):
    seen.append((kwargs.get("num_splits"), kwargs.get("config")))
    return real(*args, **kwargs)

  monkeypatch.setattr(decode.pallas_flash, "decode_attention", spy)
  _checked_variant_rows(tmp_path, "contiguous", "ours", "ours:s3:num_splits=3")
  assert {(3, None), (None, None)} == set(seen)


def test_impl_names_the_mosaic_and_triton_kernels():
  """--impl mosaic,triton,cudnn times the two kernels side by side (the first is the column
  the others are compared with); --block-kv / --num-stages / --num-splits reach 'mosaic'."""
  import argparse

  import pallas_flash
  from pallas_flash.bench import decode

  assert decode._impls(argparse.Namespace(impl="mosaic,triton,cudnn")) == [
      "mosaic", "triton", "cudnn"]
  ours = decode._ours_kwargs(argparse.Namespace(block_kv=64, block_m=None, num_warps=None,
                                                num_stages=4, num_splits=3))
  assert decode._mosaic_kwargs(ours) == {
      "num_splits": 3, "config": pallas_flash.MosaicDecodeConfig(block_kv=64, num_stages=4)}
  assert decode._mosaic_kwargs({"num_splits": None}) == {"num_splits": None}


# The fields print_rows reads of a row, beside impl, us, device_us and ours_speedup.
TABLE_ROW = dict(layout="contiguous", lengths="uniform", batch=1, cache=1024, bytes_read=2**20,
                 status="ok", rel_err=1e-3, copy_tbs=3.0, tbs=0.1, copy_fraction=0.5)


def test_anchor_cells_give_their_gpu_time_where_measured(capsys):
  """A column's cell holds its GPU time beside the per-call time where CUPTI measured one (on
  a GPU), since at short caches the calls are launch-bound; without one, the cell has none."""
  from pallas_flash.bench import decode

  rows = [dict(TABLE_ROW, impl="ours", us=40.0, device_us=10.0, ours_speedup=1.0),
          dict(TABLE_ROW, impl="cudnn", us=50.0, device_us=20.0, ours_speedup=1.25),
          dict(TABLE_ROW, impl="ours:s1", us=41.0, device_us=None, ours_speedup=1.02)]
  decode.print_rows(rows, ["ours", "cudnn", "ours:s1"])
  line = capsys.readouterr().out.strip()
  assert line.endswith("| 50.0 (1.25x) dev 20.0 | 41.0 (1.02x) |"), line


def test_kernel_times_are_medians_per_launch_and_print_under_the_row(capsys):
  """CUPTI's per-iteration (name, ms) lists become each launch's median µs, a name launched
  twice a call told apart by its order; `--kernels` prints them under the row's line."""
  from pallas_flash.bench import decode

  per_iter = [[("prep", 0.002), ("attend", 0.010), ("merge", 0.003), ("attend", 0.001)],
              [("prep", 0.004), ("attend", 0.020), ("merge", 0.005), ("attend", 0.003)],
              [("prep", 0.003), ("attend", 0.030), ("merge", 0.004), ("attend", 0.002)]]
  total, kernels = decode.kernel_medians(per_iter)
  assert total == pytest.approx(32.0)  # the median of the sums 16, 32, 39 µs
  assert list(kernels) == ["prep", "attend #1", "merge", "attend #2"]
  assert [round(us, 6) for us in kernels.values()] == [3.0, 20.0, 4.0, 2.0]
  rows = [dict(TABLE_ROW, impl="ours", us=40.0, device_us=total, ours_speedup=1.0,
               device_kernels=kernels),
          dict(TABLE_ROW, impl="cudnn", us=50.0, device_us=None, ours_speedup=1.25)]
  decode.print_rows(rows, ["ours", "cudnn"], kernels=True)
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[1:] == ["    ours: prep 3.0, attend #1 20.0, merge 4.0, attend #2 2.0"], lines
  decode.print_rows(rows, ["ours", "cudnn"])
  assert len(capsys.readouterr().out.strip().splitlines()) == 1


def test_loop_calls_chain_each_call_on_the_last_output(tmp_path, capsys, monkeypatch):
  """--loop-calls N: `looped` runs the call N times, each query taking a share of the previous
  output (so no call is hoisted), and each checked column gets its per-call time in the loop,
  beside the step of the same loop without the call."""
  import jax.numpy as jnp
  import numpy as np

  from pallas_flash.bench import decode

  fn = lambda q, k, v, lens, table: (q * 3.0 + k, None)  # noqa: E731
  q, k = jnp.arange(4.0, dtype=jnp.float32) + 1.0, jnp.full((4,), 0.5, jnp.float32)
  want = np.asarray(q)
  for _ in range(3):
    want = want + np.float32((want[0] * 3.0 + 0.5) * 1e-6)
  got = decode.looped(fn, 3)(q, k, None, None, None)
  np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))
  assert not np.array_equal(np.asarray(decode.looped(fn, 2)(q, k, None, None, None)), want)

  out = tmp_path / "rows.json"
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored afterwards
  bench.main(["--decode", "--grid", "cpu", "--dtype", "f32", "--batches", "3", "--caches", "96",
              "--layouts", "contiguous", "--lengths", "uniform", "--prefill", "no", "--impl",
              "ours,jax_xla", "--loop-calls", "4", *FAST, "--json", str(out)])
  # On a GPU the run's loops are CUDA graphs, as a model's step is (decode.GRAPH_FLAG).
  assert decode.GRAPH_FLAG in os.environ["XLA_FLAGS"].split()
  rows = {r["impl"]: r for r in json.loads(out.read_text())}
  for r in rows.values():
    assert r["status"] == "ok" and r["loop_us"] > 0 and r["empty_loop_us"] > 0, r
  ours = rows["ours"]
  line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| contiguous"))
  assert f"(loop {ours['loop_us']:.1f}, empty {ours['empty_loop_us']:.1f})" in line, line
  assert " loop " in line, line
