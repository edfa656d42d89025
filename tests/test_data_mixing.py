"""Data mixing (gem/data/mixing.py): weights, no copies, resume, per-source metrics."""

import numpy as np
import pytest
import torch

from gem.api.types import SyntheticDataSpec
from gem.data import build_splits, make_batch
from gem.data.mixing import MixedLoader, MixedLoaders, concat_batches, source_metrics
from gem.data.parquet import ParquetLoader, write_synthetic


def spec(seed, n=2000):
    return SyntheticDataSpec(seed=seed, num_users=100, num_ads=40, num_train_examples=n, num_eval_examples=400,
                             mean_history_len=8)


@pytest.fixture(scope="module")
def sources():
    a, a_eval = build_splits(spec(1))
    b, b_eval = build_splits(spec(2, 1000))
    return {"a": a, "b": b}, {"a": a_eval, "b": b_eval}


def test_concat_batches_is_a_valid_jagged_batch(sources):
    (train, _) = sources
    x = make_batch(train["a"], np.arange(5), max_seq_len=4)
    y = make_batch(train["b"], np.arange(3), max_seq_len=4)
    z = concat_batches([x, y])
    assert z.size == 8 and z.seq_offsets[-1] == z.seq_ad_id.numel()
    assert torch.equal(z.seq_ad_id[z.seq_offsets[5]:], y.seq_ad_id)
    assert torch.equal(z.seq_lengths, torch.cat([x.seq_lengths, y.seq_lengths]))


def test_weights_set_the_mix_and_each_source_is_sampled_without_repeats(sources):
    train, _ = sources
    loader = MixedLoader(train, {"a": 3.0, "b": 1.0}, batch_size=64, max_seq_len=8, seed=0)
    for _ in range(20):
        loader.next_batch()
    a, b = loader.cursors
    assert a + b == 20 * 64 and 0.68 < a / (a + b) < 0.82
    # index-level: source streams are permutations, so within an epoch no example repeats
    idx = loader.streams[0].take(0, len(train["a"]))
    assert len(np.unique(idx)) == len(train["a"])


def test_resume_exact_with_and_without_saved_cursors(sources):
    train, _ = sources
    kw = dict(batch_size=32, max_seq_len=8, seed=5, rank=1, world_size=2)
    a = MixedLoader(train, [1, 1], **kw)
    stream = [a.next_batch() for _ in range(40)]  # b (500 per rank) wraps into epoch 2
    c = MixedLoader(train, [1, 1], **kw)
    for _ in range(25):
        c.next_batch()
    for state in (c.state_dict(), {"position": 25}):  # saved cursors, or replayed from the position
        b = MixedLoader(train, [1, 1], **kw)
        b.load_state_dict(state)
        for want in stream[25:]:
            got = b.next_batch()
            assert torch.equal(got.user_id, want.user_id) and torch.equal(got.seq_ad_id, want.seq_ad_id)


def test_mixing_streamed_parquet_loaders(tmp_path):
    write_synthetic(spec(1, 1200), tmp_path / "a", rows_per_group=200)
    write_synthetic(spec(2, 1200), tmp_path / "b", rows_per_group=200)
    loaders = {n: ParquetLoader(tmp_path / n / "train", batch_size=16, max_seq_len=8, seed=0) for n in "ab"}
    mix = MixedLoaders(loaders, {"a": 0.9, "b": 0.1}, batch_size=16, seed=0)
    for _ in range(50):
        assert mix.next_batch().size == 16
    pa, pb = loaders["a"].position, loaders["b"].position
    assert pa + pb == 50 and pa > 35
    state = mix.state_dict()
    assert state["loaders"]["a"]["position"] == pa


def test_per_source_metrics(sources):
    _, evals = sources

    def predict(batch):  # an oracle on source a's world, a constant elsewhere: the per-source split shows it
        logit = torch.logit(batch.p_click.clamp(1e-4, 1 - 1e-4))
        return {"click": logit, "conversion": torch.logit(batch.p_conversion.clamp(1e-4, 1 - 1e-4))}

    m = source_metrics(predict, evals, max_seq_len=8)
    assert m["num_examples"] == 800 and m["num_examples@a"] == 400
    assert m["ne/click@a"] == pytest.approx(m["bayes_ne/click@a"])
    assert {"ne/click@b", "auc/click@b", "ne/conversion@a"} <= m.keys()


def test_resume_refuses_reordered_or_renamed_sources(sources, tmp_path):
    """Cursors are per source index: resuming [b, a] from [a, b]'s state would give a b's position."""
    train, _ = sources
    kw = dict(batch_size=16, max_seq_len=8, seed=0)
    a = MixedLoader(train, {"a": 3, "b": 1}, **kw)
    for _ in range(5):
        a.next_batch()
    swapped = MixedLoader({"b": train["b"], "a": train["a"]}, {"a": 3, "b": 1}, **kw)
    with pytest.raises(ValueError, match=r"\['a', 'b'\].*\['b', 'a'\].*spec.data.sources"):
        swapped.load_state_dict(a.state_dict())
    same = MixedLoader(train, {"a": 3, "b": 1}, **kw)
    same.load_state_dict(a.state_dict())
    assert torch.equal(same.next_batch().user_id, a.next_batch().user_id)

    write_synthetic(spec(1, 1200), tmp_path / "a", rows_per_group=200)
    write_synthetic(spec(2, 1200), tmp_path / "b", rows_per_group=200)

    def streamed(dirs):  # {source name: data directory}
        loaders = {n: ParquetLoader(tmp_path / d / "train", batch_size=16, max_seq_len=8, seed=0)
                   for n, d in dirs.items()}
        return MixedLoaders(loaders, {n: 1.0 for n in dirs}, batch_size=16, seed=0)

    saved = streamed({"a": "a", "b": "b"})
    for _ in range(5):
        saved.next_batch()
    streamed({"b": "b", "a": "a"}).load_state_dict(saved.state_dict())  # by name: the order does not matter
    with pytest.raises(ValueError, match=r"\['a', 'b'\].*\['a', 'c'\].*spec.data.sources"):
        streamed({"a": "a", "c": "b"}).load_state_dict(saved.state_dict())


def test_resume_refuses_a_single_source_state(sources, tmp_path):
    """A checkpoint of a one-source run resumed with data.sources: its position is no source's cursor."""
    from gem.data.loader import ShardedLoader

    train, _ = sources
    single = ShardedLoader(train["a"], batch_size=16, max_seq_len=8, rank=0, world_size=1, seed=0)
    for _ in range(5):
        single.next_batch()
    mixed = MixedLoader(train, [1, 1], batch_size=16, max_seq_len=8, seed=0)
    with pytest.raises(ValueError, match=r"one data source.*\['a', 'b'\].*spec.data.sources"):
        mixed.load_state_dict(single.state_dict())
    write_synthetic(spec(1, 1200), tmp_path / "a", rows_per_group=200)
    loaders = {n: ParquetLoader(tmp_path / "a" / "train", batch_size=16, max_seq_len=8, seed=0) for n in "ab"}
    with pytest.raises(ValueError, match="one data source"):
        MixedLoaders(loaders, {"a": 1, "b": 1}, batch_size=16).load_state_dict(loaders["a"].state_dict())
    old = MixedLoader(train, [1, 1], batch_size=16, max_seq_len=8, seed=0)
    old.load_state_dict({"position": 3})  # a MixedLoader state from before cursors were saved still loads
    assert old.cursors == [int(c) for c in sum(old.counts_at(j) for j in range(3))]


def test_a_one_source_run_refuses_a_mixed_state(sources, tmp_path):
    """The reverse: a mixed run's checkpoint resumed with one data source. Its position counts batches of
    the mix; the one-source loaders took it as their own (no consumed/layouts key: the old-state path)."""
    from gem.data.loader import ShardedLoader

    train, _ = sources
    mixed = MixedLoader(train, [1, 1], batch_size=16, max_seq_len=8, seed=0)
    mixed.next_batch()
    single = ShardedLoader(train["a"], batch_size=16, max_seq_len=8, rank=0, world_size=1, seed=0)
    with pytest.raises(ValueError, match=r"mixes the sources \['a', 'b'\], this run reads one data source"):
        single.load_state_dict(mixed.state_dict())
    write_synthetic(spec(1, 1200), tmp_path / "a", rows_per_group=200)
    loaders = {n: ParquetLoader(tmp_path / "a" / "train", batch_size=16, max_seq_len=8, seed=0) for n in "ab"}
    both = MixedLoaders(loaders, {"a": 1, "b": 1}, batch_size=16)
    with pytest.raises(ValueError, match=r"mixes the sources \['a', 'b'\]"):
        ParquetLoader(tmp_path / "a" / "train", batch_size=16, max_seq_len=8, seed=0).load_state_dict(both.state_dict())
