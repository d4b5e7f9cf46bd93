"""TrainConfig, the presets, and the command line that fills them in."""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib

from models.attention import ATTENTION_KINDS
from models.config import ModelConfig

TASKS = ("text", "retrieval")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """Everything one training run depends on; a run is a pure function of it (and the devices).

  Attributes:
    preset: the name this config started from.
    model: model sizes.
    task: "text" (byte-level LM on the Python standard library's sources) or "retrieval"
      (a key:value needle planted early in a long random sequence, queried at the end).
    seq_len: T tokens per sequence; batch_size: sequences per micro-batch (all devices
      together); grad_accum: micro-batches per optimizer step.
    steps: optimizer steps; warmup_steps, lr, min_lr_ratio: linear warm-up, then cosine decay
      to lr * min_lr_ratio; weight_decay, b1, b2: AdamW; grad_clip: global-norm clipping.
    attention: "ours" (pallas_flash), "cudnn" or "xla" (jax.nn.dot_product_attention baselines).
    implementation: pallas_flash implementation for attention="ours" (None: fastest here).
    segment_ids: mask attention at document boundaries of packed text (needs "ours" to be
      O(T) memory: the baselines build a dense mask).
    eval_every, eval_batches: periodic evaluation; log_every: progress-bar update interval.
    checkpoint_every: steps between checkpoints (0: only at the end); out_dir: the run's
      directory (run.json, metrics, plot and checkpoints; train/rundir.py); resume: continue
      the run in out_dir from its newest checkpoint that restores; overwrite: delete the run
      already in out_dir (its files only) and start this one there.
    init_from: a previous run's out_dir whose latest checkpoint supplies the initial
      parameters (not the optimizer state or step: a fresh schedule starts at step 0); the
      model must be the same, the data (seq_len, batch) may differ. Ignored with resume.
    max_minutes: stop early (with a final eval and checkpoint) after this wall time.
    target_accuracy: stop early once an evaluation's val_accuracy reaches this fraction.
    corpus_mb: how much of the standard library to read; num_pairs: needles per sequence.
    seed: parameters and data order.
  """

  preset: str = "cpu-demo"
  model: ModelConfig = ModelConfig()
  task: str = "text"
  seq_len: int = 1024
  batch_size: int = 8
  grad_accum: int = 1
  steps: int = 300
  warmup_steps: int = 30
  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  attention: str = "ours"
  implementation: str | None = "xla"
  segment_ids: bool = True
  eval_every: int = 50
  eval_batches: int = 4
  log_every: int = 5
  checkpoint_every: int = 100
  out_dir: str = "runs/cpu-demo"
  resume: bool = False
  overwrite: bool = False
  init_from: str | None = None
  max_minutes: float | None = None
  target_accuracy: float | None = None
  corpus_mb: float = 8.0
  num_pairs: int = 1
  seed: int = 0

  @property
  def tokens_per_step(self) -> int:
    return self.seq_len * self.batch_size * self.grad_accum


PRESETS: dict[str, TrainConfig] = {
    # 0.85M parameters, 1K context, blockwise XLA attention: ~4K tokens per step at 0.7-1.5 s
    # on 2 CPU cores (float32: bf16 matmuls are slower than f32 on CPUs), 300 steps in ~5 min.
    "cpu-demo": TrainConfig(
        model=ModelConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2),
        batch_size=4),
    # ~124M parameters at 16K context in bf16 on one H200 with our kernels. head_dim 128 and
    # GQA 8:4; blocks are recomputed in the backward pass so 128K+ tokens fit, all but their
    # attention forward, whose outputs are kept (+0.7 GiB at 2x16K, a 13 % shorter step).
    "h200-long": TrainConfig(
        preset="h200-long",
        model=ModelConfig(d_model=1024, n_layers=12, n_heads=8, n_kv_heads=4, d_ff=2304,
                          rope_theta=500_000.0, dtype="bfloat16", remat=True,
                          remat_keeps_attention=True),
        seq_len=16_384, batch_size=2, steps=400, warmup_steps=40, lr=1e-3,
        implementation=None, eval_every=100, eval_batches=2, log_every=5,
        checkpoint_every=200, out_dir="runs/h200-long", corpus_mb=32.0),
    # The retrieval task on one H200 (scripts/retrieval_gpu.sh): 3.3M parameters, 4 heads of
    # dimension 64 so that attention, not the tiny matmuls, is the work at 16K. Only 4 tokens
    # per row are scored, so rows per second is what learns. rope_theta 1e6 keeps the slowest
    # rotary channels nearly still over 16K tokens, so key matching learned at 1K carries over.
    "h200-retrieval": TrainConfig(
        preset="h200-retrieval", task="retrieval",
        model=ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4,
                          rope_theta=1_000_000.0, dtype="bfloat16"),
        seq_len=16_384, batch_size=16, steps=600, warmup_steps=20, lr=1e-3,
        implementation=None, eval_every=50, eval_batches=8, log_every=10, checkpoint_every=0,
        out_dir="runs/h200-retrieval"),
}


def _shown_default(preset: TrainConfig, flag: str) -> str:
  """' (default: X)' for a flag, X the preset's value; '' where the preset sets none."""
  name = flag.removeprefix("--").replace("-", "_")
  value = getattr(preset if hasattr(preset, name) else preset.model, name)
  if name == "implementation" and value is None:
    value = "auto"
  return "" if value in (None, "") else f" (default: {value})"


def _parser(preset_name: str) -> argparse.ArgumentParser:
  """The command line, its help showing `preset_name`'s values as the defaults.

  Every flag defaults to None, meaning "the preset's", so that only the flags given override it.
  """
  preset = PRESETS[preset_name]
  p = argparse.ArgumentParser(
      prog="python -m train", description="Train a byte-level transformer on pallas_flash.",
      epilog=f"Defaults shown are preset {preset_name}'s; `--preset NAME --help` shows another's.")
  p.add_argument("--preset", default="cpu-demo",
                 help=f"one of {sorted(PRESETS)} (default: cpu-demo)")
  add = lambda name, typ, help: p.add_argument(  # noqa: E731
      name, type=typ, default=None, help=help + _shown_default(preset, name))
  add("--task", str, f"one of {TASKS}")
  add("--seq-len", int, "tokens per sequence")
  add("--batch-size", int, "sequences per micro-batch, all devices together")
  add("--grad-accum", int, "micro-batches per optimizer step")
  add("--steps", int, "optimizer steps")
  add("--warmup-steps", int, "linear warm-up steps")
  add("--lr", float, "peak learning rate")
  add("--attention", str, f"one of {ATTENTION_KINDS}")
  add("--implementation", str, "pallas_flash implementation for --attention ours "
      "(auto = fastest available)")
  add("--eval-every", int, "steps between evaluations (and at the last step)")
  add("--eval-batches", int, "batches per evaluation")
  add("--log-every", int, "steps between progress/metrics updates")
  add("--corpus-mb", float, "MB of standard-library source to read")
  add("--checkpoint-every", int, "steps between checkpoints (0: only at the end)")
  add("--out-dir", str, "the run's directory: run.json, metrics.jsonl, loss.png, checkpoints")
  add("--max-minutes", float, "stop (eval + checkpoint) after this wall time")
  add("--target-accuracy", float, "stop (eval + checkpoint) once val_accuracy reaches this "
      "fraction")
  add("--init-from", str, "start from the parameters of this run directory's latest "
      "checkpoint (fresh optimizer, step 0; same model flags)")
  add("--num-pairs", int, "retrieval: key:value needles per sequence")
  add("--seed", int, "seed of parameters and data order")
  add("--d-model", int, "model width")
  add("--n-layers", int, "model depth")
  add("--n-heads", int, "query heads")
  add("--n-kv-heads", int, "key/value heads (GQA)")
  add("--rope-theta", float, "rotary base period")
  add("--dtype", str, "compute dtype: float32 or bfloat16")
  p.add_argument("--remat-keeps-attention", action=argparse.BooleanOptionalAction, default=None,
                 help="with remat (h200-long), keep attention's outputs instead of running its "
                      "forward again in the backward pass"
                      + _shown_default(preset, "--remat-keeps-attention"))
  p.add_argument("--no-segment-ids", action="store_true",
                 help="let packed documents attend to each other (plain causal attention)")
  p.add_argument("--resume", action="store_true",
                 help="continue the run in --out-dir from its newest checkpoint that restores")
  p.add_argument("--overwrite", action="store_true",
                 help="delete the run already in --out-dir (its run.json, metrics.jsonl, "
                      "loss.png and checkpoints) and start this one there")
  return p


def _preset_name(argv: list[str] | None) -> str:
  """--preset's value, read before the full parser exists (its help shows that preset's)."""
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument("--preset", default="cpu-demo")
  name = pre.parse_known_args(argv)[0].preset
  if name not in PRESETS:
    raise SystemExit(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
  return name


_MODEL_FLAGS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "rope_theta", "dtype")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
  """The preset named by --preset with every given flag applied on top; validated."""
  args = _parser(_preset_name(argv)).parse_args(argv)
  cfg = PRESETS[args.preset]
  model_kw = {k: getattr(args, k) for k in _MODEL_FLAGS + ("remat_keeps_attention",)
              if getattr(args, k) is not None}
  top = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
         if f.name not in ("preset", "model", "resume", "overwrite", "segment_ids",
                           "implementation")
         and getattr(args, f.name, None) is not None}
  if args.implementation is not None:
    top["implementation"] = None if args.implementation == "auto" else args.implementation
  if args.attention not in (None, "ours") and args.implementation is None:
    top["implementation"] = None
  try:
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model_kw), **top,
                              resume=args.resume, overwrite=args.overwrite,
                              segment_ids=not args.no_segment_ids)
  except ValueError as e:
    raise SystemExit(f"Bad model configuration: {e}") from None
  validate(cfg)
  return cfg


# The smallest value each numeric setting can run with (checked before anything compiles).
_AT_LEAST = {"seq_len": 1, "batch_size": 1, "grad_accum": 1, "steps": 1, "warmup_steps": 0,
             "lr": 0.0, "eval_every": 1, "eval_batches": 1, "log_every": 1,
             "checkpoint_every": 0, "max_minutes": 0.0, "num_pairs": 1}


def validate(cfg: TrainConfig, num_devices: int = 1) -> None:
  """Raises SystemExit with a clear message for any configuration that cannot run."""
  problems = []
  if cfg.task not in TASKS:
    problems.append(f"--task must be one of {TASKS}, got {cfg.task!r}")
  if cfg.attention not in ATTENTION_KINDS:
    problems.append(f"--attention must be one of {ATTENTION_KINDS}, got {cfg.attention!r}")
  for name, least in _AT_LEAST.items():
    value = getattr(cfg, name)
    if value is not None and not (math.isfinite(value) and value >= least):
      problems.append(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
  if cfg.resume and cfg.overwrite:
    problems.append("--resume continues the run in --out-dir and --overwrite deletes it; pass "
                    "one of them")
  if cfg.batch_size % num_devices:
    problems.append(f"batch_size ({cfg.batch_size}) must be divisible by the number of devices "
                    f"({num_devices}) for data parallelism")
  if cfg.task == "retrieval" and cfg.seq_len < 64 * max(cfg.num_pairs, 1):
    problems.append(f"retrieval needs seq_len >= 64 * num_pairs, got {cfg.seq_len}")
  if cfg.warmup_steps >= cfg.steps:
    problems.append(f"warmup_steps ({cfg.warmup_steps}) must be < steps ({cfg.steps})")
  if cfg.target_accuracy is not None and not 0 < cfg.target_accuracy <= 1:
    problems.append(f"target_accuracy is a fraction in (0, 1], got {cfg.target_accuracy}")
  if cfg.init_from is not None and _same_dir(cfg.init_from, cfg.out_dir):
    problems.append("--init-from must name another run's directory, not --out-dir (a new run "
                    "replaces its own metrics and checkpoints; use --resume to continue it)")
  if problems:
    raise SystemExit("Bad training configuration:\n  " + "\n  ".join(problems))


def _same_dir(a: str, b: str) -> bool:
  return pathlib.Path(a).absolute().resolve() == pathlib.Path(b).absolute().resolve()
