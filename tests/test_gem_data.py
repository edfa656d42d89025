"""The synthetic world: determinism, jagged layout, known probabilities, sharded resumable loading."""

import numpy as np
import pytest

from gem.api.types import SyntheticDataSpec
from gem.data import ShardedLoader, SyntheticWorld, build_splits, eval_batches, make_batch
from gem.eval.metrics import auc, normalized_entropy

SPEC = SyntheticDataSpec(seed=3, num_users=300, num_ads=120, num_train_examples=3000, num_eval_examples=800,
                         mean_history_len=20)


@pytest.fixture(scope="module")
def splits():
    return build_splits(SPEC)


def test_same_seed_same_world_other_seed_other_world(splits):
    train, _ = splits
    again, _ = build_splits(SPEC)
    for name in train.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(train, name), getattr(again, name), err_msg=name)
    other, _ = build_splits(SPEC.model_copy(update={"seed": 4}))
    assert not np.array_equal(train.p_click, other.p_click)


def test_jagged_history_layout(splits):
    train, _ = splits
    lengths = train.seq_lengths
    assert train.seq_offsets[0] == 0 and train.seq_offsets[-1] == len(train.seq_ad_id)
    assert lengths.min() >= 1 and lengths.max() > 3 * np.median(lengths)  # long-tailed
    assert abs(lengths.mean() - SPEC.mean_history_len) < 0.2 * SPEC.mean_history_len
    owner = np.repeat(np.arange(len(train)), lengths)
    assert (train.seq_timestamp <= train.request_time[owner]).all()
    same_owner = owner[1:] == owner[:-1]
    assert (np.diff(train.seq_timestamp)[same_owner] >= 0).all()  # oldest first
    assert (train.conversion <= train.click).all()  # no conversion without a click


def test_bayes_ne_is_informative(splits):
    _, ev = splits
    bayes = normalized_entropy(ev.click, ev.p_click)
    assert 0.4 < bayes < 0.9 and auc(ev.click, ev.p_click) > 0.75
    clicked = ev.click > 0
    assert normalized_entropy(ev.conversion[clicked], ev.p_conversion[clicked]) < 1.0


def test_history_moves_the_click_probability():
    """Recent events on the candidate's campaign raise p_click: the sequence carries signal."""
    world = SyntheticWorld(SPEC)
    ads = np.array([5, 5])
    campaign = world.ad_campaign[5]
    owner, types, ages = np.array([0]), np.array([1]), np.array([60.0])
    recent = world.history_signal(ads, owner, np.array([campaign]), types, ages)
    old = world.history_signal(ads, owner, np.array([campaign]), types, np.array([30 * 86400.0]))
    other = world.history_signal(ads, owner, np.array([(campaign + 1) % world.num_campaigns]), types, ages)
    assert recent[0] > 0.9 and old[0] < 1e-6 and other[0] == 0


def test_make_batch_keeps_the_most_recent_events(splits):
    train, _ = splits
    index = np.array([0, 7, 3])
    batch = make_batch(train, index, max_seq_len=4)
    for b, i in enumerate(index):
        lo, hi = train.seq_offsets[i], train.seq_offsets[i + 1]
        keep = train.seq_timestamp[max(lo, hi - 4) : hi]
        got = batch.seq_timestamp[batch.seq_offsets[b] : batch.seq_offsets[b + 1]].numpy()
        np.testing.assert_array_equal(got, keep)
    assert batch.seq_offsets.dtype.is_floating_point is False and batch.seq_offsets[0] == 0


def test_shards_are_disjoint_and_resumable(splits):
    train, _ = splits
    loaders = [ShardedLoader(train, batch_size=50, max_seq_len=16, rank=r, world_size=2, seed=1) for r in range(2)]
    seen = [set(), set()]
    for r, loader in enumerate(loaders):
        for _ in range(loader.batches_per_epoch):
            b = loader.next_batch()
            seen[r].update(zip(b.user_id.tolist(), b.request_time.tolist(), b.ad_id.tolist()))
    assert not seen[0] & seen[1]
    # A fresh loader restored to position k yields exactly batch k.
    a = ShardedLoader(train, batch_size=50, max_seq_len=16, rank=1, world_size=2, seed=1)
    for _ in range(37):  # crosses an epoch boundary (30 batches per epoch)
        a.next_batch()
    b = ShardedLoader(train, batch_size=50, max_seq_len=16, rank=1, world_size=2, seed=1)
    b.load_state_dict(a.state_dict())
    assert (a.next_batch().request_time == b.next_batch().request_time).all()


def test_eval_batches_cover_every_example_once(splits):
    _, ev = splits
    counts = [sum(1 for _ in eval_batches(ev, batch_size=128, max_seq_len=8, rank=r, world_size=3)) for r in range(3)]
    assert len(set(counts)) == 1  # equal number of forwards on every rank
    weights = np.concatenate([b.weight.numpy() for r in range(3)
                              for b in eval_batches(ev, batch_size=128, max_seq_len=8, rank=r, world_size=3)])
    assert weights.sum() == len(ev)
