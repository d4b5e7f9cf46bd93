"""The public entry point: validate -> choose -> differentiate -> call.

`flash_attention` canonicalises and checks its arguments (`validation`), chooses an
implementation and resolves its config once (`backends`), and runs it under one `custom_vjp`
whose backward recomputes scores from the saved output and log-sum-exp.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import custom_vjp_primal_tree_values

from pallas_flash import _tiling, backends, masks, merge, validation
from pallas_flash.backends import IMPLEMENTATIONS, Implementation
from pallas_flash.call import AttentionParams, FeatureArrays, backward_inputs
from pallas_flash.context_parallel import sharding as _cp_sharding
from pallas_flash.reference import attention_reference

__all__ = ["CHECKPOINT_NAME", "IMPLEMENTATIONS", "Explanation", "explain", "flash_attention"]


@dataclasses.dataclass(frozen=True)
class Explanation:
  """Which implementation `implementation=None` runs, and why each other one was not chosen."""

  chosen: str | None  # None: no automatic choice can run the call
  reasons: dict[str, str | None]  # None: could run this call
  # Fraction of (query block, key block) pairs the blocked kernels compute, from causal masking
  # and the local window at `block_q x block_kv`: the blocks of `config` (else 128 x 128 when
  # nothing can run). Segment ids and dense masks skip nothing here.
  blocks_computed: float = 1.0
  block_shape: tuple[int, int] = (128, 128)
  # The config `chosen` runs: the one passed, else the backend's default for this call (the
  # one flash_attention resolves). To change one knob of it:
  # dataclasses.replace(explanation.config, ...).
  config: Any = None
  # Why each implementation cannot run the call when named (implementation=name), None where
  # it can: `reasons` less the calls a backend runs only when named (not yet measured).
  reasons_when_named: dict[str, str | None] = dataclasses.field(default_factory=dict)

  def __str__(self) -> str:
    lines = [f"implementation=None runs {self.chosen!r}" if self.chosen else
             "implementation=None cannot run this call"]
    if self.config is not None:
      lines.append(f"  config: {_config_summary(self.config)}")
    lines.append(f"  blocks computed: {self.blocks_computed:.1%} of "
                 f"{self.block_shape[0]}x{self.block_shape[1]} score blocks")
    for name, why in self.reasons.items():
      if name == self.chosen:
        continue
      lines.append(f"  {name}: " + ("can run, but " + _not_chosen(name) if why is None else why))
    return "\n".join(lines)


def _config_summary(config) -> str:
  """`Name(field=value, ...)` with only the fields that differ from the class's defaults."""
  if not dataclasses.is_dataclass(config):
    return repr(config)
  base = type(config)()
  changed = (f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
             if getattr(config, f.name) != getattr(base, f.name))
  return f"{type(config).__name__}({', '.join(changed)})"


def _not_chosen(name: str) -> str:
  if name in ("interpret", "reference"):
    return "is never chosen automatically (testing only)"
  return "a faster implementation applies"


def _fp8():
  """pallas_flash.fp8, which takes FP8 calls; imported late because it builds on this module."""
  from pallas_flash import fp8
  return fp8


def explain(query, key, value, bias=None, mask=None, **kwargs) -> Explanation:
  """Says which implementation `flash_attention(query, key, value, ...)` would run.

  Takes the same arguments as `flash_attention`; `implementation` is ignored, `config` is honoured.
  Works on arrays or `jax.ShapeDtypeStruct`s. Also reports the fraction of score blocks the
  blocked kernels compute under causal masking and the local window, or under `block_mask`
  (whose tables must then be concrete). Print the result for a readable report.
  """
  if _fp8().is_fp8_call(query, key, value, kwargs.get("descale"), kwargs.get("out_dtype")):
    return _fp8().explain_fp8(explain, query, key, value, bias=bias, mask=mask, **kwargs)
  kwargs.update(bias=bias, mask=mask)
  config = kwargs.pop("config", None)
  kwargs.pop("implementation", None)
  kwargs.pop("return_residuals", None)
  kwargs.pop("sinks", None)  # every backend takes them: no influence on the choice
  kwargs.pop("checked", None)
  kwargs.pop("return_residual", None)
  info = validation.abstract_call_info(query, key, value,
                                       validation.with_defaults(kwargs))
  reasons = {name: backends.auto_reason(name, info, config) for name in IMPLEMENTATIONS}
  when_named = {name: backends.reason(name, info, config) for name in IMPLEMENTATIONS}
  chosen = backends.auto_choice(reasons)
  used = None if chosen is None else backends.resolve_config(chosen, info, config)
  bm = kwargs.get("block_mask")
  if bm is not None:
    block, fraction = (bm.block_q, bm.block_kv), bm.fraction_computed()
  else:
    tiles = used if used is not None else config  # the blocks of the kernels that run
    block = (getattr(tiles, "block_q", 128), getattr(tiles, "block_kv", 128))
    fraction = _tiling.fraction_computed(q_len=info.q_len, kv_len=info.kv_len, block_q=block[0],
                                       block_kv=block[1], band=info.params.band)
  return Explanation(chosen, reasons, fraction, block, used, when_named)



# The differentiable core

# The name (jax.ad_checkpoint.checkpoint_name) of the forward's o and lse, the residuals the
# backward needs besides the inputs: `jax.checkpoint(f, policy=
# jax.checkpoint_policies.save_only_these_names(CHECKPOINT_NAME))` keeps them, so that a
# rematerialised block recomputes its projections but not its attention forward.
CHECKPOINT_NAME = "pallas_flash.attention"


def backward_from_residuals(backend: backends.Backend, params: AttentionParams, config,
                            res: tuple, cotangents: tuple) -> tuple:
  """The VJP rule of `_differentiable` (also that of pallas_flash.fp8's training path):
  cotangents (q, k, v, None, None, FeatureArrays(bias=dbias, sinks=dsinks)) of the inputs,
  from the residuals (q, k, v, q_seg, kv_seg, arrays, o, lse) and the cotangents (do, dlse)
  of (o, lse), either of which may be a SymbolicZero. The backend recomputes the scores from
  q, k, v and lse."""
  q, k, v, q_seg, kv_seg, arrays, o, lse = res
  do, delta, lse = backward_inputs(backend.computes_delta, o, lse, cotangents, q.dtype)
  uses_arrays = bool(params.features) or params.has_sinks
  kw = dict(params=params, config=config, **({"arrays": arrays} if uses_arrays else {}))
  grads = backend.backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, **kw)
  extra = list(grads[3:])  # [dbias][, dsinks]
  dbias = extra.pop(0).astype(arrays.bias.dtype) if params.has_bias else None
  dsinks = extra.pop(0) if params.has_sinks else None
  return (*grads[:3], None, None, FeatureArrays(bias=dbias, sinks=dsinks))


@functools.cache
def _differentiable(name: str, params: AttentionParams, config) -> Callable:
  """A custom_vjp attention for one backend and static configuration.

  The forward saves only (q, k, v, segment ids, feature arrays, o, lse); the backward recomputes
  scores (and the dropout mask) blockwise. Feature arrays reach the backend only when the call
  uses a feature, so core-only backends keep the plain contract.
  """
  backend = backends.load(name)
  uses_features = bool(params.features) or params.has_sinks

  def kw(arrays):
    return dict(params=params, config=config, **({"arrays": arrays} if uses_features else {}))

  @jax.custom_vjp
  def attention(q, k, v, q_seg, kv_seg, arrays):
    return backend.forward(q, k, v, q_seg, kv_seg, **kw(arrays))

  def attention_fwd(*primals):
    # symbolic_zeros: each leaf comes as CustomVJPPrimal(value, perturbed).
    q, k, v, q_seg, kv_seg, arrays = custom_vjp_primal_tree_values(primals)
    o, lse = checkpoint_name(backend.forward(q, k, v, q_seg, kv_seg, **kw(arrays)),
                             CHECKPOINT_NAME)
    return (o, lse), (q, k, v, q_seg, kv_seg, arrays, o, lse)

  def attention_bwd(res, cotangents):
    return backward_from_residuals(backend, params, config, res, cotangents)

  attention.defvjp(attention_fwd, attention_bwd, symbolic_zeros=True)
  return attention


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
      D (MLA trains 192 / 128; not in jax.nn): the output is then [B, T, H, Dv]. "mosaic" and
      context parallelism take Dv == D only.
    bias: additive logits bias broadcastable to [B, H, T, S] (each axis 1 or full, rank <= 4, as
      in jax.nn), differentiable (its gradient is summed over broadcast axes). Dense: it costs
      T*S memory and reads; prefer the structured arguments below where they apply.
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
      pick the order of the model whose weights you load. Mosaic runs "cap_then_bias" only
      ("bias_then_cap" with a bias or ALiBi falls back, `explain` says so).
    alibi_slopes: float [H]: adds -slope[h] * |i - j| to the logits (ALiBi), computed in the
      kernels so no [T, S] bias exists. Slopes get no gradient.
    dropout_rate, dropout_rng: dropout on the attention probabilities with a JAX PRNG key. The
      mask is a hash of (key, batch, head, row, column), regenerated by the backward and the
      same on every implementation and block size (`pallas_flash.dropout.keep_mask`).
    block_mask: a `pallas_flash.BlockMask` built from mask functions (CausalMask, LocalMask,
      SegmentMask, PrefixLMMask and their & / | combinations): kernels visit only its active
      blocks and apply the element mask on partial ones only. Replaces is_causal,
      local_window_size, segment ids, lengths and `mask` (combining them raises); its block
      sizes are the kernels' (see docs/features.md). Not supported by "mosaic".
    sinks: float [H]: a learnable logit per query head that joins every row's softmax
      denominator with a zero value (attention sinks, gpt-oss), differentiable. Not in
      jax.nn. "mosaic" adds them in its forward kernels' epilogue (their gradient is a
      reduction over the backward's delta = rowsum(dO·O)); every other implementation
      computes the call without them and rescales each row by sigmoid(lse - sink)
      (`merge.add_sinks`): an elementwise pass over the output.
    descale: with float8_e4m3fn query/key/value: their descale factors, (q_scale, k_scale,
      v_scale) or a `pallas_flash.fp8.Fp8Scales` (per tensor, per (batch, head) or per block),
      as `pallas_flash.fp8.quantize` returns them. On a Hopper GPU, causal or full attention
      with per-tensor or per-(batch, head) scales runs the Mosaic FP8 forward (None or
      "mosaic"); every other FP8 call runs the float32 attention on the dequantized inputs
      (`explain` says which and why). No gradient with respect to FP8 inputs: to train,
      differentiate the bf16 activations with `pallas_flash.fp8.quantized_attention`
      (docs/fp8.md, "Training").
    out_dtype: the output dtype of an FP8 call (default bfloat16).
    deterministic: True guarantees bitwise-identical gradients run to run. Every default path
      gives them but one: the Mosaic backward of long head-dim-128 calls (causal: at least 8K
      keys and at most 8 batch entries; non-causal: at least 2K keys, a multiple of 128, at
      most 16 entries; no segment ids, window or soft cap) is the single fused kernel, which
      sums dQ with float32 atomics in a varying order, as cuDNN's backward does; True runs the
      split backward there instead, and rejects a config with `fused_backward=True`.
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
  if _fp8().is_fp8_call(query, key, value, descale, out_dtype):
    return _fp8().flash_attention_fp8(flash_attention, **locals())
  del descale, out_dtype  # FP8 only; the paths below pass locals() on
  validation.check_reverse_mode(implementation, query=query, key=key, value=value, bias=bias)
  if return_residuals and return_residual:
    raise ValueError("Pass one of `return_residuals` (float32 [B, H, T], differentiable) and "
                     "`return_residual` (jax.nn's: [B, T, H] in the input dtype, "
                     "stop_gradient), not both.")
  jax_nn_lse = return_residual  # the lse is returned, then converted by _as_jax_nn
  return_residuals = return_residuals or jax_nn_lse
  del return_residual
  # -- context parallelism: a sequence split over mesh axes runs as ring / all-gather
  # attention under shard_map (pallas_flash.context_parallel.sharding). --
  if (cp := _cp_sharding.sequence_sharding(query, key, value)) is not None:
    # the arguments above, and cp
    args = {n: x for n, x in locals().items() if n not in ("sinks", "jax_nn_lse")}
    if sinks is None:
      return _as_jax_nn(_cp_sharding.sharded_attention(**args), jax_nn_lse)
    o, lse = _cp_sharding.sharded_attention(**{**args, "return_residuals": True})
    o, lse = merge.add_sinks(o, lse, validation.check_sinks(sinks, query.shape[-2]))
    return _as_jax_nn((o, lse), jax_nn_lse) if return_residuals else o
  # Batch / head splits visible here run per shard under shard_map, so that every backend's
  # loops and kernels see local shapes (Explicit axes cannot enter their carries). Dropout and
  # block masks index global batch / head positions and stay on the global call.
  if (dropout_rate == 0.0 and block_mask is None
      and (split := _cp_sharding.batch_head_sharding(query)) is not None):
    args = {n: x for n, x in locals().items() if n != "jax_nn_lse"}
    return _as_jax_nn(_cp_sharding.split_attention(flash_attention, **args), jax_nn_lse)
  # --
  call = validation.canonicalize(query, key, value, scale=scale, is_causal=is_causal,
                       query_seq_lengths=query_seq_lengths,
                       key_value_seq_lengths=key_value_seq_lengths,
                       query_segment_ids=query_segment_ids,
                       key_value_segment_ids=key_value_segment_ids, bias=bias, mask=mask,
                       local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
                       logits_soft_cap_order=logits_soft_cap_order,
                       alibi_slopes=alibi_slopes, dropout_rate=dropout_rate,
                       dropout_rng=dropout_rng, block_mask=block_mask,
                       deterministic=deterministic, checked=checked)
  if sinks is not None:
    sinks = validation.check_sinks(sinks, call.q.shape[2])
  name = backends.choose(call.info, implementation, config)
  args = (call.q, call.k, call.v, call.q_seg, call.kv_seg)
  if name == "reference":  # defines sinks directly, as an extra softmax column
    o, lse = attention_reference(*args, params=call.info.params, arrays=call.arrays, sinks=sinks)
  else:
    config = backends.resolve_config(name, call.info, config)
    params, arrays = call.info.params, call.arrays
    fused_sinks = sinks is not None and backends.load(name).fuses_sinks
    if fused_sinks:  # the backend's forward adds them (pallas_flash.call)
      params = dataclasses.replace(params, has_sinks=True)
      arrays = dataclasses.replace(arrays, sinks=sinks.astype(jnp.float32))
    o, lse = _differentiable(name, params, config)(*args, arrays)
    if sinks is not None and not fused_sinks:
      o, lse = merge.add_sinks(o, lse, sinks)
  if call.unbatched:
    o, lse = o[0], lse[0]
  return _as_jax_nn((o, lse), jax_nn_lse) if return_residuals else o


def _as_jax_nn(results, jax_nn_lse: bool):
  """(o, lse) with lse in jax.nn's residual convention when asked: [..., T, H], o's dtype,
  stop_gradient (return_residual); unchanged otherwise (return_residuals, or o alone)."""
  if not jax_nn_lse:
    return results
  o, lse = results
  return o, jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2).astype(o.dtype))
