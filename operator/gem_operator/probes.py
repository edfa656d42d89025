"""The readiness probe: is this operator able to do its work right now?

kopf's liveness endpoint (`--liveness`) answers as long as the operator's event loop runs; it
must not fail because the API server is away (a restart would not help). Readiness is a
different question, answered here at `--readiness URL` (e.g. http://0.0.0.0:8081/readyz):

* the operator finished starting up (its handlers are registered and configured), and
* the API server answers a one-item list of every kind the operator watches (GEMTraining,
  LoopFMDistill, PyTorchJob) within GEM_READINESS_TIMEOUT_SECONDS: the API is reachable, the
  CRDs (ours and the training operator's) are installed, and RBAC lets it list them.

The answer is cached for a few seconds so probes do not load the API server. 200 with
`{"ready": true, ...}` or 503 with the failing check.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from typing import Any

from aiohttp import web

from gem.api.types import GROUP, KINDS, VERSION
from gem_operator.settings import CONFIG

#: Seconds a readiness answer is reused.
CACHE_SECONDS = 5.0

_state: dict[str, Any] = {"started": False, "runner": None, "checked": 0.0, "answer": None}


def _list_one(group: str, version: str, plural: str) -> None:
    from gem_operator import kube

    api, timeout = kube.custom(), (CONFIG.readiness_timeout_seconds,) * 2
    if CONFIG.namespaces:  # a namespaced operator may only be allowed to list its namespaces
        for ns in CONFIG.namespaces:
            api.list_namespaced_custom_object(group, version, ns, plural, limit=1, _request_timeout=timeout)
    else:
        api.list_cluster_custom_object(group, version, plural, limit=1, _request_timeout=timeout)


def check_api() -> dict[str, str]:
    """{kind: "ok" or the error} for every kind the operator watches (blocking; run in a thread)."""
    kinds = [(GROUP, VERSION, k["plural"]) for k in KINDS.values()] + [("kubeflow.org", "v1", "pytorchjobs")]
    out = {}
    for group, version, plural in kinds:
        try:
            _list_one(group, version, plural)
            out[plural] = "ok"
        except Exception as e:  # any failure makes the operator not ready, with the reason
            out[plural] = f"{getattr(e, 'status', '') or type(e).__name__} {getattr(e, 'reason', '') or e}"[:200]
    return out


async def readiness() -> tuple[bool, dict[str, Any]]:
    if not _state["started"]:
        return False, {"ready": False, "reason": "starting"}
    now = time.monotonic()
    if _state["answer"] is None or now - _state["checked"] >= CACHE_SECONDS:
        api = await asyncio.get_running_loop().run_in_executor(None, check_api)
        ready = all(v == "ok" for v in api.values())
        _state["answer"] = (ready, {"ready": ready, "api": api})
        _state["checked"] = time.monotonic()
    return _state["answer"]


async def _handle(_: web.Request) -> web.Response:
    ready, body = await readiness()
    return web.json_response(body, status=200 if ready else 503)


async def start() -> None:
    """Serve readiness at CONFIG.readiness_url (if set); called at the end of the startup handler."""
    if CONFIG.readiness_url and _state["runner"] is None:
        parts = urllib.parse.urlsplit(CONFIG.readiness_url)
        app = web.Application()
        app.router.add_get(parts.path or "/readyz", _handle)
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, parts.hostname or "0.0.0.0", parts.port or 8081).start()
        _state["runner"] = runner
    _state["started"] = True


async def stop() -> None:
    _state["started"] = False
    runner, _state["runner"] = _state["runner"], None
    if runner is not None:
        await runner.cleanup()
