"""What each device computes at each ring step, decided statically from the call's shapes.

Positions are global. Local query chunk a (global chunk ga) and key chunk b of the visiting
K/V block (global chunk gb) are offset by D = gb·ck - ga·cq, so the call's band
lo <= key - query <= hi (`AttentionParams.band`: causal, window) becomes, in the chunk pair's
own coordinates, lo - D <= j - i <= hi - D. Cut to the pair's rectangle that is empty (the
pair is skipped), everything (no mask) or a band that the kernels apply as
causal / local-window masking. The pairs a device computes at a step are grouped into as few
kernel calls as give exactly the same mask (one call per step in the common cases: zigzag
causal needs "causal over the local block" at step 0, then "all queries x first key chunk" or
"second query chunk x all keys"), and every kernel sees a band with lo <= 0 <= hi, the
form the public API validates: a band that starts right of the diagonal is moved there by
dropping the key (or query) rows it can never reach.

A step at which no device computes anything is skipped (windows: only the ring steps inside
the band run, and the K/V block jumps over the others in one `ppermute`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from pallas_flash import backends
from pallas_flash.call import AttentionParams, CallInfo
from pallas_flash.context_parallel import layout as layouts

Band = tuple[int | None, int | None]  # (lo, hi) of key - query; None: unbounded
Interval = tuple[int, int] | None  # closed interval of j - i; None: empty

# The sharding rule between the strategies (see `choose_strategy` and docs/context_parallel.md).
# A ring step hides its K/V transfer behind its compute when T_local·G is at least
# e·F / (2·f·BW) (e bytes per element, F attention FLOP/s, BW link bytes/s, f the step's
# visible fraction): about 3000 on H200 NVLink in bf16, rounded up for per-step latency.
ALL_GATHER_MAX_LOCAL_TOKENS_X_GROUP = 4096
# ... and gathering K/V (plus two rotated copies) must fit comfortably in memory.
ALL_GATHER_MAX_BYTES = 1 << 30
STRATEGIES: tuple[str, ...] = ("ring", "all_gather")


@dataclasses.dataclass(frozen=True)
class KernelCall:
  """One backend call of a ring step: local query rows x rows of the visiting K/V block, with
  the band (causal / local window) of those rows in the call's own coordinates."""

  q_rows: tuple[int, int]
  kv_rows: tuple[int, int]
  params: AttentionParams

  @property
  def shape(self) -> tuple[int, int]:
    return self.q_rows[1] - self.q_rows[0], self.kv_rows[1] - self.kv_rows[0]

  def visible_pairs(self) -> int:
    """Number of (query, key) pairs the band leaves visible (segment ids not counted)."""
    tq, sk = self.shape
    lo, hi = self.params.band
    i = np.arange(tq)
    first = np.maximum(0, i + lo) if lo is not None else np.zeros_like(i)
    last = np.minimum(sk - 1, i + hi) if hi is not None else np.full_like(i, sk - 1)
    return int(np.maximum(last - first + 1, 0).sum())

  def describe(self) -> str:
    tq, sk = self.shape
    lo, hi = self.params.band
    lo = None if lo is None or lo <= -(tq - 1) else lo
    hi = None if hi is None or hi >= sk - 1 else hi
    mask = ("full" if (lo, hi) == (None, None) else "causal" if (lo, hi) == (None, 0)
            else f"band[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]")
    return f"q[{self.q_rows[0]}:{self.q_rows[1]}] x kv[{self.kv_rows[0]}:{self.kv_rows[1]}] {mask}"


def _clip(lo, hi, tq: int, sk: int):
  """The band cut to a tq x sk rectangle: (lo, hi) with None where it constrains nothing there,
  or "empty"."""
  if (lo is not None and lo > sk - 1) or (hi is not None and hi < -(tq - 1)) or (
      lo is not None and hi is not None and lo > hi):
    return "empty"
  return (None if lo is None or lo <= -(tq - 1) else lo,
          None if hi is None or hi >= sk - 1 else hi)


def band_call(base: AttentionParams, band: Band, q_rows: tuple[int, int],
              kv_rows: tuple[int, int]) -> KernelCall | None:
  """The kernel call computing q_rows x kv_rows under `band` (call coordinates), or None when
  no pair is visible. A band right of the diagonal (lo > 0) drops the first lo key rows, one
  left of it (hi < 0) the first -hi query rows, so that the kernel's band has lo <= 0 <= hi
  (top-left causal alignment, a non-negative window) as every backend takes it."""
  (i0, i1), (j0, j1) = q_rows, kv_rows
  clipped = _clip(*band, i1 - i0, j1 - j0)
  if clipped == "empty":
    return None
  lo, hi = clipped
  if lo is not None and lo > 0:  # keys j < lo are never visible
    j0, lo, hi = j0 + lo, 0, None if hi is None else hi - lo
  elif hi is not None and hi < 0:  # queries i < -hi see no key
    i0, lo, hi = i0 - hi, None if lo is None else lo - hi, 0
  tq, sk = i1 - i0, j1 - j0
  lo, hi = _clip(lo, hi, tq, sk)
  if lo is None and hi in (None, 0):
    window = None
  else:
    window = (tq - 1 if lo is None else -lo, sk - 1 if hi is None else hi)
  params = dataclasses.replace(base, is_causal=hi == 0, local_window=window)
  return KernelCall((i0, i1), (j0, j1), params)


def _intersect(a: Band, b: tuple[int, int]) -> Interval:
  lo = b[0] if a[0] is None else max(a[0], b[0])
  hi = b[1] if a[1] is None else min(a[1], b[1])
  return (lo, hi) if lo <= hi else None


def _pair_interval(band: Band, d: int, cq: int, ck: int) -> Interval:
  """Visible j - i of a cq x ck chunk pair whose key chunk starts d positions after its query
  chunk, under the global band."""
  lo, hi = band
  return _intersect((None if lo is None else lo - d, None if hi is None else hi - d),
                    (-(cq - 1), ck - 1))


def _group_band(cells: dict, box, cq: int, ck: int):
  """A band (call coordinates) giving exactly the visible sets of every chunk pair in `box`
  (rows [a0, a1) x cols [b0, b1)) in one call, or None when no single band does."""
  (a0, a1), (b0, b1) = box
  rects, want = [], []
  for a, b in itertools.product(range(a0, a1), range(b0, b1)):
    off = (b - b0) * ck - (a - a0) * cq
    iv = cells[a, b]
    rects.append((off - (cq - 1), off + ck - 1))
    want.append(None if iv is None else (iv[0] + off, iv[1] + off))
  los = [None] + sorted({w[0] for w in want if w is not None})
  his = [None] + sorted({w[1] for w in want if w is not None})
  for band in itertools.product(los, his):
    if all(_intersect(band, r) == w for r, w in zip(rects, want)):
      return band
  return None


def _box(cells) -> tuple[tuple[int, int], tuple[int, int]]:
  rows, cols = [a for a, _ in cells], [b for _, b in cells]
  return (min(rows), max(rows) + 1), (min(cols), max(cols) + 1)


def step_calls(cells: dict, cq: int, ck: int, base: AttentionParams) -> tuple[KernelCall, ...]:
  """The fewest kernel calls covering the visible chunk pairs `cells` {(a, b): Interval}:
  one call over all of them, else one per query chunk, one per key chunk, or one per pair."""
  live = [c for c, iv in cells.items() if iv is not None]
  if not live:
    return ()
  groupings = [
      [_box(live)],
      [_box([c for c in live if c[0] == a]) for a in sorted({c[0] for c in live})],
      [_box([c for c in live if c[1] == b]) for b in sorted({c[1] for c in live})],
      [_box([c]) for c in live],
  ]
  for boxes in sorted(groupings, key=len):  # stable: ties keep the order above
    bands = [_group_band(cells, box, cq, ck) for box in boxes]
    if all(b is not None for b in bands):
      calls = (band_call(base, band, (a0 * cq, a1 * cq), (b0 * ck, b1 * ck))
               for band, ((a0, a1), (b0, b1)) in zip(bands, boxes))
      return tuple(c for c in calls if c is not None)
  raise AssertionError("a single chunk pair always has a band")


@dataclasses.dataclass(frozen=True)
class RingPlan:
  """The static schedule of a ring.

  Attributes:
    axis_size: P, devices on the ring.
    layout: token placement ("zigzag" or "contiguous").
    steps: the ring steps that compute anything, ascending; at step t device r holds the K/V
      block of device (r - t) mod P. Steps missing here are skipped (the block jumps them).
    programs: the distinct per-device programs of a step (kernel calls; () computes nothing).
    table: [len(steps)][P]: the program device r runs at each step of `steps`.
  """

  axis_size: int
  layout: str
  steps: tuple[int, ...]
  programs: tuple[tuple[KernelCall, ...], ...]
  table: tuple[tuple[int, ...], ...]

  def work(self) -> np.ndarray:
    """[len(steps), P]: visible (query, key) pairs each device computes at each step."""
    per_program = [sum(c.visible_pairs() for c in calls) for calls in self.programs]
    return np.array([[per_program[i] for i in row] for row in self.table], np.int64).reshape(
        len(self.steps), self.axis_size)

  def balance(self) -> float:
    """Ideal time / time with the ring's per-step synchronisation: mean over devices of the
    total work, divided by the sum over steps of the slowest device's work (1.0: balanced)."""
    w = self.work()
    critical = w.max(axis=1).sum()
    return float(w.sum() / self.axis_size / critical) if critical else 1.0

  def kernel_calls(self) -> np.ndarray:
    """[len(steps), P]: kernel calls each device makes at each step."""
    return np.array([[len(self.programs[i]) for i in row] for row in self.table],
                    np.int64).reshape(len(self.steps), self.axis_size)


@functools.cache
def ring_plan(base: AttentionParams, layout: str, axis_size: int, q_len: int,
              kv_len: int) -> RingPlan:
  """The ring schedule of local shards of q_len queries and kv_len keys under `base`'s band."""
  m = layouts.chunks_per_device(layout)
  cq, ck = q_len // m, kv_len // m
  band = base.band
  index: dict[tuple[KernelCall, ...], int] = {}
  steps, table = [], []
  for t in range(axis_size):
    row = []
    for r in range(axis_size):
      qa = layouts.device_chunks(layout, axis_size, r)
      kb = layouts.device_chunks(layout, axis_size, (r - t) % axis_size)
      cells = {(a, b): _pair_interval(band, kb[b] * ck - qa[a] * cq, cq, ck)
               for a in range(m) for b in range(m)}
      row.append(index.setdefault(step_calls(cells, cq, ck, base), len(index)))
    programs = list(index)
    if any(programs[i] for i in row):
      steps.append(t)
      table.append(tuple(row))
  return RingPlan(axis_size, layout, tuple(steps), tuple(index), tuple(table))


@dataclasses.dataclass(frozen=True)
class AllGatherPlan:
  """Gather K/V once, then one local call per device with global offsets.

  Each local query chunk of cq rows (global offset qo) sees a window of the gathered K/V,
  global keys [qo - left, qo + cq + right), which puts its band at a fixed place in the
  window: the chunks are stacked along the batch axis into one call. Keys of the window
  outside [0, S) are padding with a segment id nothing matches; kernels skip those blocks by
  their segment limits. Without a band (not causal, no window) every chunk sees all keys and
  the local queries make one call against the gathered K/V as is (`rotate` False).
  """

  axis_size: int
  layout: str
  rotate: bool
  left: int
  right: int
  right_pad: int  # padding after the gathered keys, so that every window lies inside
  chunk: int  # query rows per stacked chunk (the local length when not rotating)
  window: int  # keys per call
  call: KernelCall  # the stacked call (its params include segment ids when rotating)


def all_gather_plan(base: AttentionParams, layout: str, axis_size: int, q_len: int,
                    kv_len: int) -> AllGatherPlan:
  lo, hi = base.band
  t_glob, s_glob = q_len * axis_size, kv_len * axis_size
  if (lo, hi) == (None, None):
    call = KernelCall((0, q_len), (0, s_glob), base)
    return AllGatherPlan(axis_size, layout, False, 0, 0, 0, q_len, s_glob, call)
  cq = q_len // layouts.chunks_per_device(layout)
  left = t_glob - cq if lo is None else max(0, min(-lo, t_glob - cq))
  right = max(0, s_glob - cq) if hi is None else max(0, min(hi, s_glob - cq))
  width = left + cq + right
  right_pad = max(0, t_glob + right - s_glob)
  shifted = (None if lo is None else lo + left, None if hi is None else hi + left)
  params = dataclasses.replace(base, has_segments=True)
  call = band_call(params, shifted, (0, cq), (0, width))
  assert call is not None and call.q_rows == (0, cq) and call.kv_rows == (0, width), call
  return AllGatherPlan(axis_size, layout, True, left, right, right_pad, cq, width, call)


def choose_strategy(info: CallInfo, axis_size: int, strategy: str | None) -> tuple[str, str]:
  """(strategy, why) for local shards described by `info` on `axis_size` devices."""
  if strategy is not None:
    if strategy not in STRATEGIES:
      raise ValueError(f"`strategy` must be one of {STRATEGIES} or None, got {strategy!r}.")
    return strategy, "asked for"
  if axis_size == 1:
    return "ring", "one device: the ring is one local call, nothing is communicated"
  if info.params.local_window is not None:
    return "ring", ("a local window needs the K/V of the ring steps inside its band only; "
                    "all-gather would move every block")
  kv_bytes = (2 * info.batch * info.kv_len * axis_size * info.num_kv_heads * info.head_dim
              * info.dtype.itemsize)
  if kv_bytes > ALL_GATHER_MAX_BYTES:
    return "ring", (f"gathered K/V would take {kv_bytes / 2**20:.0f} MiB per device "
                    f"(> {ALL_GATHER_MAX_BYTES / 2**20:.0f} MiB)")
  group = info.num_heads // info.num_kv_heads
  work = info.q_len * group
  if work < ALL_GATHER_MAX_LOCAL_TOKENS_X_GROUP:
    return "all_gather", (
        f"local queries x GQA group = {info.q_len} x {group} = {work} < "
        f"{ALL_GATHER_MAX_LOCAL_TOKENS_X_GROUP}: a ring step's compute is too short to hide "
        f"its K/V transfer, so one all-gather ({kv_bytes / 2**20:.1f} MiB) is cheaper")
  return "ring", (f"local queries x GQA group = {work} >= "
                  f"{ALL_GATHER_MAX_LOCAL_TOKENS_X_GROUP}: each ring step's compute hides "
                  "its K/V transfer")


def sub_info(info: CallInfo, call: KernelCall, batch: int | None = None) -> CallInfo:
  """The CallInfo of one kernel call of a plan."""
  tq, sk = call.shape
  return dataclasses.replace(info, q_len=tq, kv_len=sk, params=call.params,
                             batch=info.batch if batch is None else batch)


def choose_backend(infos: list[CallInfo], implementation: str | None, config,
                   *, ring: bool) -> tuple[str | None, dict[str, str | None]]:
  """(implementation, reasons): the one asked for or the fastest that runs every call. Without
  a name the reasons are backends.auto_reason's, as flash_attention's choice: a backend that
  runs a call only when named (e.g. mosaic at an unmeasured head dim) is not picked."""
  why_not = backends.reason if implementation is not None else backends.auto_reason
  reasons: dict[str, str | None] = {}
  for name in backends.IMPLEMENTATIONS:
    if name == "reference" and ring:
      reasons[name] = ("the ring runs a backend's forward and backward per step; the "
                       "reference has none (use 'xla' on CPU)")
      continue
    reasons[name] = next((why for why in (why_not(name, i, config) for i in infos)
                          if why is not None), None)
  if implementation is not None:
    if implementation not in backends.IMPLEMENTATIONS:
      raise ValueError(f"Unknown implementation {implementation!r}; choose one of "
                       f"{backends.IMPLEMENTATIONS} or None for automatic.")
    return implementation, reasons
  return backends.auto_choice(reasons), reasons
