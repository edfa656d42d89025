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
    # expired: everything falls back to the learned default
    assert look.lookup(1, 3, now=5000).tier == "default"
    assert look.lookup(1, 3, now=10, tiers=("exact",)).tier == "exact"
    assert look.lookup(9, 99, now=10, tiers=("exact", "campaign")) is None


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
