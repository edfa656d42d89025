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
