"""`python -m benchmarks.scaling --smoke` writes one quality-study scaling grid per data budget."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import quality, scaling


def test_scaling_benchmark_smoke(tmp_path):
    out = tmp_path / "scaling.json"
    assert scaling.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"] == f"python -m benchmarks.scaling --smoke --threads 1 --out {out.resolve()}"
    sc = quality.MODES["smoke"]["scaling"]
    assert list(doc["budgets"]) == [str(b) for b in scaling.BUDGETS["smoke"]]
    for steps, study in doc["budgets"].items():
        assert study["setup"]["steps"] == int(steps)
        assert study["setup"]["train_examples"] == int(steps) * sc["batch"]  # each budget its own examples
        assert study["setup"]["eval_examples"] == sc["eval_examples"]
        assert {(g["embedding_dim"], g["max_seq_len"]) for g in study["grid"]} == {
            (d, L) for d in sc["dims"] for L in sc["lengths"]}
        assert all(math.isfinite(g["ne"]) and g["ne"] > 0 for g in study["grid"])
        assert doc["gain_by_budget"][steps] == study["ne_gain_longest_vs_shortest_rel"]
    # the budgets train different models: a longer run ends elsewhere
    first, last = (doc["budgets"][str(b)]["grid"] for b in scaling.BUDGETS["smoke"])
    assert [g["ne"] for g in first] != [g["ne"] for g in last]
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_budgets_must_be_distinct_positive_step_counts(tmp_path):
    for bad in (["0"], ["4", "4"]):
        with pytest.raises(SystemExit, match="--budgets must be distinct step counts >= 1"):
            scaling.main(["--smoke", "--budgets", *bad, "--out", str(tmp_path / "s.json")])


def test_a_candidate_design_is_trained_and_recorded(tmp_path):
    """--gem-config trains every run of the grid as that design: here the trunk without the affinity branch."""
    out = tmp_path / "pre_branch.json"
    assert scaling.main(["--smoke", "--budgets", "4", "--gem-config", "match_flags=true", "affinity_branch=false",
                         "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["gem_config"] == {"match_flags": True, "affinity_branch": False}
    assert doc["command"].endswith("--budgets 4 --gem-config match_flags=true affinity_branch=false")
    default = scaling.plan("smoke", (4,), 1)[4]
    candidate = scaling.plan("smoke", (4,), 1, doc["gem_config"])[4]
    assert set(candidate) == set(default) and all(j["gem_config"] == doc["gem_config"] for j in candidate.values())
    assert scaling.main(["--smoke", "--budgets", "4", "--out", str(tmp_path / "default.json")]) == 0
    with_branch = json.loads((tmp_path / "default.json").read_text())["budgets"]["4"]["grid"]
    without = {(g["embedding_dim"], g["max_seq_len"]): g["params"] for g in doc["budgets"]["4"]["grid"]}
    assert all(without[g["embedding_dim"], g["max_seq_len"]] < g["params"] for g in with_branch)  # no branch tables
