"""The trainer's final report: a compact JSON a Kubernetes termination message can carry.

When GEM_TERMINATION_MESSAGE_PATH is set (the operator points it at /dev/termination-log),
global rank 0 writes

    {"metrics": {...}, "ne": 0.83, "step": 200, "totalSteps": 200,
     "checkpoint": "/var/lib/gem/checkpoints/ns/job/step-00000200",
     "mlflowRunId": "...", "mlflowExperimentId": "...", "mlflowRunUrl": "http://.../#/experiments/1/runs/..."}

and on failure {"error": "ExceptionType: message"}. Kubernetes keeps at most 4096 bytes, so the
report is shrunk to fit rather than cut mid-JSON.
"""

from __future__ import annotations

import json
import os
from typing import Any

ENV_PATH = "GEM_TERMINATION_MESSAGE_PATH"
MAX_BYTES = 4096


def _dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, separators=(",", ":"), sort_keys=False, allow_nan=False)


def fit(payload: dict[str, Any]) -> str:
    """payload as compact JSON of at most MAX_BYTES: drops secondary metrics first (then per-source ones),
    then truncates error."""
    text = _dumps(payload)
    if len(text.encode()) <= MAX_BYTES:
        return text
    payload = dict(payload)
    if "metrics" in payload:
        # Keep the headline keys the operator shows; drop the rest.
        core = {k: v for k, v in payload["metrics"].items() if k.split("/")[0] in ("ne", "auc", "bayes_ne", "loss")}
        # then without the per-source copies (`ne/click@src`): a mix of many sources keeps its headline
        for metrics in (core, {k: v for k, v in core.items() if "@" not in k}):
            payload["metrics"] = metrics
            text = _dumps(payload)
            if len(text.encode()) <= MAX_BYTES:
                return text
        payload["metrics"] = {}
    if "error" in payload:
        # the longest prefix whose JSON fits: JSON escapes newlines and quotes (2 bytes), non-ASCII
        # (\uXXXX, 6), so cutting the message at a byte count left invalid JSON for the last cut below
        error, lo, hi = payload["error"], 0, len(payload["error"])
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(_dumps({**payload, "error": error[:mid] + "…"}).encode()) <= MAX_BYTES:
                lo = mid
            else:
                hi = mid - 1
        payload["error"] = error[:lo] + "…"
    text = _dumps(payload)
    return text if len(text.encode()) <= MAX_BYTES else text.encode()[:MAX_BYTES].decode(errors="ignore")


def write(payload: dict[str, Any]) -> None:
    """Write the report where GEM_TERMINATION_MESSAGE_PATH says (no-op when unset)."""
    path = os.environ.get(ENV_PATH)
    if not path:
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(fit(payload))


def error_payload(exc: BaseException) -> dict[str, Any]:
    message = str(exc).strip()
    return {"error": f"{type(exc).__name__}: {message}" if message else type(exc).__name__}
