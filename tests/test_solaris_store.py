"""Solaris: store TTL and versioning, the predictor, and every fallback tier reachable and labelled."""

import threading

import numpy as np
import pytest

from gem.solaris.fallback import TIERS, HierarchicalLookup
from gem.solaris.predictor import RequestPredictor
from gem.solaris.store import PrecomputeStore


def campaign_of(ad):  # ads 0-9 -> campaign 0, 10-19 -> 1, ...
    return ad // 10


def segment_of(user):
    return user % 2


def test_ttl_and_versions():
    s = PrecomputeStore(ttl_s=100, version="v1")
    assert s.put(1, 5, 0, 1, [0.5, -1.0], now=1000)
    assert s.get(1, 5, now=1099).value.tolist() == [0.5, -1.0]
    assert s.get(1, 5, now=1100) is None  # expired
    assert s.user_campaign(1, 0, now=1050) is not None and s.user_campaign(1, 0, now=1200) is None
    assert not s.put(1, 6, 0, 1, [1.0, 1.0], now=1000, version="v0")  # stale model version is refused
    s.set_version("v2")  # a new model: nothing of v1 is served any more
    assert s.get(1, 5, now=1001) is None and s.user_campaign(1, 0, now=1001) is None
    assert s.put(1, 5, 0, 1, [2.0, 2.0], now=1001, version="v2") and s.get(1, 5, now=1002).version == "v2"
    assert s.evict_expired(now=5000) == 1 and s.stats()["pairs"] == 0


def test_store_is_thread_safe():
    s = PrecomputeStore(ttl_s=1e9, version="v")

    def writer(base):
        for i in range(500):
            s.put(base + i, i % 7, 0, 0, [1.0, 0.0], now=0)

    threads = [threading.Thread(target=writer, args=(k * 10_000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.stats()["pairs"] == 2000 and s.stats()["puts"] == 2000
    assert s.global_default()[0] == pytest.approx(1.0)


def test_every_tier_reachable_and_labelled():
    s = PrecomputeStore(ttl_s=1000, version="v")
    look = HierarchicalLookup(s, campaign_of=campaign_of, segment_of=segment_of, neighbors_k=2)
    # user 1 has ad 3 exactly; users 3 and 5 (segment 1) have ad 25; user 4 (segment 0) has ad 42
    s.put(1, 3, 0, 1, [1.0, 0.0], now=0, user_embedding=np.array([1.0, 0.0]))
    s.put(3, 25, 2, 1, [2.0, 0.0], now=0, user_embedding=np.array([0.9, 0.1]))
    s.put(5, 25, 2, 1, [4.0, 0.0], now=0, user_embedding=np.array([-1.0, 0.0]))
    s.put(4, 42, 4, 0, [3.0, 0.0], now=0, user_embedding=np.array([1.0, 0.05]))
    got = {
        "exact": look.lookup(1, 3, now=10),
        "campaign": look.lookup(1, 7, now=10),  # same campaign 0 as ad 3
        "segment": look.lookup(7, 25, now=10),  # user 7 is in segment 1, which has ad 25
        "default": look.lookup(9, 99, now=10),
    }
    assert got["exact"].tier == "exact" and got["exact"].value[0] == 1.0
    assert got["campaign"].tier == "campaign" and got["campaign"].value[0] == 1.0
    assert got["segment"].tier == "segment" and got["segment"].value[0] == pytest.approx(3.0)
    assert got["default"].tier == "default"
    assert got["default"].value[0] == pytest.approx(np.mean([1.0, 2.0, 4.0, 3.0]))
    # neighbors: user 1 (embedding [1, 0]) asks for ad 25 with segment 1 excluded -> nearest holder is user 3
    r = look.lookup(1, 25, now=10, tiers=("exact", "campaign", "neighbors", "default"))
    assert r.tier == "neighbors" and r.value[0] == pytest.approx(2.0)
    # every tier is labelled, in order, and the result says so in JSON
    assert TIERS == ("exact", "campaign", "segment", "neighbors", "default")
    assert got["exact"].to_json()["tierIndex"] == 0 and r.to_json()["tier"] == "neighbors"
    assert look.lookup(1, 3, now=10, tiers=("exact",)).tier == "exact"
    assert look.lookup(9, 99, now=10, tiers=("exact", "campaign")) is None
    # expired (the store's clock only moves forward): everything falls back to the default
    assert look.lookup(1, 3, now=5000).tier == "default"


def test_predictor_recent_then_segment_popular():
    p = RequestPredictor(segment_of=segment_of, campaign_of=campaign_of, recent_per_user=3, top_campaigns=1,
                         ads_per_campaign=2)
    for t, (u, a) in enumerate([(1, 11), (1, 12), (3, 50), (3, 51), (3, 50), (5, 50)]):
        p.observe(u, a, now=float(t))
    pairs = p.predict([1, 7], per_user=3)
    assert pairs[:2] == [(1, 12), (1, 11)]  # recent candidates, most recent first
    # then segment 1's most popular campaign (5) and its top ads: 50 first
    assert pairs[2] == (1, 50)
    assert [a for u, a in pairs if u == 7] == [50, 51]  # a new user gets its segment's popular ads
    assert set(p.active_users(now=5.0, window_s=2.0)) == {3, 5}


def test_aggregates_are_over_fresh_entries_only():
    """Expired values leave every mean; a fresh put does not bring them back (review r1)."""
    s = PrecomputeStore(ttl_s=10, version="v")
    look = HierarchicalLookup(s, campaign_of=lambda a: 7, segment_of=lambda u: 0)
    s.put(1, 100, 7, 0, [5.0, 5.0], now=0)  # expires at t=10
    s.put(1, 101, 7, 0, [-5.0, -5.0], now=9)  # the only value fresh at t=12
    r = look.lookup(1, 102, now=12)
    assert r.tier == "campaign" and r.value.tolist() == [-5.0, -5.0]
    assert s.segment_ad(0, 100, now=12) is None and s.ad_default(100, now=12) is None
    assert s.global_default(now=12).tolist() == [-5.0, -5.0]


def test_a_pair_computed_again_replaces_its_value():
    s = PrecomputeStore(ttl_s=10, version="v")
    for t in range(0, 100, 10):  # one pair re-precomputed every TTL, with a new value each time
        s.put(1, 100, 7, 0, [float(t), 0.0], now=t)
    s.put(1, 101, 7, 0, [-90.0, 0.0], now=95)
    assert s.user_campaign(1, 7, now=96).tolist() == [0.0, 0.0]  # (90 - 90) / 2: each pair once
    assert s.segment_ad(0, 100, now=96).tolist() == [90.0, 0.0]
    s.put(1, 101, 7, 0, [10.0, 0.0], now=96)  # replaced while still fresh
    assert s.user_campaign(1, 7, now=97).tolist() == [50.0, 0.0]
    assert s.stats()["pairs"] == 2


def test_max_entries_is_enforced_oldest_first():
    s = PrecomputeStore(ttl_s=1e9, version="v", max_entries=3)
    for u in range(10):
        assert s.put(u, 1, 0, 0, [float(u), 0.0], now=float(u))
    assert s.stats()["pairs"] == 3
    assert [u for u in range(10) if s.get(u, 1, now=20) is not None] == [7, 8, 9]  # the oldest went first
    assert s.ad_default(1, now=20)[0] == pytest.approx(8.0)  # the evicted left the means too
    assert s.user_campaign(0, 0, now=20) is None and s.user_campaign(9, 0, now=20)[0] == 9.0


def test_aggregates_match_brute_force_over_held_pairs():
    rng = np.random.default_rng(0)
    ttl = 50.0
    s = PrecomputeStore(ttl_s=ttl, version="v")
    latest: dict[tuple[int, int], tuple[float, np.ndarray]] = {}
    now = 0.0
    for _ in range(3000):
        now += float(rng.exponential(1.0))
        u, a = int(rng.integers(0, 12)), int(rng.integers(0, 30))
        v = rng.normal(size=2).astype(np.float32)
        s.put(u, a, a // 10, u % 3, v, now=now)
        latest[(u, a)] = (now, v)
        if rng.random() < 0.05:
            fresh = {k: val for k, (t, val) in latest.items() if t + ttl > now}
            for u2, c in ((int(rng.integers(0, 12)), int(rng.integers(0, 3))) for _ in range(5)):
                want = [val for (uu, aa), val in fresh.items() if uu == u2 and aa // 10 == c]
                got = s.user_campaign(u2, c, now=now)
                assert (got is None) == (not want)
                if want:
                    assert np.allclose(got, np.mean(want, 0), atol=1e-5)
            seg, ad = int(rng.integers(0, 3)), int(rng.integers(0, 30))
            want = [val for (uu, aa), val in fresh.items() if uu % 3 == seg and aa == ad]
            got = s.segment_ad(seg, ad, now=now)
            assert (got is None) == (not want) and (not want or np.allclose(got, np.mean(want, 0), atol=1e-5))
            assert np.allclose(s.global_default(now=now), np.mean(list(fresh.values()), 0), atol=1e-5)
            assert s.stats()["pairs"] == len(fresh)


def test_a_user_without_a_segment_skips_the_segment_tier():
    s = PrecomputeStore(ttl_s=1000, version="v")
    look = HierarchicalLookup(s, campaign_of=campaign_of, segment_of=lambda u: None if u >= 100 else u % 2)
    s.put(3, 25, 2, 1, [2.0, 0.0], now=0, user_embedding=np.array([1.0, 0.0]))
    s.put(5, 25, 2, 1, [4.0, 0.0], now=0)
    assert look.lookup(7, 25, now=1).tier == "segment"  # a known user of segment 1
    r = look.lookup(100, 25, now=1)  # never segmented: not segment 0's or 1's mean
    assert r.tier == "default" and r.value[0] == pytest.approx(3.0)
    s.put(100, 3, 0, None, [1.0, 0.0], now=2, user_embedding=np.array([1.0, 0.0]))  # puts without a segment
    assert s.stats()["segment_ad"] == 1
    assert look.lookup(100, 25, now=3).tier == "neighbors"  # with an embedding: its neighbours answer


def test_a_value_of_the_wrong_shape_is_refused_before_it_lands():
    """A bad put raised half-way (the pair held, the aggregates not), and every later sweep failed on it."""
    s = PrecomputeStore(ttl_s=10, version="v")
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        s.put(1, 1, 0, 0, [1.0, 2.0, 3.0], now=0)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        s.put(2, 2, 0, 0, [1.0], now=0)  # would broadcast into both components of every mean
    assert s.stats()["pairs"] == 0 and s.stats()["user_campaign"] == 0
    assert s.put(3, 3, 0, 0, [1.0, 2.0], now=20)  # the store still works once time has moved on
    assert s.global_default(now=21).tolist() == [1.0, 2.0]


@pytest.mark.parametrize("ttl", [0.0, -5.0, float("nan")])
def test_a_ttl_that_is_not_positive_is_refused(ttl):
    """NaN kept every value fresh forever; <= 0 made every put expire at once (no exact hit, ever)."""
    with pytest.raises(ValueError, match="ttl_s must be a positive number"):
        PrecomputeStore(ttl_s=ttl, version="v")


def test_a_misspelt_tier_is_an_error_not_a_silent_skip():
    s = PrecomputeStore(ttl_s=1000, version="v")
    look = HierarchicalLookup(s, campaign_of=campaign_of, segment_of=segment_of)
    with pytest.raises(ValueError, match="neighbours"):
        look.lookup(1, 3, now=0, tiers=("exact", "neighbours"))


def test_a_non_finite_value_is_refused_and_counted():
    """A diverged model's NaN/inf logits were stored and served (as `NaN`, which is not JSON) by /lookup."""
    import json

    s = PrecomputeStore(ttl_s=100, version="v")
    look = HierarchicalLookup(s, campaign_of=lambda a: 0, segment_of=lambda u: 0)
    assert s.put(1, 2, 0, 0, [0.5, 0.5], now=0, user_embedding=np.array([1.0, 0.0]))
    assert not s.put(1, 3, 0, 0, [float("nan"), 1.0], now=0)
    assert not s.put(1, 2, 0, 0, [float("inf"), 1.0], now=1)  # the earlier, finite value of the pair stays
    assert not s.put(1, 4, 0, 0, [1e39, 1.0], now=1)  # finite in float64, inf once stored as float32
    assert not s.put(2, 3, 0, 0, [1.0, 1.0], now=1, user_embedding=np.array([np.nan, 0.0]))
    assert s.nonfinite == 4 and s.stats()["pairs"] == 1 and s.puts == 1
    assert s.get(1, 3, now=2) is None and s.get(1, 2, now=2).value.tolist() == [0.5, 0.5]
    assert s.user_embedding(2) is None
    r = look.lookup(1, 3, now=2)
    assert r.tier == "campaign" and r.value.tolist() == [0.5, 0.5]  # falls through to the next tier
    json.loads(json.dumps(r.to_json()), parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))


def test_user_embeddings_outlive_their_pairs_but_are_bounded():
    """An embedding is the lookup key of the neighbours tier, not a served value: it survives its user's pairs
    expiring (until set_version), but the store holds at most max_entries of them (it grew without bound)."""
    s = PrecomputeStore(ttl_s=10, version="v", max_entries=3)
    look = HierarchicalLookup(s, campaign_of=lambda a: a, segment_of=lambda u: None)
    s.put(1, 5, 5, None, [1.0, 0.0], now=0, user_embedding=np.array([1.0, 0.0]))
    s.put(2, 7, 7, None, [3.0, 0.0], now=20, user_embedding=np.array([1.0, 0.1]))  # user 1's pair has expired
    r = look.lookup(1, 7, now=21)
    assert r.tier == "neighbors" and r.value[0] == pytest.approx(3.0)  # user 1 still finds its neighbour
    for u in range(3, 8):
        s.put(u, 9, 9, None, [0.0, 0.0], now=30, user_embedding=np.array([0.0, 1.0]))
    assert s.stats()["user_embeddings"] == 3  # the least recently computed users were forgotten
    assert s.user_embedding(1) is None and s.user_embedding(7) is not None
    s.put(5, 8, 8, None, [0.0, 0.0], now=31, user_embedding=np.array([0.0, 1.0]))  # user 5 computed again
    s.put(8, 9, 9, None, [0.0, 0.0], now=31, user_embedding=np.array([0.0, 1.0]))
    assert s.user_embedding(5) is not None and s.user_embedding(6) is None
    s.set_version("w")
    assert s.stats()["user_embeddings"] == 0


def test_predictor_memory_is_bounded_by_its_horizon():
    """Every lookup (any user id) added a user to the predictor for good, and active_users scanned them all."""
    p = RequestPredictor(segment_of=lambda u: None, campaign_of=campaign_of)
    minute = 60.0
    for i in range(20_000):  # a new user every minute for ~two weeks
        p.observe(10**9 + i, i % 40, now=i * minute)
    held = 7 * 24 * 60 + 1  # the default horizon: users seen in the last 7 days
    assert len(p.last_seen) <= held and len(p._recent) <= held
    assert set(p.last_seen) == set(p._recent)


def test_forgetting_old_users_leaves_predictions_within_the_horizon_unchanged():
    rng = np.random.default_rng(1)
    horizon = 500.0
    kw = dict(segment_of=lambda u: u % 3 if u < 40 else None, campaign_of=campaign_of, recent_per_user=4)
    bounded = RequestPredictor(forget_after_s=horizon, **kw)
    unbounded = RequestPredictor(forget_after_s=float("inf"), **kw)  # the old behaviour: nobody is forgotten
    now, returned = 0.0, set()
    for step in range(4000):
        now += float(rng.exponential(2.0))
        u, a = int(rng.integers(0, 60)), int(rng.integers(0, 50))
        if rng.random() < 0.3:
            u = 1000 + step  # a user seen once
        if now - unbounded.last_seen.get(u, now) > horizon:
            returned.add(u)  # back after a gap longer than the horizon: forgotten meanwhile
        bounded.observe(u, a, now=now)
        unbounded.observe(u, a, now=now)
        if step % 400 == 399:
            for window in (100.0, horizon):
                assert sorted(bounded.active_users(now, window)) == sorted(unbounded.active_users(now, window))
            active = bounded.active_users(now, horizon)
            within = [u for u in active if u not in returned]  # never away longer than the horizon
            assert 0 < len(within) < len(active)  # both cases are exercised
            assert bounded.predict(within, per_user=6) == unbounded.predict(within, per_user=6)
            for u in set(active) - set(within):  # came back after a gap: only what is older than the horizon is gone
                kept, ref = list(bounded._recent[u]), list(unbounded._recent[u])
                assert kept == [a for a in ref if a in kept]
                assert all(now - t > horizon for a, t in unbounded._recent[u].items() if a not in kept)
            assert len(bounded.last_seen) < len(unbounded.last_seen)  # the rest were forgotten
    with pytest.raises(ValueError, match="forget_after_s"):
        RequestPredictor(forget_after_s=0.0, **kw)


def test_the_store_holds_its_own_copy_of_every_value():
    """put kept the caller's array: a caller reusing one buffer changed every pair it had put, and a
    recomputed pair took the buffer's current value out of the means instead of the one it added. A
    value read back is read-only, so a reader cannot edit the held one either."""
    s = PrecomputeStore(ttl_s=100, version="v")
    buf = np.zeros(2, np.float32)
    emb = np.ones(3, np.float32)
    for user, v in ((1, 1.0), (2, 3.0)):
        buf[:] = v
        s.put(user, 7, 0, 0, buf, now=0, user_embedding=emb)
    buf[:] = 9.0
    emb[:] = -1.0
    assert s.get(1, 7, now=1).value.tolist() == [1.0, 1.0] and s.get(2, 7, now=1).value.tolist() == [3.0, 3.0]
    assert s.user_embedding(1).tolist() == [1.0, 1.0, 1.0]
    s.put(1, 7, 0, 0, [5.0, 5.0], now=2)  # recomputed: its 1.0 leaves the means, 5.0 comes in
    assert s.ad_default(7, now=2).tolist() == [4.0, 4.0] and s.global_default(now=2).tolist() == [4.0, 4.0]
    held = s.get(2, 7, now=3).value
    with pytest.raises(ValueError, match="read-only"):
        held += 100.0
    assert s.get(2, 7, now=3).value.tolist() == [3.0, 3.0]
