"""One attention call on the arrays at hand: validate -> choose -> differentiate -> call.

`attention` canonicalises and checks its arguments (`validation`), chooses an implementation
and resolves its config once (`backends`), and runs it under one `custom_vjp` whose backward
recomputes scores from the saved output and log-sum-exp. `pallas_flash.api` routes each public
call here: directly, per shard under shard_map (context_parallel), or on dequantized FP8 inputs
(fp8); fp8's training path and context_parallel's all-gather build on this module too.
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

from pallas_flash import _tiling, backends, merge, validation
from pallas_flash.backends import IMPLEMENTATIONS
from pallas_flash.call import AttentionParams, FeatureArrays, backward_inputs
from pallas_flash.reference import attention_reference

__all__ = ["CHECKPOINT_NAME", "Explanation", "as_jax_nn", "attention", "backward_from_residuals",
           "explain"]


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


def explain(query, key, value, bias=None, mask=None, **kwargs) -> Explanation:
  """`pallas_flash.explain` of a call on float inputs (the front hands FP8 calls to fp8)."""
  kwargs.update(bias=bias, mask=mask)
  config = kwargs.pop("config", None)
  kwargs.pop("implementation", None)
  # No influence on the choice, but checked as the call checks them: an explanation must not
  # call runnable what the call refuses.
  validation.check_residual_flags(kwargs.pop("return_residuals", False),
                                  kwargs.pop("return_residual", False), "input")
  if (sinks := kwargs.pop("sinks", None)) is not None:  # every backend takes them
    validation.check_sinks(sinks, query.shape[-2])
  validation.check_bool("checked", kwargs.pop("checked", False))
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


# The name (jax.ad_checkpoint.checkpoint_name) of the forward's o and lse, the residuals the
# backward needs besides the inputs: `jax.checkpoint(f, policy=
# jax.checkpoint_policies.save_only_these_names(CHECKPOINT_NAME))` keeps them, so that a
# rematerialised block recomputes its projections but not its attention forward.
CHECKPOINT_NAME = "pallas_flash.attention"


def backward_from_residuals(backend: backends.Backend, params: AttentionParams, config,
                            res: tuple, cotangents: tuple) -> tuple:
  """The VJP rule of `_differentiable` (also that of fp8's training path):
  cotangents (q, k, v, None, None, FeatureArrays(bias=dbias, sinks=dsinks)) of the inputs,
  from the residuals (q, k, v, q_seg, kv_seg, arrays, o, lse) and the cotangents (do, dlse)
  of (o, lse), either of which may be a SymbolicZero. The backend recomputes the scores from
  q, k, v and lse. dbias is None (a zero cotangent) where not params.returns_dbias."""
  q, k, v, q_seg, kv_seg, arrays, o, lse = res
  do, delta, lse = backward_inputs(backend.computes_delta, o, lse, cotangents, q.dtype)
  uses_arrays = bool(params.features) or params.has_sinks
  kw = dict(params=params, config=config, **({"arrays": arrays} if uses_arrays else {}))
  grads = backend.backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, **kw)
  extra = list(grads[3:])  # [dbias][, dsinks]
  dbias = extra.pop(0).astype(arrays.bias.dtype) if params.returns_dbias else None
  dsinks = extra.pop(0) if params.has_sinks else None
  return (*grads[:3], None, None, FeatureArrays(bias=dbias, sinks=dsinks))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Needs:
  """What the backward must return beyond dq, dk, dv, known when the forward is traced (a
  static residual, no array): bias, whether the differentiation perturbs the bias."""

  bias: bool


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
  def run(q, k, v, q_seg, kv_seg, arrays):
    return backend.forward(q, k, v, q_seg, kv_seg, **kw(arrays))

  def run_fwd(*primals):
    # symbolic_zeros: each leaf comes as CustomVJPPrimal(value, perturbed).
    q, k, v, q_seg, kv_seg, arrays = custom_vjp_primal_tree_values(primals)
    o, lse = checkpoint_name(backend.forward(q, k, v, q_seg, kv_seg, **kw(arrays)),
                             CHECKPOINT_NAME)
    bias = primals[5].bias
    needs = _Needs(bias=bias is not None and bias.perturbed)
    return (o, lse), (q, k, v, q_seg, kv_seg, arrays, o, lse, needs)

  def run_bwd(res, cotangents):
    *res, needs = res
    bwd_params = params if needs.bias else dataclasses.replace(params, bias_grad=False)
    return backward_from_residuals(backend, bwd_params, config, tuple(res), cotangents)

  run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
  return run


def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None, query_segment_ids=None,
              key_value_segment_ids=None, local_window_size=None, logits_soft_cap=None,
              logits_soft_cap_order="cap_then_bias", alibi_slopes=None, dropout_rate=0.0,
              dropout_rng=None, block_mask=None, sinks=None, deterministic=False,
              checked=False, implementation=None, config=None) -> tuple[jax.Array, jax.Array]:
  """(o [B, T, H, Dv], lse float32 [B, H, T]) of `flash_attention`'s arguments (their meaning
  is documented there), without the batch axis for unbatched inputs; the arrays are taken as
  they are (no sharding seen, no FP8)."""
  call = validation.canonicalize(
      query, key, value, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, query_segment_ids=query_segment_ids,
      key_value_segment_ids=key_value_segment_ids, bias=bias, mask=mask,
      local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
      logits_soft_cap_order=logits_soft_cap_order, alibi_slopes=alibi_slopes,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng, block_mask=block_mask,
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
  return o, lse


def as_jax_nn(results, jax_nn_lse: bool):
  """(o, lse) with lse in jax.nn's residual convention when asked: [..., T, H], o's dtype,
  stop_gradient (return_residual); unchanged otherwise (return_residuals, or o alone)."""
  if not jax_nn_lse:
    return results
  o, lse = results
  return o, jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2).astype(o.dtype))
