"""FlashAttention kernels in Pallas Mosaic GPU: TMA, wgmma, warp specialisation.

The kernels of each GPU generation live in a folder of their own (`sm90/`: Hopper); this
module is the backend contract (pallas_flash.call) and picks the generation's kernels from the
target's compute capability. Another generation adds its folder with the same `forward` and
`backward` and an entry in KERNELS. With `MosaicConfig(debug=MosaicDebug(interpret=True))`
the sm90 kernels run in the Mosaic GPU interpreter, on any platform (slowly: for tests).

The kernels run at head dims 64, 80, 96, 128, 192 and 256 (KERNEL_HEAD_DIMS; one head dim for
Q, K and V); 80 and 96 (NARROW_HEAD_DIMS) are head dim 128's forward and split backward at
their own width, with a narrower shared-memory swizzle (a config that asks for the fused
backward runs it zero-padded to 128). Other head dims up to 256, and a value head dim of its
own, run here zero-padded to the next of those (`padded_call`: e.g. 112 to 128, 72 to 80; the
padded columns cost matrix work, plus a pad and a slice in XLA); `implementation=None` takes
every head dim, and a value head dim of its own once the pair is measured faster than Triton
(MEASURED_VALUE_HEAD_DIMS). The default
config (config.default_config) runs 80 and 96's backward split at their own width, and the
head-dim-192 and 256 kernels with V, O, dO and dV at their own value head dim
(MosaicConfig.native_value_head_dim, config.kernel_head_dims: MLA's 192 / 128) rather than
padded.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_flash import _tiling, backends, validation
from pallas_flash.call import CallInfo
from pallas_flash.mosaic_gpu.config import (KERNEL_HEAD_DIMS, NARROW_HEAD_DIMS, TUNED,
                                            MosaicConfig, MosaicDebug, default_config,
                                            kernel_head_dim, kernel_head_dims,
                                            native_value_reason)
from pallas_flash.mosaic_gpu.sm90 import backward as sm90_backward
from pallas_flash.mosaic_gpu.sm90 import block_mask as sm90_block_mask
from pallas_flash.mosaic_gpu.sm90 import common as sm90_common
from pallas_flash.mosaic_gpu.sm90 import forward as sm90_forward
from pallas_flash.mosaic_gpu.sm90 import fp8_forward as sm90_fp8_forward

CONFIG_TYPE = MosaicConfig
# Major compute capability -> (forward, backward) of that generation's kernels.
KERNELS = {9: (sm90_forward.forward, sm90_backward.backward)}
# (head dim, value head dim) pairs with Dv != D measured at least as fast here as on Triton:
# `implementation=None` runs only these of such pairs; others run when asked for by name
# (by_name_reason). Equal head dims run here whatever they are: the kernel head dims measured
# 1.3-2.6x Triton (docs/mosaic.md, "Other head dims"), and head dims zero-padded to them
# (48, 112, 160, 224) 1.2-2.6x on one H100 (2026-12-06, docs/perf.md).
MEASURED_VALUE_HEAD_DIMS = frozenset({(192, 128)})
# Optional features (pallas_flash.call.FEATURES) the kernels take; calls with any other run
# elsewhere. ALiBi's -slope·|i - j| is added to each score tile in the kernels
# (sm90/common.alibi), and so are the dense bias and mask ([B|1, H|1, T, S] tiles loaded by
# each kernel, sm90/dense.py; above head dim 128 hd256.py's backward). Dropout's keep mask is
# formed in the forward and the split backward kernels from pallas_flash.dropout's row and
# column keys (sm90/common.dropout_keep: bitwise every backend's mask), in every kernel but the
# fused backward (calls with dropout take the split backward). A block mask's tables become the
# kernels' per-tile lists of blocks (sm90/block_mask.py).
SUPPORTED_FEATURES = frozenset({"logits_soft_cap", "local_window_size", "alibi_slopes", "bias",
                                "mask", "dropout", "block_mask"})
# The forward adds attention sinks in its epilogue (sm90/forward._store_tile): the API passes
# calls with sinks here as params.has_sinks and arrays.sinks (pallas_flash.call); the backward
# kernels need nothing more, given the forward's o and lse, and dsinks comes from their delta.
FUSES_SINKS = True
# `backward` takes the forward's lse and only the lse cotangent's correction as delta, and
# computes rowsum(O∘dO) itself, in the dQ kernel (see pallas_flash.call).
BACKWARD_COMPUTES_DELTA = True


def _kernels(config: MosaicConfig):
  """(forward, backward) of the target GPU's generation (unsupported_reason checked it); the
  interpreter emulates sm90."""
  if config.interpret:
    return KERNELS[9]
  _, cc, _ = validation.target_device()
  return KERNELS[cc[0]]


def padded_call(kernel, q, k, v, *arrays, dims: tuple[int, int] | None = None):
  """kernel(q, k, v, *arrays) with q and k zero-padded along the head dim to dims[0], v and
  the arrays of rank 4 (the backward's o and do, which have V's columns) to dims[1] (None:
  kernel_head_dim(D, Dv) for both); its outputs of rank 4 (o; dq, dk, dv) sliced back to D
  (q's and k's) or Dv (o's and v's columns), the backward's others (dsinks) passed on. No pad
  or slice where a head dim is already the kernels'."""
  d, dv = q.shape[3], v.shape[3]
  p, pv = (kernel_head_dim(d, dv),) * 2 if dims is None else dims
  if (d, dv) == (p, pv):
    return kernel(q, k, v, *arrays)
  pad = lambda x, n: _tiling.pad_axis(x, 3, n)  # noqa: E731
  pad_v = lambda x: x if x is None or x.ndim != 4 else pad(x, pv)  # noqa: E731
  out = kernel(pad(q, p), pad(k, p), pad_v(v), *map(pad_v, arrays))
  if len(out) == 2:  # forward: (o, lse)
    return out[0][..., :dv], out[1]
  dq, dk, dv_, *rest = out
  return dq[..., :d], dk[..., :d], dv_[..., :dv], *rest


def forward(q, k, v, q_seg, kv_seg, *, config: MosaicConfig, **kwargs):
  kernel = functools.partial(_kernels(config)[0], config=config, **kwargs)
  return padded_call(kernel, q, k, v, q_seg, kv_seg,
                     dims=kernel_head_dims(q.shape[3], v.shape[3], config))


def backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, *, config: MosaicConfig, **kwargs):
  kernel = functools.partial(_kernels(config)[1], config=config, **kwargs)
  return padded_call(kernel, q, k, v, q_seg, kv_seg, o, lse, do, delta,
                     dims=kernel_head_dims(q.shape[3], v.shape[3], config, backward=True))


def unsupported_reason(call: CallInfo, config: MosaicConfig | None = None) -> str | None:
  """Why the Mosaic GPU kernels cannot run `call` with `config`, or None when they can."""
  cc = call.compute_capability
  interpret = config is not None and config.interpret
  if not interpret and (call.platform != "gpu" or cc is None or cc[0] not in KERNELS):
    cc = "" if cc is None else f" (compute capability {cc[0]}.{cc[1]})"
    return f"needs a Hopper GPU (sm_90), this is {call.platform} {call.device_kind!r}{cc}"
  if jnp.dtype(call.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"wgmma kernels take bfloat16 or float16, not {jnp.dtype(call.dtype).name}"
  if max(call.head_dim, call.value_head_dim) > KERNEL_HEAD_DIMS[-1]:
    return (f"head dims up to {KERNEL_HEAD_DIMS[-1]} (others zero-padded to one of "
            f"{KERNEL_HEAD_DIMS}), this call has {_dims(call)}")
  if (config is not None and config.native_value_head_dim
      and call.value_head_dim != call.head_dim
      and (why := native_value_reason(call.head_dim, call.value_head_dim)) is not None):
    return why
  if call.params.has_alibi and max(call.q_len, call.kv_len) >= sm90_common.ALIBI_MAX_LEN:
    return (f"ALiBi distances are exact below {sm90_common.ALIBI_MAX_LEN} positions, this call "
            f"has {max(call.q_len, call.kv_len)}")
  if call.params.block_mask_blocks is not None:
    if (why := sm90_block_mask.fn_reason(call.params.block_mask_fn_types)) is not None:
      return why
  if call.params.deterministic and config is not None and config.fused_backward:
    return ("config.fused_backward=True sums dQ with float32 atomics in a varying order, "
            "which deterministic=True rules out; pass fused_backward=False (the split backward)")
  return None


def by_name_reason(call: CallInfo) -> str | None:
  """Why `implementation=None` does not run `call` here though it can (a value head dim of its
  own not in MEASURED_VALUE_HEAD_DIMS), or None."""
  d, dv = call.head_dim, call.value_head_dim
  if d == dv or (d, dv) in MEASURED_VALUE_HEAD_DIMS:
    return None
  padded = kernel_head_dim(d, dv)
  how = f" zero-padded to {padded}"
  if padded in NARROW_HEAD_DIMS:
    how += " (a fused backward, where the config asks for one, zero-padded to 128)"
  return _by_name(f"{_dims(call)}{how}")


def _by_name(form: str) -> str:
  """by_name_reason's sentence for a `form` the kernels run but no GPU run has timed."""
  return (f"mosaic runs {form} only when asked for (implementation='mosaic'): not yet measured "
          "on the GPU")


def _dims(call: CallInfo) -> str:
  dims = f"head dim {call.head_dim}"
  return dims if call.value_head_dim == call.head_dim else (
      f"{dims} with value head dim {call.value_head_dim}")


# The FP8 (float8_e4m3fn) forward (sm90/fp8_forward.py): per-tensor and per-(batch, head)
# descale factors, causal or not, GQA, any lengths, the soft cap, local windows and segment
# ids / sequence lengths; forward only (an FP8 call is never differentiated, see
# pallas_flash.fp8). What it does not take runs the reference semantics.
FP8_SCALE_LAYOUTS = frozenset({"tensor", "head"})
FP8_HEAD_DIMS = (64, 128, 256)
# Optional features (pallas_flash.call.FEATURES) the FP8 forward takes.
FP8_FEATURES = frozenset({"logits_soft_cap", "local_window_size"})


def fp8_forward(q, k, v, c, v_descale, q_seg=None, kv_seg=None, *, params, out_dtype,
                config: MosaicConfig | None):
  """The FP8 forward of the target's generation (fp8_unsupported_reason checked it); params:
  the call's AttentionParams (causal, scale, soft cap, window)."""
  return sm90_fp8_forward.forward(q, k, v, c, v_descale, q_seg, kv_seg, params=params,
                                  out_dtype=out_dtype, config=config)


def fp8_unmeasured_reason(call: CallInfo) -> str | None:
  """Why `implementation=None` does not run the FP8 call `call` in the FP8 forward though it
  can (the soft cap, windows, segment ids / sequence lengths: not yet measured on the GPU),
  or None."""
  unmeasured = sorted(call.params.features & FP8_FEATURES)
  if call.params.has_segments:
    unmeasured.insert(0, "segment ids / sequence lengths")
  if not unmeasured:
    return None
  return (f"the FP8 kernel with {', '.join(unmeasured)} is not yet measured on the GPU: runs "
          "when implementation='mosaic' is named")


def fp8_unsupported_reason(call: CallInfo, *, scale_layouts, out_dtype, config=None,
                           sinks: bool = False, features: bool = True) -> str | None:
  """Why the Mosaic FP8 forward cannot run the FP8 call `call` (shapes and features of its
  float32 form), or None when it can. scale_layouts: the descale factors' layouts
  (pallas_flash.fp8: "tensor", "head", "block"); out_dtype: the output dtype; features False:
  refuse FP8_FEATURES and segment ids too (quantized_attention's training path, whose bf16
  backward is handed none of them)."""
  if (why := backends.config_type_reason("mosaic", MosaicConfig, config)) is not None:
    return why
  cc = call.compute_capability
  interpret = config is not None and config.interpret
  if not interpret and (call.platform != "gpu" or cc is None or cc[0] != 9):
    cc = "" if cc is None else f" (compute capability {cc[0]}.{cc[1]})"
    return (f"the FP8 kernel needs a Hopper GPU (sm_90), this is {call.platform} "
            f"{call.device_kind!r}{cc}")
  if call.head_dim not in FP8_HEAD_DIMS:
    return f"head_dim {call.head_dim} is not one of the FP8 kernel's {FP8_HEAD_DIMS}"
  if call.value_head_dim != call.head_dim:
    return (f"value head dim {call.value_head_dim} != query/key head dim {call.head_dim}: the "
            "FP8 kernel takes one head dim")
  unsupported = sorted(call.params.features - (FP8_FEATURES if features else frozenset()))
  if call.params.has_segments and not features:
    unsupported.insert(0, "segment ids / sequence lengths")
  if sinks:
    unsupported.append("sinks")
  if unsupported:
    takes = ("causal or full attention only" if not features else
             "causal or full attention, soft caps, local windows and segment ids only")
    return (f"the FP8 kernel takes {takes}, not {', '.join(unsupported)} (FP8 runs the "
            "reference semantics there)")
  if set(scale_layouts) - FP8_SCALE_LAYOUTS:
    return ("per-block descale factors are not in the FP8 kernel (per tensor and per (batch, "
            "head) are)")
  if not sm90_fp8_forward.fits(call.head_dim, out_dtype, config):
    need = sm90_fp8_forward.smem_bytes(
        call.head_dim, sm90_fp8_forward.block_kv(call.head_dim, config),
        sm90_fp8_forward.stages(config), out_dtype)
    return (f"head_dim {call.head_dim} with out_dtype {jnp.dtype(out_dtype).name} needs {need} "
            "bytes of shared memory per CTA, more than the 232,448 there are (use a 16-bit "
            "out_dtype, fewer num_stages or a smaller fp8_block_kv)")
  return None


__all__ = ["BACKWARD_COMPUTES_DELTA", "CONFIG_TYPE", "FUSES_SINKS",
           "KERNELS", "KERNEL_HEAD_DIMS", "MEASURED_VALUE_HEAD_DIMS", "NARROW_HEAD_DIMS",
           "MosaicConfig", "MosaicDebug", "SUPPORTED_FEATURES", "TUNED", "backward",
           "by_name_reason", "default_config", "forward", "fp8_forward",
           "fp8_unmeasured_reason", "fp8_unsupported_reason", "kernel_head_dim",
           "kernel_head_dims", "padded_call", "unsupported_reason"]
