"""The gate: the default configs and the lowered default kernels, frozen.

A refactor of the library must not change what a default call runs. Two records in
`gate.json` say what that is:

* `configs`: the config each backend chooses for a grid of calls (head dims, causal or not,
  key lengths 1K-128K with an off-grid one, batch 1-32, segment ids, window, soft cap,
  deterministic; the Triton kernels' features);
* `kernels`: for about 25 default calls, forward and gradient lowered for an abstract H200,
  a fingerprint of each Mosaic GPU kernel and Triton kernel module (printed without source
  locations, so moved code is not changed code) and of the XLA code around them.

Equal fingerprints mean the same kernels and the same XLA glue, so a change that keeps them
needs no GPU rerun to know that the speed is unchanged. A deliberate kernel change is measured
on the GPU and then re-recorded: `python tests/test_gate.py --record`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu import core as mosaic_core
from jax.sharding import use_abstract_mesh

import pallas_flash

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from testing import H200, TRITON_CALL  # noqa: E402

RECORD_PATH = pathlib.Path(__file__).with_name("gate.json")


@dataclasses.dataclass(frozen=True)
class GateCall:
  """One attention call of the gate: shapes, dtype and the features it uses."""

  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int
  causal: bool = False
  dtype: str = "bfloat16"
  features: tuple[str, ...] = ()  # segments lengths window softcap deterministic alibi
  #                                  dropout bias mask block_mask
  value_head_dim: int = 0  # 0: head_dim

  @property
  def id(self) -> str:
    out = (f"b{self.batch}_t{self.q_len}_s{self.kv_len}_h{self.heads}:{self.kv_heads}"
           f"_d{self.head_dim}" + (f"v{self.value_head_dim}" if self.value_head_dim else "")
           + f"_{self.dtype}" + ("_causal" if self.causal else ""))
    return "-".join((out, *self.features))

  def specs(self):
    """(q, k, v abstract arrays, {name: abstract array} of the call's array arguments)."""
    dt = jnp.dtype(self.dtype)
    q = jax.ShapeDtypeStruct((self.batch, self.q_len, self.heads, self.head_dim), dt)
    kv = jax.ShapeDtypeStruct((self.batch, self.kv_len, self.kv_heads, self.head_dim), dt)
    v = jax.ShapeDtypeStruct((*kv.shape[:3], self.value_head_dim or self.head_dim), dt)
    i32 = jnp.int32
    arrays = {}
    if "segments" in self.features:
      arrays["query_segment_ids"] = jax.ShapeDtypeStruct((self.batch, self.q_len), i32)
      arrays["key_value_segment_ids"] = jax.ShapeDtypeStruct((self.batch, self.kv_len), i32)
    if "lengths" in self.features:
      arrays["query_seq_lengths"] = jax.ShapeDtypeStruct((self.batch,), i32)
      arrays["key_value_seq_lengths"] = jax.ShapeDtypeStruct((self.batch,), i32)
    if "alibi" in self.features:
      arrays["alibi_slopes"] = jax.ShapeDtypeStruct((self.heads,), jnp.float32)
    if "bias" in self.features:
      arrays["bias"] = jax.ShapeDtypeStruct((1, self.heads, self.q_len, self.kv_len), dt)
    if "dropout" in self.features:
      arrays["dropout_rng"] = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    if "mask" in self.features:
      arrays["mask"] = jax.ShapeDtypeStruct((self.batch, 1, self.q_len, self.kv_len), jnp.bool_)
    return q, kv, v, arrays

  def static_kwargs(self) -> dict:
    kw: dict = {"is_causal": self.causal}
    if "window" in self.features:
      kw["local_window_size"] = (1024, 0) if self.causal else (512, 512)
    if "softcap" in self.features:
      kw["logits_soft_cap"] = 30.0
    if "deterministic" in self.features:
      kw["deterministic"] = True
    if "dropout" in self.features:
      kw["dropout_rate"] = 0.1
    if "block_mask" in self.features:
      kw["block_mask"] = pallas_flash.BlockMask.build(
          pallas_flash.CausalMask() & pallas_flash.LocalMask(256, 0), q_len=self.q_len,
          kv_len=self.kv_len, block_q=64, block_kv=64)
    return kw


# --------------------------------------------------------------------------------------------
# Default configs


def config_grid() -> list[GateCall]:
  """Mosaic: every head dim (and MLA's 192 / 128) x causal x key length x batch x feature;
  Triton: the head dims and dtypes it alone runs on an H200, and the features the Mosaic
  kernels leave to it."""
  calls = []
  for (d, dv), causal, s, b, feat in itertools.product(
      ((64, 0), (80, 0), (96, 0), (128, 0), (192, 0), (192, 128), (256, 0)), (False, True),
      (1024, 2048, 4096, 5000, 8192, 16384, 131072), (1, 2, 8, 16, 32),
      ((), ("segments",), ("window",), ("softcap",), ("deterministic",))):
    calls.append(GateCall(b, s, s, 8, 4, d, causal, features=feat, value_head_dim=dv))
  for d, dtype, causal, feat in itertools.product(
      (64, 96, 128, 256), ("bfloat16", "float32"), (False, True),
      ((), ("alibi",), ("dropout",), ("bias",), ("mask",), ("softcap", "dropout"),
       ("alibi", "softcap"), ("segments", "dropout"))):
    calls.append(GateCall(2, 1000, 1000, 4, 2, d, causal, dtype, feat))
  return calls


def default_config(call: GateCall) -> tuple[str, str, dict]:
  """(implementation, config class, config fields) that `implementation=None` runs `call`
  with on an H200."""
  q, k, v, arrays = call.specs()
  with use_abstract_mesh(H200):
    why = pallas_flash.explain(q, k, v, **arrays, **call.static_kwargs())
  fields = dataclasses.asdict(why.config)
  if isinstance(why.config, pallas_flash.MosaicConfig):
    fields = as_recorded(why.config, call)
  return why.chosen, type(why.config).__name__, fields


# MosaicConfig fields deleted since the record, with the value of the one form each kept.
_REMOVED_MOSAIC = dict(
    bwd_heads_fastest=False, bwd_head_group=0, bwd_split_tail="", fused_stagger_q=False,
    fused_dq_blocks=1, fused_overlap=False, fused_offset=False, fused_dq_head_major=False,
    fused_batch_slowest=False, fused_per_batch_entry=False, fused_dq_first=False,
    dkdv_pingpong=False, dkdv_fold_stats=False, wide_backward="mosaic", window_backward="mosaic",
    bwd_delta_in_kernel=True, bwd_flat_stats=True)
# ... and those that selected forms of the fused backward: the form kept (a fused config)
# or the record's defaults (any other config, whose fused fields no kernel reads).
_FUSED_FORM = dict(fused_dq_shared=True, fused_defer_dq=True, fused_defer_inline=True,
                   fused_auto_barriers=False, fused_static_wg=True, fused_early_probs=True)
_NOT_FUSED = dict(fused_dq_shared=False, fused_defer_dq=False, fused_defer_inline=False,
                  fused_auto_barriers=True, fused_static_wg=False, fused_early_probs=False,
                  fused_split_loop=False)


def as_recorded(config, call: GateCall) -> dict:
  """A MosaicConfig in the record's fields: renamed and nested fields spelled as they were,
  deleted ones at the value of the form that stays (the fused kernel splits its first loop
  whenever a call is non-causal without a key tail, which its defaults guarantee)."""
  fields = dataclasses.asdict(config)
  debug = fields.pop("debug")
  fields["dkdv_schedule"] = "overlap" if fields.pop("dkdv_overlap") else "serial"
  fused = (dict(_FUSED_FORM, fused_split_loop=not call.causal) if config.fused_backward
           else _NOT_FUSED)
  return {**fields, **debug, **_REMOVED_MOSAIC, **fused}


def recorded_config(call_id: str) -> tuple[str, str, dict]:
  """default_config's answer as recorded: the class defaults with the recorded changes."""
  chosen, cls, changed = _record()["configs"][call_id]
  return chosen, cls, {**_record()["config_defaults"][cls], **changed}


# --------------------------------------------------------------------------------------------
# Kernel fingerprints

KERNEL_CALLS = [
    # head dim 128, causal: the overlapped forward with Q in registers; split backward below
    # 8K keys, the fused one from 8K at batch <= 8.
    GateCall(4, 4096, 4096, 16, 16, 128, True),
    GateCall(1, 16384, 16384, 16, 16, 128, True),
    GateCall(2, 16384, 16384, 8, 4, 128, True),
    GateCall(1, 16384, 16384, 16, 16, 128, True, features=("deterministic",)),
    GateCall(1, 1000, 1100, 8, 2, 128, True),
    # head dim 128, non-causal: the persistent forward up to 4K keys, 192-key tiles past it;
    # the fused backward from 2K keys (whole 128-key tiles, batch <= 16).
    GateCall(16, 1024, 1024, 16, 16, 128),
    GateCall(4, 4096, 4096, 16, 16, 128),
    GateCall(32, 2048, 2048, 8, 8, 128),
    GateCall(1, 16384, 16384, 16, 16, 128),
    GateCall(1, 5000, 5000, 16, 16, 128),
    GateCall(1, 777, 1025, 8, 1, 128),
    # head dim 128 with features the Mosaic kernels take.
    GateCall(2, 4096, 4096, 8, 4, 128, True, features=("segments",)),
    GateCall(1, 8192, 8192, 8, 8, 128, True, features=("window",)),
    GateCall(1, 4096, 4096, 8, 8, 128, features=("window",)),
    GateCall(2, 4096, 4096, 8, 8, 128, True, features=("softcap",)),
    GateCall(2, 1000, 1000, 8, 2, 128, features=("lengths",)),
    # head dim 64: the split-tail forward (256-key tiles) non-causal, the persistent plain loop
    # up to 2K keys.
    GateCall(4, 4096, 4096, 32, 32, 64),
    GateCall(16, 1024, 1024, 16, 16, 64),
    GateCall(4, 4096, 4096, 32, 32, 64, True),
    GateCall(2, 1000, 1000, 8, 2, 64, True, features=("lengths",)),
    # head dim 256: its own backward kernels (a soft cap's slope handed over with Pᵀ).
    GateCall(4, 4096, 4096, 8, 8, 256, True),
    GateCall(1, 1000, 700, 4, 4, 256),
    GateCall(1, 1000, 1000, 4, 2, 256, True, features=("segments",)),
    GateCall(1, 2048, 2048, 4, 4, 256, True, features=("softcap",)),
    # Head dim 96 (the split backward at 96 where 128 takes the fused one) and MLA's 192 / 128
    # (V at 128).
    GateCall(2, 1000, 1000, 8, 4, 96, True),
    GateCall(4, 4096, 4096, 32, 32, 96),
    GateCall(2, 2048, 2048, 8, 2, 192, True, value_head_dim=128),
    # Features the Mosaic kernels took over from Triton (ALiBi with dropout, a dense bias, a
    # block mask), and float32, which the Triton kernels alone run.
    GateCall(2, 1024, 1024, 8, 8, 128, True, features=("alibi", "dropout")),
    GateCall(2, 512, 512, 4, 4, 64, features=("bias",)),
    GateCall(1, 1024, 1024, 4, 4, 64, features=("block_mask",)),
    GateCall(2, 512, 512, 4, 2, 128, True, "float32"),
]


@contextlib.contextmanager
def _captured_kernels(out: list):
  """Appends ("mosaic" | "triton", module text without locations) for each kernel lowered."""
  from jax._src.pallas.triton import lowering as triton_lowering

  serde, to_triton = mosaic_core._run_serde_pass, triton_lowering.lower_jaxpr_to_triton_module

  def capture_mosaic(module, *, serialize, ir_version=None):
    if serialize:
      out.append(("mosaic", module.operation.get_asm(enable_debug_info=False)))
    return serde(module, serialize=serialize, ir_version=ir_version)

  def capture_triton(*args, **kwargs):
    result = to_triton(*args, **kwargs)
    out.append(("triton", result.module.operation.get_asm(enable_debug_info=False)))
    return result

  mosaic_core._run_serde_pass = capture_mosaic
  triton_lowering.lower_jaxpr_to_triton_module = capture_triton
  try:
    yield
  finally:
    mosaic_core._run_serde_pass = serde
    triton_lowering.lower_jaxpr_to_triton_module = to_triton


def _normalised_kernel(text: str) -> str:
  """A kernel module's text without the names taken from Python function names (Mosaic names
  a module after the kernel body's function, and numbers its dumps per process)."""
  text = re.sub(r'mosaic_gpu\.dump_basename = "[^"]*"', 'mosaic_gpu.dump_basename = ""', text)
  name = re.match(r"module @([\w.$]+)", text)
  if name:  # the module, and its function @<name>_mosaic_gpu
    text = re.sub(rf"@{re.escape(name.group(1))}(\b|_mosaic_gpu\b)", r"@kernel\1", text)
  return text


def _glue(exported: jax.export.Exported) -> str:
  """The exported module without locations and without the kernels' payloads (each kernel is
  fingerprinted on its own; a Triton call's payload holds source locations); a kernel call's
  launch parameters (grid, warps, stages) stay."""
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir

  payloads = ("ir", "module", "kernel_hash", "serialized_metadata")

  def strip(block):
    for op in block.operations:
      for name in ("backend_config", "mhlo.backend_config"):
        if name in op.attributes:
          config = op.attributes[name]
          if isinstance(config, ir.DictAttr):  # keeps grid, warps, stages
            op.attributes[name] = ir.DictAttr.get(
                {config[i].name: config[i].attr for i in range(len(config))
                 if config[i].name not in payloads})
          else:
            del op.attributes[name]
      for region in op.regions:
        for inner in region.blocks:
          strip(inner)

  with mlir.make_ir_context():
    module = ir.Module.parse(exported.mlir_module())
    strip(module.body)
    return module.operation.get_asm(enable_debug_info=False)


def _sha(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:20]


def fingerprint(call: GateCall) -> dict:
  """{"kernels": [kind:sha, ...] in lowering order, "glue": sha} of the forward and the
  gradient (a vjp with a cotangent input; a bias's too) of `call` with implementation=None,
  on an H200."""
  q, k, v, arrays = call.specs()
  do = jax.ShapeDtypeStruct((*q.shape[:3], v.shape[3]), q.dtype)
  static = call.static_kwargs()

  def fwd_bwd(q, k, v, do, arrays):
    # A bias is differentiated (its dbias is the kernels' to write); nothing else is.
    diff = {n: x for n, x in arrays.items() if n == "bias"}
    rest = {n: x for n, x in arrays.items() if n not in diff}
    attn = lambda q, k, v, d: pallas_flash.flash_attention(  # noqa: E731
        q, k, v, **d, **rest, **static)
    o, vjp = jax.vjp(attn, q, k, v, diff)
    return o, vjp(do)

  kernels: list = []
  with _captured_kernels(kernels), use_abstract_mesh(H200):
    exported = jax.export.export(jax.jit(fwd_bwd), platforms=["cuda"],
                                 disabled_checks=[TRITON_CALL])(q, k, v, do, arrays)
  return {"kernels": [f"{kind}:{_sha(_normalised_kernel(t))}" for kind, t in kernels],
          "glue": _sha(_glue(exported))}


# --------------------------------------------------------------------------------------------
# Tests


@functools.cache
def _record() -> dict:
  return json.loads(RECORD_PATH.read_text())


def test_default_configs_unchanged():
  calls = config_grid()
  assert sorted(_record()["configs"]) == sorted(c.id for c in calls), "the grid changed"
  changed = []
  for call in calls:
    got, want = default_config(call), recorded_config(call.id)
    if got != want:
      changed.append(f"{call.id}: {got} != recorded {want}")
  assert not changed, f"{len(changed)} default configs changed:\n" + "\n".join(changed[:10])


@pytest.mark.parametrize("call", KERNEL_CALLS, ids=lambda c: c.id)
def test_default_kernels_unchanged(call):
  recorded = _record()["kernels"][call.id]
  got = fingerprint(call)
  assert got["kernels"] == recorded["kernels"], (
      f"{call.id}: the lowered kernels changed ({got['kernels']} != {recorded['kernels']})")
  assert got["glue"] == recorded["glue"], f"{call.id}: the XLA code around the kernels changed"


def record() -> dict:
  configs, defaults = {}, {}
  for call in config_grid():
    chosen, cls, fields = default_config(call)
    base = defaults.setdefault(cls, _class_defaults(cls))
    configs[call.id] = [chosen, cls, {k: v for k, v in fields.items() if base[k] != v}]
  kernels = {}
  for call in KERNEL_CALLS:
    kernels[call.id] = fingerprint(call)
    print(call.id, kernels[call.id], flush=True)
  return {"config_defaults": defaults, "configs": configs, "kernels": kernels}


def dumps(rec: dict) -> str:
  """JSON with one line per config or kernel entry, so that a re-record diffs line by line."""
  sections = []
  for name in sorted(rec):
    rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}"
                      for k, v in sorted(rec[name].items()))
    sections.append(f"{json.dumps(name)}: {{\n{rows}\n}}")
  return "{\n" + ",\n".join(sections) + "\n}\n"


def _class_defaults(cls: str) -> dict:
  if cls == "MosaicConfig":
    return as_recorded(pallas_flash.MosaicConfig(), GateCall(1, 1, 1, 1, 1, 64))
  return dataclasses.asdict({"TritonConfig": pallas_flash.TritonConfig,
                             "XlaConfig": pallas_flash.XlaConfig}[cls]())


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--record", action="store_true", help=f"rewrite {RECORD_PATH.name}")
  if parser.parse_args().record:
    RECORD_PATH.write_text(dumps(record()))
  else:  # checking is pytest's job: say so rather than exit silently
    parser.exit(2, f"Nothing done: `python -m pytest tests/{pathlib.Path(__file__).name}` "
                f"checks the gate, --record rewrites {RECORD_PATH.name}.\n")
