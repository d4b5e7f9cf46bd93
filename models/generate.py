"""Autoregressive generation on the KV cache: the prompt in one call, then one token per step.

Everything after `init_cache` runs in one `jit`: the prefill appends the prompt to every layer's
cache in one decode_attention call per layer (its chunked-prefill "flash" route for long prompts
on Hopper, else the split-KV kernels), then `lax.scan` feeds back one sampled token per step (its
decode path, split-KV). The caches travel through the scan's carry and are donated to
the jit, so each step writes its new token in place.

Ragged prompts (`prompt_lengths`) are right-padded to one length P: the prefill writes all P
positions, then sets every layer's `cache_seqlens` to each row's own length, so the padding lies
past the end of each sequence (never read, and overwritten by the tokens that follow). The first
token is drawn from each row's last real position, and each step appends one token per row at
that row's own position (decode_attention's per-sequence lengths; rotary there too).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.transformer import Transformer
from pallas_flash import validation


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
def _generate(graphdef, cache, rest, prompt, lengths, rng, *, steps, temperature, top_k):
  def forward(cache, tokens, lengths=None):  # [B, T] -> cache, each row's last logits [B, V]
    model = nnx.merge(graphdef, cache, rest)
    logits = model(tokens, decode=True)
    if lengths is None:
      return nnx.state(model, nnx.Cache), logits[:, -1]
    # Ragged: each row ends at its own length; its padding is causally after it.
    for block in model.blocks:
      block.attn.cache_seqlens[...] = lengths
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return nnx.state(model, nnx.Cache), last

  rngs = jax.random.split(rng, steps)
  if lengths is not None:
    p = prompt.shape[1]
    lengths = jnp.clip(lengths, 1, p)  # traced lengths: unchecked, clipped
    # Padding becomes token 0, so any value (e.g. -1, outside the vocabulary) is harmless.
    prompt = jnp.where(jnp.arange(p) < lengths[:, None], prompt, 0)
  cache, logits = forward(cache, prompt, lengths)
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


def _check_prompt_lengths(prompt_lengths, b: int, p: int) -> jax.Array:
  """prompt_lengths as int32 [B], its values checked to lie in 1..P where they are concrete."""
  if not hasattr(prompt_lengths, "dtype"):
    prompt_lengths = np.asarray(prompt_lengths)
  if prompt_lengths.shape != (b,) or not jnp.issubdtype(prompt_lengths.dtype, jnp.integer):
    raise ValueError(f"`prompt_lengths` must be an integer array [B] = [{b}] (one length per "
                     f"prompt row), got {prompt_lengths.dtype} {tuple(prompt_lengths.shape)}.")
  if not isinstance(prompt_lengths, jax.core.Tracer):
    values = np.asarray(prompt_lengths)
    bad = np.flatnonzero((values < 1) | (values > p))
    if bad.size:
      raise ValueError(f"`prompt_lengths` must lie in 1..P = 1..{p} (the prompt's padded "
                       f"length), got {values[bad[0]]} for row {bad[0]}.")
  return jnp.asarray(prompt_lengths, jnp.int32)


def _check_tokens(prompt, prompt_lengths, vocab_size: int) -> None:
  """ValueError for a concrete prompt token outside the vocabulary (an embedding lookup would
  give NaN or wrap around); padding past prompt_lengths may hold anything."""
  if isinstance(prompt, jax.core.Tracer) or isinstance(prompt_lengths, jax.core.Tracer):
    return
  tokens = np.asarray(prompt)
  real = np.arange(tokens.shape[1])[None, :] < (
      tokens.shape[1] if prompt_lengths is None else np.asarray(prompt_lengths)[:, None])
  bad = np.argwhere(real & ((tokens < 0) | (tokens >= vocab_size)))
  if bad.size:
    row, col = (int(x) for x in bad[0])
    raise ValueError(f"`prompt` token {int(tokens[row, col])} at [{row}, {col}] is outside the "
                     f"vocabulary 0..{vocab_size - 1}.")


def _check_sampling(prompt, max_new_tokens, temperature, top_k, page_size) -> None:
  """ValueError / TypeError naming the argument for what `generate` cannot take."""
  if not hasattr(prompt, "shape") or prompt.ndim != 2 or prompt.shape[0] < 1:
    raise ValueError(f"`prompt` must be an int array [batch >= 1, prompt_len], got "
                     f"{getattr(prompt, 'shape', type(prompt).__name__)}.")
  if not jnp.issubdtype(prompt.dtype, jnp.integer):
    raise TypeError(f"`prompt` must hold integer token ids, got {prompt.dtype}.")
  if not validation.is_int(max_new_tokens):
    raise TypeError(f"`max_new_tokens` must be a Python int, got {max_new_tokens!r}.")
  if (not isinstance(temperature, (int, float)) or isinstance(temperature, bool)
      or not math.isfinite(temperature) or temperature < 0):
    raise ValueError(f"`temperature` must be a finite Python float >= 0 (0: greedy), got "
                     f"{temperature!r}.")
  validation.check_positive_int("top_k", top_k, none="all tokens")
  validation.check_positive_int("page_size", page_size, none="a contiguous cache")


def generate(model: Transformer, prompt: jax.Array, max_new_tokens: int, *,
             prompt_lengths: jax.Array | None = None, rng: jax.Array | None = None,
             temperature: float = 0.0, top_k: int | None = None, page_size: int | None = None,
             cache_dtype=None, return_logits: bool = False):
  """Continues each prompt by `max_new_tokens` tokens.

  Args:
    model: the language model; its KV caches are (re)initialised for this call and hold the
      whole context afterwards (row b's first prompt_lengths[b] + N - 1 positions are real).
    prompt: [B, P] int32 tokens, one prompt per row, P >= 1; right-padded to P when
      `prompt_lengths` is given.
    max_new_tokens: N >= 1 tokens to generate.
    prompt_lengths: int [B], the real length of each row's prompt, in 1..P; the tokens after it
      are padding of any value, never attended to (None: every row has length P). At
      temperature 0 each row then generates exactly what its prompt alone (unpadded, batch 1)
      would; when sampling, a row's draws also depend on its index in the batch (one key per
      step for the whole batch). Values outside
      1..P raise a ValueError when concrete; traced values cannot be checked and are clipped
      to 1..P.
    rng: a PRNG key for sampling (default key 0; unused at temperature 0).
    temperature, top_k: greedy at 0; else sampling (sample_logits).
    page_size: a paged KV cache with pages of this many tokens (None: contiguous).
    cache_dtype: the KV cache's dtype: None for the model's compute dtype, or
      jnp.float8_e4m3fn (half the bytes of bf16 to hold and read; descales 1.0, see
      FlashMultiHeadAttention.init_cache).
    return_logits: also return the logits [B, N, V] each new token was drawn from.

  Returns:
    tokens [B, N] int32, the N new tokens of each row, which start right after its own prompt
    (padding is not repeated in them); with return_logits also the logits [B, N, V].
  """
  _check_sampling(prompt, max_new_tokens, temperature, top_k, page_size)
  b, p = prompt.shape
  if p < 1 or max_new_tokens < 1:
    raise ValueError(f"Need a prompt of at least one token and max_new_tokens >= 1, got prompt "
                     f"{prompt.shape} and {max_new_tokens}.")
  if prompt_lengths is not None:
    prompt_lengths = _check_prompt_lengths(prompt_lengths, b, p)
  _check_tokens(prompt, prompt_lengths, model.config.vocab_size)
  length = p + max_new_tokens
  if page_size is not None:
    length = -(-length // page_size) * page_size
  model.init_cache(b, length, page_size=page_size, dtype=cache_dtype)
  graphdef, cache, rest = nnx.split(model, nnx.Cache, ...)
  rng = jax.random.key(0) if rng is None else rng
  tokens, logits, cache = _generate(graphdef, cache, rest, jnp.asarray(prompt, jnp.int32),
                                    prompt_lengths, rng,
                                    steps=max_new_tokens, temperature=float(temperature),
                                    top_k=top_k)
  nnx.update(model, cache)
  return (tokens, logits) if return_logits else tokens
