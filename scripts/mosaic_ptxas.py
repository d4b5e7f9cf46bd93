"""ptxas' view of the Mosaic GPU kernels: registers, spills and wgmma serialisation per variant.

On the GPU machine, from the repository root:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/mosaic_ptxas.py [--out DIR] [VARIANT ...]

compiles each variant, checks it against the reference and times it briefly. On a machine
without a GPU, after `./scripts/setup_deviceless.sh`:

  .venv/bin/python scripts/mosaic_ptxas.py --deviceless --sass [VARIANT ...]

compiles the same kernels for a described H200 (scripts/h200_target_config.txtpb) through jax's
CUDA plugin and ptxas, without running them (the PTX is the same as on the GPU).

Each variant runs in its own process with MOSAIC_GPU_DUMP_PTXAS / _PTX set and
MOSAIC_GPU_DUMP_TO=DIR/ptxas/<variant>. The parent prints per kernel ptxas' spill bytes and any
C7512 / C7513 "wgmma ... serialized" or C7507 "setmaxnreg ignored" warning; with --sass also
the SASS (`<kernel>.sass`, needs ptxas and nvdisasm) and how many spill instructions sit in the
loops that issue wgmmas (HGMMA), i.e. in the main loops rather than in set-up code, and each
such loop's instructions with its softmax arithmetic (MUFU, FFMA, FMUL, ...). A variant
is NAME or NAME@key=value,... (MosaicConfig overrides; MosaicDecodeConfig ones for the
decode variants); without arguments every entry of VARIANTS runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _aot_dir() -> pathlib.Path:
  """The deviceless toolchain: this checkout's .cuda-aot (scripts/setup_deviceless.sh installs
  it there), else an entry of PYTHONPATH that holds jax's CUDA plugin (a git worktree using
  the main checkout's: PYTHONPATH=/path/to/main/.cuda-aot:.)."""
  own = ROOT / ".cuda-aot"
  if (own / "jax_plugins").is_dir():
    return own
  for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    if (pathlib.Path(entry) / "jax_plugins").is_dir():
      return pathlib.Path(entry)
  return own


AOT_DIR = _aot_dir()
TARGET_CONFIG = ROOT / "scripts" / "h200_target_config.txtpb"

# name -> (mode, causal, MosaicConfig keyword arguments). bf16, shape from --shape.
VARIANTS = {
    "fwd": ("fwd", False, {}),
    "fwd_causal": ("fwd", True, {}),
    "fwd_plain": ("fwd", False, dict(fwd_intra_wg_overlap=False)),
    "fwd_persistent": ("fwd", False, dict(fwd_persistent=True, block_kv=128,
                                          fwd_q_registers=True)),
    "bwd_split": ("fwdbwd", False, {}),
    "bwd_split_causal": ("fwdbwd", True, {}),
    "bwd_dkdv_serial": ("fwdbwd", False, dict(dkdv_overlap=False)),
    # config.FUSED (spelled out: this table is read before jax is imported).
    "bwd_fused": ("fwdbwd", False, dict(fused_backward=True, compute_registers=240,
                                        producer_registers=24)),
    "bwd_fused_causal": ("fwdbwd", True, dict(fused_backward=True, compute_registers=240,
                                              producer_registers=24)),
    # Segment ids (documents of 1000 tokens): the plain forward loop and the split backward
    # with the id loads and comparisons. `segments` is not a MosaicConfig field.
    "fwd_segments_causal": ("fwd", True, dict(segments=True)),
    "bwd_segments_causal": ("fwdbwd", True, dict(segments=True)),
    # logits_soft_cap=30 (a tanh per score; the backward also its slope). Not a config field.
    "fwd_softcap": ("fwd", False, dict(softcap=30.0)),
    "fwd_softcap_causal": ("fwd", True, dict(softcap=30.0)),
    "bwd_softcap": ("fwdbwd", False, dict(softcap=30.0)),
    "bwd_softcap_causal": ("fwdbwd", True, dict(softcap=30.0)),
    # local_window_size (1023, 0): the segment-id path over the band's blocks. Not a config field.
    "fwd_window": ("fwd", False, dict(window=1023)),
    "fwd_window_causal": ("fwd", True, dict(window=1023)),
    "bwd_window_causal": ("fwdbwd", True, dict(window=1023)),
    # A BlockMask, CausalMask() & LocalMask(1023, 0) at 128 x 128 blocks (the features grid's
    # row): the kernels' table-driven loops. The call passes is_causal=False (the mask holds
    # it); `causal` True picks the causal config, the one a block mask takes
    # (mosaic_gpu.config.call_config). Not a config field.
    "fwd_blockmask": ("fwd", True, dict(blockmask=1023)),
    "fwd_blockmask_plain": ("fwd", True, dict(blockmask=1023, fwd_intra_wg_overlap=False)),
    "bwd_blockmask": ("fwdbwd", True, dict(blockmask=1023)),
    "fwd_blockmask_dropout": ("fwd", True, dict(blockmask=1023, dropout=0.1)),
    "bwd_blockmask_dropout": ("fwdbwd", True, dict(blockmask=1023, dropout=0.1)),
    "bwd_blockmask_bias": ("fwdbwd", True, dict(blockmask=1023, bias=True)),
    # Attention sinks (an [H] input of the forward, added in its epilogue). Not a config field.
    "fwd_sinks": ("fwd", False, dict(sinks=True)),
    "fwd_sinks_causal": ("fwd", True, dict(sinks=True)),
    "fwd_sinks_persistent": ("fwd", False, dict(sinks=True, fwd_persistent=True, block_kv=128,
                                                fwd_q_registers=True)),
    # ALiBi (slopes 2^(-8(h+1)/H), added to every score tile). Not a config field.
    "fwd_alibi": ("fwd", False, dict(alibi=True)),
    "fwd_alibi_causal": ("fwd", True, dict(alibi=True)),
    "bwd_alibi_causal": ("fwdbwd", True, dict(alibi=True)),
    # ALiBi inside a soft cap of 30 (logits_soft_cap_order="bias_then_cap").
    "fwd_alibi_in_cap_causal": ("fwd", True, dict(alibi=True, softcap=30.0,
                                                  cap_order="bias_then_cap")),
    "bwd_alibi_in_cap_causal": ("fwdbwd", True, dict(alibi=True, softcap=30.0,
                                                     cap_order="bias_then_cap")),
    # A dense bf16 bias [1, H, T, S] (differentiated: dbias from the dQ kernel) and a bool mask
    # [B, 1, T, S] (sm90/dense.py), inputs of the grid forward and the split backward, at
    # config.dense_config's tiles. Not config fields.
    "fwd_bias": ("fwd", False, dict(bias=True)),
    "fwd_bias_causal": ("fwd", True, dict(bias=True)),
    "fwd_mask": ("fwd", False, dict(mask=True)),
    "fwd_bias_mask": ("fwd", False, dict(bias=True, mask=True)),
    "fwd_bias_mask_causal": ("fwd", True, dict(bias=True, mask=True)),
    "bwd_bias": ("fwdbwd", False, dict(bias=True)),
    "bwd_bias_causal": ("fwdbwd", True, dict(bias=True)),
    "bwd_mask": ("fwdbwd", False, dict(mask=True)),
    "bwd_mask_causal": ("fwdbwd", True, dict(mask=True)),
    "bwd_bias_mask": ("fwdbwd", False, dict(bias=True, mask=True)),
    "bwd_bias_mask_causal": ("fwdbwd", True, dict(bias=True, mask=True)),
    # Dropout 0.1 (the keep mask from row and column key vectors). Not a config field.
    "fwd_dropout": ("fwd", False, dict(dropout=0.1)),
    "fwd_dropout_causal": ("fwd", True, dict(dropout=0.1)),
    "fwd_dropout_persistent": ("fwd", False, dict(dropout=0.1, fwd_persistent=True,
                                                  block_kv=128, fwd_q_registers=True)),
    "bwd_dropout": ("fwdbwd", False, dict(dropout=0.1)),
    "bwd_dropout_causal": ("fwdbwd", True, dict(dropout=0.1)),
    # A value head dim of 128 (MLA's, beside --shape's D of 192): V, O and dO zero-padded to D
    # (`mla`: the tuned config, whose native_value_head_dim is off) or at their own width
    # (`mla_native`: the field on, what default_config sets). `value_head_dim` is not a config
    # field.
    "fwd_mla": ("fwd", False, dict(value_head_dim=128)),
    "fwd_mla_causal": ("fwd", True, dict(value_head_dim=128)),
    "bwd_mla": ("fwdbwd", False, dict(value_head_dim=128)),
    "bwd_mla_causal": ("fwdbwd", True, dict(value_head_dim=128)),
    "fwd_mla_native": ("fwd", False, dict(value_head_dim=128, native_value_head_dim=True)),
    "fwd_mla_native_causal": ("fwd", True, dict(value_head_dim=128, native_value_head_dim=True)),
    "bwd_mla_native": ("fwdbwd", False, dict(value_head_dim=128, native_value_head_dim=True)),
    "bwd_mla_native_causal": ("fwdbwd", True, dict(value_head_dim=128,
                                                    native_value_head_dim=True)),
    # The Mosaic decode kernel (decode_attention(implementation="mosaic"), decode/mosaic.py):
    # --shape B,T,H,D,K with T the cache's keys per sequence, every sequence full; contiguous
    # or paged (a shuffled pool, page_size keys a page), Tq = q_len; window and soft cap.
    # Overrides after @ are MosaicDecodeConfig fields (block_kv, num_stages).
    "decode": ("decode", False, {}),
    "decode_paged": ("decode", False, dict(page_size=16)),
    "decode_paged8": ("decode", False, dict(page_size=8)),
    "decode_features": ("decode", False, dict(page_size=16, q_len=4, window=1000,
                                              softcap=30.0)),
    # The FP8 forward (float8_e4m3fn q, k, v, per-tensor scales; sm90/fp8_forward.py): its
    # default tiles per head dim (no config), and 128-key tiles (the default's at head dim 256).
    "fp8": ("fp8", False, {}),
    "fp8_causal": ("fp8", True, {}),
    "fp8_kv128": ("fp8", False, dict(fp8_block_kv=128)),
    # The FP8 forward's features (named with implementation="mosaic"): the soft cap, a window
    # and segment ids (documents of 1000 tokens) through the segment-id path.
    "fp8_softcap": ("fp8", False, dict(softcap=30.0)),
    "fp8_softcap_causal": ("fp8", True, dict(softcap=30.0)),
    "fp8_window_causal": ("fp8", True, dict(window=1023)),
    "fp8_segments_causal": ("fp8", True, dict(segments=True)),
}


def parse_overrides(items) -> dict:
  """MosaicConfig overrides from 'key=value' strings: ints, True/False or strings."""
  kw = {}
  for item in items:
    key, value = item.split("=")
    kw[key] = ({"True": True, "False": False}[value] if value in ("True", "False")
               else int(value) if value.isdigit() else value)
  return kw


def variant(spec: str) -> tuple[str, bool, dict]:
  """'NAME' or 'NAME@key=value,...' (MosaicConfig overrides, see parse_overrides)."""
  name, _, extra = spec.partition("@")
  mode, causal, kw = VARIANTS[name]
  return mode, causal, {**kw, **parse_overrides(filter(None, extra.split(",")))}


def abstract_h200():
  """(a sharding on a described one-H200 topology (TARGET_CONFIG), an abstract mesh whose
  device pallas_flash picks and sizes kernels for, as in the lowering tests), for compiling
  without a GPU through jax's CUDA plugin."""
  from jax.experimental import topologies
  from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding, PartitionSpec

  topo = topologies.get_topology_desc(platform="cuda", topology_name="",
                                      target_config=TARGET_CONFIG.read_text(), topology="1x1x1")
  sharding = NamedSharding(topologies.make_mesh(topo, (1,), ("x",)), PartitionSpec())
  mesh = AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=AbstractDevice(
      device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
  return sharding, mesh


def time_ms(f, args, reps: int) -> float:
  """Milliseconds per call of f(*args): two warm-up calls, then `reps` back to back."""
  import time

  import jax

  for _ in range(2):
    jax.block_until_ready(f(*args))
  t0 = time.perf_counter()
  for _ in range(reps):
    out = f(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / reps * 1e3


def child(name: str, shape: tuple[int, ...], deviceless: bool, reps: int) -> None:
  """Compiles one variant (in the dumping process); on a GPU also checks and times it."""
  import jax
  import jax.numpy as jnp

  import pallas_flash
  from pallas_flash.mosaic_gpu import TUNED, MosaicConfig
  from pallas_flash.call import AttentionParams
  from pallas_flash.mosaic_gpu.config import config_head_dim, feature_tiles

  mode, causal, kw = variant(name)
  if mode == "decode":
    return decode_child(name, kw, shape, deviceless, reps)
  b, t, h, d = shape[:4]
  dv = int(kw.pop("value_head_dim", d))
  kv_shape = (b, t, shape[4] if len(shape) > 4 else h, d)
  v_shape = (*kv_shape[:3], dv)
  operand_shapes = (shape[:4], kv_shape, v_shape, (b, t, h, dv))  # q, k, v, do
  segments = kw.pop("segments", False)
  softcap = kw.pop("softcap", None)
  cap_order = kw.pop("cap_order", None)  # logits_soft_cap_order, e.g. "bias_then_cap"
  window = kw.pop("window", None)
  sinks = kw.pop("sinks", False)
  block_mask = kw.pop("blockmask", None)
  alibi = kw.pop("alibi", False)
  dropout = kw.pop("dropout", 0.0)
  # The dense inputs are jit arguments (shape, dtype), the bias differentiated.
  dense = {name: shp for name, on, shp in (
      ("bias", kw.pop("bias", False), ((1, h, t, t), jnp.bfloat16)),
      ("mask", kw.pop("mask", False), ((b, 1, t, t), jnp.bool_))) if on}
  # TUNED's config with the tiles a call with these features takes (overrides still win).
  params = AttentionParams(scale=d ** -0.5, is_causal=causal, has_segments=segments,
                           dropout_rate=float(dropout), has_bias="bias" in dense,
                           has_mask="mask" in dense)
  config = feature_tiles(TUNED.get((config_head_dim(d, d), causal), MosaicConfig()),
                         config_head_dim(d, d), params)
  config = dataclasses.replace(config, **kw)
  ids = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) // 1000, (b, t))
  features = dict(query_segment_ids=ids, key_value_segment_ids=ids) if segments else {}
  if softcap is not None:
    features["logits_soft_cap"] = float(softcap)
  if cap_order is not None:
    features["logits_soft_cap_order"] = cap_order
  if window is not None:
    features["local_window_size"] = (int(window), 0)
  if sinks:
    features["sinks"] = jnp.linspace(-1.0, 2.0, h, dtype=jnp.float32)
  if alibi:
    features["alibi_slopes"] = 2.0 ** (-8.0 * jnp.arange(1, h + 1, dtype=jnp.float32) / h)
  if dropout:
    features.update(dropout_rate=float(dropout), dropout_rng=jax.random.key(1))
  if block_mask is not None:
    features["block_mask"] = pallas_flash.BlockMask.build(
        pallas_flash.CausalMask() & pallas_flash.LocalMask(int(block_mask), 0), q_len=t,
        kv_len=t, block_q=128, block_kv=128)

  def attn(q, k, v, arrays=None, impl="mosaic"):
    return pallas_flash.flash_attention(q, k, v, is_causal=causal and block_mask is None,
                                        implementation=impl,
                                        config=config if impl == "mosaic" else None, **features,
                                        **(arrays or {}))

  def grads(q, k, v, do, arrays=None, impl="mosaic"):
    arrays = arrays or {}
    diff = {n: x for n, x in arrays.items() if n == "bias"}
    rest = {n: x for n, x in arrays.items() if n not in diff}
    _, vjp = jax.vjp(lambda q, k, v, d: attn(q, k, v, {**rest, **d}, impl=impl), q, k, v, diff)
    return vjp(do)

  if mode == "fp8":
    return fp8_child(name, causal, kw, operand_shapes, deviceless, reps, features)
  fn = attn if mode == "fwd" else grads
  nargs = 3 if mode == "fwd" else 4
  if deviceless:
    from jax.sharding import use_abstract_mesh
    sharding, h200 = abstract_h200()
    specs = [jax.ShapeDtypeStruct(sh, jnp.bfloat16, sharding=sharding)
             for sh in operand_shapes]
    dense_specs = {n: jax.ShapeDtypeStruct(sh, dt, sharding=sharding)
                   for n, (sh, dt) in dense.items()}
    with use_abstract_mesh(h200):
      traced = jax.jit(fn).trace(*specs[:nargs], dense_specs)
    traced.lower(lowering_platforms=("cuda",)).compile()
    print(json.dumps(dict(variant=name, compiled=True)), flush=True)
    return

  ks = jax.random.split(jax.random.key(0), 4)
  args = [jax.random.normal(kk, sh, jnp.bfloat16)
          for kk, sh in zip(ks, operand_shapes)][:nargs]
  arrays = {n: (jax.random.normal(ks[0], sh, dt) if n == "bias"
                else jax.random.bernoulli(ks[1], 0.9, sh)) for n, (sh, dt) in dense.items()}
  args.append(arrays)
  f = jax.jit(fn)
  out = jax.block_until_ready(f(*args))
  want = fn(*(x.astype(jnp.float32) for x in args[:nargs]),
            {n: x.astype(jnp.float32) if n == "bias" else x for n, x in arrays.items()},
            impl="reference")
  errs = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
          for x, r in zip(jax.tree.leaves(out), jax.tree.leaves(want))]
  ms = time_ms(f, args, reps)
  # Q·Kᵀ over D, P·V over Dv (4·B·H·T²·D at one head dim).
  flops = (2 * b * h * t * t * (d + dv) * (0.5 if causal else 1.0)
           * (3.5 if mode == "fwdbwd" else 1.0))
  print(json.dumps(dict(variant=name, ms=ms, tflops=flops / ms / 1e9, max_rel_err=max(errs))),
        flush=True)


def fp8_child(name: str, causal: bool, kw: dict, operand_shapes, deviceless: bool,
              reps: int, features: dict) -> None:
  """child() for the FP8 forward: e4m3 q, k, v with per-tensor scales; config None (the
  default tiles) or MosaicConfig(**kw); features: flash_attention's feature arguments (soft
  cap, window, segment ids); on a GPU checked against the reference semantics."""
  import jax
  import jax.numpy as jnp

  import pallas_flash
  from pallas_flash import fp8
  from pallas_flash.mosaic_gpu import MosaicConfig

  config = MosaicConfig(**kw) if kw else None
  q_shape, kv_shape = operand_shapes[0], operand_shapes[1]

  def attn(q8, k8, v8, sq, sk, sv):
    return pallas_flash.flash_attention(q8, k8, v8, descale=(sq, sk, sv), is_causal=causal,
                                        implementation="mosaic", config=config, **features)

  if deviceless:
    from jax.sharding import use_abstract_mesh
    sharding, h200 = abstract_h200()
    specs = [jax.ShapeDtypeStruct(sh, jnp.float8_e4m3fn, sharding=sharding)
             for sh in (q_shape, kv_shape, kv_shape)]
    specs += [jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding)] * 3
    with use_abstract_mesh(h200):
      traced = jax.jit(attn).trace(*specs)
    traced.lower(lowering_platforms=("cuda",)).compile()
    print(json.dumps(dict(variant=name, compiled=True)), flush=True)
    return

  ks = jax.random.split(jax.random.key(0), 3)
  x = [jax.random.normal(kk, sh, jnp.float32).astype(jnp.bfloat16)
       for kk, sh in zip(ks, (q_shape, kv_shape, kv_shape))]
  (q8, k8, v8), s = fp8.quantize(*x)
  args = (q8, k8, v8, s.q, s.k, s.v)
  f = jax.jit(attn)
  out = jax.block_until_ready(f(*args))
  deq = [fp8.dequantize(a, sc) for a, sc in zip((q8, k8, v8), (s.q, s.k, s.v))]
  want = pallas_flash.flash_attention(*deq, is_causal=causal, implementation="xla",
                                      **features)
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
  ms = time_ms(f, args, reps)
  b, t, h, d = q_shape
  flops = 4 * b * h * t * t * d * (0.5 if causal else 1.0)
  print(json.dumps(dict(variant=name, ms=ms, tflops=flops / ms / 1e9, max_rel_err=err)),
        flush=True)


def decode_child(name: str, kw: dict, shape: tuple[int, ...], deviceless: bool,
                 reps: int) -> None:
  """child() for the Mosaic decode kernel: q [B, q_len, H, D] bf16 over full caches of T keys
  per sequence ([B, T, K, D], or with page_size a shuffled pool of B·T / page_size pages);
  on a GPU checked against decode_reference and timed."""
  import jax
  import jax.numpy as jnp

  import pallas_flash

  kw = dict(kw)
  ps, tq = kw.pop("page_size", None), kw.pop("q_len", 1)
  features = {arg: v for arg, v in (("local_window_size", kw.pop("window", None)),
                                    ("logits_soft_cap", kw.pop("softcap", None)))
              if v is not None}
  config = pallas_flash.MosaicDecodeConfig(**kw) if kw else None
  b, t, h, d = shape[:4]
  kh = shape[4] if len(shape) > 4 else h
  shapes = [(b, tq, h, d), (b * t // ps, ps, kh, d) if ps else (b, t, kh, d)]

  def attn(q, kc, vc, lens, table, impl="mosaic"):
    return pallas_flash.decode_attention(q, kc, vc, lens, page_table=table, implementation=impl,
                                         config=config if impl == "mosaic" else None,
                                         **features)

  if deviceless:
    from jax.sharding import use_abstract_mesh
    sharding, h200 = abstract_h200()
    q, kv = (jax.ShapeDtypeStruct(sh, jnp.bfloat16, sharding=sharding) for sh in shapes)
    lens = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=sharding)
    table = jax.ShapeDtypeStruct((b, t // ps), jnp.int32, sharding=sharding) if ps else None
    with use_abstract_mesh(h200):
      traced = jax.jit(attn).trace(q, kv, kv, lens, table)
    traced.lower(lowering_platforms=("cuda",)).compile()
    print(json.dumps(dict(variant=name, compiled=True)), flush=True)
    return

  ks = jax.random.split(jax.random.key(0), 4)
  q, kc, vc = (jax.random.normal(kk, sh, jnp.bfloat16)
               for kk, sh in zip(ks, shapes[:1] + shapes[1:] * 2))
  lens = jnp.full((b,), t, jnp.int32)
  table = (jax.random.permutation(ks[3], b * t // ps).reshape(b, t // ps).astype(jnp.int32)
           if ps else None)
  args = (q, kc, vc, lens, table)
  f = jax.jit(attn)
  out = jax.block_until_ready(f(*args))
  want = attn(*(x.astype(jnp.float32) for x in (q, kc, vc)), lens, table, impl="reference")
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
  ms = time_ms(f, args, reps)
  cache_bytes = 2 * b * t * kh * d * 2
  print(json.dumps(dict(variant=name, ms=ms, tb_per_s=cache_bytes / ms / 1e9, max_rel_err=err)),
        flush=True)


_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _tool(name: str) -> str | None:
  for cand in (AOT_DIR / "nvidia" / "cu13" / "bin" / name,
               pathlib.Path(os.environ.get("MOSAIC_GPU_CUDA_ROOT", "/nonexistent")) / "bin" / name):
    if cand.is_file():
      return str(cand)
  return shutil.which(name)


_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
# ptxas diagnostics that cost a kernel its register plan: C7507 'setmaxnreg' ignored (the whole
# kernel then runs at the launch's registers), C7512 / C7513 wgmma serialised.
_WARNINGS = ("C7507", "C7512", "C7513")

# Predicated branches only: the unconditional ones jump back from out-of-line barrier retry
# blocks at the end of the kernel, which are not loops.
_BRANCH = re.compile(r"@!?U?P\d\s+BRA\s+`\((\.L_x_\d+)\)")


def _instructions(sass: str) -> list[tuple[int, str]]:
  """(address, line) of each SASS instruction line (those that carry a /*address*/)."""
  return [(int(m.group(1), 16), ln) for ln in sass.splitlines() if (m := _ADDR.search(ln))]


def wgmma_loops(sass: str) -> list[tuple[int, int]]:
  """(first, last) instruction addresses of the loops (backward branches) that issue a wgmma
  (HGMMA; QGMMA for FP8 operands): the kernel's main loops, as opposed to set-up code and
  barrier spin loops."""
  labels, instrs, pending = {}, [], []
  for ln in sass.splitlines():
    if m := _LABEL.match(ln):
      pending.append(m.group(1))
    elif m := _ADDR.search(ln):
      addr = int(m.group(1), 16)
      labels.update({name: addr for name in pending})
      pending = []
      instrs.append((addr, ln))
  loops = []
  for addr, ln in instrs:
    m = _BRANCH.search(ln)
    if m and labels.get(m.group(1), addr + 1) <= addr:
      lo = labels[m.group(1)]
      if any(lo <= a <= addr and _GMMA.search(text) for a, text in instrs):
        loops.append((lo, addr))
  return loops


_GMMA = re.compile(r"\b[HQ]GMMA\.")
# A 16-bit wgmma whose A operand is registers: HGMMA.<shape> <acc>, R<a>, gdesc[...]... (4 registers
# per k-step). Its B operand is transposed (".tnspB") for P·V-style products and not for the
# S = Q·Kᵀ-style ones, whose A operand is loop-invariant (a tile loaded before the loop).
_HGMMA_RS = re.compile(r"HGMMA\.\S+ R\d+, R(\d+), gdesc\[[^\]]*\](\.tnspB)?")
# The first register an instruction writes ("OP Rd, ..."), and how many (.64: two).
_WRITE = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s+R(\d+)\b")
_ARITH = ("FFMA", "FADD", "FMUL", "MUFU", "F2FP", "FSEL", "FMNMX", "HADD2", "HMUL2", "HFMA2")


def invariant_operand_writes(sass: str, loops) -> int:
  """Register-operand wgmmas, in the loops that issue wgmmas, whose A operand (untransposed B:
  an S = Q·Kᵀ-style product, its A loaded before the loop) was last written, going back
  around the loop, by arithmetic rather than by a load or move: ptxas gave the operand's
  registers to another value while the loop still reads them, a miscompile (the forward's
  plain loop with MosaicConfig.fwd_q_registers, see forward._q_operand). A reload from a
  spill slot is not counted. Expected 0. FP8 wgmmas (QGMMA) are not looked at: their B
  operand is never transposed, and the FP8 forward's only register operand is P."""
  rows = _instructions(sass)
  bad = 0
  for lo, hi in loops:
    body = [ln for a, ln in rows if lo <= a <= hi]
    writes = []  # per instruction: (opcode, registers written)
    for ln in body:
      m = _WRITE.search(ln)
      width = 2 if m and ".64" in m.group(1) else 4 if m and m.group(1).startswith("LDSM") else 1
      writes.append((m.group(1), {int(m.group(2)) + k for k in range(width)}) if m and
                    not m.group(1).startswith(("HGMMA", "QGMMA", "ST", "SYNCS", "RED"))
                    else ("", set()))
    for n, ln in enumerate(body):
      if not (m := _HGMMA_RS.search(ln)) or m.group(2):
        continue
      for reg in range(int(m.group(1)), int(m.group(1)) + 4):
        for k in range(1, len(body) + 1):  # backwards around the loop
          op, regs = writes[n - k]
          if reg in regs:
            bad += op.startswith(_ARITH)
            break
  return bad


_REG = re.compile(r"\bR(\d+)\b")


def max_register(lines) -> int:
  """The highest general register that SASS `lines` name (-1: none): the register demand of
  that code, give or take the last operand's width (a .64 or vector operand names its first
  register). ptxas' "Used N registers" is the launch's count under setmaxnreg, not this."""
  text = (ln.split("*/", 1)[-1].split("/*")[0] for ln in lines)  # no address, no encoding
  return max((int(r) for t in text for r in _REG.findall(t)), default=-1)


def loop_mix(sass: str, loops) -> str:
  """Per wgmma loop: its instructions and, of those, the softmax's arithmetic (_ARITH; MUFU:
  exp2, tanh), e.g. "606 (MUFU 130, FFMA 130, ...)": the instruction counts the docs compare
  between kernel forms."""
  instrs, out = _instructions(sass), []
  for lo, hi in loops:
    texts = (ln.split("*/", 1)[-1] for a, ln in instrs if lo <= a <= hi)
    ops = [re.sub(r"^\s*@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
           for text in texts if text.strip()]
    mix = ", ".join(f"{op} {ops.count(op)}" for op in _ARITH if ops.count(op))
    out.append(f"{len(ops)} ({mix})")
  return "; ".join(out)


def sass_report(ptx: pathlib.Path) -> str:
  """Assembles ptx with ptxas, disassembles it to ptx.with_suffix('.sass') and counts the
  spill loads / stores inside the loops that issue wgmmas, and each loop's instructions."""
  ptxas, nvdisasm = _tool("ptxas"), _tool("nvdisasm")
  if not (ptxas and nvdisasm):
    return "no SASS (ptxas or nvdisasm not found; scripts/setup_deviceless.sh installs both)"
  cubin = ptx.with_suffix(".cubin")
  subprocess.run([ptxas, "-arch=sm_90a", "-o", str(cubin), str(ptx)], check=True,
                 capture_output=True)
  sass = subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True,
                        text=True).stdout
  ptx.with_suffix(".sass").write_text(sass)
  loops = wgmma_loops(sass)
  inside = [ln for a, ln in _instructions(sass) if any(lo <= a <= hi for lo, hi in loops)]
  return (f"{len(loops)} wgmma loops, {sum(bool(_GMMA.search(ln)) for ln in inside)} "
          "HGMMA/QGMMA in them; "
          f"registers named in them: up to R{max_register(inside)}; "
          f"spill loads / stores in them: {sum('LDL' in ln for ln in inside)} / "
          f"{sum('STL' in ln for ln in inside)}; writes to loop-invariant wgmma register "
          f"operands: {invariant_operand_writes(sass, loops)}; instructions per loop: "
          f"{loop_mix(sass, loops)}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("variants", nargs="*", default=list(VARIANTS))
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--shape", default="1,4096,16,128",
                      help="B,T,H,D[,K] (S = T; K kv heads, default H)")
  parser.add_argument("--deviceless", action="store_true",
                      help="compile for a described H200 without a GPU (no check, no timing)")
  parser.add_argument("--sass", action="store_true", help="also write and summarise SASS")
  parser.add_argument("--reps", type=int, default=20, help="timed back-to-back calls (GPU)")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args()
  shape = tuple(int(x) for x in args.shape.split(","))
  if args.child:
    child(args.child, shape, args.deviceless, args.reps)
    return
  out = pathlib.Path(args.out) / "ptxas"
  path = [str(ROOT), os.environ.get("PYTHONPATH", "")]
  extra = {}
  if args.deviceless:
    if not (AOT_DIR / "jax_plugins").is_dir():
      sys.exit("--deviceless needs jax's CUDA plugin and ptxas: run ./scripts/setup_deviceless.sh")
    path.insert(0, str(AOT_DIR))
    # No GPU, so no CUDA or cuDNN runtime to check the plugin's constraints against.
    extra["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
  report = {}
  for name in args.variants:
    dump = out / re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)), **extra,
               MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=str(dump))
    cmd = [sys.executable, __file__, "--child", name, "--shape", args.shape, "--reps",
           str(args.reps)]
    proc = subprocess.run(cmd + ["--deviceless"] * args.deviceless, env=env,
                          capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    (dump / "log.txt").write_text(log)
    kernels = {}
    for p in sorted(dump.glob("*.ptxas")):  # one file per kernel
      text = p.read_text(errors="replace")
      kernels[p.stem] = dict(spills=[tuple(map(int, s)) for s in _SPILL.findall(text)][:1],
                             serialized=[ln.strip() for ln in text.splitlines()
                                         if any(w in ln for w in _WARNINGS)
                                         or "serializ" in ln.lower()])
      if args.sass and (dump / f"{p.stem}.ptx").is_file():
        kernels[p.stem]["sass"] = sass_report(dump / f"{p.stem}.ptx")
    timing = [json.loads(ln) for ln in log.splitlines() if ln.startswith('{"variant"')]
    report[name] = dict(rc=proc.returncode, kernels=kernels, result=timing)
    print(f"{name}: rc={proc.returncode} {timing}", flush=True)
    if proc.returncode:
      print("    " + "\n    ".join(log.strip().splitlines()[-5:]), flush=True)
    for kernel, k in kernels.items():
      print(f"    {kernel}: spill stores/loads {k['spills']}"
            + (f"; {k['sass']}" if "sass" in k else ""), flush=True)
      for ln in k["serialized"]:
        print(f"      {ln[:200]}", flush=True)
  (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
