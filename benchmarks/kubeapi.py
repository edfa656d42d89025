"""Create throughput of the API test server against kmock 0.8's emulator, side by side.

    python -m benchmarks.kubeapi [--quick] [--kmock-budget S] [--out benchmarks/results/kubeapi.json]

Sequential ConfigMap creates over one keep-alive HTTP connection, measured with 0, 100 and
1,000 objects already stored (in the same namespace), for tests/kubeapi and for kmock's
`KubernetesEmulator` in the same run. Writes benchmarks/results/kubeapi.json and .png (or --out
and the PNG beside it). A level whose store could not be filled within the budget is null. kmock
comes with the `dev` extra; in an environment without it the kmock side is skipped
(`kmock_skipped` says why, its levels and the ratios are null) and the rest still runs.
The figures are informative only; no test asserts on time.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import platform
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
LEVELS = (0, 100, 1000)


class Client:
    def __init__(self, url: str) -> None:
        u = urlparse(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        self.n = 0

    def create(self, ns: str = "default") -> None:
        self.n += 1
        body = json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": f"cm-{self.n}", "namespace": ns, "labels": {"bench": "1"}},
                           "data": {"key": "value" * 20}})
        self.conn.request("POST", f"/api/v1/namespaces/{ns}/configmaps", body, {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        r.read()
        if r.status not in (200, 201):
            raise RuntimeError(f"create failed: {r.status}")


def measure(url: str, per_level: int, budget_s: float) -> dict[str, float | None]:
    c = Client(url)
    out: dict[str, float | None] = {}
    stored = 0
    started = time.monotonic()
    for level in LEVELS:
        while stored < level:
            if time.monotonic() - started > budget_s:
                break
            c.create()
            stored += 1
        if stored < level:
            out[str(level)] = None  # ran out of time filling the store
            continue
        t0 = time.perf_counter()
        for _ in range(per_level):
            c.create()
        dt = time.perf_counter() - t0
        stored += per_level
        out[str(level)] = round(per_level / dt, 1)
    return out


def run_kmock(per_level: int, budget_s: float) -> dict:
    import kmock

    result: dict = {}
    ready = threading.Event()
    done = threading.Event()
    url_box: list[str] = []

    async def main() -> None:
        async with kmock.KubernetesEmulator() as emu, kmock.Server(emu) as srv:
            emu.resources["v1/configmaps"] = {}
            url_box.append(str(srv.url).rstrip("/"))
            ready.set()
            while not done.is_set():
                await asyncio.sleep(0.05)

    th = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    th.start()
    if not ready.wait(30):
        raise RuntimeError("kmock did not start")
    try:
        result = measure(url_box[0], per_level, budget_s)
    finally:
        done.set()
        th.join(10)
    return result


def run_kubeapi(per_level: int, budget_s: float) -> dict:
    from tests.kubeapi import KubeAPIServer

    with KubeAPIServer(crd_paths=[]) as s:
        return measure(s.url, per_level, budget_s)


def run_kubeapi_official_client(per_level: int) -> float:
    """What tests see: the `kubernetes` client, with 1,000 objects stored."""
    from kubernetes import client

    from tests.kubeapi import KubeAPIServer

    with KubeAPIServer(crd_paths=[]) as s:
        c = Client(s.url)
        for _ in range(1000):
            c.create()
        core = client.CoreV1Api(s.api_client())
        t0 = time.perf_counter()
        for i in range(per_level):
            core.create_namespaced_config_map("default", {"metadata": {"name": f"k-{i}"}, "data": {"a": "b"}})
        return round(per_level / (time.perf_counter() - t0), 1)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    kmock_name = "kmock 0.8" + (" (not installed: skipped)" if data.get("kmock_skipped") else "")
    for name, key in (("tests/kubeapi", "kubeapi"), (kmock_name, "kmock")):
        xs = [int(k) for k, v in data[key].items() if v]
        ys = [v for v in data[key].values() if v]
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("objects already stored")
    ax.set_ylabel("sequential creates / s")
    ax.set_yscale("log")
    ax.set_title("API test server create throughput")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer creates per level")
    p.add_argument("--kmock-budget", type=float, default=240.0, help="seconds allowed to fill kmock's store")
    p.add_argument("--out", type=Path, default=RESULTS / "kubeapi.json", help="the JSON; the PNG is written beside it")
    args = p.parse_args(argv)
    n = 100 if args.quick else 500
    kube = run_kubeapi(n, budget_s=120)
    try:
        import kmock  # noqa: F401
        kmock_skipped = None
    except ImportError as e:
        kmock_skipped = f"kmock is not installed ({e}); pip install 'gem-platform[dev]' (or kmock>=0.8) to compare"
    km = ({str(lvl): None for lvl in LEVELS} if kmock_skipped
          else run_kmock(30 if args.quick else 50, budget_s=args.kmock_budget))
    official = run_kubeapi_official_client(100 if args.quick else 300)
    ratio = {lvl: (round(kube[lvl] / km[lvl], 1) if kube.get(lvl) and km.get(lvl) else None) for lvl in kube}
    data = {
        "metric": "sequential ConfigMap creates per second over one keep-alive connection, by objects already stored",
        "kubeapi": kube,
        "kmock": km,
        "kmock_skipped": kmock_skipped,
        "ratio_kubeapi_over_kmock": ratio,
        "kubeapi_with_kubernetes_client_at_1000": official,
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": __import__("os").cpu_count()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    plot(data, args.out.with_suffix(".png"))
    print(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
