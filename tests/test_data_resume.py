"""Resuming the training loaders on another world size (gem/data/loader.py, parquet.py, mixing.py).

The trainer saves rank 0's loader state in trainer_state.json and every rank loads it; at ZeRO-0
a job may resume on another world size (spec.parallelism changed, a node pool shrank). The
position must then be world-size independent: the rest of the interrupted epoch is read once,
over the new ranks -- no example skipped, none read twice -- while a resume on the same world
size continues exactly the batches an uninterrupted run reads.
"""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch

from gem.api.types import SyntheticDataSpec
from gem.data import build_splits
from gem.data.loader import ShardedLoader
from gem.data.mixing import MixedLoader, MixedLoaders
from gem.data.parquet import ParquetLoader, ParquetWindows, slice_examples, write_examples

N = 1003  # not a multiple of any world size x batch size below: every layout has ragged tails
BATCH = 20
SPEC = SyntheticDataSpec(num_users=60, num_ads=30, num_train_examples=N, num_eval_examples=10,
                         mean_history_len=6)


@pytest.fixture(scope="module")
def tagged():
    """N examples whose request_time is the example's number."""
    train, _ = build_splits(SPEC)
    ex = slice_examples(train, np.arange(N))
    ex.request_time[:] = np.arange(N)
    return ex


@pytest.fixture(scope="module")
def tagged_parquet(tagged, tmp_path_factory):
    path = tmp_path_factory.mktemp("resume") / "train"
    write_examples(tagged, path, rows_per_group=90, rows_per_file=400)  # uneven groups over three files
    return path


def sharded(tagged):
    return lambda rank, world_size: ShardedLoader(tagged, batch_size=BATCH, max_seq_len=8, rank=rank,
                                                  world_size=world_size, seed=3)


def streamed(path):
    return lambda rank, world_size: ParquetLoader(path, batch_size=BATCH, max_seq_len=8, rank=rank,
                                                  world_size=world_size, seed=3, window=3)


def take(loader, n):
    return [t for _ in range(n) for t in loader.next_batch().request_time.tolist()]


def epoch_of(loader):
    state = loader.state_dict()
    # (a loader without the field -- the code before it -- is in epoch position // batches per epoch)
    return state["epoch"] if "epoch" in state else state["position"] // loader.batches_per_epoch


def rest_of_epoch(loaders):
    """Every rank's batches until its state moves to the next epoch; the counts must agree (collectives)."""
    epoch = epoch_of(loaders[0])
    seen, counts = [], []
    for loader in loaders:
        n = 0
        while epoch_of(loader) == epoch:
            seen += loader.next_batch().request_time.tolist()
            n += 1
        counts.append(n)
    assert len(set(counts)) == 1, counts
    return seen


def saved(loaders):
    """rank 0's state, as the trainer writes it (JSON); every rank's is the same."""
    states = [json.loads(json.dumps(loader.state_dict())) for loader in loaders]
    assert all(s == states[0] for s in states)
    return states[0]


def resume(make, state, world_size):
    loaders = [make(r, world_size) for r in range(world_size)]
    for loader in loaders:
        loader.load_state_dict(state)
    return loaders


@pytest.mark.parametrize("kind", ["sharded", "parquet"])
@pytest.mark.parametrize("sizes", [(2, 4), (2, 1), (4, 2), (2, 3), (2, 3, 1)])
def test_resume_on_another_world_size_neither_skips_nor_replays(kind, sizes, tagged, tagged_parquet):
    make = sharded(tagged) if kind == "sharded" else streamed(tagged_parquet)
    # an uninterrupted epoch on the first world size: what the run would have read
    full = [make(r, sizes[0]) for r in range(sizes[0])]
    want = collections.Counter(rest_of_epoch(full))
    assert max(want.values()) == 1 and N - len(want) < sizes[0] * (BATCH + 1)
    # interrupted: 7 batches per rank (window 3: mid-window), then resumed on each next world size
    seen: collections.Counter = collections.Counter()
    loaders = [make(r, sizes[0]) for r in range(sizes[0])]
    for loader in loaders:
        seen.update(take(loader, 7))
    for world_size in sizes[1:-1]:  # an intermediate world size runs 2 batches per rank, then changes again
        loaders = resume(make, saved(loaders), world_size)
        for loader in loaders:
            seen.update(take(loader, 2))
    loaders = resume(make, saved(loaders), sizes[-1])
    assert epoch_of(loaders[0]) == 0
    seen.update(rest_of_epoch(loaders))
    twice = sorted(t for t, c in seen.items() if c > 1)
    assert not twice, f"{len(twice)} examples read twice in one epoch"
    # the epoch's examples not read: only the ragged tails the last layout drops (< one batch per rank)
    missing = N - len(seen)
    assert missing < sizes[-1] * (BATCH + 1), f"{missing} examples of the epoch skipped"
    assert len(want.keys() - seen.keys()) <= missing


@pytest.mark.parametrize("kind", ["sharded", "parquet"])
def test_the_epochs_after_a_resize_are_the_new_world_sizes_own(kind, tagged, tagged_parquet):
    make = sharded(tagged) if kind == "sharded" else streamed(tagged_parquet)
    loaders = [make(r, 2) for r in range(2)]
    for loader in loaders:
        take(loader, 5)
    resumed = resume(make, saved(loaders), 4)
    rest_of_epoch(resumed)
    fresh = [make(r, 4) for r in range(4)]
    for a, b in zip(resumed, fresh):  # epoch 1 on: exactly a run started with 4 ranks
        b.load_state_dict({"position": b.batches_per_epoch})  # an old-style state: epoch 1, batch 0
        for _ in range(b.batches_per_epoch + 2):
            assert torch.equal(a.next_batch().request_time, b.next_batch().request_time)
    assert epoch_of(resumed[0]) == 2


@pytest.mark.parametrize("kind", ["sharded", "parquet"])
def test_resume_on_the_same_world_size_is_exact(kind, tagged, tagged_parquet):
    make = sharded(tagged) if kind == "sharded" else streamed(tagged_parquet)
    for stop in (7, make(0, 2).batches_per_epoch + 4):  # mid-window of epoch 0; inside epoch 1
        loaders = [make(r, 2) for r in range(2)]
        want = [[loader.next_batch() for _ in range(2 * loader.batches_per_epoch + 3)] for loader in loaders]
        interrupted = [make(r, 2) for r in range(2)]
        for loader in interrupted:
            take(loader, stop)
        for r, loader in enumerate(resume(make, saved(interrupted), 2)):
            for w in want[r][stop:]:
                got = loader.next_batch()
                assert torch.equal(got.request_time, w.request_time) and torch.equal(got.seq_ad_id, w.seq_ad_id)


def test_states_saved_before_the_epoch_fields_resume_the_old_way(tagged, tagged_parquet):
    """{"position": p} alone (older checkpoints): batch p of this world size's layout, as before."""
    for make in (sharded(tagged), streamed(tagged_parquet)):
        a, b = make(1, 2), make(1, 2)
        stream = [a.next_batch().request_time for _ in range(40)]
        b.load_state_dict({"position": 33})
        assert all(torch.equal(b.next_batch().request_time, want) for want in stream[33:])


def test_parquet_state_is_small_and_names_the_layouts(tagged_parquet):
    loaders = [streamed(tagged_parquet)(r, 2) for r in range(2)]
    for loader in loaders:
        take(loader, 7)
    assert saved(loaders) == {"position": 7, "epoch": 0, "layouts": [{"worldSize": 2, "batches": 7}]}
    resumed = resume(streamed(tagged_parquet), saved(loaders), 3)
    for loader in resumed:
        take(loader, 2)
    assert saved(resumed) == {"position": 9, "epoch": 0, "layouts": [{"worldSize": 2, "batches": 7},
                                                                     {"worldSize": 3, "batches": 2}]}


def test_parquet_windows_after_a_resize_keep_the_loader_order(tagged_parquet):
    loaders = [streamed(tagged_parquet)(r, 2) for r in range(2)]
    for loader in loaders:
        take(loader, 4)
    loader = resume(streamed(tagged_parquet), saved(loaders), 3)[1]
    want = [loader.batch_at(p) for p in range(4, 4 + 30)]  # crosses into epoch 1
    dl = torch.utils.data.DataLoader(ParquetWindows(loader), batch_size=None, num_workers=0)
    got = [b for window in zip(range(40), dl) for b in window[1]][:30]
    assert [g.request_time.tolist() for g in got] == [w.request_time.tolist() for w in want]


def test_mixing_resume_on_another_world_size(tagged):
    """Each source's examples, over all ranks, are the first ones of its epoch, each once."""
    train, _ = build_splits(SyntheticDataSpec(seed=2, num_users=60, num_ads=30, num_train_examples=701,
                                              num_eval_examples=10, mean_history_len=6))
    other = slice_examples(train, np.arange(701))
    other.request_time[:] = np.arange(701)
    sources = {"a": tagged, "b": other}

    def make(rank, world_size):
        return MixedLoader(sources, {"a": 2, "b": 1}, batch_size=8, max_seq_len=8, rank=rank,
                           world_size=world_size, seed=4)

    def taken(loaders, n):
        out = collections.defaultdict(list)
        for loader in loaders:
            before = list(loader.cursors)
            for _ in range(n):
                batch = loader.next_batch()
                t = batch.request_time.tolist()
                counts = [c - b for c, b in zip(loader.cursors, before)]
                out["a"] += t[: counts[0]]
                out["b"] += t[counts[0]:]
                before = list(loader.cursors)
        return out

    for sizes in [(2, 4), (4, 1), (2, 3)]:
        got = collections.defaultdict(list)
        loaders = [make(r, sizes[0]) for r in range(sizes[0])]
        for name, ids in taken(loaders, 9).items():
            got[name] += ids
        loaders = resume(make, saved(loaders), sizes[1])
        for name, ids in taken(loaders, 12).items():
            got[name] += ids
        ref = make(0, 1)  # one rank reads its source's epoch in order: the first T are the ones to read
        for k, name in enumerate("ab"):
            assert len(got[name]) == len(set(got[name])), (sizes, name, "read twice")
            first = ref.streams[k].take(0, len(got[name]))
            assert sorted(got[name]) == sorted(sources[name].request_time[first].tolist()), (sizes, name)


def test_mixing_states_without_streams_resume_the_old_way(tagged):
    sources = {"a": tagged, "b": tagged}
    kw = dict(batch_size=8, max_seq_len=8, rank=1, world_size=2, seed=5)
    a = MixedLoader(sources, [1, 1], **kw)
    stream = [a.next_batch().request_time for _ in range(20)]
    for state in ({"position": 12}, {"position": 12, "cursors": make_cursors(sources, kw, 12)}):
        b = MixedLoader(sources, [1, 1], **kw)
        b.load_state_dict(state)
        assert all(torch.equal(b.next_batch().request_time, want) for want in stream[12:])


def make_cursors(sources, kw, n):
    loader = MixedLoader(sources, [1, 1], **kw)
    for _ in range(n):
        loader.next_batch()
    return list(loader.cursors)


def test_mixed_streamed_loaders_resume_on_another_world_size(tagged_parquet):
    def make(rank, world_size):
        return MixedLoaders({n: streamed(tagged_parquet)(rank, world_size) for n in "ab"}, {"a": 1, "b": 1},
                            batch_size=BATCH, seed=0)

    loaders = [make(r, 2) for r in range(2)]
    for loader in loaders:
        take(loader, 6)
    state = saved(loaders)
    assert state["loaders"]["a"]["layouts"][0]["worldSize"] == 2
    resumed = resume(make, state, 4)
    assert all(loader.loaders["a"].state_dict() == state["loaders"]["a"] for loader in resumed)
