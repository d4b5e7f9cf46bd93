"""Context-parallel checks on 8 host CPU devices, forward and gradients against the reference.

XLA fixes the number of host devices when its CPU client starts, which the test process has
long done, so `test_context_parallel.py` runs each group here in a fresh subprocess:

  python tests/context_parallel_checks.py GROUP   ->  one JSON line {case id: error or null}

Every case computes (out, lse) and (dq, dk, dv) for random cotangents of both, through entry
point A (`context_parallel_attention` inside shard_map, inputs put in the layout's order with
`to_zigzag`) or B (`flash_attention` on sequence-sharded arrays), and compares them with the
unsharded reference on the global arrays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

DEVICES = 8


@dataclasses.dataclass(frozen=True)
class CPCase:
  """One context-parallel problem: the mesh, the placement and the features."""

  axis_size: int
  layout: str = "zigzag"
  strategy: str | None = "ring"
  causal: bool = True
  window: tuple[int, int] | None = None
  softcap: float | None = None
  segments: bool = False
  kv_heads: int = 2
  batch: int = 2
  seq_len: int = 32
  dtype: str = "float32"
  entry: str = "A"  # A: shard_map + context_parallel_attention; B*: flash_attention (sharding)
  masked_rows: bool = False  # some queries see no key at all
  lengths: bool = False  # sequence lengths (entry point B folds them into segment ids)
  sinks: bool = False  # attention sinks (entry point B)
  steps: tuple[int, ...] | None = None  # expected ring steps (skipped ones are not run)
  implementation: str = "xla"  # the local backend (entry point A)
  # The ring drives "xla" as a backend with BACKWARD_COMPUTES_DELTA (as "mosaic" is): its
  # backward gets the forward's lse and -dlse, and computes rowsum(dO·O) from the O passed.
  computes_delta: bool = False

  @property
  def id(self) -> str:
    feats = [f"p{self.axis_size}", self.entry, self.implementation, self.layout,
             self.strategy or "auto",
             "causal" if self.causal else "full", f"kv{self.kv_heads}", self.dtype]
    feats += [n for n, on in (("seg", self.segments), ("masked", self.masked_rows),
                              ("len", self.lengths), ("delta", self.computes_delta),
                              ("sinks", self.sinks)) if on]
    if self.window:
      feats.append(f"w{self.window[0]}-{self.window[1]}")
    if self.softcap:
      feats.append("softcap")
    return "_".join(feats)


GROUPS: dict[str, list[CPCase]] = {
    "ring-2-4": [
        CPCase(2, kv_heads=4),
        CPCase(2, layout="contiguous", causal=False, kv_heads=1, softcap=2.0, dtype="bfloat16"),
        CPCase(4, segments=True, masked_rows=True, kv_heads=1, computes_delta=True),
        CPCase(4, window=(3, 0), segments=True, steps=(0, 1, 3)),
        CPCase(4, layout="contiguous", window=(6, 6), softcap=3.0, steps=(0, 1)),
    ],
    "ring-8": [
        CPCase(8, seq_len=64, kv_heads=1, segments=True, masked_rows=True, softcap=2.0),
        CPCase(8, seq_len=64, causal=False, window=(3, 3), steps=(0, 1, 7)),
    ],
    "all-gather": [
        CPCase(4, strategy="all_gather", segments=True, masked_rows=True),
        CPCase(8, seq_len=64, layout="contiguous", strategy="all_gather", window=(5, 2),
               softcap=2.0),
        CPCase(2, strategy="all_gather", causal=False, softcap=3.0, segments=True),
    ],
    "interpret": [  # the Triton kernels (Pallas interpreter) as the ring's local backend
        CPCase(2, implementation="interpret", batch=1, segments=True, softcap=2.0),
    ],
    "sharding": [
        # B-jit: jit on a mesh with Explicit axes (data 2 x context P); B-eager: concrete
        # arrays on an Auto mesh, outside jit. strategy None: the rule picks (all-gather at
        # these sizes); "ring" lowers the rule's threshold so that the ring runs.
        CPCase(4, entry="B-jit", strategy=None, lengths=True),
        CPCase(4, entry="B-jit", kv_heads=1, segments=True, sinks=True),
        CPCase(8, entry="B-eager", layout="contiguous", causal=False, window=(4, 4),
               seq_len=64),
        CPCase(4, entry="B-errors", strategy=None),
    ],
}


def _inputs(case: CPCase):
  """((q, k, v, do, dlse), keyword arguments) of the case, global and in natural order.
  numpy, not jax.random: eager jax ops would each compile once per shape."""
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(case.axis_size * 100 + case.seq_len)
  b, t, h, d = case.batch, case.seq_len, 4, 16
  normal = lambda *shape: rng.standard_normal(shape, np.float32)
  dtype = jnp.dtype(case.dtype)
  q, do = normal(b, t, h, d), normal(b, t, h, d)
  k, v = normal(b, t, case.kv_heads, d), normal(b, t, case.kv_heads, d)
  arrays = tuple(jnp.asarray(x, dtype) for x in (q, k, v, do)) + (jnp.asarray(normal(b, h, t)),)
  kwargs = {"is_causal": case.causal, "local_window_size": case.window,
            "logits_soft_cap": case.softcap}
  if case.segments or case.masked_rows:
    # Documents of random lengths, crossing device boundaries.
    starts = rng.random((b, t)) < 0.15
    starts[:, 0] = False
    seg = np.cumsum(starts, axis=1).astype(np.int32)
    kv_seg = seg
    if case.masked_rows:  # these queries' ids match no key
      seg = np.where(rng.random((b, t)) < 0.2, seg + 100, seg).astype(np.int32)
    kwargs.update(query_segment_ids=jnp.asarray(seg), key_value_segment_ids=jnp.asarray(kv_seg))
  if case.sinks:
    kwargs["sinks"] = jnp.asarray(normal(h))
  if case.lengths:
    kwargs.update(query_seq_lengths=jnp.asarray([t - 5, t]),
                  key_value_seq_lengths=jnp.asarray([t, 9]))
  return arrays, kwargs


def _fwd_bwd(f):
  """jit of (q, k, v, do, dlse) -> (o, lse, dq, dk, dv) for f(q, k, v) -> (o, lse)."""
  import jax

  def g(q, k, v, do, dlse):
    (o, lse), vjp = jax.vjp(f, q, k, v)
    return (o, lse, *vjp((do, dlse)))

  return jax.jit(g)


def _entry_a(case: CPCase, kwargs):
  import jax
  from jax.sharding import AxisType
  from jax.sharding import PartitionSpec as P

  from pallas_flash.context_parallel import context_parallel_attention, from_zigzag, to_zigzag

  p = case.axis_size
  mesh = jax.make_mesh((p,), ("context",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:p])
  zig = case.layout == "zigzag"
  to = (lambda x: to_zigzag(x, p)) if zig else (lambda x: x)
  back = (lambda x, axis=1: from_zigzag(x, p, axis=axis)) if zig else (lambda x, axis=1: x)
  seg_names = [n for n in ("query_segment_ids", "key_value_segment_ids") if n in kwargs]
  segs = [to(kwargs[n]) for n in seg_names]
  static = {n: x for n, x in kwargs.items() if n not in seg_names}

  def local(q, k, v, *segs):
    return context_parallel_attention(
        q, k, v, axis_name="context", layout=case.layout, strategy=case.strategy,
        implementation=case.implementation, return_residuals=True,
        **dict(zip(seg_names, segs)), **static)

  spec = P(None, "context")
  sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * (3 + len(segs)),
                          out_specs=(spec, P(None, None, "context")), check_vma=False)

  def f(q, k, v):
    o, lse = sharded(to(q), to(k), to(v), *segs)
    return back(o), back(lse, axis=2)

  return f


def _entry_b(case: CPCase, kwargs, args):
  """(f, args placed on the mesh); f calls plain flash_attention."""
  import jax
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import pallas_flash

  p = case.axis_size
  data = 2 if 2 * p <= DEVICES and case.batch % 2 == 0 else 1
  types = (AxisType.Explicit if case.entry == "B-jit" else AxisType.Auto,) * 2
  mesh = jax.make_mesh((data, p), ("data", "context"), axis_types=types,
                       devices=jax.devices()[:data * p])
  place = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  seq = P("data", "context")
  kwargs = {n: place(x, seq) if n.endswith("segment_ids") else
            place(x, P("data")) if n.endswith("lengths") else x for n, x in kwargs.items()}
  q, k, v, do, dlse = args
  args = (place(q, seq), place(k, seq), place(v, seq), place(do, seq),
          place(dlse, P("data", None, "context")))

  def f(q, k, v):
    return pallas_flash.flash_attention(q, k, v, implementation="xla", return_residuals=True,
                                        **kwargs)

  return f, args, mesh


@contextlib.contextmanager
def _xla_computing_delta():
  """The ring's "xla" backend replaced by one that follows the BACKWARD_COMPUTES_DELTA
  contract (pallas_flash.call), computing delta from the O and dO it is given."""
  import dataclasses

  import jax.numpy as jnp

  from pallas_flash import backends
  from pallas_flash.context_parallel import ring

  xla = backends.load("xla")

  def backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, **kw):
    rowsum = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32))
    delta = rowsum if delta is None else rowsum + delta
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
    return xla.backward(q, k, v, q_seg, kv_seg, o, lse, do, delta, **kw)

  patched = dataclasses.replace(xla, backward=backward, computes_delta=True)
  load = ring.backends.load
  ring.ring_attention_fn.cache_clear()
  ring.backends = type("Backends", (), {"load": staticmethod(
      lambda name: patched if name == "xla" else load(name))})
  try:
    yield
  finally:
    ring.backends = backends
    ring.ring_attention_fn.cache_clear()


def _check_refusals(case: CPCase) -> None:
  """Entry point B names what it cannot run: K/V split unlike the query, features that need
  global positions. Traced only, nothing compiles."""
  import jax
  import numpy as np
  from jax.sharding import AxisType
  from jax.sharding import PartitionSpec as P

  import pallas_flash

  (q, k, v, _, _), _ = _inputs(case)
  mesh = jax.make_mesh((case.axis_size,), ("context",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:case.axis_size])
  attend = lambda q, k, v, **kw: jax.eval_shape(
      lambda q, k, v: pallas_flash.flash_attention(q, k, v, implementation="xla", **kw), q, k, v)
  with jax.set_mesh(mesh):
    seq = [jax.sharding.reshard(x, P(None, "context")) for x in (q, k, v)]
    try:
      attend(seq[0], jax.sharding.reshard(k, P()), seq[2])
      raise AssertionError("key sharded unlike the query was accepted")
    except ValueError as e:
      assert "split the same way" in str(e), e
    try:
      attend(*seq, alibi_slopes=np.ones(4, np.float32))
      raise AssertionError("ALiBi on a sharded sequence was accepted")
    except NotImplementedError as e:
      assert "alibi_slopes" in str(e), e
    out = attend(*seq, is_causal=True)  # and a supported call traces
    assert out.shape == q.shape


def check(case: CPCase) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from testing import assert_close_to_ref, tolerance

  import pallas_flash
  from pallas_flash.context_parallel import context_parallel_explain, plan

  if case.entry == "B-errors":
    _check_refusals(case)
    return
  args, kwargs = _inputs(case)
  context = contextlib.ExitStack()
  if case.computes_delta:
    context.enter_context(_xla_computing_delta())
  if case.entry == "A":
    f = _entry_a(case, kwargs)
  else:
    f, args, mesh = _entry_b(case, kwargs, args)
    if case.entry == "B-jit":
      context.enter_context(jax.set_mesh(mesh))
    if case.strategy == "ring":  # flash_attention takes no strategy: make the rule pick it
      threshold = plan.ALL_GATHER_MAX_LOCAL_TOKENS_X_GROUP
      plan.ALL_GATHER_MAX_LOCAL_TOKENS_X_GROUP = 0
      context.callback(setattr, plan, "ALL_GATHER_MAX_LOCAL_TOKENS_X_GROUP", threshold)
  with context:
    if case.entry != "A":
      ran = context_parallel_explain(*args[:3], **kwargs)
      if case.strategy is not None and ran.strategy != case.strategy:
        raise AssertionError(f"entry B ran {ran.strategy}, expected {case.strategy}")
    got = _fwd_bwd(f)(*args)
  fresh, ref_kwargs = _inputs(case)  # unsharded
  up = [jnp.asarray(x, jnp.float32) for x in fresh]
  ref = _fwd_bwd(lambda q, k, v: pallas_flash.flash_attention(
      q, k, v, implementation="reference", return_residuals=True, **ref_kwargs))(*up)
  tol = tolerance(case.dtype)
  for name, x, r, t in zip(("out", "lse", "dq", "dk", "dv"), got, ref,
                           (tol, max(tol, 1e-5), 2 * tol, 2 * tol, 2 * tol)):
    assert x.dtype == (jnp.float32 if name == "lse" else jnp.dtype(case.dtype)), (name, x.dtype)
    assert_close_to_ref(f"{name}", x, r, t)
  if case.masked_rows:  # exactly zero, not merely close
    lse_ref = np.asarray(ref[1])  # [B, H, T]
    rows = np.isinf(lse_ref).transpose(0, 2, 1)  # [B, T, H]
    assert rows.any(), "the case has no fully masked query"
    for name, x in (("out", got[0]), ("dq", got[2])):
      assert not np.asarray(x, np.float32)[rows].any(), f"{name} not zero on masked rows"
  if case.steps is not None:
    _check_steps(case, kwargs)


def _check_steps(case: CPCase, kwargs) -> None:
  """The ring runs exactly `case.steps`, and its forward sends the K/V block only between them
  (one collective-permute per array and hop)."""
  import jax
  import jax.numpy as jnp

  from pallas_flash.context_parallel import context_parallel_explain

  p, t = case.axis_size, case.seq_len
  local = lambda h: jax.ShapeDtypeStruct((case.batch, t // p, h, 16), jnp.float32)
  static = {n: x for n, x in kwargs.items() if not n.endswith("segment_ids")}
  ex = context_parallel_explain(local(4), local(case.kv_heads), local(case.kv_heads),
                                axis_size=p, layout=case.layout, strategy=case.strategy,
                                **static)
  assert ex.ring.steps == case.steps, f"ring steps {ex.ring.steps}, expected {case.steps}"
  (q, k, v, _, _), _ = _inputs(case)
  f = _entry_a(case, static)
  hlo = jax.jit(lambda q, k, v: f(q, k, v)[0]).lower(q, k, v).as_text()
  sends = hlo.count("collective_permute")
  hops = [b - a for a, b in zip(case.steps, case.steps[1:])]
  runs = sum(1 for i, h in enumerate(hops) if i == 0 or h != hops[i - 1])  # one scan per run
  assert sends == 2 * runs, f"{sends} collective-permutes (k and v) for ring steps {case.steps}"


def run_on_host_devices(cases, check_case, devices: int) -> None:
  """Runs `check_case` on each case with `devices` host CPU devices (before jax starts its CPU
  client) and prints one JSON line {case id: error or null}."""
  os.environ["XLA_FLAGS"] = " ".join([
      os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={devices}",
      # Compiling dominates these small cases; optimising the CPU code does not pay.
      "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"])
  import jax

  jax.config.update("jax_platforms", "cpu")
  assert len(jax.devices()) == devices, jax.devices()
  results = {}
  for case in cases:
    try:
      check_case(case)
      results[case.id] = None
    except Exception as e:  # noqa: BLE001 (reported per case by the test)
      results[case.id] = f"{type(e).__name__}: {str(e)[:2000]}"
  print(json.dumps(results))


def assert_all_pass_in_subprocess(script: str, cases, *args: str) -> None:
  """Runs `python tests/<script> ARGS` (run_on_host_devices in a fresh process) and fails
  with every failing case's error, or when a case did not report."""
  here = pathlib.Path(__file__).resolve().parent
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [str(here.parent),
                                                      os.environ.get("PYTHONPATH")])))
  proc = subprocess.run([sys.executable, str(here / script), *args], capture_output=True,
                        text=True, cwd=here.parent, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = json.loads(proc.stdout.strip().splitlines()[-1])
  assert set(results) == {case.id for case in cases}
  failed = {name: why for name, why in results.items() if why is not None}
  assert not failed, "\n".join(f"{name}: {why}" for name, why in failed.items())


def main(group: str) -> None:
  run_on_host_devices(GROUPS[group], check, DEVICES)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main(sys.argv[1])
