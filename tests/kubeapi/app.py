"""The aiohttp application: Kubernetes REST paths on top of `Store`.

One catch-all route parses `/api/v1/...` and `/apis/{group}/{version}/...` itself (faster
and simpler than hundreds of registered routes, and CRDs appear at run time).
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import re
import time
from typing import Any, Callable
from urllib.parse import unquote

from aiohttp import web

from . import patch as patches
from . import validation
from .errors import ApiError, invalid
from .faults import Faults
from .store import ResourceType, Store, _split_selector, object_key

LogProvider = Callable[[str, str, str | None, bool], Any]


def qbool(q: Any, key: str) -> bool:
    """Go's strconv.ParseBool, as the apiserver parses query booleans."""
    return q.get(key) in ("1", "t", "T", "true", "TRUE", "True")


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def jresponse(obj: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json", headers=headers)


#: Messages of etcd3's list paths (apiserver storage/etcd3/store.go, storage/errors).
INCONSISTENT_CONTINUE = (
    "The provided continue parameter is too old to display a consistent list result. You can start a new list "
    "without the continue parameter, or use the continue token in this response to retrieve the remainder of the "
    "results. Continuing with the provided token results in an inconsistent list - objects that were created, "
    "modified, or deleted between the time the first chunk was returned and now may show up in the list."
)


def encode_continue(start: str, rv: int) -> str:
    """storage.EncodeContinue: base64url (unpadded) JSON of the snapshot rv and the next key."""
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_continue(token: str) -> tuple[str, int]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        c = json.loads(raw)
        if not isinstance(c, dict):
            raise ValueError("not an object")
    except (ValueError, TypeError) as e:
        raise ApiError(400, f"invalid continue token: continue key is not valid: {e}", "BadRequest")
    if c.get("v") != "meta.k8s.io/v1":
        raise ApiError(400, "invalid continue token: continue key is not valid: server does not recognize this encoded key",
                       "BadRequest")
    if not c.get("rv"):
        raise ApiError(400, "invalid continue token: continue key is not valid: incorrect encoded start resourceVersion "
                            "(version meta.k8s.io/v1)", "BadRequest")
    if not c.get("start"):
        raise ApiError(400, "invalid continue token: continue key is not valid: encoded start key empty", "BadRequest")
    return str(c["start"]), int(c["rv"])


_FIELD_REQ = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*?)\s*$")


def field_selector_for(t: ResourceType, sel: str | None) -> str | None:
    """Check a fieldSelector's labels against what the kind supports (400 otherwise, like
    ConvertFieldLabel) and map the labels that do not name a path (`source`) to one."""
    if not sel:
        return sel
    labels, out = [], []
    for part in _split_selector(sel):
        m = _FIELD_REQ.match(part)
        if not m:
            raise ApiError(400, f"invalid selector: '{sel}'; can't understand '{part.strip()}'", "BadRequest")
        label, op, val = m.groups()
        labels.append(label)
        out.append(f"{validation.FIELD_PATHS.get((t.group, t.plural, label), label)}{op}{val}")
    validation.check_field_labels(t.group, t.plural, t.custom, t.namespaced, labels)
    return ",".join(out)


def check_options(kind: str, q: Any, patch_type: str | None = None, body: dict | None = None) -> None:
    errs = (validation.delete_options_errors(q, body or {}) if kind == "DeleteOptions"
            else validation.options_errors(kind, q, patch_type))
    if errs:
        raise invalid(kind, "meta.k8s.io", "", errs)


def error_response(e: ApiError) -> web.Response:
    headers = {"Retry-After": "1"} if e.code == 429 else None
    return jresponse(e.status(), e.code, headers)


class KubeApp:
    def __init__(self, store: Store, faults: Faults, bookmark_interval: float = 2.0,
                 git_version: str = "v1.31.0-kubeapi") -> None:
        self.store = store
        self.faults = faults
        self.bookmark_interval = bookmark_interval
        self.git_version = git_version
        self.log_provider: LogProvider | None = None
        self.open_watches: set = set()
        self.request_count = 0
        #: Seconds spent inside request handlers, watches and log streams excluded (they are open
        #: for as long as the client keeps them, not busy): what a benchmark subtracts as the
        #: server's share of its wall time (benchmarks/operator.py). Injected latency counts.
        self.handler_seconds = 0.0
        faults._drop_watches = self._drop_all_watches
        self.app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._time_handlers])
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    @web.middleware
    async def _time_handlers(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if qbool(request.query, "watch") or qbool(request.query, "follow"):
            return await handler(request)
        start = time.perf_counter()
        try:
            return await handler(request)
        finally:
            self.handler_seconds += time.perf_counter() - start

    def _drop_all_watches(self) -> int:
        return self.store.drop_watches()

    # ------------------------------------------------------------------ entry

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.request_count += 1
        path = request.path
        if path.startswith("/_kubeapi/"):
            return await self.admin(request)
        is_watch = qbool(request.query, "watch")
        rule = self.faults.match(request.method, request.path_qs, is_watch) if self.faults.rules else None
        if rule is not None:
            if rule.latency:
                await asyncio.sleep(rule.latency)
            if rule.hang:
                await asyncio.sleep(3600)
            if rule.status:
                return error_response(ApiError(rule.status, rule.message))
            if rule.truncate and not is_watch:
                return await self._truncated(request, await self.dispatch(request, is_watch))
        try:
            return await self.dispatch(request, is_watch)
        except ApiError as e:
            return error_response(e)
        except json.JSONDecodeError as e:
            return error_response(ApiError(400, f"the body of the request could not be decoded: {e}"))

    @staticmethod
    async def _truncated(request: web.Request, full: web.StreamResponse) -> web.StreamResponse:
        """`full`'s status and headers, then half its body, then the connection closes: what a client
        sees of a load balancer or an API server that goes away mid-answer."""
        body = full.body if isinstance(full, web.Response) and isinstance(full.body, bytes) else b""
        resp = web.StreamResponse(status=full.status, headers={"Content-Type": full.content_type})
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(body[: len(body) // 2])
        request.transport.close()
        return resp

    # ------------------------------------------------------------------ admin

    async def admin(self, request: web.Request) -> web.StreamResponse:
        p = request.path
        if p == "/_kubeapi/faults":
            if request.method == "GET":
                return jresponse([r.to_dict() for r in self.faults.rules])
            if request.method == "POST":
                body = await request.json()
                allowed = {"method", "path", "status", "probability", "times", "latency", "hang", "truncate", "message",
                           "watch"}
                rule = self.faults.add(**{k: v for k, v in body.items() if k in allowed})
                return jresponse(rule.to_dict(), 201)
            if request.method == "DELETE":
                self.faults.clear()
                return jresponse({"cleared": True})
        if p == "/_kubeapi/faults/drop-watches" and request.method == "POST":
            return jresponse({"dropped": self.faults.drop_watches()})
        if p == "/_kubeapi/faults/watch-drop-rate" and request.method in ("PUT", "POST"):
            body = await request.json()
            self.faults.watch_drop_rate = float(body.get("rate", 0.0))
            return jresponse({"rate": self.faults.watch_drop_rate})
        if p.startswith("/_kubeapi/faults/") and request.method == "DELETE":
            self.faults.remove(int(p.rsplit("/", 1)[1]))
            return jresponse({"removed": True})
        if p == "/_kubeapi/healthz":
            return web.Response(text="ok")
        return error_response(ApiError(404, "no such admin endpoint"))

    # ------------------------------------------------------------------ dispatch

    async def dispatch(self, request: web.Request, is_watch: bool) -> web.StreamResponse:
        parts = [unquote(p) for p in request.path.strip("/").split("/") if p]
        if not parts:
            return jresponse({"paths": ["/api", "/api/v1", "/apis", "/version"]})
        if parts == ["version"]:
            return jresponse({"major": "1", "minor": "31", "gitVersion": self.git_version, "platform": "linux/amd64",
                              "goVersion": "go1.22", "compiler": "gc", "buildDate": "2024-01-01T00:00:00Z",
                              "gitCommit": "kubeapi", "gitTreeState": "clean"})
        if parts in (["healthz"], ["readyz"], ["livez"]):
            return web.Response(text="ok")
        if parts[0] == "api":
            if len(parts) == 1:
                return jresponse({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": request.host}]})
            group, version, rest = "", parts[1], parts[2:]
        elif parts[0] == "apis":
            if len(parts) == 1:
                return jresponse(self.group_list())
            if len(parts) == 2:
                g = self.group_entry(parts[1])
                if g is None:
                    raise ApiError(404, "the server could not find the requested resource")
                return jresponse({"kind": "APIGroup", "apiVersion": "v1", **g})
            group, version, rest = parts[1], parts[2], parts[3:]
        elif parts[0] == "openapi":
            raise ApiError(404, "the server could not find the requested resource")
        else:
            raise ApiError(404, "the server could not find the requested resource")
        if not rest:
            return jresponse(self.resource_list(group, version))
        ns: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3 and not (len(rest) == 3 and rest[2] in ("status", "finalize")):
            ns, rest = rest[1], rest[2:]
        plural, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)
        if len(rest) > 3:
            raise ApiError(404, "the server could not find the requested resource")
        t = self.store.find_type(group, version, plural)
        if ns is not None and not t.namespaced:
            raise ApiError(404, "the server could not find the requested resource")
        if sub is not None and sub not in t.subresources:
            raise ApiError(404, "the server could not find the requested resource")
        m = request.method
        q = request.query
        dry_run = "dryRun" in q
        if name is None:
            if m == "GET":
                if is_watch:
                    return await self.watch(request, t, version, ns)
                return self.list_response(t, version, ns, q)
            if m == "POST":
                body = await self.read_body(request)
                if t.namespaced and ns is None:
                    raise ApiError(405, "POST on a namespaced collection needs a namespace")
                check_options("CreateOptions", q)
                obj = self.store.create(t, ns or "", body, version, dry_run=dry_run)
                return jresponse(self.out(obj, t, version), 201)
            if m == "DELETE":
                body = await self.read_body(request, optional=True) or {}
                check_options("DeleteOptions", q, body=body)
                items, _ = self.store.list(t, ns, q.get("labelSelector"), field_selector_for(t, q.get("fieldSelector")))
                gone = []
                for o in items:
                    try:
                        gone.append(self.store.delete(t, o["metadata"].get("namespace", ""), o["metadata"]["name"],
                                                      self.propagation(q, body), dry_run=dry_run))
                    except ApiError:
                        pass
                return jresponse(self.list_body(t, version, gone, str(self.store.rv)))
            raise ApiError(405, f"method {m} not allowed")
        if sub == "log":
            return await self.pod_log(request, ns or "", name)
        if m == "GET":
            if is_watch:
                raise ApiError(405, "watch on a single object: use fieldSelector=metadata.name=...")
            return jresponse(self.out(self.store.get(t, ns or "", name), t, version))
        if m == "PUT":
            body = await self.read_body(request)
            check_options("UpdateOptions", q)
            if (t.custom or t.key == ("apiextensions.k8s.io", "customresourcedefinitions")) and isinstance(body, dict) \
                    and not (body.get("metadata") or {}).get("resourceVersion"):
                # their strategies refuse unconditional updates (AllowUnconditionalUpdate() == false)
                raise invalid(t.plural, t.group, name, [("metadata.resourceVersion", "FieldValueInvalid",
                                                         "Invalid value: 0x0: must be specified for an update")])
            obj = self.store.update(t, ns or "", name, body, subresource=sub, version=version, dry_run=dry_run)
            return jresponse(self.out(obj, t, version))
        if m == "PATCH":
            return await self.patch(request, t, version, ns or "", name, sub, dry_run)
        if m == "DELETE":
            body = await self.read_body(request, optional=True) or {}
            check_options("DeleteOptions", q, body=body)
            obj = self.store.delete(t, ns or "", name, self.propagation(q, body), body.get("preconditions"), dry_run)
            return jresponse(self.out(obj, t, version))
        raise ApiError(405, f"method {m} not allowed")

    @staticmethod
    def propagation(q: Any, body: dict) -> str | None:
        p = q.get("propagationPolicy") or body.get("propagationPolicy")
        if p is None and body.get("orphanDependents") is True:
            p = "Orphan"
        return p

    @staticmethod
    async def read_body(request: web.Request, optional: bool = False) -> Any:
        raw = await request.read()
        if not raw:
            if optional:
                return None
            raise ApiError(400, "the body of the request was empty")
        ctype = request.content_type
        if "yaml" in ctype:
            import yaml

            return yaml.safe_load(raw)
        return json.loads(raw)

    def out(self, obj: dict, t: ResourceType, version: str) -> dict:
        av = t.api_version(version)
        if obj.get("apiVersion") == av:
            return obj
        o = dict(obj)
        o["apiVersion"] = av
        return o

    # ------------------------------------------------------------------ list / patch

    def list_body(self, t: ResourceType, version: str, items: list, rv: str, cont: str | None = None) -> dict:
        md: dict[str, Any] = {"resourceVersion": rv}
        if cont:
            md["continue"] = cont
        return {"kind": t.list_kind, "apiVersion": t.api_version(version), "metadata": md,
                "items": [self.out(o, t, version) for o in items]}

    def list_response(self, t: ResourceType, version: str, ns: str | None, q: Any) -> web.Response:
        """A list, paginated like etcd3: every page is served from the first page's snapshot
        (same resourceVersion), the continue token names the snapshot and the next key, and a
        token whose snapshot has been compacted is 410 Expired."""
        labels, fields = q.get("labelSelector"), field_selector_for(t, q.get("fieldSelector"))
        try:
            limit = int(q.get("limit") or 0)
        except ValueError:
            raise ApiError(400, f"invalid limit: {q.get('limit')!r}", "BadRequest")
        token = q.get("continue")
        if token:
            if q.get("resourceVersion") not in (None, "", "0"):
                raise ApiError(400, "specifying resource version is not allowed when using continue", "BadRequest")
            start, snap = decode_continue(token)
            if snap == -1:  # "continue at the latest", handed out with a 410 below
                items, rv = self.store.list(t, ns, labels, fields)
            else:
                try:
                    items = self.store.snapshot(t, ns, snap, labels, fields)
                except ApiError as e:
                    if e.code != 410:
                        raise
                    raise ApiError(410, INCONSISTENT_CONTINUE, "Expired",
                                   metadata={"continue": encode_continue(start, -1)}) from None
                rv = str(snap)
            items = [o for o in items if object_key(o) >= start]
        else:
            items, rv = self.store.list(t, ns, labels, fields)
        cont, remaining = None, None
        if limit > 0 and len(items) > limit:
            if not labels and not fields:
                remaining = len(items) - limit
            items = items[:limit]
            cont = encode_continue(object_key(items[-1]) + "\x00", int(rv))
        body = self.list_body(t, version, items, rv, cont)
        if remaining is not None:
            body["metadata"]["remainingItemCount"] = remaining
        return jresponse(body)

    async def patch(self, request: web.Request, t: ResourceType, version: str, ns: str, name: str,
                    sub: str | None, dry_run: bool) -> web.Response:
        ctype = request.content_type
        check_options("PatchOptions", request.query, ctype)
        body = await self.read_body(request)
        if ctype == "application/apply-patch+yaml":
            # server-side apply, approximated: create if missing, else merge
            if self.store.try_get(t, ns, name) is None:
                body.setdefault("metadata", {})["name"] = name
                return jresponse(self.out(self.store.create(t, ns, body, version, dry_run), t, version), 201)
            fn = patches.merge_patch
        elif ctype == "application/json-patch+json":
            fn = patches.json_patch
        elif ctype == "application/strategic-merge-patch+json":
            if t.custom:
                raise ApiError(415, "strategic merge patch is not supported for custom resources", "UnsupportedMediaType")
            fn = patches.strategic_merge_patch
        elif ctype in ("application/merge-patch+json", "application/json"):
            fn = patches.merge_patch
        else:
            raise ApiError(415, "the body of the request was in an unknown format - accepted media types include: "
                                "application/json-patch+json, application/merge-patch+json, "
                                "application/apply-patch+yaml", "UnsupportedMediaType")
        with self.store.lock:
            old = self.store.get(t, ns, name)
            new = fn(old, body)
            if not isinstance(new, dict):
                raise ApiError(422, "patch produced a non-object")
            import copy as _copy

            new = _copy.deepcopy(new)
            new_uid = (new.get("metadata") or {}).get("uid")
            if new_uid and new_uid != old["metadata"]["uid"]:
                raise invalid(t.kind, t.group, name, [validation.invalid("metadata.uid", new_uid, "field is immutable")])
            patched_rv = (new.get("metadata") or {}).get("resourceVersion")
            check = patched_rv is not None and patched_rv != old["metadata"]["resourceVersion"]
            if not check:
                new.setdefault("metadata", {})["resourceVersion"] = old["metadata"]["resourceVersion"]
            obj = self.store.update(t, ns, name, new, subresource=sub, version=version, dry_run=dry_run)
        return jresponse(self.out(obj, t, version))

    # ------------------------------------------------------------------ watch

    async def watch(self, request: web.Request, t: ResourceType, version: str, ns: str | None) -> web.StreamResponse:
        q = request.query
        loop = asyncio.get_running_loop()
        try:
            w = self.store.watch(loop, t, ns, q.get("resourceVersion"), q.get("labelSelector"),
                                 field_selector_for(t, q.get("fieldSelector")))
        except ApiError as e:
            if e.code != 410:
                raise
            # the real server answers 200 and a single ERROR event carrying the 410 Status
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(dumps({"type": "ERROR", "object": e.status()}) + b"\n")
            await resp.write_eof()
            return resp
        timeout = float(q.get("timeoutSeconds") or 0) or None
        bookmarks = qbool(q, "allowWatchBookmarks")
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        deadline = time.monotonic() + timeout if timeout else None

        def render(it: tuple) -> bytes:
            if it[0] == "BOOKMARK":
                return dumps({"type": "BOOKMARK", "object": {"kind": t.kind, "apiVersion": t.api_version(version),
                                                            "metadata": {"resourceVersion": it[1]}}})
            return dumps({"type": it[0], "object": self.out(it[1], t, version)})

        try:
            await resp.prepare(request)
            last_bookmark = time.monotonic()
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                wait = 1.0
                if deadline is not None:
                    wait = min(wait, deadline - now)
                try:  # asyncio.timeout: 3.11's wait_for can swallow the cancel of a server shutdown
                    async with asyncio.timeout(wait):
                        item = await w.queue.get()
                except TimeoutError:
                    item = ...
                if item is None:
                    break  # dropped
                if item is not ...:
                    chunk = [render(item)]
                    while not w.queue.empty():
                        nxt = w.queue.get_nowait()
                        if nxt is None:
                            w.closed = True
                            break
                        chunk.append(render(nxt))
                    await resp.write(b"\n".join(chunk) + b"\n")
                    if w.closed:
                        break
                if self.faults.watch_drop_rate and item is ... and random.random() < self.faults.watch_drop_rate:
                    break
                if bookmarks and time.monotonic() - last_bookmark >= self.bookmark_interval:
                    last_bookmark = time.monotonic()
                    # a bookmark promises every event up to its resourceVersion was sent: it is
                    # queued behind the events already queued or scheduled for this watch
                    self.store.bookmark(w)
        except (ConnectionResetError, asyncio.CancelledError):
            self.store.unwatch(w)
            raise
        finally:
            self.store.unwatch(w)
        try:
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return resp

    # ------------------------------------------------------------------ logs

    async def pod_log(self, request: web.Request, ns: str, name: str) -> web.StreamResponse:
        pods = self.store.types[("", "pods")]
        pod = self.store.get(pods, ns, name)
        q = request.query
        container = q.get("container")
        containers = [c["name"] for c in (pod.get("spec") or {}).get("containers") or []]
        if container and container not in containers:
            raise ApiError(400, f"container {container} is not valid for pod {name}")
        if not container and len(containers) > 1:
            raise ApiError(400, f"a container name must be specified for pod {name}, choose one of: {containers}")
        container = container or (containers[0] if containers else "")
        previous = qbool(q, "previous")
        info = self.log_provider(ns, name, container, previous) if self.log_provider else None
        if info is None and previous:
            raise ApiError(400, f'previous terminated container "{container}" in pod "{name}" not found', "BadRequest")
        if info is None:
            raise ApiError(400, f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating', "BadRequest")
        log_path, is_running = info
        tail = q.get("tailLines")
        follow = qbool(q, "follow")
        data = _read(log_path)
        if tail is not None:
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-int(tail):]) if int(tail) > 0 else b""
        if not follow:
            return web.Response(body=data, content_type="text/plain")
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        await resp.write(data)
        offset = len(_read(log_path)) if tail is not None else len(data)
        while True:
            running = is_running()
            cur = _read(log_path)
            if len(cur) > offset:
                await resp.write(cur[offset:])
                offset = len(cur)
            if not running:
                break
            await asyncio.sleep(0.1)
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------------ discovery

    def _groups(self) -> dict[str, list[ResourceType]]:
        out: dict[str, list[ResourceType]] = {}
        for t in list(self.store.types.values()):
            out.setdefault(t.group, []).append(t)
        return out

    def group_entry(self, group: str) -> dict | None:
        ts = self._groups().get(group)
        if not ts or group == "":
            return None
        versions: list[str] = []
        for t in ts:
            for v in t.versions:
                if v not in versions:
                    versions.append(v)
        pref = ts[0].storage_version if ts[0].storage_version in versions else versions[0]
        return {"name": group, "versions": [{"groupVersion": f"{group}/{v}", "version": v} for v in versions],
                "preferredVersion": {"groupVersion": f"{group}/{pref}", "version": pref}}

    def group_list(self) -> dict:
        groups = [self.group_entry(g) for g in sorted(self._groups()) if g]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [g for g in groups if g]}

    def resource_list(self, group: str, version: str) -> dict:
        gv = f"{group}/{version}" if group else version
        res = []
        found = False
        for t in list(self.store.types.values()):
            if t.group != group or version not in t.versions:
                continue
            found = True
            entry = {"name": t.plural, "singularName": t.singular, "namespaced": t.namespaced, "kind": t.kind,
                     "verbs": t.verbs}
            if t.short_names:
                entry["shortNames"] = t.short_names
            if t.categories:
                entry["categories"] = t.categories
            res.append(entry)
            for sub, verbs in t.subresources.items():
                res.append({"name": f"{t.plural}/{sub}", "singularName": "", "namespaced": t.namespaced,
                            "kind": t.kind, "verbs": verbs})
        if not found:
            raise ApiError(404, "the server could not find the requested resource")
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": res}


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""
