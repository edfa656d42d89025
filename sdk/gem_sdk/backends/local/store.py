"""The local backend's state on disk: one directory per job, shared by every process.

    <root>/
      mlflow.db                          default MLflow store (sqlite) of local jobs
      claims/<claimName>/                PersistentVolumeClaims as host directories (checkpoints)
      <namespace>/<plural>/<name>/       one job, e.g. default/gemtrainings/quickstart/
        object.yaml                      the resource with its status: written by submit, then
                                         only by the job's supervisor (atomically: tmp + rename)
        configmap.yaml                   the rendered ConfigMap (gem.api.render)
        pytorchjob.yaml                  the rendered PyTorchJob, its status kept by the supervisor
        supervisor.pid                   pid of the detached supervisor process
        supervisor.log                   the supervisor's own log
        pods.yaml                        the replicas as Pod-like objects (state, termination message)
        pods/<pod>/                      each pod's sandbox (gem.launcher.local): volumes,
                                         termination-log
        logs/<pod>.log                   each pod's log (`<pod>.log.previous` before a restart)

Readers never lock: every file is replaced atomically, so a reader sees the old or the new one.
A file that holds no YAML mapping all the same (a crash, an edit) raises `UnreadableFileError`;
`list` skips such a job with a warning, and `delete` removes it.
Writers of `object.yaml` (the supervisor's status, the SDK's update/suspend/resume) read, modify
and write it under `locked(job_dir)`, so neither loses the other's change.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from gem.api.types import KINDS
from gem_sdk._exceptions import BackendError

#: Annotations of a pod in pods.yaml: its container's pid, and the inode of the log that container
#: writes, which tells a reader that opened the log which container pods.yaml describes (a
#: restart moves the log to `<log>.previous` and starts a new one).
ANNOTATION_PID, ANNOTATION_LOG_INODE = "gem.dev/local-pid", "gem.dev/local-log-inode"
OBJECT_FILE = "object.yaml"
CONFIGMAP_FILE = "configmap.yaml"
PYTORCHJOB_FILE = "pytorchjob.yaml"
PID_FILE = "supervisor.pid"
SUPERVISOR_LOG = "supervisor.log"
PODS_DIR = "pods"
PODS_FILE = "pods.yaml"
LOGS_DIR = "logs"
CLAIMS_DIR = "claims"
MLFLOW_DB = "mlflow.db"
LOCK_FILE = ".lock"


def job_dir(root: Path, kind: str, namespace: str, name: str) -> Path:
    return root / namespace / KINDS[kind]["plural"] / name


def claims_dir(root: Path) -> Path:
    return root / CLAIMS_DIR


@contextlib.contextmanager
def locked(job_dir: Path) -> Iterator[None]:
    """Hold the job's write lock (an flock, released even if the holder is killed)."""
    fd = os.open(job_dir / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_yaml(path: Path, data: dict[str, Any]) -> None:
    """Write atomically: a reader sees the previous content or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(data, f, sort_keys=False)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class UnreadableFileError(BackendError):
    """A state file that exists but holds no YAML mapping (truncated, or edited by hand)."""


def read_yaml(path: Path) -> dict[str, Any] | None:
    """The file's mapping, or None if it does not exist (or vanished: a job deleted meanwhile).

    Raises:
        UnreadableFileError: it exists but is not a YAML mapping (empty, truncated, edited).
    """
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UnreadableFileError(f"{path} is not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(data, dict):
        raise UnreadableFileError(f"{path} holds no YAML mapping ({'empty' if data is None else type(data).__name__})")
    return data


def iter_job_dirs(root: Path, kind: str, namespace: str | None) -> Iterator[Path]:
    """Directories of jobs of one kind in one namespace (or all namespaces)."""
    if not root.is_dir():
        return
    namespaces = [root / namespace] if namespace else sorted(p for p in root.iterdir() if p.is_dir())
    for ns_dir in namespaces:
        kind_dir = ns_dir / KINDS[kind]["plural"]
        if kind_dir.is_dir():
            yield from sorted(p for p in kind_dir.iterdir() if (p / OBJECT_FILE).exists())

