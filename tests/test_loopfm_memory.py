"""The embedding memory: point-in-time lookup (no future leakage), retention, versions."""

import numpy as np
import pytest

from gem.loopfm.memory import EmbeddingMemory


def test_lookup_returns_k_most_recent_strictly_before(tmp_path):
    mem = EmbeddingMemory(tmp_path / "m")
    users = np.array([1, 1, 1, 2, 1])
    ts = np.array([100, 200, 300, 150, 400])
    emb = np.arange(5, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)  # row i = [i, i, i]
    mem.append(users[:3], ts[:3], "v1", emb[:3])
    mem.append(users[3:], ts[3:], "v1", emb[3:])  # two shards
    out, out_ts, valid = mem.lookup(np.array([1, 1, 1, 2, 3]), np.array([300, 301, 100, 1000, 500]), k=2)
    assert out.shape == (5, 2, 3)
    # user 1 at t=300: the row logged AT 300 is excluded; most recent first
    assert out_ts[0].tolist() == [200, 100] and valid[0].all() and out[0, :, 0].tolist() == [1.0, 0.0]
    assert out_ts[1].tolist() == [300, 200]
    assert not valid[2].any() and not out[2].any()  # nothing strictly before the first event
    assert out_ts[3].tolist() == [150, 0] and valid[3].tolist() == [True, False]
    assert not valid[4].any()  # unknown user


def test_no_future_leakage_randomised(tmp_path):
    rng = np.random.default_rng(0)
    n = 3000
    users, ts = rng.integers(0, 50, n), rng.integers(1_700_000_000, 1_700_100_000, n)
    mem = EmbeddingMemory(tmp_path)
    for lo in range(0, n, 700):
        sl = slice(lo, lo + 700)
        mem.append(users[sl], ts[sl], "v", np.c_[users[sl], ts[sl]].astype(np.float32) * 0 + ts[sl, None])
    q_users, q_ts = rng.integers(0, 55, 500), rng.integers(1_700_000_000, 1_700_100_000, 500)
    emb, out_ts, valid = mem.lookup(q_users, q_ts, k=5)
    for i in range(500):
        mine = np.sort(ts[(users == q_users[i]) & (ts < q_ts[i])])[::-1][:5]
        assert out_ts[i][valid[i]].tolist() == mine.tolist()
        assert (out_ts[i][valid[i]] < q_ts[i]).all()
        assert np.allclose(emb[i][valid[i], 0], out_ts[i][valid[i]].astype(np.float32))
    # under a retention of max_age_s, only [t - max_age_s, t) is readable at time t
    _, out_ts, valid = mem.lookup(q_users, q_ts, k=5, max_age_s=20_000)
    for i in range(500):
        mine = np.sort(ts[(users == q_users[i]) & (ts < q_ts[i]) & (ts >= q_ts[i] - 20_000)])[::-1][:5]
        assert out_ts[i][valid[i]].tolist() == mine.tolist()


def test_retention_and_versions(tmp_path):
    mem = EmbeddingMemory(tmp_path)
    mem.append([1, 1, 1], [10, 20, 30], "v1", np.ones((3, 2)))
    mem.append([1], [40], "v2", np.full((1, 2), 2.0))
    assert mem.model_versions() == ["v1", "v2"]
    _, ts, valid = mem.lookup([1], [100], k=4, model_version="v1")
    assert ts[0][valid[0]].tolist() == [30, 20, 10]
    assert mem.apply_retention(now=45, max_age_s=20) == 2  # drops t=10, 20 (older than 25)
    _, ts, valid = mem.lookup([1], [100], k=4)
    assert ts[0][valid[0]].tolist() == [40, 30]
    assert mem.apply_retention(now=1000, max_age_s=1) == 2
    assert mem.shards() == [] and not mem.lookup([1], [2000], k=1)[2].any()
    with pytest.raises(ValueError):
        mem.append([1], [1, 2], "v", np.ones((1, 2)))


def test_versions_of_different_widths_index_separately(tmp_path):
    # a job's memory may hold one teacher's "tokens" rows (64-d) and its "history" rows (32-d)
    mem = EmbeddingMemory(tmp_path)
    mem.append([1, 1], [10, 20], "fm", np.ones((2, 4)))
    mem.append([1, 2], [15, 25], "fm+history", np.full((2, 2), 3.0))
    assert mem.index("fm").dim == 4 and len(mem.index("fm")) == 2
    emb, ts, valid = mem.lookup([1], [100], k=3, model_version="fm+history")
    assert emb.shape == (1, 3, 2) and ts[0][valid[0]].tolist() == [15]
    with pytest.raises(ValueError, match="widths"):
        mem.index()  # all versions at once: no single width


def test_history_representation_is_candidate_independent_and_point_in_time():
    """The logged "history" user vector depends on the events before the request only: not on the
    candidate ad, campaign or the impression's labels, and not on events at or after the request."""
    import torch

    from gem.api.types import ModelSpec, SyntheticDataSpec
    from gem.data.batch import make_batch
    from gem.data.synthetic import SyntheticWorld
    from gem.loopfm.logging import UserRepresentation, embed_examples
    from gem.model import build_model

    torch.manual_seed(0)
    fm = build_model(ModelSpec(preset="tiny")).eval()
    ex = SyntheticWorld(SyntheticDataSpec(num_users=20, num_ads=40, mean_history_len=6)).sample(16, split=0)
    assert (ex.seq_timestamp < np.repeat(ex.request_time, ex.seq_lengths)).all()  # histories precede requests
    rep = UserRepresentation(fm, "history")
    assert rep.dim == 32  # tiny: d
    batch = make_batch(ex, np.arange(16), max_seq_len=fm.max_seq_len)
    _, emb = rep(batch)
    swapped = make_batch(ex, np.arange(16), max_seq_len=fm.max_seq_len)
    swapped.ad_id = (swapped.ad_id + 7) % 40
    swapped.campaign_id = swapped.ad_id % 5
    swapped.click = 1 - swapped.click
    _, emb2 = rep(swapped, logits=False)
    assert torch.equal(emb, emb2)
    # the tokens representation (what the memory logged before) moves with the candidate
    tok = UserRepresentation(fm, "tokens")
    assert not torch.allclose(tok(batch)[1], tok(swapped)[1])
    # embed_examples without logits skips the FM's forward and returns the same rows
    rows, logits = embed_examples(fm, ex, kind="history", logits=False)
    assert logits == {} and np.allclose(rows, emb.numpy())


def test_embedding_examples_leaves_no_hook_on_the_model():
    """embed_examples / log_stream with kind "tokens" hooked the FM's output norm on every call and never
    unhooked it: a log over a Parquet split (one call per row group) left one hook per group, each run
    on every later forward of the model."""
    import torch

    from gem.api.types import ModelSpec, SyntheticDataSpec
    from gem.data.synthetic import SyntheticWorld
    from gem.data.batch import make_batch
    from gem.loopfm.logging import UserRepresentation, embed_examples
    from gem.model import build_model

    torch.manual_seed(0)
    fm = build_model(ModelSpec(preset="tiny")).eval()
    ex = SyntheticWorld(SyntheticDataSpec(num_users=20, num_ads=40, mean_history_len=6)).sample(16, split=0)
    first, _ = embed_examples(fm, ex)
    again, _ = embed_examples(fm, ex)
    assert np.array_equal(first, again) and first.shape == (16, 64)
    assert not fm.norm_out._forward_hooks
    assert UserRepresentation(fm).dim == 64 and not fm.norm_out._forward_hooks  # asked only its width
    with UserRepresentation(fm) as rep:  # a long-lived reader (the Solaris scorer) unhooks when closed
        _, emb = rep(make_batch(ex, np.arange(4), max_seq_len=fm.max_seq_len))
        assert len(fm.norm_out._forward_hooks) == 1 and emb.shape == (4, 64)
        rep(make_batch(ex, np.arange(4), max_seq_len=fm.max_seq_len))
        assert len(fm.norm_out._forward_hooks) == 1
    assert not fm.norm_out._forward_hooks


def test_logging_batches_are_bounded_in_events_not_only_examples(monkeypatch):
    """The memory log batched 512 examples whatever their histories: a teacher with a long window (base: 4,096
    events, large: 16,384) held 512 x window x d floats per table on rank 0 (~17 GB each for large), and an
    OOM-killed rank 0 restarts forever. Batches now hold at most LOG_EVENTS events; the rows are unchanged."""
    import torch

    from gem.api.types import ModelSpec, SyntheticDataSpec
    from gem.data.synthetic import SyntheticWorld
    from gem.loopfm import logging as loopfm_logging
    from gem.model import build_model

    torch.manual_seed(0)
    fm = build_model(ModelSpec(preset="tiny", max_seq_len=1024)).eval()
    ex = SyntheticWorld(SyntheticDataSpec(num_users=20, num_ads=40, mean_history_len=300)).sample(600, split=0)
    assert np.minimum(ex.seq_lengths, 1024)[:512].sum() > loopfm_logging.LOG_EVENTS  # one 512-example batch would not fit
    events, make_batch = [], loopfm_logging.make_batch

    def recording(examples, idx, **kw):
        batch = make_batch(examples, idx, **kw)
        events.append(int(batch.seq_offsets[-1]))
        return batch

    monkeypatch.setattr(loopfm_logging, "make_batch", recording)
    rows, _ = loopfm_logging.embed_examples(fm, ex, kind="history", logits=False)
    assert max(events) <= loopfm_logging.LOG_EVENTS and sum(events) == np.minimum(ex.seq_lengths, 1024).sum()
    one_by_one, _ = loopfm_logging.embed_examples(fm, ex, kind="history", logits=False, batch_size=1)
    assert rows.shape == (600, 32) and np.allclose(rows, one_by_one, atol=1e-6)


def test_any_int64_user_id_point_in_time(tmp_path):
    """Hashed user ids are int64 (docs/data.md): negative and 64-bit ids index and look up like small ones."""
    rng = np.random.default_rng(1)
    ids = np.array([-(2**63), -5, 0, 7, 2**31, 2**40 + 3, 2**63 - 1], np.int64)
    n = 2000
    users, ts = rng.choice(ids, n), rng.integers(1_700_000_000, 1_700_050_000, n)
    mem = EmbeddingMemory(tmp_path)
    for lo in range(0, n, 600):
        sl = slice(lo, lo + 600)
        mem.append(users[sl], ts[sl], "v", ts[sl, None].astype(np.float32) * np.ones((1, 2), np.float32))
    q_users = rng.choice(np.r_[ids, [-4, 1, 2**31 - 1, 2**62]], 400)  # some ids the memory never saw
    q_ts = rng.integers(1_700_000_000, 1_700_050_000, 400)
    for max_age in (None, 10_000):
        emb, out_ts, valid = mem.lookup(q_users, q_ts, k=4, max_age_s=max_age)
        for i in range(400):
            mine = (users == q_users[i]) & (ts < q_ts[i]) & (max_age is None or ts >= q_ts[i] - (max_age or 0))
            assert out_ts[i][valid[i]].tolist() == np.sort(ts[mine])[::-1][:4].tolist()
            assert np.allclose(emb[i][valid[i], 0], out_ts[i][valid[i]].astype(np.float32))


def test_drop_version_removes_only_that_version(tmp_path):
    mem = EmbeddingMemory(tmp_path)
    mem.append([1, 2], [10, 20], "a", np.ones((2, 2)))
    mem.append([1], [30], "b", np.ones((1, 2)))
    mem.append([3], [40], "a", np.ones((1, 2)))
    assert mem.drop_version("a") == 3
    assert mem.model_versions() == ["b"] and len(mem.shards()) == 1 and len(mem.index()) == 1
