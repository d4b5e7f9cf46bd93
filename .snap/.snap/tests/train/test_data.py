"""Data: deterministic from (seed, step), packed with document boundaries, retrieval needles."""

import dataclasses

import numpy as np

from train.config import PRESETS
from train.data import VAL_EVERY, DataSource, load_text, positions_from_segments, stdlib_files

CFG = dataclasses.replace(PRESETS["cpu-demo"], seq_len=256, batch_size=3, grad_accum=2,
                          corpus_mb=1.0, eval_batches=2)


def test_batches_are_a_pure_function_of_seed_and_step():
  a, b = DataSource(CFG), DataSource(CFG)
  for k, v in a.train_batch(7).items():
    np.testing.assert_array_equal(v, b.train_batch(7)[k])
  assert not np.array_equal(a.train_batch(7)["tokens"], a.train_batch(8)["tokens"])
  other_seed = DataSource(dataclasses.replace(CFG, seed=1))
  assert not np.array_equal(a.train_batch(7)["tokens"], other_seed.train_batch(7)["tokens"])


def test_shapes_and_next_byte_targets():
  batch = DataSource(CFG).train_batch(0)
  assert {k: v.shape for k, v in batch.items()} == {k: (2, 3, 256) for k in batch}
  np.testing.assert_array_equal(batch["targets"][..., :-1], batch["tokens"][..., 1:])
  assert batch["tokens"].max() < 256 and batch["tokens"].dtype == np.int32


def test_segment_ids_positions_and_loss_mask_follow_document_boundaries():
  cfg = dataclasses.replace(CFG, seq_len=4096, batch_size=32, grad_accum=1)
  batch = DataSource(cfg).train_batch(3)
  seg, pos, mask = batch["segment_ids"][0], batch["positions"][0], batch["loss_mask"][0]
  starts = np.diff(seg, axis=-1) != 0
  assert starts.any(), "4K-byte windows of the stdlib should cross a file boundary"
  assert (np.diff(seg, axis=-1) >= 0).all() and (seg[:, 0] == 0).all()
  assert (pos[:, 1:][starts] == 0).all()  # a new document starts at position 0
  assert (np.diff(pos, axis=-1)[~starts] == 1).all()  # and counts up inside it
  # No loss on predicting the next file's first byte, and loss everywhere else.
  np.testing.assert_array_equal(mask[:, :-1], (~starts).astype(np.float32))


def test_positions_from_segments():
  seg = np.array([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
  np.testing.assert_array_equal(positions_from_segments(seg),
                                [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])


def test_train_and_validation_files_are_disjoint():
  train, val = load_text(1.0)
  files = stdlib_files()
  assert val.num_docs >= 1 and train.num_docs >= VAL_EVERY - 1
  first_val = files[0].read_bytes()
  assert bytes(val.tokens[:len(first_val)]) == first_val  # file 0 is validation


def test_retrieval_needle_early_and_query_at_the_end():
  cfg = dataclasses.replace(CFG, task="retrieval", seq_len=2048, num_pairs=3, grad_accum=1)
  batch = DataSource(cfg).train_batch(0)
  for row_tok, row_tgt, row_mask in zip(batch["tokens"][0], batch["targets"][0],
                                        batch["loss_mask"][0]):
    text = bytes(np.append(row_tok, row_tgt[-1]).astype(np.uint8)).decode()
    query = text[-10:]
    assert query[0] == "?" and query[5] == "="
    needle = query[1:] + ";"
    at = text.find(needle)
    assert 0 <= at < len(text) // 10, "the needle sits in the first 10% of the sequence"
    assert row_mask.sum() == 4 and row_mask[-4:].all()
    assert bytes(row_tgt[-4:].astype(np.uint8)).decode() == query[-4:]
