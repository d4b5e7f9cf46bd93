"""The public entry points: `flash_attention`, `explain` and `quantized_attention`.

Each routes a call to what runs it: FP8 inputs to `fp8` (the Mosaic FP8 forward, or this
module's float32 call on the dequantized inputs), inputs whose sharding splits the sequence to
`context_parallel` (ring or all-gather attention under shard_map), batch / head splits per
shard under shard_map, and everything else to `core.attention` (validate -> choose ->
differentiate -> call).
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

import jax

from pallas_flash import core, fp8, masks, merge, validation
from pallas_flash.backends import IMPLEMENTATIONS, Implementation
from pallas_flash.context_parallel import sharding as _cp_sharding
from pallas_flash.core import CHECKPOINT_NAME, Explanation

__all__ = ["CHECKPOINT_NAME", "IMPLEMENTATIONS", "Explanation", "explain", "flash_attention",
           "quantized_attention"]


def explain(query, key, value, bias=None, mask=None, **kwargs) -> Explanation:
  """Says which implementation `flash_attention(query, key, value, ...)` would run.

  Takes the same arguments as `flash_attention`; `implementation` is ignored, `config` is honoured.
  Works on arrays or `jax.ShapeDtypeStruct`s. Also reports the fraction of score blocks the
  blocked kernels compute under causal masking and the local window, or under `block_mask`
  (whose tables must then be concrete). Print the result for a readable report.
  """
  if fp8.is_fp8_call(query, key, value, kwargs.get("descale"), kwargs.get("out_dtype")):
    return fp8.explain_fp8(query, key, value, bias=bias, mask=mask, **kwargs)
  return core.explain(query, key, value, bias, mask, **kwargs)


def flash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    query_segment_ids: jax.Array | None = None,
    key_value_segment_ids: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    logits_soft_cap_order: str = "cap_then_bias",
    alibi_slopes: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    block_mask: masks.BlockMask | None = None,
    sinks: jax.Array | None = None,
    descale: Any = None,
    out_dtype: Any = None,
    deterministic: bool = False,
    return_residuals: bool = False,
    return_residual: bool = False,
    checked: bool = False,
    implementation: Implementation | None = None,
    config: Any = None,
):
  """Exact attention, computed blockwise without materialising the score matrix.

  Arguments and layout follow `jax.nn.dot_product_attention`, so switching is a rename.

  Args:
    query: [B, T, H, D] (or [T, H, D] together with key and value).
    key, value: [B, S, K, D] and [B, S, K, Dv], H % K == 0 (MHA, GQA, MQA). Dv may differ from
      D (MLA trains 192 / 128; not in jax.nn): the output is then [B, T, H, Dv]. "mosaic" runs
      V at its own width where its kernels take the pair (D 192 or 256, Dv a multiple of 64
      below it: 192 / 128 by default, the others when named), else zero-padded; context
      parallelism takes Dv == D only.
    bias: additive logits bias broadcastable to [B, H, T, S] (each axis 1 or full, rank <= 4, as
      in jax.nn), differentiable (its gradient is summed over broadcast axes; a bias that the
      differentiation does not reach, a constant or one under stop_gradient, costs the backward
      no gradient: its dS is neither written nor summed). Dense: it costs T*S memory and reads;
      prefer the structured arguments below where they apply.
    mask: boolean, broadcastable like `bias`; True where a query may attend. Dense as well.
    scale: softmax scale, default 1/sqrt(D). A static Python float.
    is_causal: query i attends to keys 0..i, exactly as `jax.nn.dot_product_attention`, also
      when T != S (top-left alignment: the mask is the top-left corner of a square causal mask).
    query_seq_lengths, key_value_seq_lengths: int32 [B] valid lengths of right-padded sequences,
      in [0, T] / [0, S]. Concrete lengths outside raise a ValueError; under jit they are data
      and are clipped to that range silently unless `checked=True`.
    query_segment_ids, key_value_segment_ids: int32 [B, T] / [B, S]; a query attends only to keys
      of its own segment (packed documents). key_value_segment_ids defaults to query_segment_ids
      when T == S. Ids -2**31 and -2**31 + 1 are reserved (they mark padded positions): concrete
      ids holding them raise a ValueError; under jit only `checked=True` detects them.
    local_window_size: sliding-window attention as in jax.nn: an int w (= (w, w)) or (left,
      right); query i sees keys i - left .. i + right. Combines with is_causal and segment ids.
      Key blocks outside the band are skipped: cost grows with T * window, not T * S.
    logits_soft_cap: c > 0 replaces each scaled logit s by c * tanh(s / c) (Gemma 2, Grok).
    logits_soft_cap_order: where an additive bias (`bias` and `alibi_slopes` alike) enters
      relative to the cap. "cap_then_bias" (default, FlashAttention-2's order for ALiBi):
      c * tanh(s / c) + bias, so a large bias still masks or boosts beyond the cap.
      "bias_then_cap" (tokamax's, and the cap applied to the whole logits): c * tanh((s + bias)
      / c), bounded by c. Gemma 2 and Grok cap logits with no additive bias, where both agree;
      pick the order of the model whose weights you load. Every implementation runs both.
    alibi_slopes: float [H]: adds -slope[h] * |i - j| to the logits (ALiBi), computed in the
      kernels so no [T, S] bias exists. Slopes get no gradient.
    dropout_rate, dropout_rng: dropout on the attention probabilities with a JAX PRNG key. The
      mask is a hash of (key, batch, head, row, column), regenerated by the backward and the
      same on every implementation and block size (`pallas_flash.dropout.keep_mask`).
    block_mask: a `pallas_flash.BlockMask` built from mask functions (CausalMask, LocalMask,
      SegmentMask, PrefixLMMask and their & / | combinations): kernels visit only its active
      blocks and apply the element mask on partial ones only. Replaces is_causal,
      local_window_size, segment ids, lengths and `mask` (combining them raises); its block
      sizes are the Triton and XLA kernels' (see docs/features.md), while "mosaic" re-tiles
      it to its own tiles.
    sinks: float [H]: a learnable logit per query head that joins every row's softmax
      denominator with a zero value (attention sinks, gpt-oss), differentiable. Not in
      jax.nn. "mosaic" adds them in its forward kernels' epilogue (their gradient is a
      reduction over the backward's delta = rowsum(dO·O)); the reference adds them as one
      more softmax column; every other implementation computes the call without them and
      rescales each row by sigmoid(lse - sink) (`merge.add_sinks`): an elementwise pass over
      the output.
    descale: with float8_e4m3fn query/key/value: their descale factors, (q_scale, k_scale,
      v_scale) or a `pallas_flash.fp8.Fp8Scales` (per tensor, per (batch, head) or per block),
      as `pallas_flash.fp8.quantize` returns them. On a Hopper GPU, causal or full attention
      at head dim 64, 128 or 256 with per-tensor or per-(batch, head) scales runs the Mosaic
      FP8 forward (None or "mosaic"; "mosaic" also with a soft cap, a window or segment ids);
      every other FP8 call runs the float32 attention on the dequantized inputs (`explain`
      says which and why). No gradient with respect to FP8 inputs: to train,
      differentiate the bf16 activations with `pallas_flash.quantized_attention`
      (docs/fp8.md, "Training").
    out_dtype: the output dtype of an FP8 call (default bfloat16).
    deterministic: True guarantees bitwise-identical gradients run to run. Every default path
      gives them but two, which sum in a varying order as cuDNN's backward does: the Mosaic
      backward of long head-dim-128 calls (causal: at least 8K keys and at most 8 batch
      entries; non-causal: at least 2K keys, a multiple of 128, at most 16 entries; no
      segment ids, lengths, window, soft cap, ALiBi, dropout, dense bias / mask or block
      mask) is the single fused kernel, which sums dQ with float32 atomics; and a `bias` in
      the inputs' 16-bit dtype broadcast over a batch of several, differentiated at head dim
      64 or 128 on Mosaic, has its gradient summed over the batch by the kernels' reduce-adds
      in the bias's dtype.
      True runs the split backward and XLA's float32 sum there instead, and rejects a config
      with `fused_backward=True`.
    return_residuals: also return the float32 log-sum-exp [B, H, T] (natural log, -inf for a
      query with no visible key), e.g. to merge partial attentions. It is differentiable: a
      loss that uses it gets its exact gradient, whose cotangent adds p * dlse to the score
      gradient (so reaches dQ and dK).
    return_residual: jax.nn's name and convention: also return the log-sum-exp as [B, T, H]
      in the input dtype under `stop_gradient`, exactly as `jax.nn.dot_product_attention`
      (except -inf, not a large negative number, for a query with no visible key). A loss
      that uses it then gets jax.nn's gradient, which treats the lse as a constant and so
      lacks the p * dlse term above. Passing both raises a ValueError.
    checked: add `jax.experimental.checkify` checks of the values jit cannot see (lengths in
      range, no reserved segment id); run the caller under `checkify.checkify(f)` (jitted or
      not) and read `err.throw()`. Costs a reduction over the lengths and ids.
    implementation: None picks the fastest that can run the call (see `explain`); "mosaic"
      (Hopper), "triton" (GPU), "interpret" (the Triton kernels in the Pallas interpreter, any
      platform), "xla" (blockwise jnp, O(N) memory, any platform) or "reference" (materialising).
    config: a backend config (`TritonConfig`, `XlaConfig`, `MosaicConfig`) to override tuning.

  Returns:
    The output [B, T, H, D] in the input dtype; with return_residuals or return_residual,
    (output, lse) in the layout above. A query that sees no key gets zeros (and zero
    gradients), never NaN; with sinks its lse is the sink's.

  Differentiable in reverse mode (jax.grad, jax.vjp; a custom_vjp). Forward mode (jax.jvp,
  jax.jacfwd) raises a TypeError except with implementation="reference".

  Inputs whose sharding splits the sequence axis over mesh axes (Explicit axes under jit, or
  concrete arrays) run context-parallel: ring or all-gather attention under shard_map
  (`pallas_flash.context_parallel`, docs/context_parallel.md). Inputs split over batch or heads
  only run per shard under shard_map, the output sharded like the query (not with dropout or
  block_mask). On Auto axes under jit nothing is visible: the partitioner places the call, and
  it runs the Pallas kernels whole on every device.
  """
  if fp8.is_fp8_call(query, key, value, descale, out_dtype):
    return _fp8_attention(**locals())
  del descale, out_dtype  # FP8 only; the paths below pass locals() on
  validation.check_reverse_mode(implementation, query=query, key=key, value=value, bias=bias)
  validation.check_residual_flags(return_residuals, return_residual, "input")
  jax_nn_lse = return_residual  # the lse is returned, then converted by core.as_jax_nn
  return_residuals = return_residuals or jax_nn_lse
  del return_residual
  # -- context parallelism: a sequence split over mesh axes runs as ring / all-gather
  # attention under shard_map (pallas_flash.context_parallel.sharding). --
  if (cp := _cp_sharding.sequence_sharding(query, key, value)) is not None:
    # the arguments above, and cp
    args = {n: x for n, x in locals().items() if n not in ("sinks", "jax_nn_lse")}
    if sinks is None:
      return core.as_jax_nn(_cp_sharding.sharded_attention(**args), jax_nn_lse)
    o, lse = _cp_sharding.sharded_attention(**{**args, "return_residuals": True})
    o, lse = merge.add_sinks(o, lse, validation.check_sinks(sinks, query.shape[-2]))
    return core.as_jax_nn((o, lse), jax_nn_lse) if return_residuals else o
  # Batch / head splits visible here run per shard under shard_map, so that every backend's
  # loops and kernels see local shapes (Explicit axes cannot enter their carries). Dropout and
  # block masks index global batch / head positions and stay on the global call.
  if (dropout_rate == 0.0 and block_mask is None
      and (split := _cp_sharding.batch_head_sharding(query)) is not None):
    args = {n: x for n, x in locals().items() if n != "jax_nn_lse"}
    return core.as_jax_nn(_cp_sharding.split_attention(flash_attention, **args), jax_nn_lse)
  # --
  o, lse = core.attention(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      query_segment_ids=query_segment_ids, key_value_segment_ids=key_value_segment_ids,
      local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
      logits_soft_cap_order=logits_soft_cap_order, alibi_slopes=alibi_slopes,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng, block_mask=block_mask, sinks=sinks,
      deterministic=deterministic, checked=checked, implementation=implementation,
      config=config)
  return core.as_jax_nn((o, lse), jax_nn_lse) if return_residuals else o


def _fp8_attention(*, query, key, value, descale, out_dtype, **kwargs):
  """`flash_attention` on FP8 inputs: checked, then the Mosaic FP8 forward where it applies,
  else `flash_attention` on the inputs dequantized to float32 (no gradient), cast."""
  scales, out = fp8.check_call(query, key, value, descale, out_dtype)
  if fp8.runs_on_mosaic(query, key, value, scales, out, kwargs):
    return fp8.mosaic_attention(query, key, value, scales, out, kwargs)
  q, k, v = fp8.dequantize_inputs(query, key, value, scales)
  return fp8.cast_output(flash_attention(q, k, v, **fp8.float32_kwargs(kwargs)), out)


# flash_attention's keyword arguments that quantized_attention passes on.
_QUANTIZED_KWARGS = frozenset(inspect.signature(flash_attention).parameters) - {
    "query", "key", "value", "descale", "out_dtype"}


def quantized_attention(q, k, v, *, rotate: bool = False, block: int | str | None = None,
                        key: jax.Array | None = None, out_dtype=None, **kwargs):
  """FP8 attention on bf16 (or any float) activations, differentiable: the training path.

  The forward is that of `flash_attention(*fp8.quantize(q, k, v, rotate=, block=, key=))`; the
  gradient with respect to q, k, v is straight-through: the attention's gradient at the
  dequantized values, carried to q, k, v as if quantisation were the identity (back through
  the rotation when `rotate=True`). On a Hopper GPU, causal or full attention at head dim 64,
  128 or 256 with per-tensor or per-(batch, head) scales (block None or "head") runs the
  Mosaic FP8 forward and, for the gradient, the bf16 Mosaic backward on the dequantized values
  rounded to bfloat16, recomputing from the FP8 forward's output and lse (`deterministic=True`
  as for bf16 inputs); elsewhere the float32 attention on the dequantized values (`xla` on
  CPU, `triton` on a GPU) runs both. kwargs: those of flash_attention (is_causal, segment ids,
  implementation, config, deterministic, return_residuals, ...); a MosaicConfig configures
  the FP8 forward (its key tile is `fp8_block_kv`, not `block_kv`) and the bf16 backward
  alike. Output: out_dtype, default bfloat16.
  """
  # The planned path reads only the names it knows: an unknown one (a misspelt is_causal, a
  # descale of one's own) must not pass unnoticed.
  unknown = sorted(set(kwargs) - _QUANTIZED_KWARGS)
  if unknown:
    hints = {n: difflib.get_close_matches(n, _QUANTIZED_KWARGS, n=1) for n in unknown}
    said = ", ".join(f"`{n}`" + (f" (did you mean `{h[0]}`?)" if h else "")
                     for n, h in hints.items())
    raise TypeError(f"quantized_attention got unexpected keyword arguments {said}: it takes "
                    "flash_attention's keyword arguments other than `descale` and `out_dtype`, "
                    "which it sets itself (out_dtype is its own argument).")
  inputs, plan, out = fp8.training_call(q, k, v, rotate=rotate, block=block, key=key,
                                       out_dtype=out_dtype, kwargs=kwargs)
  if plan is not None:
    return fp8.training_attention(plan, inputs, out, block, kwargs)
  # Features, segment ids, sinks, sharded inputs, "reference": flash_attention's float32 call on
  # the dequantized values, the cotangents straight through to the (rotated) inputs.
  result = flash_attention(*fp8.straight_through_inputs(inputs, block),
                           **fp8.float32_kwargs(kwargs))
  return fp8.cast_output(result, out)
