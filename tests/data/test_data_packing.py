"""Packing: bin assignment, row invariants, overlong policy, batch ids, iterator state."""

import collections

import grain
import numpy as np
import pytest

from jaxrl.data import (
    PACKING_METHODS,
    PackedBatchIterDataset,
    PackingConfig,
    assign_rows,
    pack_samples,
)

PAD = 0


def _sample(rng, length, n_turns=2):
  """A tokenised sample: tokens 1.., a few trained spans with turn ids 1..n_turns."""
  tokens = rng.integers(1, 100, size=length).astype(np.int32)
  turn = np.zeros(length, np.int32)
  bounds = np.linspace(1, length, n_turns + 1).astype(int)
  for t, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
    turn[(a + b) // 2:b] = t
  if not turn.any():
    turn[-1] = 1
  return {"tokens": tokens, "loss_mask": turn > 0, "turn_id": turn}


def _samples(n=40, seed=0, max_len=20):
  rng = np.random.default_rng(seed)
  return [_sample(rng, int(rng.integers(2, max_len + 1)), int(rng.integers(1, 3))) for _ in range(n)]


@pytest.mark.parametrize("method,expected", [
    ("best_fit", [[0, 1], [2, 3, 5], [4]]),
    ("first_fit_decreasing", [[1, 0], [3, 4, 5], [2]]),
    ("none", [[0], [1], [2], [3], [4], [5]]),
])
def test_assign_rows_by_hand(method, expected):
  # lengths 3 5 2 4 3 1, capacity 8. best_fit (arrival order, tightest row): 3->r0, 5->r0 (full),
  # 2->r1, 4->r1 (free 2), 3->r2, 1->r1 (free 2 beats 5). FFD (5 4 3 3 2 1, first row that fits):
  # 5->r0, 4->r1, 3->r0, 3->r1, 2->r2, 1->r1.
  assert assign_rows([3, 5, 2, 4, 3, 1], 8, method=method) == expected


@pytest.mark.parametrize("method", PACKING_METHODS)
def test_every_sample_appears_once_with_restarting_positions(method):
  samples = _samples()
  out = pack_samples(samples, 24, method=method, pad_id=PAD)
  found = collections.Counter()
  for r in range(len(out["tokens"])):
    seg = out["segment_ids"][r]
    for s in range(1, seg.max() + 1):
      (idx,) = np.nonzero(seg == s)
      assert np.all(np.diff(idx) == 1), "a sample is contiguous"
      np.testing.assert_array_equal(out["positions"][r, idx], np.arange(len(idx)))
      found[tuple(out["tokens"][r, idx])] += 1
    assert np.all(out["tokens"][r, seg == 0] == PAD) and np.all(out["positions"][r, seg == 0] == 0)
  assert found == collections.Counter(tuple(s["tokens"]) for s in samples)


@pytest.mark.parametrize("method", PACKING_METHODS)
def test_targets_are_next_tokens_within_a_segment(method):
  samples = _samples(seed=1)
  out = pack_samples(samples, 24, method=method, pad_id=PAD)
  seg, tok, tgt, mask = out["segment_ids"], out["tokens"], out["targets"], out["loss_mask"]
  same = (seg[:, :-1] == seg[:, 1:]) & (seg[:, :-1] > 0)  # position t and t+1 in one sample
  np.testing.assert_array_equal(tgt[:, :-1][same], tok[:, 1:][same])
  assert np.all(mask[:, :-1][~same] == 0) and np.all(mask[:, -1] == 0), "no cross-segment loss"
  assert np.all(tgt[:, :-1][~same] == PAD)
  # loss tokens: exactly the trained tokens after each sample's first token
  assert mask.sum() == sum(s["loss_mask"][1:].sum() for s in samples)
  assert np.all((out["turn_ids"] > 0) == (mask > 0))


def test_loss_mask_and_turns_shift_onto_targets():
  s = {"tokens": np.array([7, 8, 9, 10, 11], np.int32),
       "loss_mask": np.array([0, 0, 1, 1, 0], bool), "turn_id": np.array([0, 0, 1, 1, 0], np.int32)}
  t = {"tokens": np.array([20, 21, 22], np.int32),
       "loss_mask": np.array([0, 1, 1], bool), "turn_id": np.array([0, 1, 1], np.int32)}
  out = pack_samples([s, t], 10, method="best_fit", pad_id=PAD)
  np.testing.assert_array_equal(out["tokens"][0], [7, 8, 9, 10, 11, 20, 21, 22, 0, 0])
  np.testing.assert_array_equal(out["targets"][0], [8, 9, 10, 11, 0, 21, 22, 0, 0, 0])
  np.testing.assert_array_equal(out["loss_mask"][0], [0, 1, 1, 0, 0, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(out["turn_ids"][0], [0, 1, 1, 0, 0, 2, 2, 0, 0, 0])
  np.testing.assert_array_equal(out["positions"][0], [0, 1, 2, 3, 4, 0, 1, 2, 0, 0])
  np.testing.assert_array_equal(out["segment_ids"][0], [1, 1, 1, 1, 1, 2, 2, 2, 0, 0])


def _batches(samples, **cfg):
  config = PackingConfig(**{"seq_len": 24, "global_rows": 4, "buffer_size": 16, **cfg})
  return PackedBatchIterDataset(grain.MapDataset.source(samples).to_iter_dataset(), config=config,
                                pad_id=PAD)


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_overlong_samples_are_truncated_or_dropped_and_counted(policy):
  rng = np.random.default_rng(2)
  samples = [_sample(rng, n) for n in (10, 30, 5, 50, 24)]
  # a long sample whose only trained tokens lie beyond seq_len: nothing left after truncation
  late = _sample(rng, 40)
  late["loss_mask"][:] = False
  late["turn_id"][:] = 0
  late["loss_mask"][-3:] = True
  late["turn_id"][-3:] = 1
  batches = list(_batches(samples + [late], overlong=policy))
  stats = batches[-1].stats
  assert stats.samples_read == 6
  if policy == "truncate":
    assert (stats.truncated, stats.dropped) == (2, 1)
    kept = sum(b.stats.samples for b in batches)
    assert kept == 5 and max(b.arrays["positions"].max() for b in batches) == 23
  else:
    assert (stats.truncated, stats.dropped) == (0, 3)
    assert sum(b.stats.samples for b in batches) == 3


def test_batch_ids_are_unique_and_stats_are_exact():
  batches = list(_batches(_samples(n=60, seed=3), method="first_fit_decreasing"))
  for b in batches:
    a = b.arrays
    assert all(v.shape == (4, 24) for v in a.values())
    assert a["loss_mask"].dtype == np.float32 and a["tokens"].dtype == np.int32
    pairs = {(r, s) for r in range(4) for s in np.unique(a["segment_ids"][r]) if s}
    assert len(np.unique(a["sample_ids"][a["sample_ids"] > 0])) == len(pairs) == b.stats.samples
    for r in range(4):  # a sample id never appears in two rows
      others = np.delete(a["sample_ids"], r, axis=0)
      assert not set(a["sample_ids"][r][a["sample_ids"][r] > 0]) & set(others.ravel())
    assert np.all((a["turn_ids"] > 0) == (a["loss_mask"] > 0))
    assert b.stats.tokens == int((a["segment_ids"] > 0).sum())
    assert b.stats.efficiency == pytest.approx(b.stats.tokens / (4 * 24))
    assert b.stats.loss_tokens == int(a["loss_mask"].sum())
  assert sum(b.stats.samples for b in batches) == 60


def test_packing_beats_one_sample_per_row():
  samples = _samples(n=80, seed=4, max_len=12)
  eff = {m: np.mean([b.stats.efficiency for b in _batches(samples, method=m)]) for m in PACKING_METHODS}
  assert eff["best_fit"] > 1.5 * eff["none"] and eff["first_fit_decreasing"] > 1.5 * eff["none"]


def test_last_partial_batch_is_padded_or_dropped():
  samples = _samples(n=5, seed=5)
  (batch,) = list(_batches(samples, method="none", global_rows=4, buffer_size=2))[1:]
  assert batch.stats.rows == 4 and batch.stats.samples == 1
  assert np.all(batch.arrays["segment_ids"][1:] == 0) and np.all(batch.arrays["loss_mask"][1:] == 0)
  assert len(list(_batches(samples, method="none", global_rows=4, drop_remainder=True))) == 1


def test_packing_is_deterministic():
  samples = _samples(n=50, seed=6)
  a, b = list(_batches(samples)), list(_batches(samples))
  assert len(a) == len(b)
  for x, y in zip(a, b):
    for k in x.arrays:
      np.testing.assert_array_equal(x.arrays[k], y.arrays[k])


@pytest.mark.parametrize("skip", [0, 1, 3, 5])
def test_batch_iterator_state_round_trip(skip):
  ds = _batches(_samples(n=120, seed=7), buffer_size=7)  # chunks end mid-batch
  it = iter(ds)
  for _ in range(skip):
    next(it)
  state = it.get_state()
  want = [next(it) for _ in range(4)]
  restored = iter(ds)
  restored.set_state(state)
  for w in want:
    got = next(restored)
    assert got.stats == w.stats
    for k in w.arrays:
      np.testing.assert_array_equal(got.arrays[k], w.arrays[k])


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="method"):
    PackingConfig(method="greedy")
  with pytest.raises(ValueError, match="overlong"):
    PackingConfig(overlong="wrap")
  with pytest.raises(ValueError, match="seq_len"):
    PackingConfig(seq_len=1)
