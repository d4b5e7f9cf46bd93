"""The optimizer, the jit-compiled train step (with gradient accumulation) and the eval step."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.transformer import Transformer
from train.config import TrainConfig


def make_optimizer(model: Transformer, cfg: TrainConfig) -> nnx.Optimizer:
  """AdamW with linear warm-up and cosine decay, after global-norm clipping.

  Weight decay applies to matrices only (norm scales are not decayed). The optimizer state and
  the parameters are float32 (the master weights); the model casts them to its compute dtype.
  """
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
      decay_steps=cfg.steps, end_value=cfg.lr * cfg.min_lr_ratio)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
  tx = optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                  mask=decay_mask))
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def _forward(model: Transformer, batch: dict) -> jax.Array:
  """Logits [B, T, V] of a micro-batch of [B, T] arrays."""
  return model(batch["tokens"], batch.get("segment_ids"), batch["positions"])


def _scores(logits: jax.Array, batch: dict) -> dict[str, jax.Array]:
  """Summed loss (nats), correct predictions and scored-token count of [B, T] arrays."""
  mask = batch["loss_mask"]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # [B, T]
  correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
  return dict(loss_sum=jnp.sum(nll * mask), correct=jnp.sum(correct * mask),
              count=jnp.sum(mask))


def loss_fn(model: Transformer, batch: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean next-token loss over scored tokens (nats), and the raw sums for metrics."""
  sums = _scores(_forward(model, batch), batch)
  return sums["loss_sum"] / jnp.maximum(sums["count"], 1.0), sums


def _accumulated_grads(model: Transformer, batch: dict):
  """Mean gradient over the leading [A] micro-batch axis, one micro-batch live at a time."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def micro(grad_sum, micro_batch):
    def loss_of(p):
      return loss_fn(nnx.merge(graphdef, p, rest), micro_batch)

    (_, sums), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    return jax.tree.map(jnp.add, grad_sum, grads), sums

  zeros = jax.tree.map(jnp.zeros_like, params)
  grad_sum, sums = jax.lax.scan(micro, zeros, batch)
  num_micro = jax.tree.leaves(batch)[0].shape[0]
  grads = jax.tree.map(lambda g: g / num_micro, grad_sum)
  return grads, jax.tree.map(jnp.sum, sums)


@nnx.jit(donate_argnums=(0, 1))
def train_step(model: Transformer, optimizer: nnx.Optimizer, batch: dict) -> dict:
  """One optimizer step on a batch of [A, B, T] arrays; returns scalar metrics.

  Returns:
    loss (mean nats per scored token), accuracy, grad_norm (before clipping).
  """
  grads, sums = _accumulated_grads(model, batch)
  optimizer.update(model, grads)
  count = jnp.maximum(sums["count"], 1.0)
  return dict(loss=sums["loss_sum"] / count, accuracy=sums["correct"] / count,
              grad_norm=optax.tree.norm(grads))


@nnx.jit
def eval_step(model: Transformer, batch: dict) -> dict:
  """Sums of loss, correct predictions and scored tokens on one [B, T] batch."""
  return _scores(_forward(model, batch), batch)


def summarize_eval(sums: list[dict]) -> dict[str, float]:
  """Validation loss (nats), bits per byte and accuracy from eval_step sums."""
  total = {k: float(sum(s[k] for s in sums)) for k in sums[0]}
  loss = total["loss_sum"] / max(total["count"], 1.0)
  return dict(val_loss=loss, val_bpb=loss / math.log(2),
              val_accuracy=total["correct"] / max(total["count"], 1.0))
