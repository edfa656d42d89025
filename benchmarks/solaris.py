"""Solaris on a replayed request stream of the synthetic world.

    python -m benchmarks.solaris [--quick] [--checkpoint FM_DIR]

1. A foundation model: the tiny-preset GEM trained by the transfer benchmark's recipe (one pass
   over 4x the vertical's impressions of this world, split 3; cached under --cache), or --checkpoint.
2. Replay: held-out impressions (split 2) in request-time order, on a simulated clock. Every
   `tick` the service asks the predictor for the pairs of recently active users and precomputes
   the missing ones (FM logits, TTL, model version); then the tick's requests are looked up (the
   tier that answered is recorded) and observed (they feed the predictor). The first
   `warmup_days` are not measured. For every measured request each tier is also asked alone
   (lookup restricted to it), and the FM is run live on the exact request (the "exact pair").
   Point-in-time: a round scores with the impressions replayed before it (user states, and the
   candidate ads' mean quality scores), and segments are learnt from the train split's
   impressions before the first measured request (the train split spans the same month).
3. The vertical model: a LoopFM student (the transfer benchmark's, reading the FM's embedding
   memory of the train and replayed impressions point-in-time) trained on the train split. Per
   tier it consumes the Solaris value through gem.solaris.vertical.TierBlend (its own logit and
   the value, blended per tier), fitted on the first half of the measured requests that tier can
   answer and scored on the second half, against the same model fed the exact pair: the NE
   cost of each fallback. (`ne_by_tier_raw_fm_value`: the raw FM value served as the prediction.)
4. Lookup latency under concurrent load: the aiohttp service on 127.0.0.1, `--requests` GETs with
   `--concurrency` in flight (client-side p50/p99; pending pairs are scored before the app starts,
   so its first precompute round does not run beside the timed lookups), and the in-process
   library lookup.

Writes benchmarks/results/solaris.json and solaris.png.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
DAY = 86400.0


def world_spec(quick: bool) -> dict:
    return {"seed": 11, "numUsers": 200 if quick else 400, "numAds": 160, "numTrainExamples": 8000 if quick else 16000,
            "numEvalExamples": 1000, "meanHistoryLen": 24}


def train_fm(data: dict, steps: int, cache: Path) -> str:
    """A tiny GEM trained by the transfer benchmark's loop on the world's FM traffic (FM_DATA_FACTOR x
    the vertical's train split, one pass), cached under `cache`."""
    from benchmarks.transfer import FM_DATA_FACTOR, FM_SPLIT, code_fingerprint
    from benchmarks.transfer import train_fm as train
    from gem.api.types import SyntheticDataSpec
    from gem.data.synthetic import SyntheticWorld

    world = SyntheticWorld(SyntheticDataSpec.model_validate(data))
    probe = world.sample(256, split=0)  # the world's fingerprint
    key = hashlib.sha1(json.dumps([data, steps, FM_DATA_FACTOR, FM_SPLIT]).encode() + probe.p_click.tobytes()
                       + probe.seq_ad_id.tobytes() + code_fingerprint())  # new model code: a new FM
    out = cache / key.hexdigest()[:12] / "fm"
    if not (out / "model.pt").is_file():
        traffic = world.sample(FM_DATA_FACTOR * data["numTrainExamples"], split=FM_SPLIT)
        train(data, traffic, steps, out)
    return str(out)


def _ne(y: np.ndarray, logit: np.ndarray) -> float:
    from gem.eval.metrics import normalized_entropy

    return normalized_entropy(y, 1.0 / (1.0 + np.exp(-logit)))


def replay_service(scorer, world, stream, segments: dict[int, int], *, ttl_s: float, version: str, per_user: int):
    """The Solaris service the replay drives: empty store, predictor and user states (it observes the stream)."""
    from gem.solaris.fallback import HierarchicalLookup
    from gem.solaris.predictor import RequestPredictor
    from gem.solaris.service import SolarisService
    from gem.solaris.store import PrecomputeStore

    def segment_of(u: int) -> int | None:
        return segments.get(u)  # as gem.solaris.service: a user the segmentation never saw has no segment

    def campaign_of(a: int) -> int:
        return int(world.ad_campaign[a])

    store = PrecomputeStore(ttl_s=ttl_s, version=version)
    predictor = RequestPredictor(segment_of=segment_of, campaign_of=campaign_of)
    lookup = HierarchicalLookup(store, campaign_of=campaign_of, segment_of=segment_of)
    service = SolarisService(scorer=scorer, context=stream, store=store, predictor=predictor, lookup=lookup,
                             per_user=per_user, active_window_s=2 * DAY)
    service.user_row = {}  # only what the replay has observed so far
    return service


def replay_stream(service, stream, *, tick_s: float, measure_from: float) -> dict:
    """Replay `stream` (sorted by request time) through `service` on a simulated clock: every `tick_s`
    a precompute round, then the tick's requests are looked up (from `measure_from` on: recorded, and
    each tier asked alone) and observed. Returns the tier that answered and the value per measured
    request (`tiers`, `served`), `forced` (tier -> [(measured index, value)]), `rows` (their stream
    rows), `computed` pairs and `compute_s`."""
    from gem.data.parquet import slice_examples
    from gem.solaris.fallback import TIERS

    if np.any(np.diff(stream.request_time) < 0):  # the point-in-time prefixes below rely on it
        raise ValueError("replay_stream: stream is not in request-time order; pass "
                         "slice_examples(stream, np.argsort(stream.request_time, kind='stable'))")
    tiers_seen: list[str] = []
    served: list[np.ndarray] = []
    forced: dict[str, list[tuple[int, np.ndarray]]] = {t: [] for t in TIERS}
    measured_rows: list[int] = []
    computed = 0
    compute_s = 0.0
    i = 0
    now = float(stream.request_time[0])
    while i < len(stream):
        # Point-in-time: the scorer reads the impressions replayed so far (candidate ads' mean quality
        # scores), not the whole stream, whose later impressions are the future of this round.
        # The stream is in time order, so the user states (rows < i) index the prefix unchanged.
        service.context = slice_examples(stream, np.arange(i))
        t0 = time.perf_counter()  # precompute_examples_per_s: the round, not the copy
        computed += service.compute(service.pending_pairs(now), now)
        compute_s += time.perf_counter() - t0
        end = now + tick_s
        while i < len(stream) and stream.request_time[i] < end:
            u, a, t = int(stream.user_id[i]), int(stream.ad_id[i]), float(stream.request_time[i])
            if t >= measure_from:
                res = service.lookup(u, a, t, observe=False)
                tiers_seen.append(res.tier)
                served.append(res.value)
                measured_rows.append(i)
                for tier in TIERS:
                    f = service.lookup_.lookup(u, a, now=t, tiers=(tier,))
                    if f is not None:
                        forced[tier].append((len(measured_rows) - 1, f.value))
            service.observe(u, a, t, row=i)
            i += 1
        now = end
    service.context = stream  # all replayed now
    return {"tiers": tiers_seen, "served": served, "forced": forced, "rows": np.array(measured_rows, np.int64),
            "computed": computed, "compute_s": compute_s}


def replay(ckpt: str, data: dict, *, stream_size: int, ttl_s: float, tick_s: float, warmup_days: float,
           per_user: int, num_segments: int, vertical_steps: int) -> tuple[object, dict, np.ndarray]:
    from gem.api.types import SyntheticDataSpec
    from gem.data.parquet import slice_examples
    from gem.data.synthetic import SyntheticWorld
    from gem.loopfm.logging import model_version_of
    from gem.solaris.fallback import TIERS
    from gem.solaris.scorer import FMScorer, user_segments
    from gem.train.checkpoint import load_model

    model, _ = load_model(ckpt)
    world = SyntheticWorld(SyntheticDataSpec.model_validate(data))
    stream = world.sample(stream_size, split=2)
    stream = slice_examples(stream, np.argsort(stream.request_time, kind="stable"))  # in request-time order
    train = world.sample(data["numTrainExamples"], split=0)
    scorer = FMScorer(model, ad_campaign=world.ad_campaign, campaign_advertiser=world.campaign_advertiser)
    measure_from = float(stream.request_time[0]) + warmup_days * DAY
    # from the FM on the training split as known when measuring starts
    segments = user_segments(scorer, train, num_segments, until=measure_from)
    service = replay_service(scorer, world, stream, segments, ttl_s=ttl_s, version=model_version_of(ckpt),
                             per_user=per_user)
    store = service.store
    run = replay_stream(service, stream, tick_s=tick_s, measure_from=measure_from)
    tiers_seen, served, forced, measured_rows = run["tiers"], run["served"], run["forced"], run["rows"]
    computed, compute_s = run["computed"], run["compute_s"]

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
        "ne_by_tier_raw_fm_value": per_tier,
        "ne_click_served": _ne(click, served[:, 0]),
        "ne_click_exact_live": _ne(click, live[:, 0]),
        "precomputed_pairs": computed,
        "precompute_examples_per_s": computed / max(compute_s, 1e-9),
        "store": store.stats(),
    }
    result["vertical"] = vertical_by_tier(model, world, data, stream, rows_m, forced, live, served,
                                          np.array(tiers_seen), steps=vertical_steps)
    return service, result, rows_m


STUDENT = {"embeddingDim": 16, "hiddenDim": 64, "maxSeqLen": 8}  # the transfer benchmark's LoopFM student


def vertical_by_tier(fm, world, data: dict, stream, rows_m: np.ndarray, forced: dict, live: np.ndarray,
                     served: np.ndarray, served_tier: np.ndarray, *, steps: int) -> dict:
    """NE of the vertical model (a LoopFM student over this FM's memory) fed each tier's Solaris value.

    The student is trained on the world's train split (its memory: the FM's embeddings of the
    train and replayed impressions, read point-in-time). Per tier, it consumes the value through a
    TierBlend fitted on the first half (in time) of the measured requests the tier can answer, and
    is scored on the second half; the reference is the same blend fitted on the FM run live on
    the exact request ("exact pairs"), on the same requests.
    """
    import torch

    from benchmarks.transfer import FM_DATA_FACTOR, FM_SPLIT, train_loop
    from gem.api.types import DistillationSpec, StudentSpec
    from gem.data.batch import make_batch
    from gem.loopfm.logging import UserRepresentation, embed_examples, log_stream
    from gem.loopfm.memory import EmbeddingMemory
    from gem.loopfm.student import LoopFMStudent
    from gem.loopfm.task import loopfm_loss
    from gem.solaris.fallback import TIERS
    from gem.solaris.vertical import TierBlend

    train = world.sample(data["numTrainExamples"], split=0)
    with tempfile.TemporaryDirectory(prefix="gem-solaris-memory-") as tmp:
        memory = EmbeddingMemory(tmp)
        fm_traffic = world.sample(FM_DATA_FACTOR * data["numTrainExamples"], split=FM_SPLIT)
        log_stream(fm, [fm_traffic, train, stream], memory, "fm")  # everything the FM scored
        index = memory.index()
    _, teacher_np = embed_examples(fm, train)
    teacher = {k: torch.from_numpy(v) for k, v in teacher_np.items()}
    dist = DistillationSpec(method="loopfm", alpha=0.5, temperature=2.0)

    def loss(m, b, idx):
        t = {k: v[idx] for k, v in teacher.items()}
        return loopfm_loss(m(b, t), t, b, alpha=dist.alpha, temperature=dist.temperature)

    with torch.enable_grad():  # FMScorer turned gradients off process-wide
        torch.manual_seed(0)
        student = LoopFMStudent.from_spec(StudentSpec.model_validate(STUDENT), dist, UserRepresentation(fm).dim)
        student.attach_memory(index)
        train_loop(student, loss, train, steps=steps, seed=0, max_seq_len=fm.max_seq_len)
    with torch.no_grad():
        outs = [student(make_batch(stream, rows_m[lo : lo + 1024], max_seq_len=fm.max_seq_len))
                for lo in range(0, len(rows_m), 1024)]
    s_logit = np.stack([np.concatenate([o[t].numpy() for o in outs]) for t in ("click", "conversion")], 1)  # [M, 2]

    y = np.stack([stream.click[rows_m], stream.conversion[rows_m]], 1)  # [M, 2]
    task_rows = np.stack([np.ones(len(rows_m), bool), y[:, 0] > 0], 1)  # conversion: clicked requests only
    calib = np.arange(len(rows_m)) < len(rows_m) // 2  # measured rows are in request-time order

    def blended_ne(avail: np.ndarray, tier_of: np.ndarray, value: np.ndarray) -> list[float]:
        """[NE click, NE conversion] on the test half of `avail`, blend fitted on its calibration half."""
        nes = []
        for k in range(2):
            fit, test = avail & calib & task_rows[:, k], avail & ~calib & task_rows[:, k]
            blend = TierBlend().fit(tier_of[fit], s_logit[fit, k], value[fit, k], y[fit, k])
            nes.append(_ne(y[test, k], blend.predict(tier_of[test], s_logit[test, k], value[test, k])))
        return nes

    def student_ne(avail: np.ndarray) -> list[float]:
        return [_ne(y[avail & ~calib & task_rows[:, k], k], s_logit[avail & ~calib & task_rows[:, k], k])
                for k in range(2)]

    everywhere = np.ones(len(rows_m), bool)
    live_tier = np.full(len(rows_m), "live")
    out: dict = {"student_steps": steps, "requests_fit": int(calib.sum()), "requests_scored": int((~calib).sum())}
    for tier in TIERS:
        if not forced[tier]:
            out[tier] = {"available": 0.0}
            continue
        value = np.full((len(rows_m), 2), np.nan, np.float32)
        idx = np.array([j for j, _ in forced[tier]])
        value[idx] = np.stack([v for _, v in forced[tier]])
        avail = np.isfinite(value[:, 0])
        ne_t = blended_ne(avail, np.full(len(rows_m), tier), np.nan_to_num(value))
        ne_x = blended_ne(avail, live_tier, live)
        ne_s = student_ne(avail)
        out[tier] = {"available": float(avail.mean()), "ne": float(np.mean(ne_t)), "ne_click": ne_t[0],
                     "ne_conversion": ne_t[1], "ne_exact_pairs": float(np.mean(ne_x)), "ne_click_exact_pairs": ne_x[0],
                     "ne_student_alone": float(np.mean(ne_s)), "ne_cost": float(np.mean(ne_t) - np.mean(ne_x))}
    cascade = blended_ne(everywhere, served_tier, served)
    exact = blended_ne(everywhere, live_tier, live)
    alone = student_ne(everywhere)
    out["cascade"] = {"ne": float(np.mean(cascade)), "ne_click": cascade[0], "ne_conversion": cascade[1]}
    out["exact_pairs_everywhere"] = {"ne": float(np.mean(exact)), "ne_click": exact[0], "ne_conversion": exact[1]}
    out["student_alone"] = {"ne": float(np.mean(alone)), "ne_click": alone[0], "ne_conversion": alone[1]}
    return out


async def http_load(service, pairs: list[tuple[int, int]], concurrency: int) -> dict:
    import aiohttp

    # The app runs a precompute round as it starts: score what is pending first, so that round finds
    # nothing to do and no FM scoring competes with the timed lookups.
    now = service.clock()
    service.compute(service.pending_pairs(now), now)
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
    ap.add_argument("--vertical-steps", type=int, default=None, help="training steps of the vertical LoopFM student")
    ap.add_argument("--stream", type=int, default=None, help="replayed requests")
    ap.add_argument("--ttl-hours", type=float, default=48.0)
    ap.add_argument("--tick-hours", type=float, default=6.0)
    ap.add_argument("--requests", type=int, default=2000, help="HTTP lookups in the load test")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "gem-solaris-cache"),
                    help="where the trained FM is kept between runs (keyed by world, FM steps and code)")
    ap.add_argument("--out", default=str(RESULTS / "solaris.json"))
    args = ap.parse_args(argv)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    import torch

    from benchmarks.transfer import FM_DATA_FACTOR

    torch.set_num_threads(1)  # small models: threads only contend
    data = world_spec(args.quick)
    stream_size = args.stream or (8000 if args.quick else 20000)
    fm_steps = args.fm_steps or FM_DATA_FACTOR * data["numTrainExamples"] // 128  # one pass, batch 128
    vertical_steps = args.vertical_steps or 2 * data["numTrainExamples"] // 128  # two passes, as in the transfer bench
    ckpt = args.checkpoint or train_fm(data, fm_steps, Path(args.cache))
    t0 = time.perf_counter()
    service, result, rows = replay(ckpt, data, stream_size=stream_size, ttl_s=args.ttl_hours * 3600,
                                   tick_s=args.tick_hours * 3600, warmup_days=5.0, per_user=8, num_segments=16,
                                   vertical_steps=vertical_steps)
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
    result["config"] = {"data": data, "stream": stream_size, "fm_steps": None if args.checkpoint else fm_steps,
                        "vertical_steps": vertical_steps, "ttl_hours": args.ttl_hours,
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
    v = result["vertical"]
    tiers = [t for t in TIERS if v[t].get("available")]
    x = np.arange(len(tiers))
    b.bar(x - 0.2, [v[t]["ne"] for t in tiers], 0.4, label="vertical model + value from tier")
    b.bar(x + 0.2, [v[t]["ne_exact_pairs"] for t in tiers], 0.4, label="vertical model + exact pair (live FM)")
    b.axhline(v["student_alone"]["ne"], ls="--", color="grey", label="vertical model alone (all requests)")
    shown = [v[t][k] for t in tiers for k in ("ne", "ne_exact_pairs")] + [v["student_alone"]["ne"]]
    b.set_ylim(min(shown) - 0.03, max(shown) + 0.03)
    b.set_xticks(x, tiers)
    b.set_ylabel("NE, mean of click and conversion (same requests)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
