"""Data that needs no download, deterministic from (seed, step).

Two sources, both yielding dicts of numpy arrays with a leading [A] grad-accumulation axis:
  tokens, targets [A, B, T] int32; loss_mask [A, B, T] float32; positions [A, B, T] int32;
  segment_ids [A, B, T] int32 (text with document masking only).

- Text: the Python standard library's own sources, one document per file, as bytes. Files go
  to validation when their index is a multiple of 20. Each split is one long stream; a batch
  row is a window at an offset drawn from a generator seeded by (seed, step), so batch `step`
  is a pure function and `--resume` replays exactly the same data.
- Retrieval: random lowercase letters with `KEY=1234;` needles planted in the first 10% of the
  sequence and `?KEY=1234` at its very end; only the value digits are scored, so the task is
  solved only by attending across (almost) the whole sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sysconfig

import numpy as np

from train.config import TrainConfig

VAL_EVERY = 20  # every 20th file of the sorted list is validation
_EVAL_STREAM = 1 << 30  # step offset of evaluation batches: never collides with training


@dataclasses.dataclass(frozen=True)
class Corpus:
  """One split as a stream: tokens [N] uint8 and the document index of each byte [N] int32."""

  tokens: np.ndarray
  doc_ids: np.ndarray

  @property
  def num_docs(self) -> int:
    return int(self.doc_ids[-1]) + 1 if len(self.doc_ids) else 0


def stdlib_files(root: str | None = None) -> list[pathlib.Path]:
  """Sorted *.py files of the standard library (site-packages excluded): same list every run."""
  root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
  return sorted(p for p in root.rglob("*.py")
                if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def _pack(docs: list[bytes]) -> Corpus:
  tokens = np.frombuffer(b"".join(docs), np.uint8)
  doc_ids = np.repeat(np.arange(len(docs), dtype=np.int32), [len(d) for d in docs])
  return Corpus(tokens, doc_ids)


@functools.cache
def load_text(max_mb: float, root: str | None = None) -> tuple[Corpus, Corpus]:
  """(train, validation) corpora from the first `max_mb` MB of the standard library."""
  train, val, total = [], [], 0
  for i, path in enumerate(stdlib_files(root)):
    data = path.read_bytes()
    if not data:
      continue
    (val if i % VAL_EVERY == 0 else train).append(data)
    total += len(data)
    if total >= max_mb * 1e6:
      break
  if not train or not val:
    raise SystemExit(f"Found too little Python source under {root or 'the stdlib'} for a "
                     "train/validation split.")
  return _pack(train), _pack(val)


def positions_from_segments(seg: np.ndarray) -> np.ndarray:
  """[..., T] position of each token within its document (restarting at every boundary)."""
  t = seg.shape[-1]
  idx = np.broadcast_to(np.arange(t), seg.shape)
  starts = np.concatenate([np.ones_like(seg[..., :1], bool), seg[..., 1:] != seg[..., :-1]], -1)
  return idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=-1)


def text_rows(corpus: Corpus, rng: np.random.Generator, rows: int, seq_len: int,
              segment_ids: bool) -> dict[str, np.ndarray]:
  """`rows` windows of seq_len + 1 bytes -> inputs/targets of [rows, T]."""
  if len(corpus.tokens) <= seq_len + 1:
    raise SystemExit(f"The corpus split has {len(corpus.tokens)} bytes, too few for "
                     f"seq_len={seq_len}; raise --corpus-mb or lower --seq-len.")
  offsets = rng.integers(0, len(corpus.tokens) - seq_len - 1, size=rows)
  window = offsets[:, None] + np.arange(seq_len + 1)
  tok, doc = corpus.tokens[window].astype(np.int32), corpus.doc_ids[window]
  doc = doc - doc[:, :1]  # small ids, 0 for the document the row starts in
  seg = doc[:, :-1]
  out = dict(tokens=tok[:, :-1], targets=tok[:, 1:],
             positions=positions_from_segments(seg).astype(np.int32),
             loss_mask=np.ones(seg.shape, np.float32))
  if segment_ids:
    # A target that starts the next document cannot be predicted from the previous one.
    out["loss_mask"] = (doc[:, 1:] == seg).astype(np.float32)
    out["segment_ids"] = seg.astype(np.int32)
  return out


NEEDLE_LEN = 10  # "KEYS=1234;" and "?KEYS=1234"


def retrieval_rows(rng: np.random.Generator, rows: int, seq_len: int, num_pairs: int):
  """Haystacks with needles early and one query at the end -> [rows, T] arrays.

  Only the 4 value digits after the final query are in the loss: chance is 10% per digit.
  """
  n = seq_len + 1
  row = rng.integers(ord("a"), ord("z") + 1, size=(rows, n), dtype=np.int32)
  keys = rng.integers(ord("A"), ord("Z") + 1, size=(rows, num_pairs, 4), dtype=np.int32)
  vals = rng.integers(ord("0"), ord("9") + 1, size=(rows, num_pairs, 4), dtype=np.int32)
  region = max(n // 10, num_pairs * NEEDLE_LEN)  # needles live in the first 10%
  slot = region // num_pairs
  for r in range(rows):
    for p in range(num_pairs):
      at = p * slot + int(rng.integers(0, slot - NEEDLE_LEN + 1))
      row[r, at:at + NEEDLE_LEN] = [*keys[r, p], ord("="), *vals[r, p], ord(";")]
    q = int(rng.integers(0, num_pairs))
    row[r, n - NEEDLE_LEN:] = [ord("?"), *keys[r, q], ord("="), *vals[r, q]]
  mask = np.zeros((rows, seq_len), np.float32)
  mask[:, -4:] = 1.0
  return dict(tokens=row[:, :-1], targets=row[:, 1:], loss_mask=mask,
              positions=np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)))


class DataSource:
  """Training and evaluation batches of one TrainConfig; batch(step) is a pure function."""

  def __init__(self, cfg: TrainConfig):
    self.cfg = cfg
    if cfg.task == "text":
      self.train_split, self.val_split = load_text(cfg.corpus_mb)

  def _rows(self, stream: int, rows: int, split) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self.cfg.seed, stream])
    if self.cfg.task == "retrieval":
      return retrieval_rows(rng, rows, self.cfg.seq_len, self.cfg.num_pairs)
    return text_rows(split, rng, rows, self.cfg.seq_len, self.cfg.segment_ids)

  def train_batch(self, step: int) -> dict[str, np.ndarray]:
    """Batch of optimizer step `step`: arrays [A, B, T]."""
    a, b = self.cfg.grad_accum, self.cfg.batch_size
    rows = self._rows(step, a * b, getattr(self, "train_split", None))
    return {k: np.ascontiguousarray(v).reshape(a, b, -1) for k, v in rows.items()}

  def eval_batches(self) -> list[dict[str, np.ndarray]]:
    """The fixed evaluation set: eval_batches arrays of [B, T] (validation split for text)."""
    split = getattr(self, "val_split", None)
    return [{k: np.ascontiguousarray(v) for k, v in
             self._rows(_EVAL_STREAM + i, self.cfg.batch_size, split).items()}
            for i in range(self.cfg.eval_batches)]
