"""The Mosaic kernels' forms under the Mosaic GPU interpreter's race detector (-m slow).

`plgpu.InterpretGPUParams(detect_races=True)` gives every warpgroup and TMA copy a vector clock
(advanced by mbarrier arrivals and waits, `commit_smem` and `wait_smem_to_gmem`) and reports
two accesses to the same bytes, one a write, that no chain of these orders. It sees reads and
writes of shared and global memory by warpgroups and by TMA copies; not the shared-memory
operand reads of wgmma, which the `race_detector` fixture (tests/race_detection.py) adds: a
read at issue through the async proxy (as a TMA store's is), complete before the warpgroup
goes on, as the interpreted kernels' products are (each is read from its accumulator at
once). With it a store through a tile another warpgroup's matmul still reads (hd256.py's dK
and dV) is a race.

What it cannot see: what the interpreter does not run. The kernels' GPU-only code (register
operand wgmma, `run_state` accumulators and the `wgmma_wait` before a ring slot is released,
the fused backward's TMA reduce-add, the overlapped dK/dV loop, Q in registers) is replaced by
synchronous, staged products in interpret mode; hazards between the warps of one warpgroup
are below its granularity; CTAs run one after another with their clocks reset between them,
so two CTAs' accesses are compared only when those clocks happen to be unordered (some races
between CTAs are found, none is ruled out). tests/mosaic/test_gpu.py runs the forms on a GPU.
"""

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import pytest
from jax import lax

from pallas_flash.mosaic_gpu.sm90 import common
from testing import (check_against_reference, check_block_mask_against_reference,
                     interpret_config, small_case)

pytestmark = pytest.mark.slow

def _two_warpgroups(ordered: bool):
  """Warpgroup 0 writes a shared tile, warpgroup 1 multiplies it (wgmma) by another, after
  an mbarrier that orders the two if `ordered`."""
  tiles = common.smem_transforms(jnp.bfloat16)

  def body(out_ref, a_smem, b_smem, written):
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
      a_smem[...] = jnp.ones((64, 64), jnp.bfloat16)
      b_smem[...] = jnp.ones((64, 64), jnp.bfloat16)
      plgpu.commit_smem()
      plgpu.barrier_arrive(written)

    @pl.when(wg == 1)
    def _():
      if ordered:
        plgpu.barrier_wait(written)
      out_ref[...] = common.smem_matmul(a_smem, b_smem, (64, 64))
      if not ordered:  # every waiter observes every phase
        plgpu.barrier_wait(written)

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
      scratch_types=[plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tiles),
                     plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tiles), plgpu.Barrier()],
      num_threads=2, thread_name="wg", interpret=common.interpret_params(True))()


@pytest.mark.parametrize("ordered", [False, True])
def test_wgmma_operand_reads_are_checked(race_detector, ordered):
  """The fixture's wgmma operand reads: a shared tile written by one warpgroup and read by
  another's wgmma is a race without the barrier between them and none with it."""
  jax.block_until_ready(_two_warpgroups(ordered))
  assert race_detector.wgmma_reads == 1
  assert race_detector.races == [not ordered]


_config, _case = interpret_config, small_case


_native = functools.partial(_config, native_value_head_dim=True)
_OVERLAP = _config(fwd_intra_wg_overlap=True, block_kv=128)
_PERSISTENT = _config(fwd_persistent=True, fwd_intra_wg_overlap=True,
                      debug=dict(persistent_ctas=2))
# (name, config, case, block mask (mask function, blocks) or None). The forms run on the GPU
# (the plain, overlapped, persistent and split-tail forwards, the split and fused backward, head
# dim 256, the dense bias and mask, dropout, block masks), then the one not yet run there: the
# native value head dim (forward, dQ and hd256.py's role-split dK/dV kernel, which with Dv < D
# stores dV through V's tile and dK through K's) and hd256.py's soft cap (its interpreted "P"
# role stages dV's operand through the Pᵀ slot before the tile it hands over). Each 5-10 s here.
FORMS = [
    ("plain", _config(), _case(130, 190, is_causal=True), None),
    ("overlap", _OVERLAP, _case(200, 200, kh=2, is_causal=True), None),
    ("persistent", _PERSISTENT, _case(200, 200, h=3, d=128), None),
    # A window's band in the persistent forward (tiles of differing steps, idle steps).
    ("persistent_window", _config(fwd_persistent=True, debug=dict(persistent_ctas=2)),
     _case(300, 300, h=3, is_causal=True, features=("window_left",)), None),
    ("split_tail", _config(fwd_split_tail=True, debug=dict(wave_ctas=2, tail_parts=3)),
     _case(384, 192, h=3), None),
    # Two key CTAs per kv head adding into the same dQ rows.
    ("fused", _config(fused_backward=True), _case(256, 256, h=4, kh=2, d=128), None),
    ("hd256", _config(), _case(130, 190, kh=2, d=256, is_causal=True), None),
    ("bias_mask_dropout", _config(), _case(140, 100, is_causal=True,
                                           features=("bias", "mask", "dropout")), None),
    # A bias in the inputs' dtype: the forward's bias tiles through the shared-memory ring
    # (dense.BiasRing) in the overlapped loop, causal (idle steps observe the ring too).
    ("bias_overlap", _OVERLAP, _case(200, 200, kh=2, is_causal=True, features=("bias_full",)),
     None),
    ("dropout_persistent", _PERSISTENT, _case(200, 200, h=3, d=128, features=("dropout",)),
     None),
    ("dropout_hd256", _config(), _case(130, 190, kh=2, d=256, is_causal=True,
                                       features=("dropout",)), None),
    ("block_mask_overlap", _OVERLAP, _case(150, 130, b=2),
     ("segment_and_prefix_or_local", (32, 96))),
    ("block_mask_plain", _config(), _case(200, 200, b=2), ("causal_segment", (64, 64))),
    ("native_causal_dropout", _native(),
     _case(130, 190, d=192, value_head_dim=128, is_causal=True,
           features=("dropout", "alibi", "sinks")), None),
    # GQA 3:1 (persistent forward).
    ("native_persistent", _native(fwd_persistent=True, debug=dict(persistent_ctas=2)),
     _case(200, 200, h=3, d=192, value_head_dim=128), None),
    ("softcap_hd256", _config(), _case(130, 190, kh=2, d=256, is_causal=True,
                                       features=("softcap",)), None),
]


@pytest.mark.parametrize("name, config, case, block_mask", FORMS,
                         ids=[f"{f[0]}-{f[2].id}" for f in FORMS])
def test_kernel_forms_have_no_races_in_interpreter(race_detector, name, config, case,
                                                   block_mask):
  """Forward, dQ and dK/dV (forward and fused backward) of each form: the outputs and
  gradients against the reference, and no race reported in any kernel (printed above)."""
  del name
  if block_mask is None:
    check_against_reference("mosaic", case, config=config)
  else:
    check_block_mask_against_reference("mosaic", case, block_mask[0], blocks=block_mask[1],
                                       config=config)
  expected = 2 if config.fused_backward else 3
  assert len(race_detector.states) == expected, "kernels interpreted without detection"
  assert race_detector.wgmma_reads > 0
  assert all(s.reads and s.writes for s in race_detector.states)
  assert not any(race_detector.races), (
      f"the interpreter's race detector reported races (kernels: {race_detector.races})")
