"""Orbax checkpoints of the model and optimizer state, for exact `--resume`.

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
