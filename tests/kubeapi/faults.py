r"""Fault injection for the test API server.

Rules match (method, path regex) and are tried in the order they were added; the first
rule that fires decides. A rule can answer an error status (optionally only with some
probability, or only for the next N matching requests), add latency, or hang the request
until the client gives up. Open watch streams can be dropped at once or at a rate.

From Python::

    server.faults.add(method="PATCH", path=r"/pytorchjobs/", status=409, times=2)
    server.faults.add(path=r"/api/v1/namespaces/.*/events", status=503, probability=0.5)
    server.faults.add(path=r"/gemtrainings", latency=0.5)
    server.faults.add(method="GET", path=r"/pods/", hang=True, times=1)
    server.faults.add(method="GET", path=r"/pods\?", truncate=True, times=1)  # drop the connection mid-body
    server.faults.drop_watches()            # close every open watch now
    server.faults.watch_drop_rate = 0.2     # each open watch is dropped with p=0.2 per second
    server.faults.clear()

Over HTTP (same fields as `add`): `POST /_kubeapi/faults` with a JSON rule, `GET` lists,
`DELETE` clears, `POST /_kubeapi/faults/drop-watches`, `PUT /_kubeapi/faults/watch-drop-rate`
with `{"rate": 0.2}`.
"""

from __future__ import annotations

import itertools
import random
import re
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

_ids = itertools.count(1)


@dataclass
class FaultRule:
    method: str = "*"
    path: str = ".*"
    status: int | None = None
    probability: float = 1.0
    times: int | None = None  # None: unlimited
    latency: float = 0.0
    hang: bool = False
    truncate: bool = False  # answer as usual, but drop the connection halfway through the body
    message: str = "injected fault"
    watch: bool | None = None  # None: any request; True: only watches; False: never watches
    id: int = field(default_factory=lambda: next(_ids))
    hits: int = 0

    def __post_init__(self) -> None:
        self._re = re.compile(self.path)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return d


class Faults:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rules: list[FaultRule] = []
        self.watch_drop_rate = 0.0
        self._drop_watches: Callable[[], int] | None = None

    def add(self, method: str = "*", path: str = ".*", status: int | None = None, probability: float = 1.0,
            times: int | None = None, latency: float = 0.0, hang: bool = False, message: str = "injected fault",
            watch: bool | None = None, truncate: bool = False) -> FaultRule:
        rule = FaultRule(method.upper(), path, status, probability, times, latency, hang, truncate, message, watch)
        with self._lock:
            self.rules.append(rule)
        return rule

    def remove(self, rule: FaultRule | int) -> None:
        rid = rule if isinstance(rule, int) else rule.id
        with self._lock:
            self.rules = [r for r in self.rules if r.id != rid]

    def clear(self) -> None:
        with self._lock:
            self.rules = []
            self.watch_drop_rate = 0.0

    def drop_watches(self) -> int:
        """Close every open watch stream now; returns how many were open."""
        return self._drop_watches() if self._drop_watches else 0

    def match(self, method: str, path_qs: str, is_watch: bool) -> FaultRule | None:
        """The rule that fires for this request, if any (consumes one of its `times`)."""
        with self._lock:
            for r in self.rules:
                if r.times is not None and r.times <= 0:
                    continue
                if r.method not in ("*", method):
                    continue
                if r.watch is not None and r.watch != is_watch:
                    continue
                if not r._re.search(path_qs):
                    continue
                if r.probability < 1.0 and random.random() >= r.probability:
                    continue
                if r.times is not None:
                    r.times -= 1
                r.hits += 1
                return r
        return None
