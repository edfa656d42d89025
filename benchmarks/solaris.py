"""Solaris on a replayed request stream of the synthetic world.

    python -m benchmarks.solaris [--quick] [--checkpoint FM_DIR]

1. A foundation model: the tiny-preset GEM trained briefly on this world (or --checkpoint).
2. Replay: held-out impressions (split 2) in request-time order, on a simulated clock. Every
   `tick` the service asks the predictor for the pairs of recently active users and precomputes
   the missing ones (FM logits, TTL, model version); then the tick's requests are looked up (the
   tier that answered is recorded) and observed (they feed the predictor). The first
   `warmup_days` are not measured.
3. Per tier, the NE of the click / conversion prediction served from that tier alone
   (lookup restricted to it) against the NE of the FM scored live on the exact request, on the
   same requests: the cost of each fallback.
4. Lookup latency under concurrent load: the aiohttp service on 127.0.0.1, `--requests` GETs with
   `--concurrency` in flight (client-side p50/p99), and the in-process library lookup.

Writes benchmarks/results/solaris.json and solaris.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
DAY = 86400.0


def world_spec(quick: bool) -> dict:
    return {"seed": 11, "numUsers": 200 if quick else 400, "numAds": 160, "numTrainExamples": 8000 if quick else 16000,
            "numEvalExamples": 1000, "meanHistoryLen": 24}


def train_fm(data: dict, steps: int, work: Path) -> str:
    from gem import cli

    manifest = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining",
                "metadata": {"name": "solaris-fm", "namespace": "bench"},
                "spec": {"model": {"preset": "tiny"}, "data": {"synthetic": data},
                         "training": {"steps": steps, "batchSize": 128, "warmupSteps": 10, "learningRate": 0.003},
                         "checkpoint": {"path": str(work / "ckpt"), "everySteps": steps},
                         "mlflow": {"enabled": False}}}
    path = work / "fm.yaml"
    path.write_text(yaml.safe_dump(manifest))
    os.environ["GEM_TERMINATION_MESSAGE_PATH"] = str(work / "fm.report.json")
    if cli.main(["train", "--config", str(path)]) != 0:
        raise RuntimeError("training the FM failed")
    return json.loads((work / "fm.report.json").read_text())["checkpoint"]


def _ne(y: np.ndarray, logit: np.ndarray) -> float:
    from gem.eval.metrics import normalized_entropy

    return normalized_entropy(y, 1.0 / (1.0 + np.exp(-logit)))


def replay(ckpt: str, data: dict, *, stream_size: int, ttl_s: float, tick_s: float, warmup_days: float,
           per_user: int, num_segments: int) -> tuple[object, dict, np.ndarray]:
    from gem.api.types import SyntheticDataSpec
    from gem.data.synthetic import SyntheticWorld
    from gem.loopfm.logging import model_version_of
    from gem.solaris.fallback import TIERS, HierarchicalLookup
    from gem.solaris.predictor import RequestPredictor
    from gem.solaris.scorer import FMScorer, kmeans_segments
    from gem.solaris.service import SolarisService
    from gem.solaris.store import PrecomputeStore
    from gem.train.checkpoint import load_model

    model, _ = load_model(ckpt)
    world = SyntheticWorld(SyntheticDataSpec.model_validate(data))
    stream = world.sample(stream_size, split=2)
    order = np.argsort(stream.request_time, kind="stable")
    scorer = FMScorer(model, ad_campaign=world.ad_campaign, campaign_advertiser=world.campaign_advertiser)
    # Segments from the FM's user representation on the training split (known before the replay).
    train = world.sample(data["numTrainExamples"], split=0)
    last = dict(zip(train.user_id[np.argsort(train.request_time)].tolist(), np.argsort(train.request_time).tolist()))
    users = np.array(sorted(last))
    rows = np.array([last[u] for u in users.tolist()])
    _, embs = scorer.score(train, rows, train.ad_id[rows])
    seg = dict(zip(users.tolist(), kmeans_segments(embs, num_segments).tolist()))

    def segment_of(u: int) -> int:
        return seg.get(u, u % num_segments)

    def campaign_of(a: int) -> int:
        return int(world.ad_campaign[a])

    store = PrecomputeStore(ttl_s=ttl_s, version=model_version_of(ckpt))
    predictor = RequestPredictor(segment_of=segment_of, campaign_of=campaign_of)
    lookup = HierarchicalLookup(store, campaign_of=campaign_of, segment_of=segment_of)
    service = SolarisService(scorer=scorer, context=stream, store=store, predictor=predictor, lookup=lookup,
                             per_user=per_user, active_window_s=2 * DAY)
    service.user_row = {}  # only what the replay has observed so far

    t_first = float(stream.request_time[order[0]])
    measure_from = t_first + warmup_days * DAY
    tiers_seen: list[str] = []
    served: list[np.ndarray] = []
    forced: dict[str, list[tuple[int, np.ndarray]]] = {t: [] for t in TIERS}
    measured_rows: list[int] = []
    computed = 0
    compute_s = 0.0
    i = 0
    now = t_first
    while i < len(order):
        t0 = time.perf_counter()
        computed += service.compute(service.pending_pairs(now), now)
        compute_s += time.perf_counter() - t0
        end = now + tick_s
        while i < len(order) and stream.request_time[order[i]] < end:
            r = int(order[i])
            u, a, t = int(stream.user_id[r]), int(stream.ad_id[r]), float(stream.request_time[r])
            if t >= measure_from:
                res = service.lookup(u, a, t, observe=False)
                tiers_seen.append(res.tier)
                served.append(res.value)
                measured_rows.append(r)
                for tier in TIERS:
                    f = lookup.lookup(u, a, now=t, tiers=(tier,))
                    if f is not None:
                        forced[tier].append((len(measured_rows) - 1, f.value))
            service.observe(u, a, t, row=r)
            i += 1
        now = end

    rows_m = np.array(measured_rows)
    live, _ = scorer.score(stream, rows_m, stream.ad_id[rows_m])  # the FM on the exact request: the reference
    click, conv = stream.click[rows_m], stream.conversion[rows_m]
    counts = {t: tiers_seen.count(t) for t in TIERS}
    per_tier = {}
    for tier in TIERS:
        if not forced[tier]:
            per_tier[tier] = {"available": 0.0}
            continue
        idx = np.array([j for j, _ in forced[tier]])
        val = np.stack([v for _, v in forced[tier]])
        clicked = click[idx] > 0
        per_tier[tier] = {
            "available": len(idx) / len(rows_m),
            "ne_click": _ne(click[idx], val[:, 0]),
            "ne_click_exact_live": _ne(click[idx], live[idx, 0]),
            "ne_conversion": _ne(conv[idx][clicked], val[clicked, 1]),
            "ne_conversion_exact_live": _ne(conv[idx][clicked], live[idx][clicked, 1]),
        }
        per_tier[tier]["ne_click_cost"] = per_tier[tier]["ne_click"] - per_tier[tier]["ne_click_exact_live"]
    served = np.stack(served)
    result = {
        "hit_rate": {t: counts[t] / len(rows_m) for t in TIERS},
        "requests_measured": len(rows_m),
        "ne_by_tier": per_tier,
        "ne_click_served": _ne(click, served[:, 0]),
        "ne_click_exact_live": _ne(click, live[:, 0]),
        "precomputed_pairs": computed,
        "precompute_examples_per_s": computed / max(compute_s, 1e-9),
        "store": store.stats(),
    }
    return service, result, rows_m


async def http_load(service, pairs: list[tuple[int, int]], concurrency: int) -> dict:
    import aiohttp

    runner, port = await service.start("127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}/lookup"
    lat: list[float] = []
    tiers: dict[str, int] = {}
    queue: asyncio.Queue = asyncio.Queue()
    for p in pairs:
        queue.put_nowait(p)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
            async def worker():
                while not queue.empty():
                    u, a = queue.get_nowait()
                    t0 = time.perf_counter()
                    async with http.get(base, params={"user": u, "ad": a}) as r:
                        body = await r.json()
                    lat.append(time.perf_counter() - t0)
                    tiers[body["tier"]] = tiers.get(body["tier"], 0) + 1

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            wall = time.perf_counter() - t0
    finally:
        await runner.cleanup()
    ms = np.array(lat) * 1000
    return {"requests": len(pairs), "concurrency": concurrency, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "requests_per_s": len(pairs) / wall, "tiers": tiers}


def library_latency(service, pairs: list[tuple[int, int]], now: float) -> dict:
    lat = []
    for u, a in pairs:
        t0 = time.perf_counter()
        service.lookup_.lookup(u, a, now=now)
        lat.append(time.perf_counter() - t0)
    us = np.array(lat) * 1e6
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--checkpoint", help="FM checkpoint dir (default: train a tiny one on this world)")
    ap.add_argument("--fm-steps", type=int, default=None)
    ap.add_argument("--stream", type=int, default=None, help="replayed requests")
    ap.add_argument("--ttl-hours", type=float, default=48.0)
    ap.add_argument("--tick-hours", type=float, default=6.0)
    ap.add_argument("--requests", type=int, default=2000, help="HTTP lookups in the load test")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS / "solaris.json"))
    args = ap.parse_args(argv)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    data = world_spec(args.quick)
    stream_size = args.stream or (8000 if args.quick else 20000)
    with tempfile.TemporaryDirectory(prefix="gem-solaris-") as tmp:
        ckpt = args.checkpoint or train_fm(data, args.fm_steps or (80 if args.quick else 200), Path(tmp))
        t0 = time.perf_counter()
        service, result, rows = replay(ckpt, data, stream_size=stream_size, ttl_s=args.ttl_hours * 3600,
                                       tick_s=args.tick_hours * 3600, warmup_days=5.0, per_user=8, num_segments=16)
        result["replay_seconds"] = time.perf_counter() - t0
    stream = service.context
    rng = np.random.default_rng(0)
    pick = rng.choice(rows, size=min(args.requests, len(rows)), replace=len(rows) < args.requests)
    pairs = [(int(stream.user_id[r]), int(stream.ad_id[r])) for r in pick]
    end = float(stream.request_time.max())
    service.clock = lambda: end
    service.interval_s = 3600.0  # the store is already filled: no background rounds during the load test
    result["latency_http"] = asyncio.run(http_load(service, pairs, args.concurrency))
    result["latency_library"] = library_latency(service, pairs, end)
    result["config"] = {"data": data, "stream": stream_size, "ttl_hours": args.ttl_hours,
                        "tick_hours": args.tick_hours, "warmup_days": 5.0, "per_user": 8, "segments": 16,
                        "quick": args.quick}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("hit_rate", "latency_http", "latency_library")}, indent=2))
    return 0


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gem.solaris.fallback import TIERS

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(TIERS, [result["hit_rate"][t] for t in TIERS])
    a.set_ylabel("share of requests answered")
    a.set_title("hit rate per tier (cascade)")
    tiers = [t for t in TIERS if result["ne_by_tier"][t].get("available")]
    x = np.arange(len(tiers))
    b.bar(x - 0.2, [result["ne_by_tier"][t]["ne_click"] for t in tiers], 0.4, label="served from tier")
    b.bar(x + 0.2, [result["ne_by_tier"][t]["ne_click_exact_live"] for t in tiers], 0.4, label="FM on exact request")
    b.set_xticks(x, tiers)
    b.set_ylabel("click NE (same requests)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
