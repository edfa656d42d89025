"""Parquet storage (gem/data/parquet.py): round trip, sharded windowed loader, resume, workers, trainer dispatch."""

import dataclasses

import numpy as np
import pytest
import torch

from gem.api.types import SyntheticDataSpec
from gem.data import build_splits, make_batch
from gem.data.parquet import (ParquetLoader, ParquetSource, ParquetWindows, load_parquet_splits, slice_examples,
                              write_examples, write_synthetic)

SPEC = SyntheticDataSpec(num_users=200, num_ads=64, num_train_examples=3000, num_eval_examples=500,
                         mean_history_len=12)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("pq") / "synth"
    write_synthetic(SPEC, path, rows_per_group=250, rows_per_file=1000)
    return path


def test_round_trip_is_exact(dataset):
    train, eval_ = build_splits(SPEC)
    src = ParquetSource(dataset / "train")
    assert len(src.files) == 3 and len(src.groups) >= 12 and src.num_rows == 3000
    assert src.group_rows.max() <= 250
    _, back_eval = load_parquet_splits(dataset)
    for ex, back in ((train, src.read_all()), (eval_, back_eval)):
        for f in dataclasses.fields(ex):
            a, b = getattr(ex, f.name), getattr(back, f.name)
            assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), f.name


def test_writer_takes_an_iterator_and_missing_columns_are_nan(tmp_path):
    train, _ = build_splits(SPEC)
    chunks = (slice_examples(train, np.arange(lo, min(lo + 700, 3000))) for lo in range(0, 3000, 700))
    write_examples(chunks, tmp_path / "it", rows_per_file=1000, rows_per_group=500)
    back = ParquetSource(tmp_path / "it").read_all()
    assert np.array_equal(back.seq_ad_id, train.seq_ad_id) and np.array_equal(back.seq_offsets, train.seq_offsets)
    import pyarrow.parquet as pq
    from gem.data.parquet import table_to_examples
    t = pq.read_table(tmp_path / "it" / "part-00000.parquet").drop_columns(["p_click", "p_conversion"])
    ex = table_to_examples(t)
    assert np.isnan(ex.p_click).all() and len(ex) == 1000
    # a schema-1 file (before dwell, surfaces of events, objectives, delays): unknowns, objective -1
    v1 = pq.read_table(tmp_path / "it" / "part-00000.parquet").drop_columns(
        ["dwell", "p_dwell", "seq_surface", "objective", "conversion_delay"])
    ex = table_to_examples(v1)
    assert np.isnan(ex.dwell).all() and (ex.objective == -1).all() and (ex.seq_surface == 0).all()
    assert np.isnan(ex.conversion_delay).all() and np.array_equal(ex.seq_type, train.seq_type[: len(ex.seq_type)])


def test_streamed_synthetic_parquet(tmp_path):
    import json

    from gem.data import SyntheticWorld
    write_synthetic(SPEC, tmp_path / "s", chunk_size=700, rows_per_file=1000)
    assert json.loads((tmp_path / "s" / "_gem.json").read_text())["schemaVersion"] == 2
    back = ParquetSource(tmp_path / "s" / "train").read_all()
    chunks = list(SyntheticWorld(SPEC).stream(SPEC.num_train_examples, 0, 700))
    assert len(back) == 3000 and [len(c) for c in chunks] == [700] * 4 + [200]
    assert np.array_equal(back.seq_ad_id, np.concatenate([c.seq_ad_id for c in chunks]))
    assert (back.seq_type == 3).any() and len(np.unique(back.surface)) == 4


def test_ranks_read_disjoint_data_and_batches_are_length_sorted(dataset):
    loaders = [ParquetLoader(dataset / "train", batch_size=32, max_seq_len=64, rank=r, world_size=2, seed=3,
                             window=4) for r in range(2)]
    assert loaders[0].batches_per_epoch == loaders[1].batches_per_epoch
    assert 30 <= loaders[0].batches_per_epoch <= 1500 // 32
    seen = [set(), set()]
    spreads = []
    for r, loader in enumerate(loaders):
        for _ in range(loader.batches_per_epoch):
            b = loader.next_batch()
            assert b.size == 32 and b.seq_offsets[-1] == b.seq_ad_id.numel()
            seen[r].update(zip(b.user_id.tolist(), b.request_time.tolist(), b.ad_id.tolist()))
            spreads.append(float(b.seq_lengths.float().std()))
    assert not (seen[0] & seen[1])  # disjoint shards
    # length-sorted windows: a batch's lengths vary far less than a random batch of the split
    train, _ = build_splits(SPEC)
    random_spread = np.mean([np.minimum(train.seq_lengths[np.random.default_rng(i).choice(3000, 32)], 64).std()
                             for i in range(20)])
    assert np.mean(spreads) < 0.5 * random_spread


def test_resume_from_position_continues_exactly(dataset):
    a = ParquetLoader(dataset / "train", batch_size=40, max_seq_len=16, seed=1, window=3)
    stream = [a.next_batch() for _ in range(a.batches_per_epoch + 5)]  # crosses an epoch boundary
    b = ParquetLoader(dataset / "train", batch_size=40, max_seq_len=16, seed=1, window=3)
    b.load_state_dict({"position": 70})
    assert a.state_dict() == {"position": a.batches_per_epoch + 5, "epoch": 1,
                              "layouts": [{"worldSize": 1, "batches": 5}]}
    for want in stream[70:]:
        got = b.next_batch()
        assert torch.equal(got.user_id, want.user_id) and torch.equal(got.seq_ad_id, want.seq_ad_id)
    # a new epoch is a different order
    assert not torch.equal(stream[0].user_id, stream[a.batches_per_epoch].user_id)


def test_dataloader_workers_split_windows_and_keep_order(dataset):
    loader = ParquetLoader(dataset / "train", batch_size=50, max_seq_len=32, seed=0, window=4)
    want = [loader.batch_at(p) for p in range(6, 6 + 20)]
    dl = torch.utils.data.DataLoader(ParquetWindows(loader, start=6), batch_size=None, num_workers=2)
    got = []
    for window in dl:
        got.extend(window)
        if len(got) >= 20:
            break
    for g, w in zip(got, want):
        assert torch.equal(g.user_id, w.user_id) and torch.equal(g.seq_offsets, w.seq_offsets)


def test_batches_match_make_batch(dataset):
    loader = ParquetLoader(dataset / "train", batch_size=32, max_seq_len=8, seed=0, sort_by_length=False)
    (batches, data) = loader._window(0, 0)
    want = make_batch(data, batches[0], max_seq_len=8)
    got = loader.batch_at(0)
    for f in dataclasses.fields(got):
        assert torch.equal(getattr(got, f.name), getattr(want, f.name)), f.name


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    """1100 rows whose request_time is the row number, in uneven row groups across two files."""
    train, _ = build_splits(SPEC)
    ex = slice_examples(train, np.arange(1100))
    ex.request_time[:] = np.arange(1100)
    path = tmp_path_factory.mktemp("tagged") / "train"
    write_examples(ex, path, rows_per_group=300, rows_per_file=700)
    return path


def test_writer_leaves_no_empty_row_groups_and_the_reader_skips_them(tagged, tmp_path):
    import pyarrow.parquet as pq

    sizes = [pq.ParquetFile(f).metadata.row_group(g).num_rows
             for f in sorted(tagged.glob("*.parquet")) for g in range(pq.ParquetFile(f).metadata.num_row_groups)]
    assert sizes == [300, 300, 100, 300, 100]
    # files of other writers may hold 0-row groups: they are not part of the index
    table = pq.read_table(tagged / "part-00000.parquet")
    with pq.ParquetWriter(tmp_path / "part-00000.parquet", table.schema) as w:
        w.write_table(table.slice(0, 0))
        w.write_table(table)
    src = ParquetSource(tmp_path)
    assert src.group_rows.min() > 0 and src.num_rows == 700


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])  # 8 ranks > 5 row groups
def test_every_rank_reads_nearly_all_its_rows_each_epoch(tagged, world_size):
    batch_size = 25
    loaders = [ParquetLoader(tagged, batch_size=batch_size, max_seq_len=8, rank=r, world_size=world_size, seed=0,
                             window=2) for r in range(world_size)]
    per_epoch = loaders[0].batches_per_epoch
    assert all(loader.batches_per_epoch == per_epoch for loader in loaders)  # collectives stay in step
    for epoch in range(2):
        rows = [loader.batch_at(epoch * per_epoch + j).request_time.tolist()
                for loader in loaders for j in range(per_epoch)]
        flat = [r for batch in rows for r in batch]
        assert len(flat) == len(set(flat))  # disjoint over ranks and batches
        assert len(flat) > 1100 - world_size * batch_size  # each rank drops less than one batch


def test_resume_is_exact_with_several_ranks(tagged):
    a = ParquetLoader(tagged, batch_size=25, max_seq_len=8, rank=1, world_size=2, seed=4, window=3)
    stream = [a.next_batch().request_time for _ in range(2 * a.batches_per_epoch + 3)]
    b = ParquetLoader(tagged, batch_size=25, max_seq_len=8, rank=1, world_size=2, seed=4, window=3)
    b.load_state_dict({"position": a.batches_per_epoch - 1})
    for want in stream[a.batches_per_epoch - 1:]:
        assert torch.equal(b.next_batch().request_time, want)
