"""Text from a trained run: its latest checkpoint continues a prompt on the KV cache.

  python -m train.sample --run runs/cpu-demo --prompt "def "
  python -m train.sample --run runs/h200-long --batch 64 --max-new-tokens 512 --profile
  python -m train.sample --preset h200-long --batch 64 --max-new-tokens 512 --profile --quiet

Reads the run's model config (the first record of its metrics.jsonl) and the parameters of
its latest checkpoint, then generates with `models.generate` (prefill and decode steps in one
jit). Prints the text of each sequence; on a GPU it also reports tokens/s per sequence and in
total. --profile times one decode step and the attention calls inside it (decode_attention at
the step's shapes and cache layout) to report attention's share of a step. --preset NAME
instead of --run samples from a freshly initialised model of that training preset (speed only:
the text is noise).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_flash
from models import ModelConfig, Transformer, generate
from train import metrics as metrics_lib
from train.checkpoint import load_params


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m train.sample", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--run", help="a training run's out_dir (with checkpoints/)")
  src.add_argument("--preset", help="a training preset's model, randomly initialised (speed)")
  p.add_argument("--prompt", default="def ", help="text to continue (bytes are tokens)")
  p.add_argument("--max-new-tokens", type=int, default=256)
  p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
  p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest (0: all)")
  p.add_argument("--batch", type=int, default=1, help="sequences continuing the same prompt")
  p.add_argument("--page-size", type=int, default=None, help="a paged KV cache (tokens/page)")
  p.add_argument("--fp8-cache", action="store_true",
                 help="an FP8 (e4m3) KV cache, descales 1.0 (half the bytes of bf16)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--profile", action="store_true",
                 help="report a decode step's time and attention's share of it")
  p.add_argument("--quiet", action="store_true", help="do not print the sequences")
  return p.parse_args(argv)


def run_model_config(run_dir: str | pathlib.Path) -> ModelConfig:
  """The ModelConfig a run trained, from the config record of its metrics.jsonl."""
  log = pathlib.Path(run_dir) / "metrics.jsonl"
  if not log.exists():
    raise SystemExit(f"--run {run_dir}: no metrics.jsonl there, so its model is unknown "
                     "(is it a `python -m train` out_dir?).")
  record = next((r for r in metrics_lib.read_jsonl(log) if r.get("kind") == "config"), None)
  if record is None:
    raise SystemExit(f"--run {run_dir}: metrics.jsonl has no config record.")
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  return ModelConfig(**{k: v for k, v in record["config"]["model"].items() if k in fields})


def load_model(run_dir: str | pathlib.Path) -> tuple[Transformer, int]:
  """The run's model with its latest checkpoint's parameters, and that checkpoint's step."""
  config = run_model_config(run_dir)
  model = Transformer(config, rngs=nnx.Rngs(0))
  try:
    step = load_params(run_dir, model)
  except SystemExit as e:  # its messages name train's --init-from flag
    raise SystemExit(str(e).replace("--init-from", "--run")) from None
  return model, step


def encode(text: str) -> list[int]:
  return list(text.encode("utf-8"))


def decode_bytes(tokens) -> str:
  return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def _timed(fn) -> tuple[object, float]:
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


def attention_share(model: Transformer, batch: int, context: int, step_s: float, *,
                    fp8_cache: bool = False, page_size: int | None = None) -> dict:
  """decode_attention's time in one decode step: every layer's call at the step's shapes (one
  query token against `context` cached tokens, in the compute dtype or e4m3, contiguous or in
  pages of `page_size` as the step's cache), timed alone on random values."""
  c = model.config
  dtype = c.compute_dtype
  kq, kc = jax.random.split(jax.random.key(0))
  q = jax.random.normal(kq, (batch, 1, c.n_heads, c.head_dim), dtype)
  rows, extra = (batch, context), {}
  if page_size:  # every sequence's pages in order: the reads of the step's paged cache
    pages = -(-context // page_size)
    rows = (batch * pages, page_size)
    extra["page_table"] = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
  cache = jax.random.normal(kc, (*rows, c.n_kv_heads, c.head_dim), dtype)
  if fp8_cache:
    cache, extra["kv_descale"] = cache.astype(jnp.float8_e4m3fn), (1.0, 1.0)
  lens = jnp.full((batch,), context, jnp.int32)

  @jax.jit
  def layers(q, k, v, lens):
    outs = [pallas_flash.decode_attention(q + i, k, v, lens, **extra)
            for i in range(c.n_layers)]
    return sum(o.astype(jnp.float32) for o in outs)

  layers(q, cache, cache, lens).block_until_ready()
  reps = 10
  _, t = _timed(lambda: [layers(q, cache, cache, lens) for _ in range(reps)][-1])
  attn_s = t / reps
  kv_bytes = 2 * batch * context * c.n_kv_heads * c.head_dim * cache.dtype.itemsize
  return {"attention_s": attn_s, "attention_fraction": attn_s / step_s,
          "kv_tb_per_s": kv_bytes * c.n_layers / attn_s / 1e12}


def preset_model(name: str) -> Transformer:
  """A randomly initialised model of a training preset (train.config.PRESETS)."""
  from train.config import PRESETS
  if name not in PRESETS:
    raise SystemExit(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
  return Transformer(PRESETS[name].model, rngs=nnx.Rngs(0))


def main(argv: list[str] | None = None) -> list[str]:
  opts = parse_args(argv)
  if opts.run is not None:
    model, step = load_model(opts.run)
    source = f"{opts.run} (step {step}"
  else:
    model = preset_model(opts.preset)
    source = f"preset {opts.preset} (random parameters"
  prompt = encode(opts.prompt)
  if not prompt:
    raise SystemExit("--prompt must not be empty.")
  tokens = jnp.tile(jnp.asarray(prompt, jnp.int32)[None], (opts.batch, 1))
  kw = dict(temperature=opts.temperature, top_k=opts.top_k or None, page_size=opts.page_size,
            rng=jax.random.key(opts.seed),
            cache_dtype=jnp.float8_e4m3fn if opts.fp8_cache else None)
  device = jax.devices()[0]
  print(f"{source}, {model.config.num_params() / 1e6:.2f}M parameters) on "
        f"{device.device_kind}: {opts.batch} x {opts.max_new_tokens} tokens after a "
        f"{len(prompt)}-byte prompt" + (", FP8 KV cache" if opts.fp8_cache else ""))
  out, first_s = _timed(lambda: generate(model, tokens, opts.max_new_tokens, **kw))
  texts = [opts.prompt + decode_bytes(row) for row in jax.device_get(out)]
  for i, text in enumerate([] if opts.quiet else texts):
    print(f"--- sequence {i}\n{text}")
  if device.platform == "gpu" or opts.profile:
    _, total_s = _timed(lambda: generate(model, tokens, opts.max_new_tokens, **kw))
    n = opts.max_new_tokens
    print(f"--- {n / total_s:.1f} tokens/s per sequence, {opts.batch * n / total_s:.1f} in "
          f"total ({total_s:.2f} s for {opts.batch} x {n} tokens, prefill included; the first "
          f"call, compiling, took {first_s:.1f} s)")
    if opts.profile and n > 1:
      generate(model, tokens, 1, **kw)  # compiles the prefill-only call
      _, one_s = _timed(lambda: generate(model, tokens, 1, **kw))  # the prefill and 1 token
      step_s = (total_s - one_s) / (n - 1)
      if step_s <= 0:  # timing noise exceeds the steps' time (tiny models, a CPU)
        print("--- decode step: too short to time apart from the prefill; raise "
              "--max-new-tokens")
        return texts
      share = attention_share(model, opts.batch, len(prompt) + n // 2, step_s,
                              fp8_cache=opts.fp8_cache, page_size=opts.page_size)
      print(f"--- decode step {step_s * 1e3:.3f} ms at a {len(prompt) + n // 2}-token context; "
            f"attention {share['attention_s'] * 1e3:.3f} ms of it "
            f"({share['attention_fraction']:.0%}), reading the KV cache at "
            f"{share['kv_tb_per_s']:.2f} TB/s")
  return texts


if __name__ == "__main__":
  main()
