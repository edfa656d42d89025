"""How fast the operator turns a burst of GEMTrainings into PyTorchJobs.

    python -m benchmarks.operator [--resources 200] [--rounds 1] [--quick] [--out benchmarks/results/operator.json]

Against the API test server (tests/kubeapi, executor off: nothing runs, only the operator's
work is measured), `gem-operator` runs as its own process, exactly as deployed. Once its
readiness probe says ready, N GEMTrainings are created at once (straight into the server's
store, so creating them costs the operator nothing) and the benchmark records when each one's
PyTorchJob appears. Reported:

* `time_to_last_job_s`: from the first create until the last PyTorchJob exists (target <= 30 s);
* `reconcile_p50_s`, `reconcile_p99_s`: the duration of one reconcile (validate, render, create the
  ConfigMap and the job, post the Event, write the status), from the operator's own histogram
  `gem_operator_reconcile_duration_seconds`, interpolated within buckets like Prometheus'
  histogram_quantile (target p99 <= 5 s);
* `create_to_job_p50_s`/`p99_s`: per resource, from its create to its job;
* `server_busy_s` and `server_share`: the time the test API server spent inside request handlers
  during the window (its timing middleware, `KubeApp.handler_seconds`) and its share of the window,
  so the figures above are the operator's and not the server's; `operator_cpu_s` is the
  operator process's CPU time in the window.

Writes benchmarks/results/operator.json and operator.png (or --out and the PNG beside it).
`--quick` is a smoke run: 20 GEMTrainings instead of 200. Informative: no test asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
API = "gem.dev/v1alpha1"
TARGETS = {"time_to_last_job_s": 30.0, "reconcile_p99_s": 5.0}
QUICK_RESOURCES = 20


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def histogram(text: str, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a Prometheus histogram, summed over its labels."""
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            labels, value = line.rsplit(" ", 1)
            le = labels.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + float(value)
    return sorted(buckets.items())


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q."""
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = bound, count
    return lower


def one_round(n: int, workdir: Path) -> dict:
    from gem.launcher import free_port
    from tests.kubeapi import KubeAPIServer

    metrics_port, ready_port = free_port(), free_port()
    with KubeAPIServer(executor=False, workdir=workdir) as server:
        env = {**os.environ, "GEM_METRICS_PORT": str(metrics_port), "GEM_MLFLOW_TRACKING_URI": "http://mlflow:5000"}
        log = open(workdir / "operator.log", "wb")
        op = subprocess.Popen(
            [sys.executable, "-m", "gem_operator", "--kubeconfig", str(server.kubeconfig_path), "-n", "default",
             "--readiness", f"http://127.0.0.1:{ready_port}/readyz", "--log-format", "plain"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
        try:
            deadline = time.monotonic() + 120
            while _get(f"http://127.0.0.1:{ready_port}/readyz")[0] != 200:
                if op.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the operator did not get ready; see {workdir / 'operator.log'}")
                time.sleep(0.2)
            jobs_t = server.resource("kubeflow.org/v1", "PyTorchJob")
            gemt = server.resource(API, "GEMTraining")
            busy0, requests0, cpu0 = server.app.handler_seconds, server.requests_served, _cpu_seconds(op.pid)
            created: dict[str, float] = {}
            t0 = time.monotonic()
            for i in range(n):
                name = f"bench-{i:04d}"
                server.store.create(gemt, "default", {"apiVersion": API, "kind": "GEMTraining",
                                                      "metadata": {"name": name}, "spec": {"training": {"steps": 100}}})
                created[name] = time.monotonic()
            seen: dict[str, float] = {}
            deadline = time.monotonic() + 300
            while len(seen) < n:
                now = time.monotonic()
                if now > deadline or op.poll() is not None:
                    raise RuntimeError(f"only {len(seen)}/{n} jobs after {now - t0:.0f}s; see {workdir / 'operator.log'}")
                for job in server.store.list(jobs_t, "default")[0]:  # stored dicts: no copies
                    seen.setdefault(job["metadata"]["labels"]["gem.dev/name"], now)
                time.sleep(0.02)
            t_last = max(seen.values())
            busy, requests, cpu = server.app.handler_seconds - busy0, server.requests_served - requests0, _cpu_seconds(op.pid) - cpu0
            # Let the last reconciles finish and be counted before reading the histogram.
            time.sleep(2.0)
            text = _get(f"http://127.0.0.1:{metrics_port}/metrics")[1]
        finally:
            op.kill()
            op.wait(10)
            log.close()
    buckets = histogram(text, "gem_operator_reconcile_duration_seconds")
    latencies = sorted(seen[k] - created[k] for k in seen)
    window = t_last - t0
    return {
        "time_to_last_job_s": round(window, 2),
        "reconcile_p50_s": _r(quantile(0.5, buckets)),
        "reconcile_p99_s": _r(quantile(0.99, buckets)),
        "reconciles": int(buckets[-1][1]) if buckets else 0,
        "create_to_job_p50_s": _r(statistics.median(latencies)),
        "create_to_job_p99_s": _r(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]),
        "server_busy_s": _r(busy),
        "server_share": _r(busy / window if window else None),
        "server_requests": requests,
        "server_mean_request_ms": _r(1000 * busy / requests if requests else None),
        "operator_cpu_s": _r(cpu),
        "_jobs_over_time": sorted(v - t0 for v in seen.values()),
    }


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def plot(rounds: list[dict], summary: dict, n: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, r in enumerate(rounds):
        times = r["_jobs_over_time"]
        left.step(times, range(1, len(times) + 1), where="post", label=f"round {i + 1}")
    left.axvline(TARGETS["time_to_last_job_s"], color="red", linestyle="--", label="target: all within 30 s")
    left.set_xlabel("seconds since the burst of creates")
    left.set_ylabel("PyTorchJobs that exist")
    left.set_title(f"{n} GEMTrainings created at once")
    left.legend(loc="lower right")
    r = summary
    parts = {"API server handlers": r["server_busy_s"], "operator CPU": r["operator_cpu_s"]}
    right.bar(list(parts), list(parts.values()), color=["tab:gray", "tab:blue"])
    right.axhline(r["time_to_last_job_s"], color="black", linestyle=":", label="window (first create to last job)")
    right.set_ylabel("seconds (median of rounds)")
    right.set_title(f"reconcile p50 {r['reconcile_p50_s']} s, p99 {r['reconcile_p99_s']} s (target p99 <= 5 s)")
    right.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--resources", type=int, default=None, help="GEMTrainings created at once (default 200).")
    p.add_argument("--rounds", type=int, default=1, help="Repeat with a fresh server and operator (median reported).")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK_RESOURCES} GEMTrainings (unless --resources is given)")
    p.add_argument("--out", type=Path, default=RESULTS / "operator.json", help="the JSON; the PNG is written beside it")
    args = p.parse_args(argv)
    if args.resources is None:
        args.resources = QUICK_RESOURCES if args.quick else 200
    rounds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-operator-") as tmp:
            rounds.append(one_round(args.resources, Path(tmp)))
        print(f"round {i + 1}: {json.dumps({k: v for k, v in rounds[-1].items() if not k.startswith('_')})}", flush=True)
    keys = [k for k in rounds[0] if not k.startswith("_")]
    summary = {k: statistics.median(r[k] for r in rounds) if isinstance(rounds[0][k], (int, float)) else rounds[0][k]
               for k in keys}
    data = {
        "benchmark": f"{args.resources} GEMTrainings created at once against the API test server; "
                     "the operator as a process, executor off",
        "resources": args.resources,
        "rounds": args.rounds,
        **summary,
        "targets": TARGETS,
        "meets_targets": summary["time_to_last_job_s"] <= TARGETS["time_to_last_job_s"]
        and (summary["reconcile_p99_s"] or 0) <= TARGETS["reconcile_p99_s"],
        "per_round": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rounds],
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    plot(rounds, summary, args.resources, args.out.with_suffix(".png"))
    print(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
