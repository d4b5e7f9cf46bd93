"""The Triton kernels on a real GPU, at larger sizes than the CPU suite affords, features too."""

import dataclasses

import jax.numpy as jnp
import pytest

from testing import Case, check_against_reference

pytestmark = pytest.mark.gpu

CASES = (
    [Case(batch=2, q_len=t, kv_len=s, num_heads=8, num_kv_heads=kh, head_dim=d,
          dtype=jnp.bfloat16, is_causal=c)
     for t, s in ((1000, 1000), (1, 1), (17, 4096), (4096, 300))
     for d in (64, 128) for kh in (8, 2) for c in (False, True)]
    + [Case(batch=2, q_len=1537, kv_len=1537, num_heads=8, num_kv_heads=kh, head_dim=d,
            dtype=dt, is_causal=True, segments=True)
       for d in (64, 96, 128, 256) for kh in (8, 1) for dt in (jnp.bfloat16, jnp.float16)]
    + [Case(batch=2, q_len=777, kv_len=1000, num_heads=4, num_kv_heads=2, head_dim=d,
            dtype=jnp.float32, is_causal=c, lengths=True, segments=seg)
       for d in (64, 256) for c in (False, True) for seg in (False, True)]
    + [Case(batch=1, q_len=8192, kv_len=8192, num_heads=4, num_kv_heads=1, head_dim=128,
            dtype=jnp.bfloat16, is_causal=c) for c in (False, True)]
)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_triton_against_reference(case):
  check_against_reference("triton", case)


FEATURE_SETS = [("window_512",), ("window",), ("softcap",), ("alibi",), ("dropout",), ("bias",),
                ("bias_bcast", "mask"), ("window_512", "softcap", "alibi", "dropout"),
                ("window", "softcap", "dropout", "bias", "mask")]
FEATURE_CASES = (
    [Case(batch=2, q_len=2048, kv_len=2048, num_heads=8, num_kv_heads=2, head_dim=d,
          dtype=jnp.bfloat16, is_causal=True, segments=seg)
     for d in (64, 128) for seg in (False, True)]
    + [Case(batch=1, q_len=1537, kv_len=1000, num_heads=4, num_kv_heads=1, head_dim=96,
            dtype=jnp.float16, lengths=True)]
)


@pytest.mark.parametrize("names", FEATURE_SETS, ids="+".join)
@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: c.id)
def test_triton_features_against_reference(case, names):
  check_against_reference("triton", dataclasses.replace(case, features=names))


@pytest.mark.parametrize("names", [("window_512",), ("softcap", "alibi", "dropout")], ids="+".join)
def test_triton_features_long(names):
  case = Case(batch=1, q_len=8192, kv_len=8192, num_heads=4, num_kv_heads=1, head_dim=128,
              dtype=jnp.bfloat16, is_causal=True, segments=True, features=names)
  check_against_reference("triton", case)


# MLA's head dims (query/key 192, value 128) and the reverse, with sinks on some.
VALUE_DIM_CASES = [
    (Case(batch=2, q_len=2048, kv_len=2048, num_heads=8, num_kv_heads=8, head_dim=192,
          value_head_dim=128, dtype=jnp.bfloat16, is_causal=True), ()),
    (Case(batch=2, q_len=1000, kv_len=1537, num_heads=8, num_kv_heads=2, head_dim=64,
          value_head_dim=128, dtype=jnp.bfloat16, segments=True), ("sinks",)),
    (Case(batch=2, q_len=2048, kv_len=2048, num_heads=8, num_kv_heads=2, head_dim=128,
          dtype=jnp.bfloat16, is_causal=True), ("sinks", "softcap")),
]


@pytest.mark.parametrize("case, names", VALUE_DIM_CASES, ids=[c.id for c, _ in VALUE_DIM_CASES])
def test_triton_value_head_dim_and_sinks(case, names):
  check_against_reference("triton", dataclasses.replace(case, features=names))
