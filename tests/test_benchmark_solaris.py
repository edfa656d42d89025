"""`python -m benchmarks.solaris` end to end on a tiny budget: FM training, replay, per-tier blend,
HTTP and library latency, JSON and plot; and the replay's point-in-time guarantees on a tiny world."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import numpy as np
import pytest

from benchmarks import solaris
from gem.api import parse_object
from gem.data.parquet import slice_examples
from gem.data.synthetic import DENSE_AD_QUALITY, SyntheticWorld
from gem.model import build_model
from gem.solaris.fallback import TIERS
from gem.solaris.scorer import FMScorer

WORLD = {"numUsers": 30, "numAds": 40, "numTrainExamples": 600, "numEvalExamples": 50, "meanHistoryLen": 8}
MANIFEST = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "fm"},
            "spec": {"model": {"preset": "tiny"}, "data": {"synthetic": WORLD}}}
DAY = solaris.DAY


@pytest.fixture(scope="module")
def tiny():
    """An untrained tiny FM (the replay only needs a GEM model), its world, a time-sorted stream and the train split."""
    manifest = parse_object(MANIFEST)
    world = SyntheticWorld(manifest.spec.data.synthetic)
    scorer = FMScorer(build_model(manifest.spec.model), ad_campaign=world.ad_campaign,
                      campaign_advertiser=world.campaign_advertiser)
    stream = world.sample(400, split=2)
    stream = slice_examples(stream, np.argsort(stream.request_time, kind="stable"))
    return world, scorer, stream, world.sample(600, split=0)


@pytest.fixture(scope="module")
def replayed(tiny):
    """The tiny stream replayed once: (service, run)."""
    return run_replay(tiny, tiny[2])


def run_replay(tiny, stream):
    world, scorer, _, _ = tiny
    service = solaris.replay_service(scorer, world, stream, {}, ttl_s=2 * DAY, version="v",
                                     per_user=4)
    run = solaris.replay_stream(service, stream, tick_s=12 * 3600.0, measure_from=float(stream.request_time[0]))
    return service, run


def test_a_future_impression_does_not_change_a_value_precomputed_before_it(tiny, replayed):
    """The scorer's context was the whole replayed stream, so a candidate ad's mean quality score (its dense
    feature) averaged impressions from the future of the precompute round. Now it is what was replayed so far."""
    _, _, stream, _ = tiny
    t_cut = float(np.median(stream.request_time))
    future = stream.request_time >= t_cut
    dense = stream.dense.copy()
    dense[future, DENSE_AD_QUALITY] += 3.0  # every ad looks much better after t_cut
    changed = dataclasses.replace(stream, dense=dense)

    _, a = replayed
    _, b = run_replay(tiny, changed)
    before = stream.request_time[a["rows"]] < t_cut
    tiers = np.array(a["tiers"])
    assert (tiers[before] != "default").sum() > 20  # precomputed values were served before t_cut
    np.testing.assert_array_equal(np.stack(a["served"])[before], np.stack(b["served"])[before])
    for tier in TIERS:
        va = {j: v for j, v in a["forced"][tier] if before[j]}
        vb = {j: v for j, v in b["forced"][tier] if before[j]}
        assert va.keys() == vb.keys()
        for j in va:
            np.testing.assert_array_equal(va[j], vb[j], err_msg=f"tier {tier}")
    # after t_cut the change is seen: the test can tell the two streams apart
    assert not np.array_equal(np.stack(a["served"])[~before], np.stack(b["served"])[~before])


def test_segments_are_learnt_from_user_states_before_the_measured_requests(tiny):
    """Segments came from each user's latest train-split impression, and the train split spans the replay's
    month: the segment of a user measured on day 6 was their state of day 30. Now only states before `until`."""
    _, scorer, stream, train = tiny
    until = float(stream.request_time[0]) + 5 * DAY
    past = slice_examples(train, np.flatnonzero(train.request_time < until))
    assert len(past) < len(train)
    from gem.solaris.scorer import user_segments

    segments = user_segments(scorer, train, 4, until=until)
    assert segments == user_segments(scorer, past, 4, until=until)  # later impressions change nothing
    assert set(segments) == set(past.user_id.tolist())  # a user first seen after `until` has no segment


def test_no_precompute_round_scores_pairs_while_lookups_are_timed(tiny, replayed):
    """The HTTP load test started the app, whose first precompute round at once scored the pairs the replay left
    pending, in a worker thread beside the timed lookups (the p50/p99 measured the FM too)."""
    _, _, stream, _ = tiny
    service, run = replayed
    end = float(stream.request_time.max())
    service.clock, service.interval_s = (lambda: end), 3600.0  # as main(): one round, at start
    assert service.pending_pairs(end)  # the replay leaves pairs to score
    pending_at_round = []
    round_ = service.precompute_once

    async def spy(now=None):
        pending_at_round.append(len(service.pending_pairs(end)))
        return await round_(now)

    service.precompute_once = spy
    pairs = [(int(stream.user_id[r]), int(stream.ad_id[r])) for r in run["rows"][:100]]
    result = asyncio.run(solaris.http_load(service, pairs, 4))
    assert result["requests"] == sum(result["tiers"].values()) == 100
    assert pending_at_round and pending_at_round[0] == 0


def test_solaris_benchmark_smoke(tmp_path):
    out = tmp_path / "solaris.json"
    argv = ["--quick", "--fm-steps", "10", "--vertical-steps", "10", "--stream", "2000", "--requests", "40",
            "--concurrency", "4", "--cache", str(tmp_path / "cache"), "--out", str(out)]
    assert solaris.main(argv) == 0
    doc = json.loads(out.read_text())
    # every request is answered by exactly one tier of the cascade
    assert set(doc["hit_rate"]) == set(TIERS)
    assert math.isclose(sum(doc["hit_rate"].values()), 1.0)
    # the store holds only live pairs: never more than were computed
    assert 0 < doc["store"]["pairs"] <= doc["precomputed_pairs"] == doc["store"]["puts"]
    for tier in TIERS:
        result = doc["vertical"][tier]
        if result["available"]:
            assert all(math.isfinite(result[k]) and result[k] > 0 for k in ("ne", "ne_exact_pairs"))
    assert sum(doc["latency_http"]["tiers"].values()) == doc["latency_http"]["requests"] == 40
    assert doc["config"]["fm_steps"] == 10
    assert out.with_suffix(".png").stat().st_size > 10_000
