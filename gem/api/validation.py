"""What a spec that pydantic accepts must also satisfy to run: the values it passes into the
PyTorchJob and its pods (names, label keys and values, paths).

Pure and torch-free: the operator (`gem_operator.validation`) refuses such a spec with
`Valid=False`, and the SDK's local backend refuses it at submit, with the same messages, so a spec
tried on a laptop gets the verdict it would get on a cluster.
"""

from __future__ import annotations

import re
from typing import Any

from gem.api.types import CONFIG_MOUNT_PATH

# --------------------------------------------------------------------------- what the children need
# Values the spec passes into the PyTorchJob and its pods, which the API server (or the kubelet)
# would refuse there: names, label values, paths. The CRD schema cannot say it, so a spec that
# passes it would otherwise create a job that never runs.

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
#: Paths the operator mounts itself; the checkpoint volume may not take them.
_RESERVED_MOUNTS = (CONFIG_MOUNT_PATH, "/dev/shm")


def _subdomain(value: str) -> str | None:
    if len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        return (
            f"{value!r} is not a valid object name: lowercase letters, digits, '-' and '.', "
            "starting and ending with a letter or digit, at most 253 characters"
        )
    return None


def _label_value(value: str) -> str | None:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        return (
            f"{value!r} is not a valid label value: at most 63 letters, digits, '-', '_' and '.', "
            "starting and ending with a letter or digit"
        )
    return None


def _label_key(key: str) -> str | None:
    prefix, slash, name = key.rpartition("/")
    if (slash and _subdomain(prefix)) or len(name) > 63 or not _LABEL_NAME.match(name):
        return (
            f"{key!r} is not a valid label key: an optional DNS prefix and '/', then at most 63 "
            "letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
        )
    return None


def _procs_fit_gpus(spec: Any) -> str | None:
    """Each trainer process of a GPU pod takes the GPU of its local rank: more processes than GPUs
    fail at start (cuda.set_device). CPU-only pods (gpusPerNode 0) run any number."""
    gpus, procs = spec.resources.gpus_per_node, spec.parallelism.procs_per_node
    if gpus and procs > gpus:
        return (
            f"{procs} processes per pod but spec.resources.gpusPerNode is {gpus}: each process needs a GPU of "
            f"its own (local ranks {gpus}-{procs - 1} would have none); set procsPerNode to at most {gpus} "
            "or request as many GPUs as processes"
        )
    return None


def runnable_field_problems(obj: Any) -> list[tuple[str, str]]:
    """(path, problem) for each value of a parsed spec that its PyTorchJob or pods could not carry."""
    spec = obj.spec
    checks: list[tuple[str, str | None]] = []
    if not obj.metadata.name[:1].isalpha():
        # The training operator names the job's Services after it: a DNS-1035 label.
        checks.append(("metadata.name", f"{obj.metadata.name!r} must start with a letter: its PyTorchJob and the "
                                        "job's Services are named after it (DNS-1035 labels)"))
    if spec.image is not None and (not spec.image.strip() or any(c.isspace() for c in spec.image)):
        checks.append(("spec.image", f"{spec.image!r} is not an image reference: no whitespace allowed"))
    if spec.scheduling.queue_name:
        checks.append(("spec.scheduling.queueName", _label_value(spec.scheduling.queue_name)))
    if spec.scheduling.priority_class_name:
        name = spec.scheduling.priority_class_name
        checks.append(("spec.scheduling.priorityClassName", _subdomain(name) or _label_value(name)))
    checks.append(("spec.parallelism.procsPerNode", _procs_fit_gpus(spec)))
    for i, level in enumerate(spec.parallelism.topology.levels):
        # node-label keys: they become pod-affinity topology keys and Kueue annotations
        checks.append((f"spec.parallelism.topology.levels[{i}]", _label_key(level)))
    if len(set(spec.parallelism.topology.levels)) != len(spec.parallelism.topology.levels):
        checks.append(("spec.parallelism.topology.levels", "each label key may appear once"))
    for key, value in spec.resources.node_selector.items():
        checks.append((f"spec.resources.nodeSelector[{key!r}]", _label_key(key) or _label_value(value)))
    for i, tol in enumerate(spec.resources.tolerations):
        where = f"spec.resources.tolerations[{i}]"
        if tol.key:
            checks.append((f"{where}.key", _label_key(tol.key)))
        if tol.operator == "Exists" and tol.value:
            checks.append((f"{where}.value", "must be empty when operator is Exists"))
        if not tol.key and tol.operator != "Exists":
            checks.append((f"{where}.operator", "must be Exists when key is empty (tolerate every taint)"))
        if tol.value:
            checks.append((f"{where}.value", _label_value(tol.value)))
    path = spec.checkpoint.path.rstrip("/")
    if not spec.checkpoint.path.startswith("/") or ":" in path:
        checks.append(("spec.checkpoint.path", f"{spec.checkpoint.path!r} must be an absolute path without ':'"))
    elif not path:
        checks.append(("spec.checkpoint.path", "'/' cannot be a volume: pick a directory such as /var/lib/gem/checkpoints"))
    elif any(path == m or path.startswith(m + "/") or m.startswith(path + "/") for m in _RESERVED_MOUNTS):
        checks.append(("spec.checkpoint.path", f"{spec.checkpoint.path!r} overlaps a path the operator mounts itself "
                                               f"({', '.join(_RESERVED_MOUNTS)}); pick another directory"))
    if spec.checkpoint.claim_name:
        checks.append(("spec.checkpoint.claimName", _subdomain(spec.checkpoint.claim_name)))
    if spec.mlflow.credentials_secret:
        checks.append(("spec.mlflow.credentialsSecret", _subdomain(spec.mlflow.credentials_secret)))
    teacher = getattr(spec, "teacher", None)
    if teacher is not None and teacher.gem_training:
        checks.append(("spec.teacher.gemTraining", _subdomain(teacher.gem_training)))
    return [(where, problem) for where, problem in checks if problem]


def runnable_problems(obj: Any) -> list[str]:
    """`path: problem` for each value of a parsed spec that its PyTorchJob or pods could not carry:
    the operator's `Valid=False` message (joined with "; ") and, one per field, the local backend's
    `ValidationError`."""
    return [f"{where}: {problem}" for where, problem in runnable_field_problems(obj)]
