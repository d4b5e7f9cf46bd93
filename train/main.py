"""The training loop: devices -> model -> data -> jit-compiled steps -> eval, logs, checkpoints."""

from __future__ import annotations

import json
import pathlib
import signal
import sys
import threading
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

import pallas_flash

from models.attention import check_attention_runs, make_attention
from models.transformer import Transformer
from train import metrics as metrics_lib
from train import rundir
from train.checkpoint import Checkpointer, latest_checkpoint_step, load_params
from train.config import TrainConfig, validate
from train.data import DataSource
from train.step import eval_step, make_optimizer, summarize_eval, train_step

BATCH_AXIS = "data"
# What the default preset should show; measured on 2 CPU cores (see docs/training.md).
CPU_DEMO_EXPECTATION = ("expect the loss to fall from ~8 bits/byte (untrained) to ~4 by step 50 "
                        "and ~3.0 (validation) by step 300: 4-6 minutes on 2 CPU cores")


def check_environment(cfg: TrainConfig) -> None:
  """Fails at start, with the reason, when this machine cannot run `cfg`."""
  devices = jax.devices()
  validate(cfg, len(devices))
  if cfg.preset.startswith("h200") and devices[0].platform != "gpu":
    raise SystemExit(f"Preset {cfg.preset!r} needs a GPU (bf16 at {cfg.seq_len} tokens); this "
                     f"machine has {devices[0].platform}. Use the default preset 'cpu-demo' "
                     "here (model flags such as --d-model and --n-heads override its sizes).")
  check_init_from(cfg)
  check_attention_runs(cfg.attention, implementation=cfg.implementation,
                       dtype=cfg.model.compute_dtype, head_dim=cfg.model.head_dim,
                       num_heads=cfg.model.n_heads, num_kv_heads=cfg.model.n_kv_heads,
                       seq_len=cfg.seq_len)


def check_init_from(cfg: TrainConfig) -> None:
  """Fails before compiling when --init-from names a run without a checkpoint or of another model.

  The run's run.json (or, for older runs, metrics.jsonl) records its ModelConfig; a different
  rope_theta, say, leaves every shape equal but the parameters would mean something else.
  Without that record, the shapes are still checked when the parameters load.
  """
  if cfg.init_from is None or cfg.resume:
    return
  latest_checkpoint_step(cfg.init_from)
  saved = rundir.saved_config(cfg.init_from)
  diffs = [] if saved is None else rundir.model_differences(saved, cfg)
  if diffs:
    raise SystemExit(f"--init-from {cfg.init_from}: that run trained a different model; pass "
                     "the same model flags (--preset, --d-model, ...):\n  "
                     + "\n  ".join(f"{k}: {a!r} there, {b!r} here" for k, a, b in diffs))


def make_mesh(devices) -> jax.sharding.Mesh:
  """A 1-D data-parallel mesh over every device.

  Auto axes (GSPMD propagation): jax.make_mesh's default Explicit axes would make every
  sharding-ambiguous op in the model (the embedding gather, say) demand an out_sharding.
  """
  return jax.make_mesh((len(devices),), (BATCH_AXIS,),
                       axis_types=(jax.sharding.AxisType.Auto,), devices=devices)


def _place(tree, mesh: jax.sharding.Mesh):
  """Puts an nnx State on the mesh: replicated unless a variable has sharding annotations."""
  specs = nnx.get_partition_spec(tree)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s if isinstance(s, P) else P()), specs,
                           is_leaf=lambda x: isinstance(x, P))
  return jax.device_put(tree, shardings)


def build(cfg: TrainConfig, mesh: jax.sharding.Mesh) -> tuple[Transformer, nnx.Optimizer]:
  """Model and optimizer, their states placed on `mesh`."""
  attention_fn = make_attention(cfg.attention, implementation=cfg.implementation, mesh=mesh,
                                batch_axis=BATCH_AXIS)
  model = Transformer(cfg.model, attention_fn=attention_fn, rngs=nnx.Rngs(cfg.seed))
  nnx.update(model, _place(nnx.state(model), mesh))
  optimizer = make_optimizer(model, cfg)
  nnx.update(optimizer, _place(nnx.state(optimizer), mesh))
  return model, optimizer


def _shard_batch(batch: dict, mesh, *, accum_axis: bool) -> dict:
  spec = P(None, BATCH_AXIS) if accum_axis else P(BATCH_AXIS)
  return jax.device_put(batch, NamedSharding(mesh, spec))


def evaluate(model, eval_batches: list[dict], mesh) -> dict[str, float]:
  sums = [eval_step(model, _shard_batch(b, mesh, accum_axis=False)) for b in eval_batches]
  return summarize_eval(jax.device_get(sums))


class _Throughput:
  """Tokens/s and MFU over the steps since the last report (the compile step excluded)."""

  def __init__(self, cfg: TrainConfig, devices: list):
    self.tokens_per_step = cfg.tokens_per_step
    self.flops_per_step = cfg.model.flops_per_token(cfg.seq_len) * cfg.tokens_per_step
    peak = metrics_lib.peak_flops(devices[0])
    self.peak = None if peak is None else peak * len(devices)
    self.t0, self.steps = None, 0

  def mark(self, steps_done: int) -> dict:
    now, out = time.perf_counter(), {}
    if self.t0 is not None and steps_done > 0:
      dt = now - self.t0
      out["tokens_per_s"] = steps_done * self.tokens_per_step / dt
      if self.peak:
        out["mfu"] = steps_done * self.flops_per_step / dt / self.peak
    self.t0 = now
    return out

  def restart(self) -> None:
    """Starts the next interval now: evaluation and checkpoint time is not training throughput."""
    self.t0 = time.perf_counter()


class _StopOnCtrlC:
  """Within `with`, the first Ctrl-C asks the loop to stop after the current step (it then
  saves a checkpoint and returns); a second one raises KeyboardInterrupt and aborts."""

  def __enter__(self):
    self.requested = False
    # Signal handlers can only be set from the main thread; elsewhere Ctrl-C stays Python's.
    self._previous = None
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGINT, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True
    print("\nCtrl-C: stopping after this step to save a checkpoint (Ctrl-C again aborts).",
          file=sys.stderr, flush=True)

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGINT, self._previous)


def _log_train(log, pending: list, rate: dict) -> dict:
  """Writes pending (step, device metrics) pairs; returns the last one as floats."""
  last = {}
  for step, m in jax.device_get(pending):
    last = {k: float(v) for k, v in m.items()}
    last["loss_bpb"] = last["loss"] / np.log(2)
    log.write({"kind": "train", "step": step, **last, **rate})
  return last


def run(cfg: TrainConfig) -> dict:
  """Trains according to `cfg`.

  Returns:
    {"train": {step: loss}, "eval": last eval metrics, "interrupted": whether Ctrl-C stopped
    the run (after saving a checkpoint of its last step)}.
  """
  check_environment(cfg)
  rundir.check_out_dir(cfg)
  devices = jax.devices()
  mesh = make_mesh(devices)
  out_dir = pathlib.Path(cfg.out_dir)
  if cfg.overwrite:
    rundir.clear(out_dir)
  saved = rundir.read(out_dir) if cfg.resume else None
  run_id = saved["run_id"] if saved else rundir.new_run_id()
  ckpt = Checkpointer(out_dir, run_id=run_id)
  model, optimizer = build(cfg, mesh)
  start, init_step = 0, None
  if cfg.resume:
    start = _restore(cfg, ckpt, model, optimizer)
  elif cfg.init_from is not None:
    init_step = load_params(cfg.init_from, model)
  rundir.write(out_dir, run_id, cfg)
  log = metrics_lib.MetricsLog(out_dir, resume_at=start if cfg.resume else None)
  log.write({"kind": "config", "step": start, "run_id": run_id,
             "config": rundir.config_json(cfg), "devices": [d.device_kind for d in devices],
             "num_params": cfg.model.num_params(), "init_from_step": init_step,
             "resumed_from": start if cfg.resume else None})
  data = DataSource(cfg)
  eval_set = data.eval_batches()
  _print_header(cfg, devices, start)
  if init_step is not None:
    print(f"parameters from {cfg.init_from} (step {init_step}); optimizer and step count fresh")
  with _StopOnCtrlC() as ctrl_c:
    history, last_eval = _loop(cfg, model, optimizer, data, eval_set, mesh, log, ckpt, start,
                               ctrl_c)
  _plot(log.path, out_dir / "loss.png", title=f"{cfg.preset} ({cfg.task})")
  ckpt.close()
  peak = metrics_lib.peak_memory_bytes(devices[0])
  print(f"done: {json.dumps({k: round(v, 4) for k, v in last_eval.items()})}; metrics "
        f"{log.path}, plot {out_dir / 'loss.png'}" +
        (f"; peak memory {peak / 2**30:.2f} GiB" if peak else ""))
  return {"train": history, "eval": last_eval, "interrupted": ctrl_c.requested}


def _restore(cfg: TrainConfig, ckpt: Checkpointer, model, optimizer) -> int:
  """Loads the newest checkpoint that restores; says what it skipped and what cfg changes."""
  start, skipped = ckpt.restore_newest(model, optimizer)
  for step, reason in skipped:
    print(f"skipped checkpoint {step}: {reason} (moved to {ckpt.directory / f'{step}.skipped'})")
  changes = rundir.resume_changes(rundir.saved_config(cfg.out_dir), cfg, start)
  if changes:
    print(f"--resume at step {start} with a config that differs from the saved run's (run.json "
          "records the new one):\n  " + "\n  ".join(changes))
  return start


def _plot(jsonl: pathlib.Path, png: pathlib.Path, title: str) -> None:
  """The loss plot, skipped with a note where matplotlib is missing (the JSONL has it all)."""
  try:
    metrics_lib.plot_losses(jsonl, png, title=title)
  except ImportError as e:
    print(f"no {png.name}: {e}")


def _loop(cfg, model, optimizer, data, eval_set, mesh, log, ckpt, start, ctrl_c):
  history, pending, last_eval = {}, [], {}
  rate = _Throughput(cfg, jax.devices())
  t_start, done = time.time(), start
  if start == 0:  # the curve starts from the untrained model
    last_eval = _eval_and_log(model, eval_set, mesh, log, 0, None)
  bar = tqdm(initial=start, total=cfg.steps, dynamic_ncols=True)
  for step in range(start, cfg.steps):
    batch = _shard_batch(data.train_batch(step), mesh, accum_axis=True)
    pending.append((step, train_step(model, optimizer, batch)))
    done = step + 1
    ready = _steps_to_log(cfg, pending, done, start)
    if ready:
      jax.block_until_ready(ready[-1][1])
      speed = rate.mark(len(ready) if done > start + 1 else 0)
      last = _log_train(log, ready, speed)
      history.update({s: float(m["loss"]) for s, m in jax.device_get(ready)})
      pending = pending[len(ready):]
      bar.set_postfix(_postfix(last, speed))
    bar.update()  # before any break below, so the bar ends at the step reached
    if done % cfg.eval_every == 0 or done == cfg.steps:
      last_eval = _eval_and_log(model, eval_set, mesh, log, done, bar)
      rate.restart()
      if _reached_target(cfg, last_eval):
        bar.write(f"--target-accuracy {cfg.target_accuracy} reached at step {done}.")
        break
    if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
      ckpt.save(done, model, optimizer)
      rate.restart()
    if cfg.max_minutes is not None and time.time() - t_start > 60 * cfg.max_minutes:
      bar.write(f"--max-minutes {cfg.max_minutes} reached at step {done}.")
      break
    if ctrl_c.requested:
      break
  bar.close()
  if pending:
    history.update({s: float(m["loss"]) for s, m in jax.device_get(pending)})
    _log_train(log, pending, {})
  if done % cfg.eval_every and done != cfg.steps and not ctrl_c.requested:
    last_eval = _eval_and_log(model, eval_set, mesh, log, done, None)
  if ckpt.latest_step() != done:
    ckpt.save(done, model, optimizer)
  if ctrl_c.requested:
    print(f"interrupted at step {done}: saved checkpoint {done}; `--resume` (same flags and "
          "--out-dir) continues from it.", file=sys.stderr)
  return history, last_eval


def _steps_to_log(cfg: TrainConfig, pending: list, done: int, start: int) -> list:
  """The pending (step, metrics) pairs to log now, oldest first.

  At a plain logging step all but the newest: waiting for the step just dispatched would drain
  the GPU's queue and leave it idle while the host logs and dispatches the next step (20-30 ms
  per synchronisation for the h200-long preset against ~175 ms steps). The first (compiling)
  step, the last, and steps that evaluate or checkpoint (which wait for the model anyway) log
  everything, so that a checkpoint never precedes its step's record in metrics.jsonl."""
  evaluates = done % cfg.eval_every == 0
  checkpoints = cfg.checkpoint_every and done % cfg.checkpoint_every == 0
  if done == start + 1 or done == cfg.steps or evaluates or checkpoints:
    return pending
  return pending[:-1] if done % cfg.log_every == 0 else []


def _reached_target(cfg: TrainConfig, last_eval: dict) -> bool:
  return (cfg.target_accuracy is not None
          and last_eval.get("val_accuracy", 0.0) >= cfg.target_accuracy)


def _postfix(last: dict, speed: dict) -> dict:
  out = {"loss": f"{last['loss_bpb']:.3f}b/B"}
  if "tokens_per_s" in speed:
    out["tok/s"] = f"{speed['tokens_per_s']:,.0f}"
  out["mfu"] = f"{100 * speed['mfu']:.1f}%" if "mfu" in speed else "n/a"
  return out


def _eval_and_log(model, eval_set, mesh, log, step, bar) -> dict:
  result = evaluate(model, eval_set, mesh)
  log.write({"kind": "eval", "step": step, **result})
  msg = (f"step {step}: val loss {result['val_bpb']:.3f} bits/byte, "
         f"accuracy {100 * result['val_accuracy']:.1f}%")
  (bar.write if bar is not None else print)(msg)
  return result


def _chosen_implementation(cfg: TrainConfig) -> str:
  """The pallas_flash implementation the model's attention calls will run."""
  if cfg.implementation is not None:
    return cfg.implementation
  m = cfg.model
  shape = lambda h: jax.ShapeDtypeStruct((1, cfg.seq_len, h, m.head_dim), m.compute_dtype)  # noqa
  kv = shape(m.n_kv_heads)
  return "auto: " + pallas_flash.explain(shape(m.n_heads), kv, kv, is_causal=True).chosen


def _print_header(cfg: TrainConfig, devices, start: int) -> None:
  m = cfg.model
  print(f"preset {cfg.preset}: task {cfg.task}, {m.num_params() / 1e6:.2f}M params "
        f"(d_model {m.d_model}, {m.n_layers} layers, {m.n_heads}/{m.n_kv_heads} heads, "
        f"{m.dtype}), seq_len {cfg.seq_len}, {cfg.tokens_per_step:,} tokens/step, "
        f"attention {cfg.attention}"
        + (f" ({_chosen_implementation(cfg)})" if cfg.attention == "ours" else "")
        + f", {len(devices)} x {devices[0].device_kind}"
        + (f", resuming at step {start}" if start else ""))
  if cfg.preset == "cpu-demo" and cfg.task == "text":
    print(CPU_DEMO_EXPECTATION)
