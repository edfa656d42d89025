"""Helpers for tests that drive the API test server."""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def wait_for(fn: Callable[[], T], timeout: float = 20.0, interval: float = 0.05, what: str = "condition") -> T:
    """Poll `fn` until it returns something truthy; fail with `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")
        time.sleep(interval)


def container(command: list[str], name: str = "pytorch", **extra: Any) -> dict:
    return {"name": name, "image": "local", "command": command, **extra}


def pytorchjob(name: str, master: list[str] | None, worker: list[str] | None = None, workers: int = 0,
               restart_policy: str = "OnFailure", run_policy: dict | None = None, volumes: list | None = None,
               extra_container: dict | None = None, **spec: Any) -> dict:
    """A kubeflow.org/v1 PyTorchJob whose containers run `command` lists locally."""

    def rspec(cmd: list[str], replicas: int) -> dict:
        c = container(cmd, **(extra_container or {}))
        pod: dict = {"containers": [c]}
        if volumes:
            pod["volumes"] = volumes
        return {"replicas": replicas, "restartPolicy": restart_policy, "template": {"spec": pod}}

    specs = {}
    if master is not None:
        specs["Master"] = rspec(master, 1)
    if workers:
        specs["Worker"] = rspec(worker or master or ["true"], workers)
    body = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name, "namespace": "default"},
            "spec": {"pytorchReplicaSpecs": specs, "runPolicy": run_policy or {}, **spec}}
    return body


def condition(obj: dict | None, ctype: str) -> dict | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == ctype and c["status"] == "True":
            return c
    return None
