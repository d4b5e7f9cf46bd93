"""Orbax checkpoints of the model and optimizer state, for exact `--resume`, and `--init-from`.

The data order is a pure function of (seed, step) and the step count lives in the optimizer
state, so restoring these two is all an exact resume needs.
"""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp
from flax import nnx


class Checkpointer:
  """Saves {model, optimizer} states under out_dir/checkpoints/<step>; keeps the last few."""

  def __init__(self, out_dir: str | pathlib.Path, max_to_keep: int = 2):
    directory = pathlib.Path(out_dir).absolute() / "checkpoints"
    self.manager = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    self.manager.save(step, args=ocp.args.StandardSave(state))
    self.manager.wait_until_finished()

  def restore(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    """Loads step's state into `model`/`optimizer` in place, keeping their current shardings."""
    target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        target)
    restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    nnx.update(model, restored["model"])
    nnx.update(optimizer, restored["optimizer"])

  def close(self) -> None:
    self.manager.close()


def _key_str(key) -> str:
  return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  """{'blocks/0/attn/query/kernel/value': shape} for every array of a state or metadata tree.

  Orbax stores list indices as strings and nnx names the variable leaf by attribute; joining
  the plain names makes the two spellings of one parameter compare equal.
  """
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(_key_str(k) for k in path): tuple(leaf.shape) for path, leaf in leaves}


def _shape_mismatches(saved: dict, wanted: dict) -> list[str]:
  """Human-readable differences between two _shapes() maps (first few of each kind)."""
  out = [f"{name}: checkpoint {saved[name]}, this model {wanted[name]}"
         for name in sorted(saved.keys() & wanted.keys()) if saved[name] != wanted[name]]
  out += [f"{name}: missing from the checkpoint" for name in sorted(wanted.keys() - saved.keys())]
  out += [f"{name}: in the checkpoint only" for name in sorted(saved.keys() - wanted.keys())]
  return out[:8] + ([f"... and {len(out) - 8} more"] if len(out) > 8 else [])


def _params_reader(run_dir: str | pathlib.Path) -> tuple[ocp.CheckpointManager, int]:
  """A manager over run_dir/checkpoints that reads trees piecewise, and its latest step."""
  directory = pathlib.Path(run_dir).absolute() / "checkpoints"
  if not directory.is_dir():
    raise SystemExit(f"--init-from {run_dir}: no checkpoint under {directory}.")
  # The plain PyTree handler (what StandardSave wrote through) can restore part of a tree.
  manager = ocp.CheckpointManager(directory, item_handlers=ocp.PyTreeCheckpointHandler())
  step = manager.latest_step()
  if step is None:
    manager.close()
    raise SystemExit(f"--init-from {run_dir}: no checkpoint under {directory}.")
  return manager, step


def latest_checkpoint_step(run_dir: str | pathlib.Path) -> int:
  """The newest finished checkpoint's step under run_dir/checkpoints (SystemExit if none)."""
  manager, step = _params_reader(run_dir)
  manager.close()
  return step


def load_params(run_dir: str | pathlib.Path, model: nnx.Module) -> int:
  """Loads only the parameters of run_dir's latest checkpoint into `model`; returns its step.

  The optimizer state stays fresh (the caller's new schedule starts at step 0). Parameter
  names and shapes must match exactly; the arrays keep the model's current shardings.
  """
  manager, step = _params_reader(run_dir)
  try:
    params = nnx.state(model, nnx.Param)
    saved = manager.item_metadata(step)["model"]
    problems = _shape_mismatches(_shapes(saved), _shapes(params))
    if problems:
      raise SystemExit(f"--init-from {run_dir}: the checkpoint (step {step}) holds a different "
                       "model:\n  " + "\n  ".join(problems))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        params)
    restored = manager.restore(step, args=ocp.args.PyTreeRestore(
        item={"model": abstract},
        restore_args={"model": ocp.checkpoint_utils.construct_restore_args(abstract)},
        partial_restore=True))  # the optimizer's half of the checkpoint is never read
  finally:
    manager.close()
  nnx.update(model, restored["model"])
  return step
