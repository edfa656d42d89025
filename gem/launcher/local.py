"""Run a PyTorchJob's replicas as local processes, the way a kubelet would run its pods.

No cluster, no containers, no torch import. Two layers:

* `LocalPod` runs one pod's `pytorch` container (or its first container) as a process
  group in a sandbox directory, emulating the kubelet's mounts by *path remapping*:

  - `configMap` volumes are written as files under `<sandbox>/volumes/<volume>/`
    (`items` honoured; `binaryData` decoded), `secret` volumes likewise;
  - `emptyDir` volumes are empty directories under the sandbox;
  - `persistentVolumeClaim` volumes are `<claims_dir>/<claimName>/`, shared by every pod
    (and every job) using that claim, and kept after the pod is gone;
  - `hostPath` volumes are the host path itself (identity);
  - the container's `terminationMessagePath` (default `/dev/termination-log`) is
    `<sandbox>/termination-log`.

  Every occurrence of a mountPath (or of the terminationMessagePath) as a path prefix in
  the container's `command`, `args` and env values, and in the text files materialised
  from ConfigMaps, is rewritten to the local directory (longest mountPath first;
  `subPath` honoured). In a YAML or JSON file (`rewrite_document`) the rewrite must not
  change what the file means: where replacing the text would (a local directory holding
  " #", ": ", a quote...), the file's string values are rewritten and it is dumped again.
  The process runs with the sandbox as working directory and a PATH whose first entry
  is the running interpreter's bin directory (so `gem`, `torchrun` from the same
  virtualenv resolve). When it exits, up to 4096 bytes of the termination message file
  become the message (policy `FallbackToLogsOnError`: the last 80 lines,
  at most 2048 bytes, of the log when the file is empty and the container failed).
  `stop` sends SIGTERM to the process group, then, after the grace, SIGKILL to it and to every
  other process of the pod (`pod_processes`: torchrun starts its workers in sessions of their own),
  as the kubelet's kill of the container's cgroup reaches them all.

* `LocalPyTorchJob` creates a `LocalPod` per replica with exactly the environment
  training-operator v1.9 injects (see `gem.launcher.env`), mapping the master's Service
  address to 127.0.0.1 and its port to a free local port (`free_port`: below the kernel's
  ephemeral range, which outgoing connections draw from), and decides the job's outcome
  like the operator: the job succeeds when the master succeeds (all workers when there is
  no master). Replicas with restartPolicy OnFailure/Always (what gem.api.render renders)
  restart in place, and the job fails where v1.9's PastBackoffLimit would: once the summed
  restartCount of its OnFailure/Always pods that have not succeeded reaches
  `runPolicy.backoffLimit` (is > 0 for a limit of 0). A failure is not restarted when that
  restart would reach the limit, so a limit of n allows n - 1 restarts (none for 0 or 1).
  ExitCode restarts on exit codes >= 128, counted apart: up to `backoffLimit` of them (the
  operator recreates such pods, which PastBackoffLimit does not count); Never does not restart.
  Without `backoffLimit` there is no limit (v1.9's PastBackoffLimit is false for a nil limit).
  `backoff_exhausted` is that rule alone; `LocalPyTorchJob.restart_blocked` applies it to a set
  of failed replicas (the SDK's local supervisor, which restarts the whole gang, asks it too).
  A restart waits out a back-off, as the kubelet's CrashLoopBackOff does (`RestartBackOff`):
  10 s, doubled for each further failure up to 5 min, back to 10 s after 10 min of running;
  `GEM_LOCAL_RESTART_BACKOFF_S` (or `restart_backoff=`) sets the first delay, 0 restarts at once.
  Unlike the kubelet, the first restart waits too: locally the failed container's log is the only
  record of why it failed, and it stays in place (`<log>`, not yet `.previous`) meanwhile.
  GPUs are handed out as the NVIDIA device plugin does: a replica whose container asks for
  `nvidia.com/gpu: g` gets g GPUs of its own (`CUDA_VISIBLE_DEVICES`), out of `gpu_pool()`, so the
  replicas' local ranks 0.. do not all land on GPU 0 (NCCL refuses two ranks on one GPU).

The process environment is a small base (`BASE_ENV_KEYS` copied from this process when
set, `PATH` with the interpreter's bin dir first, and `HOSTNAME` = pod name) plus the
container's `envFrom`/`env` plus the operator's variables. Nothing else of the caller's
environment leaks in.
"""

from __future__ import annotations

import base64
import datetime as dt
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from .env import (EnvError, SecretResolver, _replica_specs, container_env, expand, replica_name, replicas_of,
                  training_operator_env)

BASE_ENV_KEYS = ("HOME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ", "PYTHONPATH", "VIRTUAL_ENV", "SYSTEMROOT", "USER")
DEFAULT_TERMINATION_PATH = "/dev/termination-log"
MAX_TERMINATION_BYTES = 4096
FALLBACK_LINES = 80
FALLBACK_BYTES = 2048
#: Restart policies whose containers the kubelet restarts in place (PastBackoffLimit counts them).
IN_PLACE_POLICIES = ("OnFailure", "Always")
#: `JobFailure.reason`s.
BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
REPLICA_FAILED = "ReplicaFailed"
#: The kubelet's CrashLoopBackOff (pkg/kubelet: 10 s initial, 300 s cap, reset once a container
#: ran 2 x the cap); the environment variable sets the initial delay (tests shorten it).
RESTART_BACKOFF_ENV = "GEM_LOCAL_RESTART_BACKOFF_S"
RESTART_BACKOFF_S = 10.0
MAX_RESTART_BACKOFF_S = 300.0
RESTART_BACKOFF_RESET_S = 600.0


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_processes(sandbox: str | os.PathLike, pod_name: str) -> list[int]:
    """The pids of a local pod's processes, where /proc tells (else none): started in its sandbox
    (the working directory) with its HOSTNAME, which they inherit, also those in sessions of their
    own (torchrun's workers), which its process group does not hold. Both, so that neither a shell
    sitting in the sandbox nor a process that reuses a recorded pid is taken for one."""
    if not os.path.isdir("/proc"):
        return []
    root = os.path.realpath(sandbox)
    marker = f"HOSTNAME={pod_name}".encode()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry.name}/cwd")
            if not (cwd == root or cwd.startswith(root + os.sep)):
                continue
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    out.append(int(entry.name))
        except OSError:  # gone, or not ours to look at
            continue
    return out


#: Where `free_port` looks first: below the kernel's ephemeral range, above the ports that
#: development servers commonly take (5000, 8000, 8080, 9000...).
LOW_PORT = 15000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the source ports of outgoing connections (Linux's default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1, for a job's rendezvous.

    Picked at random below the ephemeral range where there is room: the kernel gives ports of that
    range to every outgoing connection (this machine's other jobs', MLflow's...), and one that
    took the port between this pick and the rendezvous' bind would fail the job (EADDRINUSE).
    """
    lo, _ = ephemeral_ports()
    rng = random.SystemRandom()
    for _ in range(64 if lo - LOW_PORT >= 1000 else 0):
        port = rng.randrange(LOW_PORT, lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GPU_RESOURCE = "nvidia.com/gpu"


def gpu_pool(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The GPUs local replicas are given from: `$CUDA_VISIBLE_DEVICES` when set (ids or UUIDs),
    else the NVIDIA GPUs the driver lists (`/proc/driver/nvidia/gpus`); None when neither tells."""
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        return [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return None


def gpus_requested(pod_spec: Mapping[str, Any]) -> int:
    """The `nvidia.com/gpu` a pod's main container asks for (its limit, else its request)."""
    resources = _pick_container(pod_spec, None).get("resources") or {}
    value = (resources.get("limits") or {}).get(GPU_RESOURCE) or (resources.get("requests") or {}).get(GPU_RESOURCE)
    return int(value or 0)


def restart_backoff_from_env(environ: Mapping[str, str] | None = None) -> float:
    """The first restart's delay in seconds: `$GEM_LOCAL_RESTART_BACKOFF_S`, else 10.

    Raises:
        ValueError: the variable is set to something other than a number of seconds >= 0.
    """
    raw = (os.environ if environ is None else environ).get(RESTART_BACKOFF_ENV, "").strip()
    if not raw:
        return RESTART_BACKOFF_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{RESTART_BACKOFF_ENV}={raw!r} is not a number of seconds >= 0: set it to the delay "
                         "before a failed replica's first restart (doubled for each further one, up to "
                         f"{MAX_RESTART_BACKOFF_S:g} s; 0 restarts at once), or unset it for {RESTART_BACKOFF_S:g} s")
    return value


class RestartBackOff:
    """How long to wait before restarting a failed container: the kubelet's CrashLoopBackOff, the
    initial delay doubled after each failure up to `cap` (at least the initial delay), and the
    initial delay again after a container that ran `reset_after` seconds before it failed."""

    def __init__(self, initial: float, cap: float = MAX_RESTART_BACKOFF_S,
                 reset_after: float = RESTART_BACKOFF_RESET_S) -> None:
        self.initial, self.cap, self.reset_after = initial, max(cap, initial), reset_after
        self.delay: float | None = None  # the last delay given; None before the first failure

    def next(self, ran_s: float) -> float:
        """The delay before restarting a container that failed after running `ran_s` seconds."""
        if self.delay is None or ran_s >= self.reset_after:
            self.delay = self.initial
        else:
            self.delay = min(self.cap, self.delay * 2)
        return self.delay


@dataclass
class ContainerState:
    """What the kubelet would report for the container."""

    phase: str = "Pending"  # Pending, Running, Succeeded, Failed
    exit_code: int | None = None
    reason: str | None = None  # Completed, Error, StartError, CreateContainerConfigError
    message: str = ""
    started_at: str | None = None
    finished_at: str | None = None
    restart_count: int = 0
    pid: int | None = None

    @property
    def done(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


def _pick_container(pod_spec: Mapping[str, Any], name: str | None) -> dict:
    containers = list(pod_spec.get("containers") or [])
    if not containers:
        raise ValueError("pod spec has no containers")
    if name:
        for c in containers:
            if c.get("name") == name:
                return dict(c)
    for c in containers:
        if c.get("name") == "pytorch":
            return dict(c)
    return dict(containers[0])


class LocalPod:
    """One pod's main container run as a local process group.

    Args:
        name: the pod name (also HOSTNAME and the log file's name).
        pod_spec: the pod's `spec` (containers, volumes).
        sandbox: the pod's private directory (created; reused by restarts).
        extra_env: (name, value) pairs appended after the container's env (operator vars).
        configmaps: ConfigMap name -> data, for configMap volumes, envFrom and
            configMapKeyRef.
        secrets: Secret name -> decoded data (or None), for secret volumes and refs.
        claims_dir: where persistentVolumeClaim volumes live (default `<sandbox>/../claims`).
        container: the container to run (default `pytorch`, else the first).
        log_path: the log file (default `<sandbox>/<name>.log`).
    """

    def __init__(
        self,
        name: str,
        pod_spec: Mapping[str, Any],
        sandbox: str | os.PathLike,
        extra_env: Iterable[tuple[str, str]] = (),
        configmaps: Mapping[str, Mapping[str, str]] | None = None,
        secrets: SecretResolver | None = None,
        claims_dir: str | os.PathLike | None = None,
        container: str | None = None,
        log_path: str | os.PathLike | None = None,
        rewrite_files: bool = True,
    ) -> None:
        self.name = name
        self.pod_spec = pod_spec
        self.container = _pick_container(pod_spec, container)
        self.sandbox = Path(sandbox)
        self.claims_dir = Path(claims_dir) if claims_dir else self.sandbox.parent / "claims"
        self.extra_env = list(extra_env)
        self.configmaps = dict(configmaps or {})
        self.secrets = secrets
        self.rewrite_files = rewrite_files
        self.log_path = Path(log_path) if log_path else self.sandbox / f"{name}.log"
        self.state = ContainerState()
        self.proc: subprocess.Popen | None = None
        self._started_mono: float | None = None
        #: How long the last container ran before it exited (what a restart's back-off resets on).
        self.ran_s = 0.0
        self.mounts: dict[str, str] = {}
        self._prepared = False
        self._rewrite_re: re.Pattern | None = None
        self.termination_path = self.container.get("terminationMessagePath") or DEFAULT_TERMINATION_PATH
        self.local_termination_path = self.sandbox / "termination-log"

    # ------------------------------------------------------------------ mounts

    def _materialise(self, vol: Mapping[str, Any], target: Path) -> Path:
        if "hostPath" in vol:
            p = Path(vol["hostPath"]["path"])
            if (vol["hostPath"].get("type") or "") in ("DirectoryOrCreate", ""):
                p.mkdir(parents=True, exist_ok=True)
            return p
        if "persistentVolumeClaim" in vol:
            p = self.claims_dir / vol["persistentVolumeClaim"]["claimName"]
            p.mkdir(parents=True, exist_ok=True)
            return p
        target.mkdir(parents=True, exist_ok=True)
        if "configMap" in vol or "secret" in vol:
            src = vol.get("configMap") or vol.get("secret") or {}
            if "configMap" in vol:
                data = self.configmaps.get(src.get("name", ""))
            else:
                data = self.secrets(src.get("secretName", "")) if self.secrets else None
            if data is None:
                if not src.get("optional"):
                    raise EnvError(f'{"configmap" if "configMap" in vol else "secret"} "{src.get("name") or src.get("secretName")}" not found')
                data = {}
            items = src.get("items")
            pairs = [(it["key"], it["path"]) for it in items] if items else [(k, k) for k in data]
            for key, rel in pairs:
                if key not in data:
                    continue
                f = target / rel
                f.parent.mkdir(parents=True, exist_ok=True)
                val = data[key]
                if isinstance(val, bytes):
                    f.write_bytes(val)
                else:
                    f.write_text(val)
        return target

    def _prepare(self) -> None:
        if self._prepared:
            return
        self.sandbox.mkdir(parents=True, exist_ok=True)
        vols: dict[str, Path] = {}
        identity: set[str] = set()
        for vol in self.pod_spec.get("volumes") or []:
            vols[vol["name"]] = self._materialise(vol, self.sandbox / "volumes" / vol["name"])
            if "hostPath" in vol:
                identity.add(vol["name"])
        for m in self.container.get("volumeMounts") or []:
            base = vols.get(m["name"])
            if base is None:
                raise EnvError(f'volume "{m["name"]}" not found in pod {self.name}')
            if m["name"] in identity and not m.get("subPath"):
                if m["mountPath"] != str(base):
                    self.mounts[m["mountPath"].rstrip("/") or "/"] = str(base)
                continue
            local = base / m["subPath"] if m.get("subPath") else base
            self.mounts[m["mountPath"].rstrip("/") or "/"] = str(local)
        self.mounts[self.termination_path] = str(self.local_termination_path)
        if self.mounts:
            alts = "|".join(re.escape(p) for p in sorted(self.mounts, key=len, reverse=True))
            self._rewrite_re = re.compile(r"(?<![\w.\-/])(" + alts + r")(?=$|/|[^\w.\-])")
        if self.rewrite_files:
            for vol in self.pod_spec.get("volumes") or []:
                if "configMap" in vol:
                    for f in vols[vol["name"]].rglob("*"):
                        if f.is_file():
                            try:
                                text = f.read_text()
                            except (UnicodeDecodeError, OSError):
                                continue
                            new = rewrite_document(text, self.rewrite, f.name)
                            if new != text:
                                f.write_text(new)
        self._prepared = True

    def rewrite(self, value: str) -> str:
        """Map container paths under a mountPath to their local directories."""
        if self._rewrite_re is None:
            return value
        return self._rewrite_re.sub(lambda m: self.mounts[m.group(1)], value)

    # ------------------------------------------------------------------ env / argv

    def environment(self) -> dict[str, str]:
        """The exact process environment (base + container env + operator env)."""
        self._prepare()
        base = {k: os.environ[k] for k in BASE_ENV_KEYS if k in os.environ}
        bindir = os.path.dirname(sys.executable)
        base["PATH"] = bindir + os.pathsep + os.environ.get("PATH", os.defpath)
        base["HOSTNAME"] = self.name
        env = container_env(self.container, self.extra_env, self.configmaps, self.secrets)
        env = {k: self.rewrite(v) for k, v in env.items()}
        return {**base, **env}

    def argv(self, env: Mapping[str, str]) -> list[str]:
        cmd = [str(x) for x in (self.container.get("command") or [])]
        args = [str(x) for x in (self.container.get("args") or [])]
        argv = [self.rewrite(expand(a, env)) for a in cmd + args]
        if not argv:
            raise EnvError("container has neither command nor args (no image entrypoint locally)")
        return argv

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> ContainerState:
        """Start the container (no-op when it is running)."""
        if self.proc is not None and self.proc.poll() is None:
            return self.state
        st = self.state
        try:
            self._prepare()
            env = self.environment()
            argv = self.argv(env)
        except EnvError as e:
            self._finish(1, "CreateContainerConfigError", str(e))
            return st
        exe = shutil.which(argv[0], path=env["PATH"]) if os.sep not in argv[0] else argv[0]
        if exe is None:
            self._finish(128, "StartError", f'exec: "{argv[0]}": executable file not found in $PATH')
            return st
        try:
            self.local_termination_path.write_bytes(b"")
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    [exe] + argv[1:], cwd=self.sandbox, env=env, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )
        except OSError as e:
            self._finish(128, "StartError", str(e))
            return st
        st.phase, st.pid = "Running", self.proc.pid
        self._started_mono = time.monotonic()
        st.started_at, st.finished_at, st.exit_code, st.reason, st.message = now_iso(), None, None, None, ""
        return st

    def _finish(self, code: int, reason: str | None = None, message: str | None = None) -> None:
        st = self.state
        self.ran_s = time.monotonic() - self._started_mono if self._started_mono is not None else 0.0
        self._started_mono = None
        st.exit_code = code
        st.phase = "Succeeded" if code == 0 else "Failed"
        st.reason = reason or ("Completed" if code == 0 else "Error")
        st.finished_at = now_iso()
        st.started_at = st.started_at or st.finished_at
        if message is None:
            message = self._termination_message(code)
        st.message = message

    def _termination_message(self, code: int) -> str:
        try:
            with open(self.local_termination_path, "rb") as f:
                msg = f.read(MAX_TERMINATION_BYTES)
        except OSError:
            msg = b""
        policy = self.container.get("terminationMessagePolicy") or "File"
        if not msg.strip() and code != 0 and policy == "FallbackToLogsOnError":
            try:
                data = self.log_path.read_bytes()
            except OSError:
                data = b""
            msg = b"".join(data.splitlines(keepends=True)[-FALLBACK_LINES:])[-FALLBACK_BYTES:]
        return msg.decode(errors="replace")

    def poll(self) -> ContainerState:
        """Refresh and return the state (non-blocking)."""
        if self.proc is not None and self.state.phase == "Running":
            code = self.proc.poll()
            if code is not None:
                if code < 0:  # killed by a signal: the runtime reports 128 + signal
                    code = 128 - code
                self._finish(code)
        return self.state

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM the whole process group (non-blocking)."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the whole process group and every other process in the sandbox (what the
        kubelet's kill of the container's cgroup reaches)."""
        self._signal(signal.SIGKILL)
        if self.proc is None:
            return
        for pid in pod_processes(self.sandbox, self.name):
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _signal(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace: float = 5.0) -> ContainerState:
        """SIGTERM, wait up to `grace` seconds, then SIGKILL; blocks until it exited."""
        if self.proc is None:
            return self.state
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self.kill()  # also reaps stragglers left in the group
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        return self.poll()

    def restart(self, count: bool = True) -> ContainerState:
        """Restart the container in place (same sandbox), like the kubelet under
        restartPolicy OnFailure/Always; the previous log is kept as `<log>.previous`.
        `count=False` leaves restartCount alone (a replica restarted only because others failed)."""
        if self.running:
            self.stop()
        if self.log_path.exists():
            os.replace(self.log_path, str(self.log_path) + ".previous")
        if count:
            self.state.restart_count += 1
        self.proc = None
        return self.start()

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, size: int = 16384) -> str:
        """The last `size` bytes of the log ("" when there is none yet): what a poll loop reads."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - size))
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""


def total_gpus(job: Mapping[str, Any]) -> int:
    """The `nvidia.com/gpu` a PyTorchJob's replicas ask for together."""
    return sum(replicas_of(job, rtype) * gpus_requested((spec.get("template") or {}).get("spec") or {})
               for rtype, spec in _replica_specs(job).items())


def gpu_shortage(wanted: int, have: int) -> str:
    """Why replicas asking for `wanted` GPUs together cannot run on `have`."""
    return (f"the job's replicas ask for {wanted} {GPU_RESOURCE} together (spec.parallelism.numNodes x "
            f"spec.resources.gpusPerNode) and this machine has {have} for them (CUDA_VISIBLE_DEVICES, else "
            "every NVIDIA GPU): locally each replica needs GPUs of its own, as on a cluster; lower numNodes "
            "or gpusPerNode, or make more GPUs visible")


def backoff_exhausted(backoff_limit: int | str | None, restart_policy: str, restarts: int, failing: int = 1) -> bool:
    """Whether restarting `failing` failed replicas of `restart_policy` would take the job past
    `runPolicy.backoffLimit` (training-operator v1.9), `restarts` being what is counted so far.

    OnFailure/Always: `restarts` is the summed restartCount of the job's OnFailure/Always pods that
    have not succeeded. PastBackoffLimit fails the job once that sum is >= the limit (> 0 for a
    limit of 0), so the restarts that would reach it are not made: a limit of n allows n - 1
    restarts (none for 0 or 1). ExitCode: `restarts` is the ExitCode restarts made so far; up to
    `backoffLimit` of them (the operator recreates those pods, outside PastBackoffLimit). No limit
    (None): never exhausted.
    """
    if backoff_limit is None:
        return False
    limit = int(backoff_limit)
    if restart_policy in IN_PLACE_POLICIES:
        return restarts + failing >= limit  # >= 1 whenever failing: also v1.9's `> 0` for 0
    return restarts + failing > limit


@dataclass(frozen=True)
class JobFailure:
    """Why a job failed: `reason` BACKOFF_LIMIT_EXCEEDED or REPLICA_FAILED (a replica whose
    restartPolicy does not restart it), `message` a sentence fragment naming the limit or pod."""

    reason: str
    message: str


@dataclass
class ReplicaInfo:
    replica_type: str  # "Master" / "Worker"
    index: int
    pod: LocalPod
    restart_policy: str = "OnFailure"


class LocalPyTorchJob:
    """Run a whole PyTorchJob (the dict you would `kubectl apply`) as local processes.

    Example::

        job = LocalPyTorchJob(pytorchjob_dict, workdir="/tmp/run1",
                              configmaps={"my-config": {"config.yaml": "..."}})
        job.start()
        phase = job.wait(timeout=600)         # "Succeeded" or "Failed"
        print(job.logs("my-job-master-0"))
        job.stop()

    Args:
        job: the PyTorchJob object (kubeflow.org/v1).
        workdir: pods' sandboxes go to `<workdir>/pods/<pod>`, logs to `<workdir>/logs`.
        configmaps: ConfigMap name -> data for volumes and env references.
        secrets: Secret name -> decoded data dict (or None when missing).
        claims_dir: where PVCs live (default `<workdir>/claims`).
        master_addr / master_port: what MASTER_ADDR / MASTER_PORT become locally
            (default 127.0.0.1 and a free port).
        restart_backoff: the delay before a failed replica's first restart, in seconds (doubled
            for each further one, see `RestartBackOff`); default `restart_backoff_from_env()`.
        gpus: the GPUs to hand out to replicas that ask for `nvidia.com/gpu`; default `gpu_pool()`
            (None: unknown, nothing handed out: each replica sees what this process sees).

    Raises:
        ValueError: the replicas ask for more GPUs than `gpus` holds (a cluster would leave
            them Pending; here they would share GPUs, which NCCL refuses).
    """

    def __init__(
        self,
        job: Mapping[str, Any],
        workdir: str | os.PathLike,
        configmaps: Mapping[str, Mapping[str, str]] | None = None,
        secrets: SecretResolver | None = None,
        claims_dir: str | os.PathLike | None = None,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        restart_backoff: float | None = None,
        gpus: list[str] | None = None,
    ) -> None:
        self.job = job
        self.name = job["metadata"]["name"]
        self.workdir = Path(workdir)
        self.master_addr = master_addr
        self.master_port = master_port or free_port()
        self.replicas: dict[str, ReplicaInfo] = {}
        self.restart_backoff = restart_backoff_from_env() if restart_backoff is None else restart_backoff
        self._backoffs: dict[str, RestartBackOff] = {}
        self._restart_at: dict[str, float] = {}  # pod -> when its restart is due (poll's own restarts)
        specs = job["spec"]["pytorchReplicaSpecs"]
        run_policy = job["spec"].get("runPolicy") or {}
        self.backoff_limit = run_policy.get("backoffLimit")
        rdzv = f"{master_addr}:{self.master_port}"
        pool = gpu_pool() if gpus is None else list(gpus)
        wanted = total_gpus(job)
        if pool and wanted > len(pool):
            raise ValueError(gpu_shortage(wanted, len(pool)))
        for rtype in sorted(specs, key=lambda r: (r != "Master", r)):
            spec = specs[rtype]
            for i in range(int(spec.get("replicas") if spec.get("replicas") is not None else 1)):
                pod_name = replica_name(self.name, rtype, i)
                pod_spec = (spec.get("template") or {}).get("spec") or {}
                extra = training_operator_env(job, rtype, i, master_addr, self.master_port, rdzv_endpoint=rdzv)
                wanted = gpus_requested(pod_spec) if pool else 0  # no GPUs known: none handed out
                if wanted:
                    extra.append(("CUDA_VISIBLE_DEVICES", ",".join(pool[:wanted])))
                    pool = pool[wanted:]
                pod = LocalPod(
                    pod_name, pod_spec, self.workdir / "pods" / pod_name,
                    extra_env=extra, configmaps=configmaps, secrets=secrets,
                    claims_dir=claims_dir or self.workdir / "claims", log_path=self.workdir / "logs" / f"{pod_name}.log",
                )
                self.replicas[pod_name] = ReplicaInfo(rtype, i, pod, spec.get("restartPolicy") or "OnFailure")

    @property
    def pods(self) -> dict[str, LocalPod]:
        return {n: r.pod for n, r in self.replicas.items()}

    @property
    def restarts(self) -> int:
        """In-place restarts made so far, over all replicas (only `poll` restarts a pod)."""
        return sum(r.pod.state.restart_count for r in self.replicas.values())

    def start(self) -> None:
        for r in self.replicas.values():
            r.pod.start()

    def restart_delay(self, name: str) -> float:
        """The back-off before restarting the failed replica `name` (its `RestartBackOff` moves on)."""
        backoff = self._backoffs.setdefault(name, RestartBackOff(self.restart_backoff))
        return backoff.next(self.replicas[name].pod.ran_s)

    def poll(self) -> dict[str, ContainerState]:
        """Refresh every replica, restarting failed ones within the backoff limit once their
        back-off has passed (a replica waiting for it stays Failed, its log in place)."""
        for n, r in self.replicas.items():
            st = r.pod.poll()
            # phase_now() fails the job for any failed replica that may not restart (Never,
            # ExitCode under 128, backoff exhausted), `r` included: "Running" means restart it.
            if st.phase == "Failed" and self.phase_now() == "Running":
                due = self._restart_at.setdefault(n, time.monotonic() + self.restart_delay(n))
                if time.monotonic() >= due:
                    del self._restart_at[n]
                    r.pod.restart()
        return {n: r.pod.state for n, r in self.replicas.items()}

    def _restarts_counted(self, policies: tuple[str, ...]) -> int:
        """What `backoff_exhausted` counts for replicas of these policies: in place, the
        restartCount of pods that have not succeeded (v1.9 sums Running pods only); ExitCode, all."""
        return sum(x.pod.state.restart_count for x in self.replicas.values() if x.restart_policy in policies
                   and (x.pod.state.phase != "Succeeded" or x.restart_policy not in IN_PLACE_POLICIES))

    def restart_blocked(self, failed: Iterable[ReplicaInfo]) -> JobFailure | None:
        """Why the failed replicas `failed`, restarted together, may not be (the job fails then);
        None when they may. Never, and ExitCode with a code under 128, do not restart; otherwise
        `backoff_exhausted` decides, with every failed replica of a kind counted at once (the
        operator would see all of their restartCounts go up)."""
        failed = list(failed)
        for r in failed:
            code = r.pod.state.exit_code
            if r.restart_policy == "Never":
                return JobFailure(REPLICA_FAILED, f"{r.pod.name} exited with code {code} (restartPolicy Never)")
            if r.restart_policy == "ExitCode" and (code or 0) < 128:
                return JobFailure(REPLICA_FAILED, f"{r.pod.name} exited with code {code} (restartPolicy ExitCode "
                                                  "restarts only on codes >= 128)")
        for policies, what in ((IN_PLACE_POLICIES, "restart(s)"), (("ExitCode",), "ExitCode restart(s)")):
            failing = sum(1 for r in failed if r.restart_policy in policies)
            made = self._restarts_counted(policies)
            if failing and backoff_exhausted(self.backoff_limit, policies[0], made, failing):
                return JobFailure(BACKOFF_LIMIT_EXCEEDED, f"backoffLimit {int(self.backoff_limit)} reached after {made} {what}")
        return None

    def failure_now(self) -> JobFailure | None:
        """Why the job has failed (None while it has not): the first failed replica that may not
        restart. Does not poll."""
        if self.phase_now() != "Failed":
            return None
        return self._first_blocked()

    def _first_blocked(self) -> JobFailure | None:
        for r in self.replicas.values():
            if r.pod.state.phase == "Failed":
                why = self.restart_blocked([r])
                if why is not None:
                    return why
        return None

    def phase_now(self) -> str:
        """Succeeded, Failed or Running, from the replicas' states as they are (no poll)."""
        masters = [r for r in self.replicas.values() if r.replica_type == "Master"]
        decisive = masters or list(self.replicas.values())
        if decisive and all(r.pod.state.phase == "Succeeded" for r in decisive):
            return "Succeeded"
        return "Failed" if self._first_blocked() is not None else "Running"

    @property
    def phase(self) -> str:
        self.poll()
        return self.phase_now()

    def wait(self, timeout: float | None = None, interval: float = 0.1) -> str:
        """Block until the job succeeds or fails (or timeout: returns "Running")."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ph = self.phase
            if ph != "Running":
                return ph
            if deadline is not None and time.monotonic() >= deadline:
                return ph
            time.sleep(interval)

    def stop(self, grace: float = 5.0) -> None:
        for r in self.replicas.values():
            r.pod.terminate()
        end = time.monotonic() + grace
        for r in self.replicas.values():
            r.pod.stop(max(0.0, end - time.monotonic()))

    def logs(self, pod_name: str) -> str:
        return self.replicas[pod_name].pod.logs()

    def __enter__(self) -> "LocalPyTorchJob":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


#: File names whose text is read as YAML (JSON for .json) when rewriting mount paths;
#: files without a suffix are too when they hold a mapping or a list.
YAML_SUFFIXES = (".yaml", ".yml")


def _map_strings(doc: Any, fn: Any) -> Any:
    """doc with fn applied to every string in it (mapping keys and values, list items)."""
    if isinstance(doc, str):
        return fn(doc)
    if isinstance(doc, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_map_strings(v, fn) for v in doc]
    return doc


def rewrite_document(text: str, rewrite: Any, name: str = "") -> str:
    """A ConfigMap file's text with `rewrite` applied to the paths in it, keeping its meaning.

    Plain text replacement (what happens to every other file) is kept whenever it reads back as
    the document with its strings rewritten: formatting and comments stay. Where it does not --
    a local directory holding " #" or ": " ends a plain YAML scalar early or makes it a mapping,
    a quote or backslash breaks a quoted one -- JSON files (`*.json`, or no suffix and a JSON
    object or array) are dumped again as JSON from the rewritten document, YAML files (`*.yaml`,
    `*.yml`, or no suffix and a mapping or list inside) as YAML. Anything else is plain text.
    """
    replaced = rewrite(text)
    if replaced == text:
        return text
    suffix = os.path.splitext(name)[1].lower()
    if suffix not in ("", ".json", *YAML_SUFFIXES):
        return replaced
    if suffix in ("", ".json"):
        import json

        try:
            doc = json.loads(text)
        except ValueError:
            if suffix == ".json":
                return replaced  # not JSON after all: text
        else:
            if suffix == ".json" or isinstance(doc, (dict, list)):
                want = _map_strings(doc, rewrite)
                try:
                    if json.loads(replaced) == want:
                        return replaced
                except ValueError:
                    pass
                return json.dumps(want, indent=2, ensure_ascii=False) + ("\n" if text.endswith("\n") else "")
    import yaml

    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError:
        return replaced  # not YAML after all: text
    if suffix == "" and not any(isinstance(d, (dict, list)) for d in docs):
        return replaced  # a script or a note (one plain scalar), not a configuration

    def dump(documents: list[Any]) -> str:
        return yaml.safe_dump_all(documents, sort_keys=False, allow_unicode=True, width=1 << 30)

    want = [_map_strings(d, rewrite) for d in docs]
    try:
        if dump(list(yaml.safe_load_all(replaced))) == dump(want):
            return replaced
    except yaml.YAMLError:
        pass
    return dump(want)


def decode_configmap(cm: Mapping[str, Any]) -> dict[str, Any]:
    """A ConfigMap object's `data` plus decoded `binaryData` as one dict."""
    out: dict[str, Any] = dict(cm.get("data") or {})
    for k, v in (cm.get("binaryData") or {}).items():
        out[k] = base64.b64decode(v)
    return out
