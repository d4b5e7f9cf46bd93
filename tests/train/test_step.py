"""Training on CPU: the loss falls, accumulation is exact, data parallelism, clear config errors."""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from models import ModelConfig, Transformer, make_attention
from train.config import PRESETS, parse_args, validate
from train.data import DataSource
from train.main import run
from train.step import _accumulated_grads

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = dataclasses.replace(
    PRESETS["cpu-demo"], model=ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2),
    seq_len=128, batch_size=4, steps=30, warmup_steps=3, lr=1e-2, corpus_mb=1.0,
    eval_every=30, eval_batches=1, log_every=5, checkpoint_every=0)


def test_a_few_steps_lower_the_loss(tmp_path):
  result = run(dataclasses.replace(TINY, out_dir=str(tmp_path)))
  losses = [result["train"][s] for s in sorted(result["train"])]
  assert len(losses) == TINY.steps
  assert np.mean(losses[-5:]) < np.mean(losses[:3]) - 1.0, losses  # nats
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert {"config", "train", "eval"} <= {r["kind"] for r in records}
  assert (tmp_path / "loss.png").stat().st_size > 1000
  assert 0 < result["eval"]["val_bpb"] < 8


def test_gradient_accumulation_equals_one_large_batch():
  cfg = dataclasses.replace(TINY, task="retrieval", batch_size=2, grad_accum=2)  # 4 scored/row
  batch = jax.tree.map(np.asarray, DataSource(cfg).train_batch(0))  # [2, 2, T]
  model = Transformer(cfg.model, attention_fn=make_attention("ours", implementation="xla"),
                      rngs=nnx.Rngs(np.random.randint(1 << 30)))
  accumulated, _ = _accumulated_grads(model, batch)
  whole, _ = _accumulated_grads(model, {k: v.reshape(1, 4, -1) for k, v in batch.items()})
  for a, b in zip(jax.tree.leaves(accumulated), jax.tree.leaves(whole)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * float(np.max(np.abs(b))))



_TINY_ARGS = ["--seq-len", "128", "--batch-size", "4", "--steps", "4", "--warmup-steps", "1",
              "--d-model", "32", "--n-layers", "2", "--corpus-mb", "1", "--eval-every", "4",
              "--eval-batches", "1", "--checkpoint-every", "0"]


def test_two_devices_train_like_one(tmp_path):
  """Data parallelism over 2 (forced host) devices gives the single-device losses."""
  one = run(parse_args(_TINY_ARGS + ["--out-dir", str(tmp_path / "one")]))
  code = (f"import jax, json, sys; sys.path.insert(0, {str(ROOT)!r})\n"
          "from train.config import parse_args\nfrom train.main import run\n"
          "assert len(jax.devices()) == 2, jax.devices()\n"
          f"r = run(parse_args({_TINY_ARGS + ['--out-dir', str(tmp_path / 'two')]!r}))\n"
          "print('LOSSES', json.dumps([r['train'][s] for s in sorted(r['train'])]))")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  two = json.loads(proc.stdout.split("LOSSES", 1)[1])
  np.testing.assert_allclose(two, [one["train"][s] for s in sorted(one["train"])], rtol=1e-4)


@pytest.mark.parametrize("argv,message", [
    (["--preset", "nope"], "Unknown preset"),
    (["--preset", "h200-long"], "needs a GPU"),
    (["--implementation", "triton"], "cannot run here"),
    (["--task", "poetry"], "--task must be one of"),
    (["--attention", "cudnn"], "needs an NVIDIA GPU"),
    (["--d-model", "130"], "divisible by n_heads"),
    (["--eval-every", "0"], "--eval-every must be at least 1, got 0"),
    (["--log-every", "0"], "--log-every must be at least 1, got 0"),
    (["--lr", "-1"], "--lr must be at least 0.0, got -1.0"),
    (["--checkpoint-every", "-5"], "--checkpoint-every must be at least 0"),
    (["--max-minutes", "nan"], "--max-minutes must be at least 0.0, got nan"),
    (["--resume", "--overwrite"], "pass one of them"),
], ids=["preset", "gpu-preset", "implementation", "task", "cudnn", "model", "eval-every",
        "log-every", "lr", "checkpoint-every", "max-minutes", "resume-overwrite"])
def test_bad_configuration_fails_at_start_with_a_clear_message(argv, message, tmp_path):
  from train.main import check_environment

  with pytest.raises(SystemExit, match=message):
    check_environment(parse_args(argv + ["--out-dir", str(tmp_path)]))


@pytest.mark.parametrize("preset,flag,default", [
    ("cpu-demo", "--seq-len SEQ_LEN", "1024"),
    ("h200-long", "--seq-len SEQ_LEN", "16384"),
    ("cpu-demo", "--lr LR", "0.003"),
    ("cpu-demo", "--implementation IMPLEMENTATION", "xla"),
    ("h200-long", "--implementation IMPLEMENTATION", "auto"),
    ("h200-long", "--remat-keeps-attention, --no-remat-keeps-attention", "True"),
])
def test_help_shows_the_presets_values(preset, flag, default, capsys):
  with pytest.raises(SystemExit) as exit_:
    parse_args(["--preset", preset, "--help"])
  assert exit_.value.code == 0
  text = " ".join(capsys.readouterr().out.split())  # unwrapped
  assert "(default: None)" not in text
  # the flag's entry in the options list (the usage line brackets it: "[--seq-len SEQ_LEN]")
  shown = re.search(re.escape(flag) + r" [^[]*?\(default: ([^)]*)\)", text)
  assert shown is not None and shown.group(1) == default, text


def test_batch_must_divide_over_devices():
  with pytest.raises(SystemExit, match="divisible by the number of devices"):
    validate(dataclasses.replace(TINY, batch_size=3), num_devices=2)


@pytest.mark.gpu
def test_gpu_kernels_train_in_bf16(tmp_path):
  """The automatic (fastest GPU) implementation trains the model in bf16 and lowers the loss."""
  model = ModelConfig(d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, dtype="bfloat16")
  cfg = dataclasses.replace(TINY, model=model, implementation=None, seq_len=1024,
                            out_dir=str(tmp_path))
  losses = [v for _, v in sorted(run(cfg)["train"].items())]
  assert np.mean(losses[-5:]) < np.mean(losses[:3]) - 1.0, losses
