"""The in-memory object store of the test API server.

Why not kmock's storage: kmock 0.8 (by kopf's author) emulates Kubernetes well enough for
kopf's own tests, but its object history is scanned linearly; we measured 95 creates/s with
100 objects falling to 12/s with 700 (see `benchmarks/kubeapi.py`). A test server must never
hide the operator's own cost, so this store indexes objects per (resource, namespace) and
by uid and owner uid, and keeps a bounded global event log for watches.

Objects are plain dicts that are never mutated once stored (copy-on-write): readers may
serialise them without copying; every write stores a new dict. One re-entrant lock guards
the store, so tests may read it from their own thread while the server's loop writes.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime as dt
import random
import re
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from . import schema as schemas
from . import validation
from .errors import ApiError, already_exists, conflict, invalid, not_found, precondition_failed


#: utilrand.String's alphabet (no vowels, no 0/1/3: generated names spell no words).
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------- resource types


@dataclass
class ResourceType:
    group: str
    versions: list[str]
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    subresources: dict[str, list[str]] = field(default_factory=dict)  # name -> verbs
    schemas: dict[str, dict] = field(default_factory=dict)  # version -> openAPIV3Schema
    storage_version: str = ""
    custom: bool = False
    verbs: list[str] = field(
        default_factory=lambda: ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
    )

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def list_kind(self) -> str:
        return self.kind + "List"

    @property
    def status_subresource(self) -> bool:
        return "status" in self.subresources

    def api_version(self, version: str | None = None) -> str:
        v = version or self.storage_version or self.versions[0]
        return f"{self.group}/{v}" if self.group else v


def _builtin_types() -> list[ResourceType]:
    rw = ["get", "patch", "update"]
    return [
        ResourceType("", ["v1"], "namespaces", "Namespace", False, "namespace", ["ns"], subresources={"status": rw, "finalize": ["update"]}),
        ResourceType("", ["v1"], "pods", "Pod", True, "pod", ["po"], ["all"], subresources={"status": rw, "log": ["get"]}),
        # Nodes exist only when a test creates them (labels drive topology-aware placement tests).
        ResourceType("", ["v1"], "nodes", "Node", False, "node", ["no"], subresources={"status": rw}),
        ResourceType("", ["v1"], "configmaps", "ConfigMap", True, "configmap", ["cm"]),
        ResourceType("", ["v1"], "secrets", "Secret", True, "secret"),
        ResourceType("", ["v1"], "services", "Service", True, "service", ["svc"], ["all"], subresources={"status": rw}),
        ResourceType("", ["v1"], "serviceaccounts", "ServiceAccount", True, "serviceaccount", ["sa"]),
        ResourceType("", ["v1"], "events", "Event", True, "event", ["ev"]),
        ResourceType("", ["v1"], "persistentvolumeclaims", "PersistentVolumeClaim", True, "persistentvolumeclaim", ["pvc"], subresources={"status": rw}),
        ResourceType("events.k8s.io", ["v1"], "events", "Event", True, "event", ["ev"]),
        ResourceType("coordination.k8s.io", ["v1"], "leases", "Lease", True, "lease"),
        ResourceType(
            "apiextensions.k8s.io", ["v1"], "customresourcedefinitions", "CustomResourceDefinition", False,
            "customresourcedefinition", ["crd", "crds"], ["api-extensions"], subresources={"status": rw},
        ),
    ]


# --------------------------------------------------------------------------- selectors

_SPECIAL = frozenset("=!(),><")
_WHITESPACE = frozenset(" \t\r\n")
#: The lexer's tokens of k8s.io/apimachinery/pkg/labels/selector.go (string2token).
_TOKENS = {")": ")", ",": ",", "!": "!", "==": "==", "=": "=", ">": ">", "in": "in", "<": "<", "!=": "!=",
           "notin": "notin", "(": "("}
_IDENT, _EOS, _ERROR = "identifier", "end", "error"


def _lex_selector(sel: str) -> list[tuple[str, str]]:
    """(token, literal) pairs ending with _EOS, as labels.Lexer scans them (an identifier is
    whatever runs up to a blank or one of `=!(),><`)."""
    out, i, n = [], 0, len(sel)
    while True:
        while i < n and sel[i] in _WHITESPACE:
            i += 1
        if i >= n:
            out.append((_EOS, ""))
            return out
        if sel[i] in _SPECIAL:
            # The longest run of special characters that is a token ("!=", "=="), one at least.
            j, last = i, None
            while j < n and sel[j] in _SPECIAL:
                if sel[i:j + 1] in _TOKENS:
                    last = j + 1
                elif last is not None:
                    break
                j += 1
            if last is None:
                out.append((_ERROR, f"error expected: keyword found '{sel[i:j]}'"))
                i = j
            else:
                out.append((_TOKENS[sel[i:last]], sel[i:last]))
                i = last
            continue
        j = i
        while j < n and sel[j] not in _SPECIAL and sel[j] not in _WHITESPACE:
            j += 1
        word = sel[i:j]
        out.append((_TOKENS.get(word, _IDENT), word))
        i = j


class _SelectorParser:
    """labels.Parse (k8s.io/apimachinery/pkg/labels/selector.go): the grammar, the error texts
    and NewRequirement's checks, so that the server refuses what kube-apiserver refuses."""

    def __init__(self, sel: str) -> None:
        self.items = _lex_selector(sel)
        self.pos = 0

    def lookahead(self, values: bool = True) -> tuple[str, str]:
        tok, lit = self.items[self.pos]
        # In the values context `in` and `notin` are identifiers (`a in (in)`).
        return (_IDENT if values and tok in ("in", "notin") else tok), lit

    def consume(self, values: bool = True) -> tuple[str, str]:
        item = self.lookahead(values)
        self.pos += 1
        return item

    def parse(self) -> list[tuple[str, str, list[str]]]:
        reqs = []
        while True:
            tok, lit = self.lookahead()
            if tok == _EOS:
                return reqs
            if tok not in (_IDENT, "!"):
                raise _bad(f"found '{lit}', expected: !, identifier, or 'end of string'")
            try:
                reqs.append(self.requirement())
            except _SelectorError as e:
                raise _bad(f"unable to parse requirement: {e}") from None
            tok, lit = self.consume()
            if tok == _EOS:
                return reqs
            if tok != ",":
                raise _bad(f"found '{lit}', expected: ',' or 'end of string'")
            tok2, lit2 = self.lookahead()
            if tok2 not in (_IDENT, "!"):
                raise _bad(f"found '{lit2}', expected: identifier after ','")

    def requirement(self) -> tuple[str, str, list[str]]:
        op = None
        tok, key = self.consume()
        if tok == "!":
            op = "!"
            tok, key = self.consume()
        if tok != _IDENT:
            raise _SelectorError(f"found '{key}', expected: identifier")
        key_errs = validation.is_qualified_name(key)
        if key_errs:  # field.Invalid with the parser's nil path
            raise _SelectorError(f"<nil>: Invalid value: {validation.go_value(key)}: {'; '.join(key_errs)}")
        if op is None and self.lookahead()[0] in (_EOS, ","):
            op = "exists"
        if op is not None:
            return _requirement(key, op, [])
        tok, lit = self.consume(values=False)
        if tok not in ("in", "notin", "=", "==", "!=", ">", "<"):
            raise _SelectorError(f"found '{lit}', expected: '=', '!=', '==', 'in', notin'")
        vals = self.values() if tok in ("in", "notin") else self.exact_value()
        return _requirement(key, tok, sorted(set(vals)))

    def values(self) -> list[str]:
        tok, lit = self.consume()
        if tok != "(":
            raise _SelectorError(f"found '{lit}' expected: '('")
        tok, lit = self.lookahead()
        if tok == ")":  # "()": the empty value
            self.consume()
            return [""]
        if tok not in (_IDENT, ","):
            raise _SelectorError(f"found '{lit}', expected: ',', ')' or identifier")
        vals = self.identifiers()
        if self.consume()[0] != ")":
            raise _SelectorError(f"found '{lit}', expected: ')'")
        return vals

    def identifiers(self) -> list[str]:
        vals: list[str] = []
        while True:
            tok, lit = self.consume()
            if tok == _IDENT:
                vals.append(lit)
                tok2, lit2 = self.lookahead()
                if tok2 == ")":
                    return vals
                if tok2 != ",":
                    raise _SelectorError(f"found '{lit2}', expected: ',' or ')'")
            elif tok == ",":  # "(,", ",,", ",)": empty values
                if not vals:
                    vals.append("")
                tok2 = self.lookahead()[0]
                if tok2 == ")":
                    vals.append("")
                    return vals
                if tok2 == ",":
                    self.consume()
                    vals.append("")
            else:
                raise _SelectorError(f"found '{lit}', expected: ',', or identifier")

    def exact_value(self) -> list[str]:
        if self.lookahead()[0] in (_EOS, ","):
            return [""]
        tok, lit = self.consume()
        if tok == _IDENT:
            return [lit]
        raise _SelectorError(f"found '{lit}', expected: identifier")


class _SelectorError(Exception):
    pass


def _bad(message: str) -> ApiError:
    return ApiError(400, message, "BadRequest")


def _requirement(key: str, op: str, vals: list[str]) -> tuple[str, str, list[str]]:
    """labels.NewRequirement's checks (the aggregate of every problem, as Go prints it)."""
    errs = []
    if op in ("in", "notin") and not vals:
        errs.append("values: Invalid value: []string{}: for 'in', 'notin' operators, values set can't be empty")
    if op in (">", "<"):
        for i, v in enumerate(vals):
            if _go_int(v) is None:
                errs.append(f"values[{i}]: Invalid value: {validation.go_value(v)}: "
                            "for 'Gt', 'Lt' operators, the value must be an integer")
    for i, v in enumerate(vals):
        v_errs = validation.is_valid_label_value(v)
        if v_errs:
            errs.append(f"values[{i}][{key}]: Invalid value: {validation.go_value(v)}: {'; '.join(v_errs)}")
    if errs:
        raise _SelectorError(errs[0] if len(errs) == 1 else "[" + ", ".join(errs) + "]")
    return key, op, vals


def _go_int(s: str | None) -> int | None:
    """strconv.ParseInt(s, 10, 64), None where it fails (Python's int() takes more: "1_0", " 1")."""
    if s is None or not re.fullmatch(r"[+-]?[0-9]+", s) or not -2**63 <= int(s) < 2**63:
        return None
    return int(s)


def _split_selector(sel: str) -> list[str]:
    """A fieldSelector's requirements, split at the commas outside parentheses."""
    parts, depth, cur = [], 0, []
    for ch in sel:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur))
    return [p for p in parts if p.strip()]


def _matches(labels: dict, key: str, op: str, vals: list[str]) -> bool:
    """Requirement.Matches."""
    if op in ("=", "==", "in"):
        return key in labels and labels[key] in vals
    if op in ("!=", "notin"):
        return key not in labels or labels[key] not in vals
    if op == "exists":
        return key in labels
    if op == "!":
        return key not in labels
    # > and <: both sides integers, else no match
    have = _go_int(labels.get(key))
    return have is not None and (have > int(vals[0]) if op == ">" else have < int(vals[0]))


def parse_label_selector(sel: str | None) -> Callable[[dict], bool] | None:
    """A labelSelector (`a=b,c!=d,e in (x,y),f notin (z),g,!h,n>1`) as a predicate over a labels
    dict; what labels.Parse refuses is a 400 BadRequest with its message."""
    if not sel:
        return None
    reqs = _SelectorParser(sel).parse()
    return lambda labels: all(_matches(labels, *r) for r in reqs)


def object_key(obj: dict) -> str:
    """Where etcd keeps an object, relative to its resource: lists are in this order."""
    md = obj["metadata"]
    return f"{md.get('namespace') or ''}/{md['name']}"


def _lookup(obj: dict, dotted: str) -> Any:
    cur: Any = obj
    for p in dotted.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(p)
    return cur


def parse_field_selector(sel: str | None) -> Callable[[dict], bool] | None:
    if not sel:
        return None
    reqs = []
    for part in _split_selector(sel):
        m = re.match(r"^\s*([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*?)\s*$", part)
        if not m:
            raise ApiError(400, f"invalid field selector: {part!r}")
        path, op, val = m.groups()

        def req(o: dict, path=path, op=op, val=val) -> bool:
            got = _lookup(o, path)
            got_s = "" if got is None else (str(got).lower() if isinstance(got, bool) else str(got))
            return (got_s == val) if op != "!=" else (got_s != val)

        reqs.append(req)
    return lambda o: all(r(o) for r in reqs)


# --------------------------------------------------------------------------- watchers


class Watcher:
    """One open watch: a queue of (type, object) filled from the store's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, str], namespace: str | None,
                 labels: Callable | None, fields: Callable | None) -> None:
        self.loop = loop
        self.key = key
        self.namespace = namespace
        self.labels = labels
        self.fields = fields
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False
        #: puts scheduled on the loop and not run yet; while there are any, a put from the loop's
        #: own thread queues behind them, so events reach the client in resourceVersion order
        self._pending = 0
        self._pending_lock = threading.Lock()

    def matches(self, obj: dict | None) -> bool:
        if obj is None:
            return False
        md = obj.get("metadata", {})
        if self.namespace is not None and md.get("namespace") != self.namespace:
            return False
        if self.labels is not None and not self.labels(md.get("labels") or {}):
            return False
        if self.fields is not None and not self.fields(obj):
            return False
        return True

    def push(self, item: Any) -> None:
        """Queue an item, in the order of the calls (the store calls it under its lock, in
        resourceVersion order), whichever thread calls."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        with self._pending_lock:
            if running is self.loop and not self._pending:
                self.queue.put_nowait(item)
                return
            if self.loop.is_closed():
                return
            self._pending += 1
        if running is self.loop:
            self.loop.call_soon(self._put, item)
        else:
            self.loop.call_soon_threadsafe(self._put, item)

    def _put(self, item: Any) -> None:
        with self._pending_lock:
            self._pending -= 1
        self.queue.put_nowait(item)

    def close(self) -> None:
        """Drop the stream (fault injection / shutdown)."""
        self.closed = True
        self.push(None)


# --------------------------------------------------------------------------- store


Key = tuple[str, str]


class Store:
    def __init__(self, history_size: int = 10000) -> None:
        self.lock = threading.RLock()
        self.rv = 0
        self.types: dict[Key, ResourceType] = {}
        self.objects: dict[Key, dict[str, dict[str, dict]]] = {}
        self.by_uid: dict[str, tuple[Key, str, str]] = {}
        self.dependents: dict[str, set[str]] = collections.defaultdict(set)  # owner uid -> dependent uids
        self.history: collections.deque = collections.deque(maxlen=history_size)
        self.compacted_rv = 0
        self.watchers: dict[Key, set[Watcher]] = collections.defaultdict(set)
        self.listeners: list[Callable[[str, ResourceType, dict, dict | None], None]] = []
        for t in _builtin_types():
            self.register(t)

    # ------------------------------------------------------------------ registry

    def register(self, t: ResourceType) -> None:
        with self.lock:
            if not t.storage_version:
                t.storage_version = t.versions[0]
            self.types[t.key] = t
            self.objects.setdefault(t.key, {})

    def unregister(self, key: Key) -> None:
        with self.lock:
            for ns, objs in list(self.objects.get(key, {}).items()):
                for name in list(objs):
                    self._remove(self.types[key], ns, name)
            self.types.pop(key, None)
            self.objects.pop(key, None)
            for w in list(self.watchers.pop(key, ())):
                w.close()

    def find_type(self, group: str, version: str, plural: str) -> ResourceType:
        t = self.types.get((group, plural))
        if t is None or version not in t.versions:
            raise ApiError(404, "the server could not find the requested resource", "NotFound",
                           {"group": group, "kind": plural})
        return t

    # ------------------------------------------------------------------ basics

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _emit(self, etype: str, t: ResourceType, obj: dict, old: dict | None = None) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        if len(self.history) == self.history.maxlen:
            self.compacted_rv = self.history[0][0]
        self.history.append((rv, t.key, etype, obj, old))
        for w in self.watchers.get(t.key, ()):
            self._deliver(w, etype, obj, old)
        for fn in self.listeners:
            try:
                fn(etype, t, obj, old)
            except Exception:  # a listener must never break a write
                import traceback

                traceback.print_exc()

    @staticmethod
    def _deliver(w: Watcher, etype: str, obj: dict, old: dict | None) -> None:
        if w.closed:
            return
        if etype == "MODIFIED" and old is not None and (w.labels is not None or w.fields is not None):
            now_m, was_m = w.matches(obj), w.matches(old)
            if now_m and not was_m:
                w.push(("ADDED", obj))
            elif was_m and not now_m:
                w.push(("DELETED", obj))
            elif now_m:
                w.push((etype, obj))
        elif w.matches(obj):
            w.push((etype, obj))

    def _bucket(self, t: ResourceType, ns: str) -> dict[str, dict]:
        return self.objects[t.key].setdefault(ns, {})

    def get(self, t: ResourceType, ns: str, name: str) -> dict:
        with self.lock:
            obj = self.objects.get(t.key, {}).get(ns if t.namespaced else "", {}).get(name)
            if obj is None:
                raise not_found(t.plural, name, t.group)
            return obj

    def try_get(self, t: ResourceType, ns: str, name: str) -> dict | None:
        try:
            return self.get(t, ns, name)
        except ApiError:
            return None

    def list(self, t: ResourceType, ns: str | None = None, label_selector: str | None = None,
             field_selector: str | None = None) -> tuple[list[dict], str]:
        lab = parse_label_selector(label_selector)
        fld = parse_field_selector(field_selector)
        with self.lock:
            buckets = self.objects.get(t.key, {})
            if ns is not None and t.namespaced:
                sources: Iterable = [buckets.get(ns, {})]
            else:
                # etcd order: by "<namespace>/<name>" (so "a-b" sorts before "a")
                sources = [buckets[k] for k in sorted(buckets, key=lambda n: n + "/")]
            out = []
            for b in sources:
                for name in sorted(b):
                    o = b[name]
                    if lab is not None and not lab(o["metadata"].get("labels") or {}):
                        continue
                    if fld is not None and not fld(o):
                        continue
                    out.append(o)
            return out, str(self.rv)

    def snapshot(self, t: ResourceType, ns: str | None, rv: int, label_selector: str | None = None,
                 field_selector: str | None = None) -> list[dict]:
        """The objects as they were at resourceVersion `rv`, in list order: the current ones with
        every later event undone (what etcd serves for a paginated list's later pages). 410 Expired
        once `rv` is older than the kept history."""
        lab = parse_label_selector(label_selector)
        fld = parse_field_selector(field_selector)
        with self.lock:
            if rv < self.compacted_rv:
                raise ApiError(410, f"too old resource version: {rv} ({self.compacted_rv + 1})", "Expired")
            items, _ = self.list(t, ns)
            state: dict[str, dict | None] = {object_key(o): o for o in items}
            for erv, key, etype, obj, old in reversed(self.history):
                if erv <= rv:
                    break
                if key != t.key:
                    continue
                if ns is not None and t.namespaced and obj["metadata"].get("namespace") != ns:
                    continue
                state[object_key(obj)] = None if etype == "ADDED" else old
        out = []
        for k in sorted(state):
            o = state[k]
            if o is None:
                continue
            if lab is not None and not lab(o["metadata"].get("labels") or {}):
                continue
            if fld is not None and not fld(o):
                continue
            out.append(o)
        return out

    # ------------------------------------------------------------------ watch

    def watch(self, loop: asyncio.AbstractEventLoop, t: ResourceType, ns: str | None, rv: str | None,
              label_selector: str | None, field_selector: str | None) -> Watcher:
        w = Watcher(loop, t.key, ns if t.namespaced else None, parse_label_selector(label_selector),
                    parse_field_selector(field_selector))
        with self.lock:
            if not rv or rv == "0":
                for o in self.list(t, ns, label_selector, field_selector)[0]:
                    w.queue.put_nowait(("ADDED", o))
            else:
                try:
                    start = int(rv)
                except ValueError:
                    raise ApiError(400, f"invalid resourceVersion {rv!r}")
                if start < self.compacted_rv:
                    raise ApiError(410, f"too old resource version: {start} ({self.compacted_rv + 1})", "Expired")
                for erv, key, etype, obj, old in self.history:
                    if erv > start and key == t.key:
                        self._deliver_replay(w, etype, obj, old)
            self.watchers[t.key].add(w)
        return w

    def _deliver_replay(self, w: Watcher, etype: str, obj: dict, old: dict | None) -> None:
        saved = w.push
        w.push = w.queue.put_nowait  # type: ignore[method-assign]
        try:
            self._deliver(w, etype, obj, old)
        finally:
            w.push = saved  # type: ignore[method-assign]

    def bookmark(self, w: Watcher) -> None:
        """Queue a BOOKMARK at the current resourceVersion behind every event already queued or
        scheduled for `w`: its resourceVersion never runs ahead of what the client was sent."""
        with self.lock:
            w.push(("BOOKMARK", str(self.rv)))

    def unwatch(self, w: Watcher) -> None:
        with self.lock:
            self.watchers.get(w.key, set()).discard(w)

    def drop_watches(self) -> int:
        with self.lock:
            ws = [w for s in self.watchers.values() for w in s]
            for s in self.watchers.values():
                s.clear()
        for w in ws:
            w.close()
        return len(ws)

    # ------------------------------------------------------------------ writes

    def _prepare_custom(self, t: ResourceType, obj: dict, version: str) -> None:
        """Prune, default and validate a custom object against its version's schema."""
        sch = t.schemas.get(version)
        if sch is None:
            return
        schemas.prune(obj, sch, root=True)
        schemas.apply_defaults(obj, sch)
        errs = schemas.validate(obj, sch, root=True)
        if errs:
            raise invalid(t.kind, t.group, obj["metadata"].get("name", ""), errs)

    def _check_names(self, t: ResourceType, obj: dict) -> None:
        """Name (by the kind's rule), labels, annotations, ownerReferences, finalizers; Events' own rules."""
        md = obj["metadata"]
        name = md.get("name", "")
        errs = validation.name_errors(t.group, t.plural, name, md.get("generateName"))
        errs += validation.object_meta_errors(md)
        errs += self._kind_errors(t, obj)
        if errs:
            raise invalid(t.kind, t.group, name, errs)

    @staticmethod
    def _kind_errors(t: ResourceType, obj: dict) -> list[tuple[str, str, str]]:
        if t.plural == "events" and t.group in ("", "events.k8s.io"):
            return validation.event_errors(t.group, obj)
        return []

    def _admit(self, t: ResourceType, obj: dict, old: dict | None) -> None:
        """Validating admission webhooks of the kinds the executor stands in for."""
        if t.key == ("kubeflow.org", "pytorchjobs"):
            msgs = validation.pytorchjob_webhook_errors(obj)
            if msgs:
                text = msgs[0] if len(msgs) == 1 else "[" + ", ".join(msgs) + "]"
                raise ApiError(403, f'admission webhook "{validation.PYTORCHJOB_WEBHOOK}" denied the request: {text}',
                               "Forbidden")

    def _namespace_terminating(self, t: ResourceType, ns: str, name: str) -> None:
        """NamespaceLifecycle admission: nothing new in a namespace that is being deleted."""
        nso = self.objects[("", "namespaces")].get("", {}).get(ns)
        if nso is not None and nso["metadata"].get("deletionTimestamp"):
            msg = f"unable to create new content in namespace {ns} because it is being terminated"
            qual = f"{t.plural}.{t.group}" if t.group else t.plural
            raise ApiError(403, f'{qual} "{name}" is forbidden: {msg}', "Forbidden", {
                "name": name, "group": t.group, "kind": t.plural,
                "causes": [{"reason": "NamespaceTerminating", "message": f"namespace {ns} is being terminated",
                            "field": "metadata.namespace"}]})

    def create(self, t: ResourceType, ns: str, body: dict, version: str | None = None, dry_run: bool = False) -> dict:
        if not isinstance(body, dict):
            raise ApiError(400, "the body of the request was in an unknown format")
        version = version or t.storage_version
        obj = body  # callers hand over a fresh dict (parsed from JSON or deep-copied)
        av = t.api_version(version)
        if obj.get("kind") not in (None, t.kind) or obj.get("apiVersion") not in (None, av):
            raise ApiError(400, f"the API version in the data ({obj.get('apiVersion')}) does not match the expected API version ({av})")
        obj["apiVersion"], obj["kind"] = av, t.kind
        md = obj.get("metadata")
        if not isinstance(md, dict):
            md = obj["metadata"] = {}
        with self.lock:
            if t.namespaced:
                if md.get("namespace") and md["namespace"] != ns:
                    raise ApiError(400, "the namespace of the provided object does not match the namespace sent on the request")
                md["namespace"] = ns
                if not ns:
                    raise ApiError(404, "the server could not find the requested resource")
                nst = self.types[("", "namespaces")]
                if self.try_get(nst, "", ns) is None:
                    raise not_found("namespaces", ns)
            else:
                md.pop("namespace", None)
                ns = ""
            if not md.get("name") and md.get("generateName"):
                # names.SimpleNameGenerator: the base cut to 58 characters, 5 random ones appended
                bucket = self._bucket(t, ns)
                while True:
                    cand = str(md["generateName"])[:58] + "".join(random.choices(_NAME_ALPHABET, k=5))
                    if cand not in bucket:
                        md["name"] = cand
                        break
            self._check_names(t, obj)
            name = md["name"]
            if t.namespaced:
                self._namespace_terminating(t, ns, name)
            if t.custom:
                if t.status_subresource:
                    obj.pop("status", None)
                self._prepare_custom(t, obj, version)
            if name in self._bucket(t, ns):
                raise already_exists(t.plural, name, t.group)
            for k in ("deletionTimestamp", "deletionGracePeriodSeconds", "managedFields"):
                md.pop(k, None)
            md["uid"] = str(uuid.uuid4())
            md["creationTimestamp"] = now_iso()
            md["generation"] = 1
            if t.plural == "namespaces":
                obj.setdefault("spec", {"finalizers": ["kubernetes"]})
                obj["status"] = {"phase": "Active"}
            if t.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
                self._crd_admit(obj)
            self._admit(t, obj, None)
            if dry_run:
                return obj
            md["resourceVersion"] = self._next_rv()
            obj["apiVersion"] = t.api_version()  # stored at the storage version
            self._bucket(t, ns)[name] = obj
            self._index(obj, t, ns)
            self._emit("ADDED", t, obj)
            if t.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
                self._crd_register(obj)
            return obj

    def _index(self, obj: dict, t: ResourceType, ns: str) -> None:
        md = obj["metadata"]
        self.by_uid[md["uid"]] = (t.key, ns, md["name"])
        for ref in md.get("ownerReferences") or ():
            if ref.get("uid"):
                self.dependents[ref["uid"]].add(md["uid"])

    def _unindex(self, obj: dict) -> None:
        md = obj["metadata"]
        self.by_uid.pop(md["uid"], None)
        for ref in md.get("ownerReferences") or ():
            deps = self.dependents.get(ref.get("uid", ""))
            if deps is not None:
                deps.discard(md["uid"])
                if not deps:
                    self.dependents.pop(ref["uid"], None)

    @staticmethod
    def _generation_part(t: ResourceType, obj: dict) -> dict:
        skip = {"metadata", "apiVersion", "kind"}
        if t.status_subresource or not t.custom:
            skip.add("status")
        return {k: v for k, v in obj.items() if k not in skip}

    def update(self, t: ResourceType, ns: str, name: str, body: dict, subresource: str | None = None,
               version: str | None = None, dry_run: bool = False, check_rv: bool = True) -> dict:
        """PUT semantics: `body` is the whole new object (a fresh dict this call may keep)."""
        if not isinstance(body, dict):
            raise ApiError(400, "the body of the request was in an unknown format")
        version = version or t.storage_version
        ns = ns if t.namespaced else ""
        with self.lock:
            old = self.get(t, ns, name)
            md = body.get("metadata")
            if not isinstance(md, dict):
                md = body["metadata"] = {}
            if md.get("name", name) != name:
                raise ApiError(400, f'the name of the object ({md.get("name")}) does not match the name on the URL ({name})')
            rv = md.get("resourceVersion")
            if check_rv and md.get("uid") and md["uid"] != old["metadata"]["uid"]:
                # DefaultUpdatedObjectInfo makes the body's uid a precondition
                raise precondition_failed(t.plural, t.group, ns, name, "UID", md["uid"], old["metadata"]["uid"])
            if check_rv and rv and rv != old["metadata"]["resourceVersion"]:
                raise conflict(t.plural, name, t.group)
            if subresource == "status":
                new = dict(old)
                if "status" in body:
                    new["status"] = body["status"]
                else:
                    new.pop("status", None)
                new["metadata"] = dict(old["metadata"])
            else:
                new = body
                new["apiVersion"], new["kind"] = t.api_version(version), t.kind
                if t.status_subresource:
                    if "status" in old:
                        new["status"] = old["status"]
                    else:
                        new.pop("status", None)
                nmd = dict(md)
                omd = old["metadata"]
                for k in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation"):
                    if k in omd:
                        nmd[k] = omd[k]
                    else:
                        nmd.pop(k, None)
                nmd["name"] = name
                if t.namespaced:
                    nmd["namespace"] = ns
                else:
                    nmd.pop("namespace", None)
                new["metadata"] = nmd
                errs = validation.object_meta_errors(nmd) + self._kind_errors(t, new)
                if omd.get("deletionTimestamp"):
                    added = validation.new_finalizer_error(nmd.get("finalizers") or [], omd.get("finalizers") or [])
                    if added:
                        errs.insert(0, added)
                if errs:
                    raise invalid(t.kind, t.group, name, errs)
            if t.custom:
                self._prepare_custom(t, new, version)
            if subresource is None:
                self._admit(t, new, old)
            new["apiVersion"] = t.api_version()
            nmd = new["metadata"]
            nmd["resourceVersion"] = old["metadata"]["resourceVersion"]
            if self._generation_part(t, new) != self._generation_part(t, old):
                nmd["generation"] = int(old["metadata"].get("generation") or 1) + 1
            if new == old:
                return old  # no-op writes do not bump resourceVersion, like the real server
            if dry_run:
                return new
            nmd["resourceVersion"] = self._next_rv()
            if nmd.get("deletionTimestamp") and not nmd.get("finalizers"):
                # the last finalizer is gone: the object goes away
                self._bucket(t, ns)[name] = new
                self._remove(t, ns, name, emit_rv=nmd["resourceVersion"], prior=old)
                return new
            self._bucket(t, ns)[name] = new
            if old["metadata"].get("ownerReferences") != nmd.get("ownerReferences"):
                self._unindex(old)
                self._index(new, t, ns)
            self._emit("MODIFIED", t, new, old)
            if t.key == ("apiextensions.k8s.io", "customresourcedefinitions") and subresource != "status":
                self._crd_register(new)
            return new

    def mutate(self, t: ResourceType, ns: str, name: str, fn: Callable[[dict], None], subresource: str | None = None) -> dict:
        """Internal read-modify-write: fn edits a deep copy in place (no rv precondition)."""
        with self.lock:
            new = copy.deepcopy(self.get(t, ns, name))
            fn(new)
            return self.update(t, ns, name, new, subresource=subresource, check_rv=False)

    # ------------------------------------------------------------------ deletes

    def delete(self, t: ResourceType, ns: str, name: str, propagation: str | None = None,
               preconditions: dict | None = None, dry_run: bool = False) -> dict:
        ns = ns if t.namespaced else ""
        with self.lock:
            obj = self.get(t, ns, name)
            md = obj["metadata"]
            if preconditions:
                if preconditions.get("uid") and preconditions["uid"] != md["uid"]:
                    raise precondition_failed(t.plural, t.group, ns, name, "UID", preconditions["uid"], md["uid"])
                if preconditions.get("resourceVersion") and preconditions["resourceVersion"] != md["resourceVersion"]:
                    raise precondition_failed(t.plural, t.group, ns, name, "ResourceVersion",
                                              preconditions["resourceVersion"], md["resourceVersion"])
            if dry_run:
                return obj
            propagation = propagation or "Background"
            if t.plural == "namespaces" and t.group == "":
                return self._delete_namespace(t, obj)
            finalizers = list(md.get("finalizers") or ())
            if propagation == "Orphan":
                self._orphan(md["uid"])
            elif propagation == "Foreground" and self.dependents.get(md["uid"]):
                if "foregroundDeletion" not in finalizers:
                    finalizers.append("foregroundDeletion")
            if finalizers:
                if md.get("deletionTimestamp") and finalizers == list(md.get("finalizers") or ()):
                    return obj
                new = dict(obj)
                nmd = new["metadata"] = dict(md)
                nmd["finalizers"] = finalizers
                if not nmd.get("deletionTimestamp"):
                    nmd["deletionTimestamp"] = now_iso()
                    nmd["deletionGracePeriodSeconds"] = 0
                    if t.custom:
                        nmd["generation"] = int(nmd.get("generation") or 1) + 1
                nmd["resourceVersion"] = self._next_rv()
                self._bucket(t, ns)[name] = new
                self._emit("MODIFIED", t, new, obj)
                if "foregroundDeletion" in finalizers:
                    for dep in list(self.dependents.get(md["uid"], ())):
                        self._delete_by_uid(dep, "Foreground")
                    self._foreground_check(md["uid"])
                return self.try_get(t, ns, name) or new
            self._remove(t, ns, name)
            return obj

    def _delete_by_uid(self, uid: str, propagation: str = "Background") -> None:
        loc = self.by_uid.get(uid)
        if loc is None:
            return
        key, ns, name = loc
        try:
            self.delete(self.types[key], ns, name, propagation=propagation)
        except ApiError:
            pass

    def _remove(self, t: ResourceType, ns: str, name: str, emit_rv: str | None = None,
                prior: dict | None = None) -> None:
        """Drop the object: a DELETED event (carrying, as `old`, the object as it was before this
        write, `prior` when the write that empties the finalizers is that event), then GC."""
        obj = self._bucket(t, ns).pop(name, None)
        if obj is None:
            return
        self._unindex(obj)
        gone = dict(obj)
        gone["metadata"] = dict(obj["metadata"])
        gone["metadata"]["resourceVersion"] = emit_rv or self._next_rv()
        self._emit("DELETED", t, gone, prior or obj)
        uid = obj["metadata"]["uid"]
        # garbage collection: dependents whose owners are all gone are deleted (background)
        for dep_uid in list(self.dependents.pop(uid, ())):
            loc = self.by_uid.get(dep_uid)
            if loc is None:
                continue
            dkey, dns, dname = loc
            dt_ = self.types.get(dkey)
            dep = self._bucket(dt_, dns).get(dname) if dt_ else None
            if dep is None:
                continue
            refs = [r for r in dep["metadata"].get("ownerReferences") or () if r.get("uid") != uid]
            if any(r.get("uid") in self.by_uid for r in refs):
                self.mutate(dt_, dns, dname, lambda o, refs=refs: o["metadata"].__setitem__("ownerReferences", refs))
            else:
                try:
                    self.delete(dt_, dns, dname, propagation="Background")
                except ApiError:
                    pass
        for ref in obj["metadata"].get("ownerReferences") or ():
            self._foreground_check(ref.get("uid", ""))
        if t.namespaced:
            self._namespace_check(ns)
        if t.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._crd_unregister(obj)

    def _orphan(self, uid: str) -> None:
        for dep_uid in list(self.dependents.pop(uid, ())):
            loc = self.by_uid.get(dep_uid)
            if loc is None:
                continue
            dkey, dns, dname = loc
            self.mutate(self.types[dkey], dns, dname, lambda o: o["metadata"].__setitem__(
                "ownerReferences", [r for r in o["metadata"].get("ownerReferences") or () if r.get("uid") != uid]))

    def _foreground_check(self, owner_uid: str) -> None:
        loc = self.by_uid.get(owner_uid)
        if loc is None or self.dependents.get(owner_uid):
            return
        key, ns, name = loc
        t = self.types[key]
        owner = self._bucket(t, ns).get(name)
        if owner is None or "foregroundDeletion" not in (owner["metadata"].get("finalizers") or ()):
            return
        self.mutate(t, ns, name, lambda o: o["metadata"].__setitem__(
            "finalizers", [f for f in o["metadata"]["finalizers"] if f != "foregroundDeletion"]))

    def _delete_namespace(self, t: ResourceType, obj: dict) -> dict:
        name = obj["metadata"]["name"]
        if not obj["metadata"].get("deletionTimestamp"):
            new = copy.deepcopy(obj)
            new["metadata"]["deletionTimestamp"] = now_iso()
            new["status"] = {"phase": "Terminating"}
            new["metadata"]["resourceVersion"] = self._next_rv()
            self._bucket(t, "")[name] = new
            self._emit("MODIFIED", t, new, obj)
            for rt in list(self.types.values()):
                if rt.namespaced:
                    for oname in list(self.objects.get(rt.key, {}).get(name, {})):
                        try:
                            self.delete(rt, name, oname)
                        except ApiError:
                            pass
        self._namespace_check(name)
        return self.try_get(t, "", name) or obj

    def _namespace_check(self, ns: str) -> None:
        nst = self.types[("", "namespaces")]
        nso = self._bucket(nst, "").get(ns)
        if nso is None or not nso["metadata"].get("deletionTimestamp"):
            return
        for rt in self.types.values():
            if rt.namespaced and self.objects.get(rt.key, {}).get(ns):
                return
        self._remove(nst, "", ns)

    # ------------------------------------------------------------------ CRDs

    def _crd_admit(self, crd: dict) -> None:
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        errs = []
        if not spec.get("group"):
            errs.append(("spec.group", "FieldValueRequired", "Required value"))
        if not names.get("plural") or not names.get("kind"):
            errs.append(("spec.names", "FieldValueRequired", "Required value"))
        if not spec.get("versions"):
            errs.append(("spec.versions", "FieldValueInvalid", "Invalid value: null: must have exactly one version marked as storage version"))
        expected = f"{names.get('plural')}.{spec.get('group')}"
        if crd["metadata"].get("name") != expected:
            errs.append(("metadata.name", "FieldValueInvalid", f'Invalid value: "{crd["metadata"].get("name")}": must be spec.names.plural+"."+spec.group'))
        if errs:
            raise invalid("CustomResourceDefinition", "apiextensions.k8s.io", crd["metadata"].get("name", ""), errs)
        crd["status"] = {
            "acceptedNames": {k: v for k, v in names.items()},
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "no conflicts found", "lastTransitionTime": now_iso()},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted", "message": "the initial names have been accepted", "lastTransitionTime": now_iso()},
            ],
            "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")] or [spec["versions"][0]["name"]],
        }

    def _crd_register(self, crd: dict) -> None:
        spec = crd["spec"]
        names = spec["names"]
        served = [v for v in spec["versions"] if v.get("served", True)]
        storage = next((v["name"] for v in spec["versions"] if v.get("storage")), spec["versions"][0]["name"])
        subs: dict[str, list[str]] = {}
        schemas_: dict[str, dict] = {}
        for v in spec["versions"]:
            sr = v.get("subresources") or spec.get("subresources") or {}
            if "status" in sr:
                subs["status"] = ["get", "patch", "update"]
            if "scale" in sr:
                subs["scale"] = ["get", "patch", "update"]
            sch = (v.get("schema") or spec.get("validation") or {}).get("openAPIV3Schema")
            if sch:
                schemas_[v["name"]] = sch
        key = (spec["group"], names["plural"])
        existing = self.types.get(key)
        t = ResourceType(
            group=spec["group"], versions=[v["name"] for v in served], plural=names["plural"], kind=names["kind"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced", singular=names.get("singular", names["kind"].lower()),
            short_names=list(names.get("shortNames") or []), categories=list(names.get("categories") or []),
            subresources=subs, schemas=schemas_, storage_version=storage, custom=True,
        )
        self.types[key] = t
        self.objects.setdefault(key, {})
        if existing is not None:
            # keep open watches attached to the (re)registered type
            pass

    def _crd_unregister(self, crd: dict) -> None:
        key = (crd["spec"]["group"], crd["spec"]["names"]["plural"])
        if key in self.types and self.types[key].custom:
            self.unregister(key)
