"""Smoke runs of the benchmarks that have no test of their own: model, parallel, kubeapi, data,
transfer and operator, each in its smallest mode, writing into tmp_path (never into
benchmarks/results/, the results of record).

Each runs as `python -m benchmarks.<name>`, as `make bench` runs it, in its own process (data
pins itself to one core, transfer and model set torch's thread count). Structure only, never
speed: the documented keys are there with finite values of the right type, the figures derived
from others recompute from them, and the PNG was written. A benchmark exits 1 when one of its
targets is missed (the Makefile's "-"); model is the one with targets in its exit status, so its
test accepts 1 exactly when the JSON says a target was missed.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from benchmarks import data as data_bench
from benchmarks import model as model_bench
from benchmarks import operator as operator_bench
from benchmarks import parallel as parallel_bench

ROOT = Path(__file__).resolve().parents[1]


def run(module: str, out: Path, *args: str) -> tuple[int, dict]:
    """Run `python -m benchmarks.<module> *args --out out`; its exit status and the JSON it wrote."""
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), f"benchmarks.{module} crashed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert out.is_file(), f"benchmarks.{module} wrote no JSON:\n{proc.stderr[-3000:]}"
    assert out.with_suffix(".png").stat().st_size > 0
    return proc.returncode, json.loads(out.read_text())


def finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def positive(x) -> bool:
    return finite(x) and x > 0


def count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def test_model_smoke(tmp_path):
    rc, doc = run("model", tmp_path / "model.json", "--smoke", "--threads", "1")
    assert doc["command"] == "python -m benchmarks.model --smoke --threads 1"
    assert doc["workload"]["batch"] == model_bench.SMOKE_BATCH
    assert doc["workload"]["block_attention_lengths"] == dict(zip(("short", "long"), model_bench.SMOKE_BLOCK_LENGTHS))
    m = doc["machine"]
    assert m["cpu_threads"] == 1 and isinstance(m["torch"], str) and isinstance(m["cpu_capability"], str)
    dtypes = m["precision"]["dtypes"]
    assert dtypes in (["fp32"], ["fp32", "bf16"]) and positive(m["precision"]["bf16_over_fp32"])
    assert all(finite(x) for x in m["load_average_before"] + m["load_average_after"])

    # Exit status 1 is "a target missed", and only that.
    assert set(doc["targets"]) == set(model_bench.TARGETS)
    for key, t in doc["targets"].items():
        op, target = model_bench.TARGETS[key]
        assert finite(t["value"]) and t["value"] == doc["results"][key] and t["target"] == f"{op} {target}"
        assert t["met"] is (t["value"] >= target if op == ">=" else t["value"] <= target), (key, t)
    assert rc == (0 if all(t["met"] for t in doc["targets"].values()) else 1)

    r = doc["results"]
    for key in ("jagged_attention_speedup", "jagged_attention_ideal", "jagged_attention_tile_ideal",
                "block_attention_scaling", "pffn_forward_speedup", "pffn_forward_ideal",
                "pffn_forward_speedup_vs_ffn_hidden_d", "pffn_forward_ideal_vs_ffn_hidden_d",
                "train_step_speedup_vs_padded", "train_step_ideal_vs_padded", "mfu", "achieved_gflops",
                *(f"peak_{dt}_gflops" for dt in dtypes)):
        assert positive(r[key]), key
    short, long = model_bench.SMOKE_BLOCK_LENGTHS
    assert r["block_attention_ideal"] == long / short and r["mfu_ideal"] == 1.0
    assert 0 < r["compskip_flop_reduction"] < 1
    assert 0 <= r["jagged_attention_max_abs_err_fp32"] < 1e-3  # the jagged path computes the padded one's result
    timed = doc["details"]["jagged_attention"]["chosen"]["jagged"].removeprefix("jagged_")
    assert 0 <= r[f"jagged_attention_max_abs_err_{timed}"] < 0.05  # ... in the precision the ratio timed too
    assert r["max_len"] <= model_bench.SMOKE_MAX_LEN and count(r["total_tokens"]) and count(r["jagged_attention_num_buckets"])

    # The ratios recompute from the best times in `details`.
    d = doc["details"]
    assert set(d) == {"jagged_attention", "block_attention", "compskip", "pffn", "train_step"}
    for part in ("jagged_attention", "block_attention", "pffn", "train_step"):
        for name, s in d[part]["seconds"].items():
            assert positive(s["best_s"]) and s["best_s"] <= s["median_s"], (part, name)
    sec = {p: {k: v["best_s"] for k, v in d[p]["seconds"].items()} for p in d if "seconds" in d[p]}
    ch = d["jagged_attention"]["chosen"]
    assert math.isclose(r["jagged_attention_speedup"], sec["jagged_attention"][ch["padded"]] / sec["jagged_attention"][ch["jagged"]])
    ch = d["pffn"]["chosen"]
    assert math.isclose(r["pffn_forward_speedup"], sec["pffn"][ch["token_ffn_4d"]] / sec["pffn"][ch["pffn"]])
    ch = d["train_step"]["chosen"]
    assert math.isclose(r["train_step_speedup_vs_padded"], sec["train_step"][ch["padded"]] / sec["train_step"][ch["gem"]])
    assert all(v.rsplit("_", 1)[1] in dtypes for part in ("jagged_attention", "pffn", "train_step")
               for v in d[part]["chosen"].values())
    for part in ("jagged_attention", "pffn", "train_step"):  # both sides of a ratio in one precision
        assert len({v.rsplit("_", 1)[1] for k, v in d[part]["chosen"].items() if k != "mfu_step"}) == 1, part
    assert math.isclose(r["achieved_gflops"], d["train_step"]["step_flops"]["gem"] / sec["train_step"][ch["mfu_step"]] / 1e9)
    on, off = d["compskip"]["flops_per_example_on"], d["compskip"]["flops_per_example_off"]
    assert math.isclose(r["compskip_flop_reduction"], 1 - sum(on.values()) / sum(off.values()))
    assert finite(doc["wall_seconds"]) and doc["wall_seconds"] >= 0


def test_model_ratios_compare_both_sides_in_one_precision(monkeypatch):
    """Each speedup divides two times taken in the same precision (the one where the pair is
    fastest together), never the baseline's best fp32 time by GEM's best bf16 time; MFU takes
    GEM's fastest step against the fastest matmul peak. Timings are replaced by fixed ones."""
    fake = {"padded_fp32": 1.0, "padded_bf16": 3.0, "jagged_fp32": 0.5, "jagged_bf16": 0.1,
            "token_ffn_4d_fp32": 1.0, "token_ffn_4d_bf16": 3.0, "pffn_fp32": 0.5, "pffn_bf16": 0.1,
            "gem_fp32": 0.5, "gem_bf16": 0.1, "peak_fp32": 1.0, "peak_bf16": 0.5}
    monkeypatch.setattr(model_bench, "DTYPES", ("fp32", "bf16"))
    monkeypatch.setattr(model_bench, "rounds", lambda fns, num_rounds, warmup=None: {k: [fake.get(k, 1.0)] for k in fns})
    j = model_bench.bench_jagged_attention(1, batch=4, max_len=32)
    assert j["chosen"] == {"padded": "padded_fp32", "jagged": "jagged_fp32"}
    assert j["jagged_attention_speedup"] == 2.0  # 1.0 / 0.5, not fp32 padded over bf16 jagged (10)
    assert set(j) >= {"jagged_attention_max_abs_err_fp32"}
    fake["padded_bf16"] = 0.8  # now the pair is faster in bf16: its outputs are compared in bf16 too
    j = model_bench.bench_jagged_attention(1, batch=4, max_len=32)
    assert j["chosen"] == {"padded": "padded_bf16", "jagged": "jagged_bf16"} and j["jagged_attention_speedup"] == 8.0
    assert 0 <= j["jagged_attention_max_abs_err_fp32"] < 1e-5 and 0 <= j["jagged_attention_max_abs_err_bf16"] < 0.05
    fake["padded_bf16"] = 3.0
    p = model_bench.bench_pffn(1, batch=4, max_len=32)
    assert set(p["chosen"].values()) == {"pffn_fp32", "token_ffn_4d_fp32", "token_ffn_1d_fp32"}
    assert p["pffn_forward_speedup"] == 2.0
    t = model_bench.bench_train_step(1, batch=4, max_len=32)
    assert t["chosen"] == {"gem": "gem_fp32", "padded": "padded_fp32", "mfu_step": "gem_bf16"}
    assert t["train_step_speedup_vs_padded"] == 2.0
    assert math.isclose(t["mfu"], (t["step_flops"]["gem"] / 0.1) / (model_bench.PEAK_FLOPS / 0.5))


def test_parallel_smoke(tmp_path):
    rc, doc = run("parallel", tmp_path / "parallel.json", "--quick")
    assert rc == 0
    assert doc["benchmark"] == "parallel" and isinstance(doc["model"], str)
    assert set(doc["hints"]) >= {"dense_params", "hidden_dim", "num_experts"} and set(doc["workload"]) >= {"dense_params"}
    assert [c["name"] for c in doc["clusters"]] == [c[0] for c in parallel_bench.QUICK]
    for c in doc["clusters"]:
        base = c["chosen"]["crossBlockBytes"]
        assert positive(base) and isinstance(c["chosen"]["reason"], str)
        for v in (c["chosen"], c["unaware"], *c["variants"].values()):
            assert finite(v["crossBlockBytes"]) and v["crossBlockBytes"] >= 0
            assert positive(v["commSecondsEstimate"]) and v["levelTotals"]
            assert all(finite(float(x)) and x >= 0 for x in v["levelTotals"].values())
        assert set(c["variants"]) == {"chosenPlanArbitraryPlacement", "chosenDegreesReversedAxes",
                                      "unawarePlanTopologyPlacement"}
        for v in (c["unaware"], *c["variants"].values()):
            assert math.isclose(v["crossBlockBytesRatio"], v["crossBlockBytes"] / base)
        assert c["cross_block_bytes_ratio"] == c["unaware"]["crossBlockBytesRatio"]
    assert positive(doc["cross_block_bytes_ratio"])
    assert doc["cross_block_bytes_ratio"] == doc["clusters"][0]["cross_block_bytes_ratio"]


def test_kubeapi_smoke(tmp_path):
    # A small kmock budget: kmock's store fills in quadratic time (minutes to 1,000 objects), and a
    # level it could not fill in time is null, as documented.
    rc, doc = run("kubeapi", tmp_path / "kubeapi.json", "--quick", "--kmock-budget", "5")
    assert rc == 0
    levels = [str(lvl) for lvl in (0, 100, 1000)]
    assert isinstance(doc["metric"], str)
    assert list(doc["kubeapi"]) == levels and all(positive(v) for v in doc["kubeapi"].values())
    assert list(doc["kmock"]) == levels and list(doc["ratio_kubeapi_over_kmock"]) == levels
    if doc["kmock_skipped"] is not None:  # kmock is not a dependency of the project
        assert isinstance(doc["kmock_skipped"], str) and all(v is None for v in doc["kmock"].values())
    else:
        assert positive(doc["kmock"]["0"])  # nothing to fill before the first level
        assert all(v is None or positive(v) for v in doc["kmock"].values())
    for lvl in levels:
        ratio, km = doc["ratio_kubeapi_over_kmock"][lvl], doc["kmock"][lvl]
        if km is None:
            assert ratio is None
        else:
            assert math.isclose(ratio, doc["kubeapi"][lvl] / km, rel_tol=0.02, abs_tol=0.06)  # both rounded
    assert positive(doc["kubeapi_with_kubernetes_client_at_1000"])
    assert set(doc["machine"]) == {"python", "platform", "cpus"}


def test_data_smoke(tmp_path):
    rc, doc = run("data", tmp_path / "data.json", "--quick")
    assert rc == 0
    assert doc["target_examples_per_second"] == data_bench.TARGET and doc["chunk"] == data_bench.CHUNK
    assert doc["threads"] == 1 and doc["config"] == {**doc["config"], **data_bench.WORLD}
    rate_keys = ("examples_per_second", "best_examples_per_second", "events_per_second", "wall_examples_per_second")
    assert doc["in_memory"]["chunks"] == 2 and all(positive(doc["in_memory"][k]) for k in rate_keys)
    assert doc["examples_per_second"] == doc["in_memory"]["examples_per_second"]
    assert doc["in_memory"]["best_examples_per_second"] >= doc["examples_per_second"]
    assert [r["mean_history_len"] for r in doc["by_history_len"]] == list(data_bench.QUICK_HISTORY_LENS)
    for r in doc["by_history_len"]:
        assert r["chunks"] == 1 and all(positive(r[k]) for k in rate_keys)
    pq = doc["parquet"]
    assert pq["examples"] == data_bench.CHUNK and pq["files"] >= 1
    assert positive(pq["examples_per_second"]) and positive(pq["wall_examples_per_second"]) and positive(pq["bytes_per_example"])
    assert positive(doc["world_build_seconds"])
    assert doc["pinned_cpu"] is None or count(doc["pinned_cpu"])
    assert doc["load_average"] is None or (len(doc["load_average"]) == 3 and all(finite(x) for x in doc["load_average"]))


def test_transfer_smoke(tmp_path):
    seeds = 2
    rc, doc = run("transfer", tmp_path / "transfer.json", "--smoke", "--no-cache", "--seeds", str(seeds))
    assert rc == 0
    cfg = doc["config"]
    assert cfg["smoke"] is True and cfg["seeds"] == seeds and cfg["data"]["numTrainExamples"] == 2000
    assert doc["command"].startswith("python -m benchmarks.transfer --smoke")
    models = ("baseline", "kd", "loopfm")
    for metric in ("ne", "ne_click", "ne_conversion", "auc_click"):
        assert set(doc[metric]) == {*models, "fm"} and finite(doc[metric]["fm"]), metric
        for m in models:
            s = doc[metric][m]
            assert len(s["values"]) == seeds and all(finite(v) for v in s["values"]), (metric, m)
            assert math.isclose(s["mean"], sum(s["values"]) / seeds) and finite(s["std"])
    assert 0 < doc["bayes_ne"] < 1

    # TR per seed against that seed's baseline, from the NEs beside it.
    ne = doc["ne"]
    gaps = [b - ne["fm"] for b in ne["baseline"]["values"]]
    assert all(math.isclose(a, b) for a, b in zip(doc["fm_gain_over_baseline"]["values"], gaps))
    for m in ("kd", "loopfm"):
        tr = [(b - s) / g for b, s, g in zip(ne["baseline"]["values"], ne[m]["values"], gaps)]
        assert all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip(doc["transfer_ratio"][m]["values"], tr))
        assert math.isclose(doc[f"transfer_ratio_{m}"], sum(tr) / seeds, abs_tol=1e-12)
    kd, loopfm = doc["transfer_ratio_kd"], doc["transfer_ratio_loopfm"]
    assert (doc["loopfm_over_kd"] is None) if kd <= 0 else math.isclose(doc["loopfm_over_kd"], loopfm / kd)

    # Equal serving cost: the KD student is widened to within 5% of the LoopFM student's multiply-adds.
    cost = doc["serving_cost"]
    assert all(count(cost[m][k]) and cost[m][k] > 0 for m in ("kd", "loopfm") for k in ("flops", "params", "hidden"))
    assert abs(cost["kd"]["flops"] - cost["loopfm"]["flops"]) <= 0.05 * cost["loopfm"]["flops"]
    mem = doc["memory"]
    assert count(mem["rows"]) and mem["rows"] > 0 and count(mem["dim"]) and count(mem["k"])
    assert 0 <= mem["eval_coverage"] <= 1 and 0 <= mem["eval_mean_embeddings_read"] <= mem["k"]
    assert set(mem["click_probes"]) == {"memory_mean", "baseline", "baseline+memory_mean",
                                        "baseline+memory_x_campaign", "current_embedding"}
    assert all(positive(v) for v in mem["click_probes"].values())
    assert set(mem["interest_r2"]) == {"memory_mean", "student_window"}
    assert all(finite(v) and v <= 1 for v in mem["interest_r2"].values())
    assert {"fm_train", "memory_log"} <= set(doc["seconds"])
    assert {f"{m}_seed{s}" for m in models for s in range(seeds)} <= set(doc["seconds"])


def test_operator_smoke(tmp_path):
    rc, doc = run("operator", tmp_path / "operator.json", "--quick")
    assert rc == 0
    n = operator_bench.QUICK_RESOURCES
    assert doc["resources"] == n and doc["rounds"] == 1 and isinstance(doc["benchmark"], str)
    assert doc["targets"] == operator_bench.TARGETS and isinstance(doc["meets_targets"], bool)
    seconds = ("time_to_last_job_s", "reconcile_p50_s", "reconcile_p99_s", "create_to_job_p50_s",
               "create_to_job_p99_s", "server_busy_s", "server_share", "server_mean_request_ms", "operator_cpu_s")
    counts = ("reconciles", "server_requests")
    assert len(doc["per_round"]) == 1 and set(doc["per_round"][0]) == {*seconds, *counts}
    for key in seconds:
        assert finite(doc[key]) and doc[key] >= 0 and doc[key] == doc["per_round"][0][key], key
    assert doc["reconcile_p50_s"] <= doc["reconcile_p99_s"] and doc["create_to_job_p50_s"] <= doc["create_to_job_p99_s"]
    # one reconcile (at least) and a handful of API requests per GEMTraining
    assert count(doc["reconciles"]) and doc["reconciles"] >= n
    assert count(doc["server_requests"]) and doc["server_requests"] >= n
    t = operator_bench.TARGETS
    assert doc["meets_targets"] is (doc["time_to_last_job_s"] <= t["time_to_last_job_s"]
                                    and doc["reconcile_p99_s"] <= t["reconcile_p99_s"])
