"""scripts/mosaic_ptxas.py's SASS reading on a small nvdisasm-style listing: which loops are
the kernel's main loops, and the instruction counts the docs compare between kernel forms."""

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "mosaic_ptxas.py"

# A wgmma loop (a predicated backward branch over an HGMMA), then a barrier spin loop (no
# wgmma: not a main loop), then an out-of-line unconditional jump back (not a loop).
SASS = """
        /*0100*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0110*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0120*/                   MUFU.EX2 R5, R6 ;
        /*0130*/                   FMUL R7, R5, 0.5 ;
        /*0140*/              @!P2 FMUL R8, R5, R7 ;
        /*0150*/                   STL [R1+0x10], R8 ;
        /*0160*/              @P0  BRA `(.L_x_1) ;
.L_x_2:
        /*0170*/                   SYNCS.PHASECHK.TRANS64 P1, [UR5], R2 ;
        /*0180*/              @!P1 BRA `(.L_x_2) ;
        /*0190*/                   EXIT ;
.L_x_3:
        /*01a0*/                   BRA `(.L_x_1) ;
"""


@pytest.fixture(scope="module")
def ptxas():
  spec = importlib.util.spec_from_file_location("mosaic_ptxas", _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_main_loops_and_their_instruction_mix(ptxas):
  loops = ptxas.wgmma_loops(SASS)
  assert loops == [(0x110, 0x160)]
  assert ptxas.loop_mix(SASS, loops) == "6 (FMUL 2, MUFU 1)"
