"""Orbax checkpoints of the model and optimizer state, for exact `--resume`, and `--init-from`.

The data order is a pure function of (seed, step) and the step count lives in the optimizer
state, so restoring these two is all an exact resume needs.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import shutil

import jax
import orbax.checkpoint as ocp
from flax import nnx


class Checkpointer:
  """Saves {model, optimizer} states under out_dir/checkpoints/<step>; keeps the last few.

  Every checkpoint records `run_id` (rundir.py), and restore_newest skips those of any other
  run: checkpoints of two runs never mix.
  """

  def __init__(self, out_dir: str | pathlib.Path, run_id: str | None = None,
               max_to_keep: int = 2):
    self.directory = pathlib.Path(out_dir).absolute() / "checkpoints"
    self.run_id = run_id
    # Naming the handler lets orbax read a step's metadata without warning that it could not.
    self.manager = ocp.CheckpointManager(
        self.directory, item_handlers=ocp.StandardCheckpointHandler(),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    # orbax declines (returns False) to save at or below its latest step; saying so loudly
    # keeps an older checkpoint from passing for this run's.
    if not self.manager.save(step, args=ocp.args.StandardSave(state),
                             custom_metadata={"run_id": self.run_id}):
      raise RuntimeError(f"orbax did not save step {step}: {self.directory} already holds "
                         f"step {self.latest_step()}.")
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

  def restore_newest(self, model: nnx.Module,
                     optimizer: nnx.Optimizer) -> tuple[int, list[tuple[int, str]]]:
    """Restores the newest checkpoint that restores; returns its step and the (step, reason)
    of each newer one skipped.

    A skipped checkpoint (a truncated file, missing metadata, an empty directory, another
    run's) is moved aside to <step>.skipped once an older one restores: orbax never saves at
    or below an existing step, so left in place it would block saving that step again.
    SystemExit, with every reason, if none restores.
    """
    skipped = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        reason = self._skip_reason(step)
        if reason is None:
          with _asyncio_errors_silenced():
            self.restore(step, model, optimizer)
      except Exception as e:  # noqa: BLE001  orbax and tensorstore raise bare Exceptions
        reason = _one_line(e)
      if reason is None:
        self._move_aside([s for s, _ in skipped])
        return step, skipped
      skipped.append((step, reason))
    if not skipped:
      raise SystemExit(f"--resume: no checkpoint under {self.directory}; a run that stopped "
                       "before its first checkpoint starts again with --overwrite.")
    raise SystemExit(f"--resume: no checkpoint under {self.directory} restores:\n  " +
                     "\n  ".join(f"checkpoint {s}: {r}" for s, r in skipped))

  def _skip_reason(self, step: int) -> str | None:
    """Why `step` cannot be this run's checkpoint, as far as its directory tells."""
    path = self.directory / str(step)
    if not any(path.iterdir()):
      return "empty directory"
    if self.manager.item_metadata(step) is None:  # restoring it fails with a cryptic tree error
      return "its tree metadata (default/_METADATA) is missing"
    saved_by = (self.manager.metadata(step).custom_metadata or {}).get("run_id")
    if saved_by is not None and self.run_id is not None and saved_by != self.run_id:
      return f"written by another run ({saved_by}, not {self.run_id} of run.json)"
    return None

  def _move_aside(self, steps: list[int]) -> None:
    for step in steps:
      target = self.directory / f"{step}.skipped"
      shutil.rmtree(target, ignore_errors=True)
      (self.directory / str(step)).rename(target)
    if steps:
      self.manager.reload()

  def close(self) -> None:
    self.manager.close()


@contextlib.contextmanager
def _asyncio_errors_silenced():
  """orbax reads a checkpoint's arrays in concurrent asyncio tasks; when a damaged file fails
  one, asyncio logs every other failed task with its traceback (hundreds of lines) as it shuts
  down. The first failure is raised, and reported on one line, all the same."""
  logger = logging.getLogger("asyncio")
  level = logger.level
  logger.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    logger.setLevel(level)


def _one_line(error: BaseException) -> str:
  """The innermost cause of `error` on one line: orbax wraps tensorstore's precise message
  (e.g. "OUT_OF_RANGE: ... byte range [76181, 91137) is not valid ...") in a generic one."""
  seen = {id(error)}
  while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
    error = inner
    seen.add(id(error))
  line = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
  return line if len(line) <= 300 else line[:297] + "..."


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
