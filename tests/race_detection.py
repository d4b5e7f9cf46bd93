"""The `race_detector` fixture: the Mosaic GPU interpreter's race detector with the shared-memory
operand reads of wgmma registered too (tests/mosaic/test_races.py says what it sees and what
not). tests/conftest.py makes it available to every test module."""

import dataclasses

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret import shared_memory as interpret_memory

from pallas_flash.mosaic_gpu.sm90 import common

_SMEM = interpret_memory.IDX_BY_GPU_MEMORY_SPACE[plgpu.MemorySpace.SMEM]


def _checked_wgmma(wgmma):
  """The interpreter's wgmma callback, first registering its shared-memory operand reads with
  the race detector (at the issuing warpgroup's async-proxy clock, advanced on a TMA
  thread's entry as a TMA copy's is), then joining that clock into the warpgroup's: the
  product completes before the warpgroup's next access, as in the interpreter."""
  def checked(*, token, mesh_location, thread, a_allocation_key_as_array, a_transforms,
              b_allocation_key_as_array, b_transforms, source_info=None, **kwargs):
    memory = gpu_callbacks._get_shared_memory()
    if memory.detect_races:
      clock = memory.get_clock(thread)
      clock.inc(memory.get_next_tma_thread_id())
      for key, transforms in ((a_allocation_key_as_array, a_transforms),
                              (b_allocation_key_as_array, b_transforms)):
        key = interpret_memory.HostAllocationKey.from_array(key)
        if key.memory_space_id != _SMEM:
          continue
        transforms = jax.tree.map(int, gpu_callbacks._remove_noop_transforms(transforms))
        gpu_callbacks.get_races().check_read(thread, clock.async_smem_clock.copy(), key,
                                             memory.access(key, transforms),
                                             source_info=source_info)
      with memory.lock:
        memory.clocks[thread].update(clock)
    return wgmma(token=token, mesh_location=mesh_location, thread=thread,
                 a_allocation_key_as_array=a_allocation_key_as_array, a_transforms=a_transforms,
                 b_allocation_key_as_array=b_allocation_key_as_array, b_transforms=b_transforms,
                 source_info=source_info, **kwargs)

  return checked


@dataclasses.dataclass
class Detected:
  """The race detection state of every kernel interpreted since the fixture started, and the
  wgmma operand reads registered."""

  states: list = dataclasses.field(default_factory=list)
  wgmma_reads: int = 0

  @property
  def races(self) -> list[bool]:
    return [s.races_found for s in self.states]


@pytest.fixture
def race_detector(monkeypatch):
  """Interprets the sm90 kernels with race detection and wgmma operand reads checked; yields
  a Detected. Caches are cleared on both sides, so that no kernel traced without detection is
  reused here and none traced with it later."""
  detected = Detected()
  state_type = gpu_callbacks.GPURaceDetectionState

  class Recorded(state_type):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      detected.states.append(self)

  wgmma = _checked_wgmma(gpu_callbacks.wgmma)

  def counted(**kwargs):
    detected.wgmma_reads += 1
    return wgmma(**kwargs)

  monkeypatch.setattr(gpu_callbacks, "GPURaceDetectionState", Recorded)
  monkeypatch.setattr(gpu_callbacks, "wgmma", counted)
  monkeypatch.setattr(common, "interpret_params",
                      lambda interpret: plgpu.InterpretGPUParams(detect_races=True)
                      if interpret else None)
  jax.clear_caches()
  yield detected
  jax.clear_caches()
