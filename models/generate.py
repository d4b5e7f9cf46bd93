"""Autoregressive generation on the KV cache: the prompt in one call, then one token per step.

Everything after `init_cache` runs in one `jit`: the prefill appends the prompt to every layer's
cache (decode_attention's chunked-prefill path), then `lax.scan` feeds back one sampled token per
step (its decode path, split-KV). The caches travel through the scan's carry and are donated to
the jit, so each step writes its new token in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.transformer import Transformer


def sample_logits(logits: jax.Array, rng: jax.Array, *, temperature: float = 0.0,
                  top_k: int | None = None) -> jax.Array:
  """Next tokens [B] int32 from logits [B, V]: argmax at temperature 0, else a draw from
  softmax(logits / temperature) restricted to the top_k most likely tokens (None: all)."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(rng, logits).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "temperature", "top_k"),
                   donate_argnames=("cache",))
def _generate(graphdef, cache, rest, prompt, rng, *, steps, temperature, top_k):
  def forward(cache, tokens):  # [B, T] -> cache, last logits [B, V]
    model = nnx.merge(graphdef, cache, rest)
    logits = model(tokens, decode=True)[:, -1]
    return nnx.state(model, nnx.Cache), logits

  rngs = jax.random.split(rng, steps)
  cache, logits = forward(cache, prompt)
  first = sample_logits(logits, rngs[0], temperature=temperature, top_k=top_k)

  def step(carry, rng_t):
    cache, token = carry
    cache, logits = forward(cache, token[:, None])
    nxt = sample_logits(logits, rng_t, temperature=temperature, top_k=top_k)
    return (cache, nxt), (nxt, logits)

  (cache, _), (tokens, step_logits) = jax.lax.scan(step, (cache, first), rngs[1:])
  tokens = jnp.concatenate([first[:, None], tokens.T], axis=1)  # [B, steps]
  step_logits = jnp.concatenate([logits[:, None], step_logits.transpose(1, 0, 2)], axis=1)
  return tokens, step_logits, cache


def generate(model: Transformer, prompt: jax.Array, max_new_tokens: int, *,
             rng: jax.Array | None = None, temperature: float = 0.0, top_k: int | None = None,
             page_size: int | None = None, return_logits: bool = False):
  """Continues each prompt by `max_new_tokens` tokens.

  Args:
    model: the language model; its KV caches are (re)initialised for this call and hold the
      whole context afterwards.
    prompt: [B, P] int32 tokens, one prompt per row, all of length P >= 1.
    max_new_tokens: N >= 1 tokens to generate.
    rng: a PRNG key for sampling (default key 0; unused at temperature 0).
    temperature, top_k: greedy at 0; else sampling (sample_logits).
    page_size: a paged KV cache with pages of this many tokens (None: contiguous).
    return_logits: also return the logits [B, N, V] each new token was drawn from.

  Returns:
    tokens [B, N] int32 (and the logits).
  """
  b, p = prompt.shape
  if p < 1 or max_new_tokens < 1:
    raise ValueError(f"Need a prompt of at least one token and max_new_tokens >= 1, got prompt "
                     f"{prompt.shape} and {max_new_tokens}.")
  length = p + max_new_tokens
  if page_size is not None:
    length = -(-length // page_size) * page_size
  model.init_cache(b, length, page_size=page_size)
  graphdef, cache, rest = nnx.split(model, nnx.Cache, ...)
  rng = jax.random.key(0) if rng is None else rng
  tokens, logits, cache = _generate(graphdef, cache, rest, jnp.asarray(prompt, jnp.int32), rng,
                                    steps=max_new_tokens, temperature=float(temperature),
                                    top_k=top_k)
  nnx.update(model, cache)
  return (tokens, logits) if return_logits else tokens
