"""`KubeAPIServer`: run the test API server in a background thread (its own event loop)."""

from __future__ import annotations

import asyncio
import copy
import glob
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterable

import yaml
from aiohttp import web

from .app import KubeApp
from .errors import ApiError
from .faults import Faults
from .store import ResourceType, Store

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
PYTORCHJOB_CRD = HERE / "crds" / "kubeflow.org_pytorchjobs.yaml"
GEM_CRDS_DIR = REPO_ROOT / "manifests" / "crds"


def default_crd_paths() -> list[Path]:
    """The vendored PyTorchJob CRD plus whatever is in manifests/crds/*.yaml."""
    return [PYTORCHJOB_CRD] + sorted(Path(p) for p in glob.glob(str(GEM_CRDS_DIR / "*.yaml")))


_YAML_CACHE: dict[tuple[str, float], list[dict]] = {}
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml_docs(paths: Iterable[str | os.PathLike]) -> list[dict]:
    """Parse yaml files (cached by path and mtime: the PyTorchJob CRD is 600 KB)."""
    docs = []
    for p in paths:
        key = (str(p), os.path.getmtime(p))
        if key not in _YAML_CACHE:
            with open(p) as f:
                _YAML_CACHE[key] = [d for d in yaml.load_all(f, Loader=_Loader) if isinstance(d, dict)]
        docs += _YAML_CACHE[key]
    return docs


def write_kubeconfig(path: str | os.PathLike, url: str, namespace: str = "default") -> Path:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kubeapi", "cluster": {"server": url}}],
        "users": [{"name": "kubeapi", "user": {"token": "kubeapi-test-token"}}],
        "contexts": [{"name": "kubeapi", "context": {"cluster": "kubeapi", "user": "kubeapi", "namespace": namespace}}],
        "current-context": "kubeapi",
        "preferences": {},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class KubeAPIServer:
    """A Kubernetes API test server on 127.0.0.1, usable as a context manager.

    Args:
        crd_paths: CRD yaml files to install at start (default: the vendored PyTorchJob
            CRD plus `manifests/crds/*.yaml`); `[]` installs none.
        executor: run PyTorchJobs as local processes (fake training-operator + kubelet).
        workdir: where the kubeconfig, pod sandboxes, logs and PVC dirs go (default: a
            temporary directory removed at stop).
        port: 0 picks a free port.
        namespaces: namespaces created at start.
        history_size: watch events kept for resuming (older resourceVersions get 410).
        restart_backoff: the executor's first CrashLoopBackOff delay in seconds.
        bookmark_interval: seconds between BOOKMARK events on watches that allow them.
    """

    def __init__(
        self,
        crd_paths: Iterable[str | os.PathLike] | None = None,
        executor: bool = False,
        workdir: str | os.PathLike | None = None,
        port: int = 0,
        host: str = "127.0.0.1",
        namespaces: Iterable[str] = ("default",),
        history_size: int = 10000,
        restart_backoff: float = 0.5,
        bookmark_interval: float = 2.0,
    ) -> None:
        self.crd_paths = list(default_crd_paths() if crd_paths is None else crd_paths)
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="kubeapi-")
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = port
        self.namespaces = list(namespaces)
        self.store = Store(history_size=history_size)
        self.faults = Faults()
        self.app = KubeApp(self.store, self.faults, bookmark_interval=bookmark_interval)
        self.executor = None
        if executor:
            from .executor import PyTorchJobExecutor

            self.executor = PyTorchJobExecutor(self.store, self.workdir, restart_backoff=restart_backoff)
            self.app.log_provider = self.executor.log_provider
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.url = ""
        self.kubeconfig_path = self.workdir / "kubeconfig"

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "KubeAPIServer":
        for ns in self.namespaces:
            self.create("v1", "Namespace", {"metadata": {"name": ns}})
        for doc in load_yaml_docs(self.crd_paths):
            if doc.get("kind") == "CustomResourceDefinition":
                self.apply_crd(doc)
        self._thread = threading.Thread(target=self._serve, name="kubeapi", daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._error:
            raise self._error
        write_kubeconfig(self.kubeconfig_path, self.url)
        return self

    def _serve(self) -> None:
        loop = self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self._runner = web.AppRunner(self.app.app, handle_signals=False, access_log=None, shutdown_timeout=0.5)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            loop.run_until_complete(site.start())
            sock = site._server.sockets[0]  # type: ignore[union-attr]
            self.port = sock.getsockname()[1]
            self.url = f"http://{self.host}:{self.port}"
            if self.executor is not None:
                self.executor.start(loop)
        except BaseException as e:  # surface bind errors to start()
            self._error = e
            self._started.set()
            return
        self._started.set()
        loop.run_forever()
        # shutdown
        try:
            if self.executor is not None:
                self.executor.shutdown()
                if self.executor._task is not None:
                    loop.run_until_complete(asyncio.gather(self.executor._task, return_exceptions=True))
            self.store.drop_watches()
            loop.run_until_complete(self._runner.cleanup())
        finally:
            loop.close()

    def stop(self) -> None:
        if self.loop is not None and self._thread is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
        elif self.executor is not None:
            self.executor.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "KubeAPIServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ direct store access

    def resource(self, api_version: str, kind_or_plural: str) -> ResourceType:
        """The resource type for ("v1", "Pod") / ("kubeflow.org/v1", "pytorchjobs")."""
        group, _, version = api_version.rpartition("/")
        for t in self.store.types.values():
            if t.group == group and version in t.versions and kind_or_plural in (t.kind, t.plural):
                return t
        raise KeyError(f"no resource {kind_or_plural} in {api_version}")

    def get(self, api_version: str, kind: str, name: str, namespace: str = "default") -> dict | None:
        """A deep copy of the stored object, or None."""
        obj = self.store.try_get(self.resource(api_version, kind), namespace, name)
        return copy.deepcopy(obj) if obj is not None else None

    def list(self, api_version: str, kind: str, namespace: str | None = "default",
             label_selector: str | None = None, field_selector: str | None = None) -> list[dict]:
        """Deep copies of matching objects (namespace None: all namespaces)."""
        items, _ = self.store.list(self.resource(api_version, kind), namespace, label_selector, field_selector)
        return copy.deepcopy(items)

    def create(self, api_version: str, kind: str, body: dict, namespace: str = "default") -> dict:
        t = self.resource(api_version, kind)
        body = copy.deepcopy(body)
        body.setdefault("apiVersion", api_version)
        body.setdefault("kind", t.kind)
        return copy.deepcopy(self.store.create(t, namespace, body))

    def delete(self, api_version: str, kind: str, name: str, namespace: str = "default",
               propagation: str | None = None) -> dict:
        return copy.deepcopy(self.store.delete(self.resource(api_version, kind), namespace, name, propagation))

    def patch_status(self, api_version: str, kind: str, name: str, status: dict, namespace: str = "default") -> dict:
        t = self.resource(api_version, kind)

        def fn(o: dict) -> None:
            o["status"] = copy.deepcopy(status)

        return copy.deepcopy(self.store.mutate(t, namespace, name, fn, subresource="status" if t.status_subresource else None))

    def apply_crd(self, crd: dict) -> dict:
        """Install (or replace) a CRD; its kind is served at once."""
        t = self.resource("apiextensions.k8s.io/v1", "CustomResourceDefinition")
        crd = copy.deepcopy(crd)
        existing = self.store.try_get(t, "", crd["metadata"]["name"])
        if existing is None:
            return self.store.create(t, "", crd)
        crd["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
        return self.store.update(t, "", crd["metadata"]["name"], crd)

    def events(self, namespace: str = "default", involved_name: str | None = None) -> list[dict]:
        evs = self.list("v1", "Event", namespace)
        if involved_name is not None:
            evs = [e for e in evs if (e.get("involvedObject") or {}).get("name") == involved_name]
        return evs

    def api_client(self):
        """A `kubernetes.client.ApiClient` configured for this server."""
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig_path), client_configuration=cfg)
        return client.ApiClient(cfg)

    @property
    def requests_served(self) -> int:
        return self.app.request_count


__all__ = ["KubeAPIServer", "ApiError", "write_kubeconfig", "default_crd_paths", "PYTORCHJOB_CRD"]
