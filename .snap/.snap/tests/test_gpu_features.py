"""Windows, soft cap, ALiBi, dropout, bias and mask on the Triton kernels of a real GPU."""

import jax.numpy as jnp
import pytest

from features_testing import check_features
from testing import GPU_FWD_TOL, Case

pytestmark = pytest.mark.gpu

FEATURE_SETS = [("window_512",), ("window",), ("softcap",), ("alibi",), ("dropout",), ("bias",),
                ("bias_bcast", "mask"), ("window_512", "softcap", "alibi", "dropout"),
                ("window", "softcap", "dropout", "bias", "mask")]
CASES = (
    [Case(batch=2, q_len=2048, kv_len=2048, num_heads=8, num_kv_heads=2, head_dim=d,
          dtype=jnp.bfloat16, is_causal=True, segments=seg)
     for d in (64, 128) for seg in (False, True)]
    + [Case(batch=1, q_len=1537, kv_len=1000, num_heads=4, num_kv_heads=1, head_dim=96,
            dtype=jnp.float16, lengths=True)]
)


@pytest.mark.parametrize("names", FEATURE_SETS, ids="+".join)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_triton_features_against_reference(case, names):
  check_features("triton", case, names, tol_table=GPU_FWD_TOL, seed=len(names))


@pytest.mark.parametrize("names", [("window_512",), ("softcap", "alibi", "dropout")], ids="+".join)
def test_triton_features_long(names):
  case = Case(batch=1, q_len=8192, kv_len=8192, num_heads=4, num_kv_heads=1, head_dim=128,
              dtype=jnp.bfloat16, is_causal=True, segments=True)
  check_features("triton", case, names, tol_table=GPU_FWD_TOL)
