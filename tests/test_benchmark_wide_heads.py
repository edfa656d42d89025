"""`python -m benchmarks.wide_heads --smoke` writes well-formed curves and the noise probe."""

from __future__ import annotations

import json
import math

from benchmarks import wide_heads


def test_wide_heads_benchmark_smoke(tmp_path):
    out = tmp_path / "wide_heads.json"
    assert wide_heads.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    mode = wide_heads.MODES["smoke"]
    assert doc["command"] == f"python -m benchmarks.wide_heads --smoke --threads 1 --out {out.resolve()}"
    assert set(doc["curves"]) == set(wide_heads.CURVE_MODELS)
    for kind, run in doc["curves"].items():
        assert [p["step"] for p in run["curve"]] == list(range(mode["every"], mode["steps"] + 1, mode["every"]))
        for point in run["curve"]:
            for split in ("eval", "train"):
                assert set(point[split]) == {"click", "conversion", "dwell"}
                assert all(math.isfinite(v) and v > 0 for v in point[split].values())
    # The wide-off model really has no wide heads, and fewer parameters than GEM.
    assert doc["curves"]["gem_wide_off"]["params"] < doc["curves"]["gem"]["params"]
    final = doc["final_eval_ne"]
    for task, gain in doc["wide_heads_gain_rel"].items():
        assert math.isclose(gain, (final["gem_wide_off"][task] - final["gem"][task]) / final["gem_wide_off"][task])
    assert set(doc["noise_probe"]) == {str(n) for n in mode["noise_tokens"]}
    assert out.with_suffix(".png").stat().st_size > 10_000
