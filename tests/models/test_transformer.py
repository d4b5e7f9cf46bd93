"""The decoder-only transformer: shapes, causality, document isolation, remat, baselines."""

import dataclasses

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_flash
from models import ModelConfig, Transformer, make_attention

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)


def rel_err(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _model(cfg=TINY, seed=0, kind="ours"):
  impl = "xla" if kind == "ours" else None
  return Transformer(cfg, attention_fn=make_attention(kind, implementation=impl),
                     rngs=nnx.Rngs(seed))


def _tokens(seed, b=2, t=40):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (b, t)), jnp.int32)


# One program per model and input shapes: called op by op, each operation compiles on its own.
_call = nnx.jit(lambda model, *args: model(*args))


def _grads(model, tok):
  """The parameters' gradients of mean(model(tok) ** 2), as leaves."""
  g = nnx.jit(nnx.grad(lambda m: jnp.mean(m(tok) ** 2)))(model)
  return jax.tree.leaves(nnx.state(g, nnx.Param))


def test_shapes_dtype_and_parameter_count():
  model = _model(dataclasses.replace(TINY, dtype="bfloat16"))
  logits = _call(model, _tokens(0))
  assert logits.shape == (2, 40, 256) and logits.dtype == jnp.float32
  params = nnx.state(model, nnx.Param)
  assert sum(x.size for x in jax.tree.leaves(params)) == TINY.num_params()
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))  # master weights


def test_causal_future_tokens_do_not_change_past_logits():
  seed = np.random.randint(1 << 30)
  model, tok = _model(seed=seed), _tokens(seed)
  changed = tok.at[:, 25:].set((tok[:, 25:] + 1) % 256)
  a, b = _call(model, tok), _call(model, changed)
  assert rel_err(b[:, :25], a[:, :25]) < 1e-5
  assert rel_err(b[:, 25:], a[:, 25:]) > 1e-3


def test_packed_documents_match_separate_documents():
  seed = np.random.randint(1 << 30)
  model = _model(seed=seed)
  a, b = _tokens(seed, 1, 23), _tokens(seed + 1, 1, 17)
  seg = jnp.concatenate([jnp.zeros(23, jnp.int32), jnp.ones(17, jnp.int32)])[None]
  pos = jnp.concatenate([jnp.arange(23), jnp.arange(17)])[None]
  packed = _call(model, jnp.concatenate([a, b], 1), seg, pos)
  assert rel_err(packed[:, :23], _call(model, a)) < 2e-5
  assert rel_err(packed[:, 23:], _call(model, b)) < 2e-5


@pytest.mark.slow  # suite time: the next test checks the same gradients under its policy
def test_remat_gives_the_same_gradients():
  seed = np.random.randint(1 << 30)
  tok = _tokens(seed)
  grads = []
  for remat in (False, True):
    grads.append(_grads(_model(dataclasses.replace(TINY, remat=remat), seed=seed), tok))
  for a, b in zip(*grads):
    assert rel_err(a, b) < 1e-5


def test_remat_keeping_attention_saves_the_kernel_outputs_with_the_same_gradients(capsys):
  # Pallas kernels in the interpreter: the policy keeps each layer's attention outputs (o and
  # the log-sum-exp, named by pallas_flash) as residuals, so the backward does not rerun them.
  seed = np.random.randint(1 << 30)
  tok = _tokens(seed, t=64)
  grads, kept = [], []
  for keep in (False, True):
    cfg = dataclasses.replace(TINY, remat=True, remat_keeps_attention=keep)
    model = Transformer(cfg, attention_fn=make_attention("ours", implementation="interpret"),
                        rngs=nnx.Rngs(seed))
    graph, params = nnx.split(model)
    jax.ad_checkpoint.print_saved_residuals(
        lambda p: jnp.mean(nnx.merge(graph, p)(tok) ** 2), params)  # noqa: B023
    kept.append(capsys.readouterr().out.count(f"named '{pallas_flash.CHECKPOINT_NAME}'"))
    grads.append(_grads(model, tok))
  assert kept == [0, 2 * TINY.n_layers], kept
  for a, b in zip(*grads):
    assert rel_err(a, b) < 1e-5


def test_jax_nn_baseline_matches_ours():
  seed = np.random.randint(1 << 30)
  tok = _tokens(seed)
  seg = jnp.cumsum(jax.random.bernoulli(jax.random.key(seed), 0.1, tok.shape), -1)
  ours, xla = _model(seed=seed), _model(seed=seed, kind="xla")
  assert rel_err(_call(xla, tok, seg), _call(ours, tok, seg)) < 2e-5


def test_unknown_attention_kind_is_rejected():
  with pytest.raises(ValueError, match="Unknown attention"):
    make_attention("flash3")
