"""scripts/train_step_profile.py's trace reading on a hand-made profiler trace (CPU)."""

import gzip
import importlib.util
import json
import pathlib

_PATH = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "train_step_profile.py"
_SPEC = importlib.util.spec_from_file_location("train_step_profile", _PATH)
tsp = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tsp)


def _trace(tmp_path) -> pathlib.Path:
  meta = [dict(ph="M", pid=1, name="process_name", args=dict(name="/device:GPU:0")),
          dict(ph="M", pid=1, tid=7, name="thread_name", args=dict(name="Stream #14(Compute)")),
          dict(ph="M", pid=1, tid=8, name="thread_name", args=dict(name="XLA Ops")),
          dict(ph="M", pid=2, name="process_name", args=dict(name="/host:CPU")),
          dict(ph="M", pid=2, tid=1, name="thread_name", args=dict(name="python3"))]
  x = lambda pid, tid, ts, dur, name: dict(ph="X", pid=pid, tid=tid, ts=ts, dur=dur, name=name)  # noqa: E731
  events = [x(1, 7, 0.0, 10.0, "body_mosaic_gpu_kernel"),
            x(1, 7, 12.0, 3.0, "nvjet_sm90_tst_128x160"),   # 2 µs idle before it
            x(1, 7, 15.5, 4.5, "loop_add_fusion"),          # 0.5 µs idle: counted, no gap entry
            x(1, 7, 30.0, 5.0, "body_mosaic_gpu_kernel"),   # 10 µs idle
            x(1, 8, 0.0, 35.0, "command_buffer"),           # a derived line: not a kernel
            x(2, 1, 0.0, 7.0, "cuGraphLaunch (CudaGraph:1)"),
            x(2, 1, 8.0, 1.0, "$python frame")]
  path = tmp_path / "t.trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump(dict(traceEvents=meta + events), f)
  return path


def test_read_trace_keeps_stream_kernels_and_host_cuda_calls(tmp_path):
  kernels, api = tsp.read_trace(str(_trace(tmp_path)))
  assert [k[2] for k in kernels] == ["body_mosaic_gpu_kernel", "nvjet_sm90_tst_128x160",
                                     "loop_add_fusion", "body_mosaic_gpu_kernel"]
  assert api == {"cuGraphLaunch (CudaGraph:1)": [7.0]}


def test_idle_gaps_name_the_kernels_around_them(tmp_path):
  kernels, _ = tsp.read_trace(str(_trace(tmp_path)))
  idle, gaps = tsp.idle_gaps(kernels)
  assert idle == 2.0 + 0.5 + 10.0
  assert gaps == {("body_mosaic_gpu_kernel", "nvjet_sm90_tst_128x160"): [2.0],
                  ("loop_add_fusion", "body_mosaic_gpu_kernel"): [10.0]}


def test_overlapping_kernels_are_not_idle():
  kernels = [(0.0, 10.0, "a"), (2.0, 5.0, "b"), (9.0, 12.0, "c"), (14.0, 15.0, "d")]
  idle, gaps = tsp.idle_gaps(kernels)
  assert idle == 2.0 and gaps == {("c", "d"): [2.0]}


def test_categories():
  assert tsp.categorise("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
  assert tsp.categorise("body_mosaic_gpu_kernel") == "attention"
  assert tsp.categorise("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT") == "matmul"
  assert tsp.categorise("input_add_reduce_fusion_35") == "fusion"
  assert tsp.categorise("Memset 0") == "copy/collective"
  assert tsp.categorise("something_new") == "other"
