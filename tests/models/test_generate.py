"""Generation on the KV cache: teacher-forced logits of a full forward equal each step's, the
sampling rules, ragged prompts (each row as its prompt alone), and `python -m train.sample` on a
freshly trained tiny run."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import ModelConfig, Transformer, generate, sample_logits

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)


@pytest.fixture(scope="module")
def model():
  return Transformer(TINY, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("page_size", [None, 4], ids=["contiguous", "paged"])
def test_greedy_steps_equal_the_teacher_forced_forward(model, page_size):
  prompt = jax.random.randint(jax.random.key(1), (2, 5), 0, 256)
  tokens, logits = generate(model, prompt, 6, page_size=page_size, return_logits=True)
  full = model(jnp.concatenate([prompt, tokens], axis=1))  # [2, 11, 256]
  # Step i drew token i from the logits at position P - 1 + i of the whole sequence.
  np.testing.assert_allclose(np.asarray(logits), np.asarray(full[:, 4:10]), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(jnp.argmax(full[:, 4:10], -1)))
  assert int(model.blocks[0].attn.cache_seqlens[...][0]) == 10  # the context, less the last


def test_fp8_cache_generation_follows_the_forward(model):
  """cache_dtype=float8_e4m3fn: e4m3 caches in every layer; each step's logits within a few %
  of the teacher-forced forward on the same tokens (keys and values rounded to e4m3)."""
  prompt = jax.random.randint(jax.random.key(1), (2, 5), 0, 256)
  tokens, logits = generate(model, prompt, 6, cache_dtype=jnp.float8_e4m3fn,
                            return_logits=True)
  assert all(b.attn.cached_key.dtype == jnp.float8_e4m3fn for b in model.blocks)
  full = np.asarray(model(jnp.concatenate([prompt, tokens], axis=1)))
  err = np.abs(np.asarray(logits) - full[:, 4:10]).max() / np.abs(full).max()
  assert err < 0.05, err


def test_sampling_stays_in_the_top_k_and_follows_the_key(model):
  prompt = jnp.full((3, 4), 100, jnp.int32)
  kw = dict(temperature=1.5, top_k=3, return_logits=True)
  tokens, logits = generate(model, prompt, 5, rng=jax.random.key(7), **kw)
  top3 = np.asarray(jax.lax.top_k(logits, 3)[1])  # [B, N, 3]
  assert (top3 == np.asarray(tokens)[..., None]).any(-1).all()
  again, _ = generate(model, prompt, 5, rng=jax.random.key(7), **kw)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(tokens))


def test_sample_logits_rules():
  logits = jnp.array([[0.0, 5.0, 1.0, -2.0]])
  assert int(sample_logits(logits, jax.random.key(0))[0]) == 1
  draws = jax.vmap(lambda k: sample_logits(logits, k, temperature=10.0, top_k=2))(
      jax.random.split(jax.random.key(0), 200))
  assert set(np.asarray(draws).ravel().tolist()) == {1, 2}


def test_sample_command_on_a_trained_run(tmp_path, capsys):
  from train.config import PRESETS
  from train.main import run
  from train.sample import load_model, main

  cfg = dataclasses.replace(
      PRESETS["cpu-demo"], task="retrieval", model=TINY, seq_len=64, batch_size=2, steps=2,
      warmup_steps=1, eval_every=2, eval_batches=1, log_every=1, checkpoint_every=0,
      out_dir=str(tmp_path))
  run(cfg)
  texts = main(["--run", str(tmp_path), "--prompt", "def ", "--max-new-tokens", "8",
                "--temperature", "0", "--batch", "2", "--page-size", "4", "--profile"])
  out = capsys.readouterr().out
  assert "step 2" in out and "tokens/s per sequence" in out and "attention" in out
  trained, _ = load_model(tmp_path)
  want = generate(trained, jnp.array([list(b"def ")] * 2), 8)
  assert texts == ["def " + bytes(np.asarray(row).tolist()).decode("utf-8", "replace")
                   for row in want]
  with pytest.raises(SystemExit, match="--run"):
    main(["--run", str(tmp_path / "missing")])


def test_sample_command_on_a_preset_model(capsys):
  """--preset: a random model of a training preset, for speed (cpu-demo here)."""
  from train.sample import main

  texts = main(["--preset", "cpu-demo", "--max-new-tokens", "4", "--quiet"])
  assert len(texts) == 1 and texts[0].startswith("def ")
  out = capsys.readouterr().out
  assert "preset cpu-demo (random parameters" in out and "--- sequence" not in out


# Paged under -m slow: the cache layout is the decode tests' business; each case compiles four
# shapes.
@pytest.mark.parametrize("page_size", [None, pytest.param(4, marks=pytest.mark.slow)],
                         ids=["contiguous", "paged"])
def test_ragged_prompts_generate_what_each_prompt_alone_does(model, page_size):
  lengths = [5, 2, 7]
  prompt = jax.random.randint(jax.random.key(3), (3, 7), 0, 256)
  row = jnp.arange(7) < jnp.array(lengths)[:, None]  # [B, P] real tokens
  kw = dict(page_size=page_size, return_logits=True)
  tokens, logits = generate(model, jnp.where(row, prompt, 255), 6, prompt_lengths=lengths, **kw)
  again, again_logits = generate(model, jnp.where(row, prompt, -1), 6,
                                 prompt_lengths=jnp.array(lengths, jnp.int16), **kw)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(tokens))  # padding is ignored
  np.testing.assert_array_equal(np.asarray(again_logits), np.asarray(logits))
  # Every row's cache ends at its own context, the last token not yet appended.
  np.testing.assert_array_equal(np.asarray(model.blocks[0].attn.cache_seqlens[...]),
                                np.array(lengths) + 5)
  for b, n in enumerate(lengths):
    alone, alone_logits = generate(model, prompt[b:b + 1, :n], 6, **kw)
    np.testing.assert_array_equal(np.asarray(tokens[b]), np.asarray(alone[0]))
    np.testing.assert_allclose(np.asarray(logits[b]), np.asarray(alone_logits[0]), atol=1e-5)


def test_ragged_sampling_stays_in_the_top_k(model):
  """Sampling on ragged prompts; the logits themselves are checked greedily above."""
  prompt = jax.random.randint(jax.random.key(4), (2, 6), 0, 256)
  tokens, logits = generate(model, prompt, 4, prompt_lengths=[6, 3], rng=jax.random.key(2),
                            temperature=1.0, top_k=2, return_logits=True)
  top2 = np.asarray(jax.lax.top_k(logits, 2)[1])  # [B, N, 2]
  assert (top2 == np.asarray(tokens)[..., None]).any(-1).all()


@pytest.mark.parametrize("lengths, match", [
    ([3], r"\[B\] = \[2\]"), ([[3, 3]], r"\[B\] = \[2\]"), ([3.0, 2.0], "integer"),
    ([0, 2], "1..P = 1..4"), ([2, 5], "1..P = 1..4")])
def test_bad_prompt_lengths_raise(model, lengths, match):
  with pytest.raises(ValueError, match=r"prompt_lengths(.|\n)*" + match):
    generate(model, jnp.zeros((2, 4), jnp.int32), 2, prompt_lengths=jnp.array(lengths))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(temperature=-1.0), ValueError, "`temperature` must be a finite"),
    (dict(temperature=float("nan")), ValueError, "`temperature` must be a finite"),
    (dict(top_k=0), ValueError, r"`top_k` must be None \(all tokens\) or a positive Python int"),
    (dict(page_size=0), ValueError, "`page_size` must be None"),
    (dict(max_new_tokens=2.5), TypeError, "`max_new_tokens` must be a Python int"),
    (dict(prompt=jnp.zeros((4,), jnp.int32)), ValueError, "`prompt` must be an int array"),
    (dict(prompt=jnp.zeros((2, 4))), TypeError, "`prompt` must hold integer token ids"),
    (dict(prompt=jnp.zeros((2, 4), jnp.int32).at[1, 2].set(256)), ValueError,
     r"`prompt` token 256 at \[1, 2\] is outside the vocabulary 0..255"),
    (dict(prompt=jnp.zeros((2, 4), jnp.int32).at[0, 0].set(-5)), ValueError,
     "`prompt` token -5"),
])
def test_bad_sampling_arguments_raise(model, kwargs, error, match):
  args = dict(prompt=jnp.zeros((2, 4), jnp.int32), max_new_tokens=2)
  args.update(kwargs)
  with pytest.raises(error, match=match):
    generate(model, args.pop("prompt"), args.pop("max_new_tokens"), **args)


def test_traced_prompt_lengths_are_clipped(model):
  """Under nnx.jit the lengths cannot be checked; they are clipped to 1..P as documented."""
  prompt = jax.random.randint(jax.random.key(5), (2, 4), 0, 256)
  traced = nnx.jit(lambda m, n: generate(m, prompt, 2, prompt_lengths=n))(
      model, jnp.array([0, 9]))
  want = generate(model, prompt, 2, prompt_lengths=[1, 4])
  np.testing.assert_array_equal(np.asarray(traced), np.asarray(want))
