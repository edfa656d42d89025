"""`python -m benchmarks.solaris` end to end on a tiny budget: FM training, replay, per-tier blend,
HTTP and library latency, JSON and plot."""

from __future__ import annotations

import json
import math

from benchmarks import solaris
from gem.solaris.fallback import TIERS


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
