"""Generation rate of the synthetic ads world on one core: in memory and through the Parquet writer.

    python -m benchmarks.data [--quick] [--out benchmarks/results/data.json]

One process pinned to one CPU with OMP/MKL/OpenBLAS threads = 1. Measures
SyntheticWorld.sample in chunks of CHUNK examples (examples/s and history events/s; the median
chunk is reported, the best beside it), the same rate at several mean history lengths, and
generate + write to zstd Parquet shards (gem.data.parquet.write_examples over
SyntheticWorld.stream). Writes benchmarks/results/data.json and data.png (or --out and the PNG
beside it). Informative only: no test asserts on time.

Rates are examples per second of the process's CPU time (one thread, so one core's work): on
an idle machine that equals wall time; on a shared one wall time also counts the time other
processes held the core, so the wall-clock rates (`wall_*`) are reported beside them.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy is imported: one core means one thread

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from gem.api.types import SyntheticDataSpec  # noqa: E402
from gem.data.parquet import write_examples  # noqa: E402
from gem.data.synthetic import SyntheticWorld  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CHUNK = 50_000
TARGET = 50_000  # examples/s on one core (issue #4)
HISTORY_LENS = (8, 16, 32, 48, 96, 192)
QUICK_HISTORY_LENS = (8, 32)  # --quick: each length is a world of its own to build (~2 s of one core)
# A world bigger than the default (2k users, 500 ads) so gathers are not all cache hits.
WORLD = dict(seed=0, num_users=100_000, num_ads=5_000, num_train_examples=CHUNK, num_eval_examples=CHUNK,
             mean_history_len=48.0)


def pin_one_core() -> int | None:
    try:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return cpu
    except (AttributeError, OSError):  # not Linux: threads = 1 still holds
        return None


def sample_rates(world: SyntheticWorld, reps: int) -> dict[str, float]:
    world.sample(CHUNK, split=99)  # warm-up: page in the world's tables
    rates, events, wall = [], [], []
    for i in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        ex = world.sample(CHUNK, split=i)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        rates.append(CHUNK / dc)
        events.append(len(ex.seq_ad_id) / dc)
        wall.append(CHUNK / dt)
    return {"examples_per_second": statistics.median(rates), "best_examples_per_second": max(rates),
            "events_per_second": statistics.median(events), "wall_examples_per_second": statistics.median(wall),
            "chunks": reps}


def parquet_rate(world: SyntheticWorld, n: int) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(prefix="gem-bench-data-"))
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        paths = write_examples(world.stream(n, split=0, chunk_size=CHUNK), out / "train")
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        size = sum(p.stat().st_size for p in paths)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"examples_per_second": n / dc, "wall_examples_per_second": n / dt, "examples": n, "files": len(paths),
            "bytes_per_example": size / n}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_len = result["by_history_len"]
    xs = [r["mean_history_len"] for r in by_len]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(xs, [r["examples_per_second"] for r in by_len], marker="o", label="in memory (SyntheticWorld.sample)")
    ax.plot([result["config"]["mean_history_len"]], [result["parquet"]["examples_per_second"]], marker="s",
            ls="none", label="generate + write zstd Parquet")
    ax.axhline(TARGET, color="grey", ls="--", lw=1, label=f"target {TARGET:,}/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("mean history length (events per example)")
    ax.set_ylabel("examples / s, one core")
    ax.set_title("synthetic ads world: generation rate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 2 chunks, 2 history lengths of 1 chunk each, 1 chunk to Parquet")
    ap.add_argument("--out", type=Path, default=RESULTS / "data.json", help="the JSON; the PNG is written beside it")
    args = ap.parse_args(argv)
    cpu = pin_one_core()
    reps = 2 if args.quick else 9
    spec = SyntheticDataSpec(**WORLD)
    t0 = time.perf_counter()
    world = SyntheticWorld(spec)
    build_s = time.perf_counter() - t0
    main_rate = sample_rates(world, reps)
    by_len = []
    for length in QUICK_HISTORY_LENS if args.quick else HISTORY_LENS:
        w = SyntheticWorld(spec.model_copy(update={"mean_history_len": float(length)}))
        r = sample_rates(w, 1 if args.quick else max(2, reps // 3))
        by_len.append({"mean_history_len": length, **r})
    pq = parquet_rate(world, CHUNK * (1 if args.quick else 6))
    result = {
        "examples_per_second": main_rate["examples_per_second"],
        "target_examples_per_second": TARGET,
        "in_memory": main_rate,
        "parquet": pq,
        "by_history_len": by_len,
        "world_build_seconds": build_s,
        "config": spec.model_dump(),
        "chunk": CHUNK,
        "threads": 1,
        "pinned_cpu": cpu,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "numpy": np.__version__,
                    "cpus": os.cpu_count()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    try:
        plot(result, args.out.with_suffix(".png"))
    except ImportError:
        pass
    print(json.dumps({"examples_per_second": round(result["examples_per_second"]),
                      "best": round(main_rate["best_examples_per_second"]),
                      "wall_examples_per_second": round(main_rate["wall_examples_per_second"]),
                      "parquet_examples_per_second": round(pq["examples_per_second"]),
                      "load_average": result["load_average"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
