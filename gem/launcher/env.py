"""The environment Kubeflow training-operator v1.9 injects into PyTorchJob pods.

Pure functions, no I/O, no torch. Sources (kubeflow/training-operator, release-1.9):

* `pkg/controller.v1/pytorch/envvar.go` (`setPodEnv`): for every container, appended
  after the container's own `env`, in this order:
  `PYTHONUNBUFFERED=1`; if a Master replica exists: the master vars (below), `WORLD_SIZE`
  (= total replicas x nprocPerNode, where a non-integer nprocPerNode such as "auto" counts
  as 1), `RANK` (node rank: master 0, worker i -> i+1) and `PET_NODE_RANK` (same value);
  then `PET_NPROC_PER_NODE` when `spec.nprocPerNode` is set; then, with an `elasticPolicy`
  the elastic vars, otherwise `PET_NNODES` = total replicas.
* `pkg/controller.v1/pytorch/master.go`: `MASTER_PORT`, `PET_MASTER_PORT` (the master
  `pytorch` container's port named `pytorchjob-port`), `MASTER_ADDR`, `PET_MASTER_ADDR`
  (`<job>-master-0`, the master's headless Service).
* `pkg/controller.v1/pytorch/elastic.go`: `PET_RDZV_ENDPOINT` (rdzvHost or
  `<job>-worker-0`, and rdzvPort or the worker port), `PET_RDZV_BACKEND` (default c10d),
  `PET_NNODES` (`min:max`, or worker replicas), `PET_MAX_RESTARTS`, `PET_NPROC_PER_NODE`
  (elasticPolicy.nProcPerNode), `PET_RDZV_ID`, `PET_RDZV_CONF` (`k=v,k=v`), `PET_STANDALONE`.
* Defaults the 1.9 webhook applies before the controller sees a job
  (`pkg/apis/kubeflow.org/v1/pytorch_defaults.go`): replicas 1, `nprocPerNode` "auto"
  (when elasticPolicy has no nProcPerNode), the `pytorchjob-port` port 23456.

Kubernetes resolves duplicate env names by "last one wins", so an operator variable
overrides a same-named variable from the container's own `env`.
"""

from __future__ import annotations

import base64
import re
from typing import Any, Callable, Iterable, Mapping

DEFAULT_PORT = 23456
DEFAULT_PORT_NAME = "pytorchjob-port"
DEFAULT_CONTAINER_NAME = "pytorch"
DEFAULT_NPROC_PER_NODE = "auto"

#: a secret resolver takes a Secret's name and returns its decoded data (or None: missing)
SecretResolver = Callable[[str], Mapping[str, str] | None]


def replica_name(job_name: str, replica_type: str, index: int) -> str:
    """`<job>-<type lowercased>-<index>`: the pod name and its headless Service's name."""
    return f"{job_name}-{replica_type.lower()}-{index}".replace("/", "-")


def _replica_specs(job: Mapping[str, Any]) -> dict[str, Any]:
    return dict((job.get("spec") or {}).get("pytorchReplicaSpecs") or {})


def replicas_of(job: Mapping[str, Any], replica_type: str) -> int:
    spec = _replica_specs(job).get(replica_type) or {}
    r = spec.get("replicas")
    return 1 if r is None else int(r)


def total_replicas(job: Mapping[str, Any]) -> int:
    return sum(replicas_of(job, rt) for rt in _replica_specs(job))


def nproc_per_node(job: Mapping[str, Any]) -> str | None:
    """spec.nprocPerNode after the 1.9 webhook's defaulting ("auto" unless elastic sets it)."""
    spec = job.get("spec") or {}
    if spec.get("nprocPerNode") is not None:
        return str(spec["nprocPerNode"])
    elastic = spec.get("elasticPolicy")
    if elastic is None or elastic.get("nProcPerNode") is None:
        return DEFAULT_NPROC_PER_NODE
    return None


def _nproc_int(job: Mapping[str, Any]) -> int:
    v = nproc_per_node(job)
    try:
        return int(v) if v is not None else 1
    except ValueError:
        return 1


def container_port(job: Mapping[str, Any], replica_type: str) -> int | None:
    """The `pytorchjob-port` port of the replica's `pytorch` container (default 23456)."""
    spec = _replica_specs(job).get(replica_type)
    if spec is None:
        return None
    for c in ((spec.get("template") or {}).get("spec") or {}).get("containers") or []:
        if c.get("name") == DEFAULT_CONTAINER_NAME:
            for p in c.get("ports") or []:
                if p.get("name") == DEFAULT_PORT_NAME:
                    return int(p["containerPort"])
            return DEFAULT_PORT  # the webhook adds the default port when it is missing
    return None


def training_operator_env(
    job: Mapping[str, Any],
    replica_type: str,
    index: int,
    master_addr: str | None = None,
    master_port: int | None = None,
    rdzv_endpoint: str | None = None,
) -> list[tuple[str, str]]:
    """The (name, value) pairs training-operator v1.9 appends to each container's env.

    `replica_type` is "Master" or "Worker" (any case). `master_addr`/`master_port` default
    to what the operator writes on a cluster (`<job>-master-0`, the master's
    pytorchjob-port); a local runner passes 127.0.0.1 and a free port instead.
    `rdzv_endpoint` likewise overrides the elastic `PET_RDZV_ENDPOINT`.
    """
    name = (job.get("metadata") or {}).get("name", "")
    spec = job.get("spec") or {}
    specs = _replica_specs(job)
    rtype = replica_type.lower()
    env: list[tuple[str, str]] = [("PYTHONUNBUFFERED", "1")]
    total = total_replicas(job)
    if "Master" in specs:
        port = master_port if master_port is not None else (container_port(job, "Master") or DEFAULT_PORT)
        addr = master_addr if master_addr is not None else replica_name(name, "Master", 0)
        env += [
            ("MASTER_PORT", str(port)),
            ("PET_MASTER_PORT", str(port)),
            ("MASTER_ADDR", addr),
            ("PET_MASTER_ADDR", addr),
        ]
        rank = int(index) + 1 if rtype == "worker" else int(index)
        env += [
            ("WORLD_SIZE", str(total * _nproc_int(job))),
            ("RANK", str(rank)),
            ("PET_NODE_RANK", str(rank)),
        ]
    nproc = nproc_per_node(job)
    if nproc is not None:
        env.append(("PET_NPROC_PER_NODE", nproc))
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        env += _elastic_env(job, elastic, rdzv_endpoint)
    else:
        env.append(("PET_NNODES", str(total)))
    return env


def _elastic_env(job: Mapping[str, Any], ep: Mapping[str, Any], rdzv_endpoint: str | None) -> list[tuple[str, str]]:
    name = (job.get("metadata") or {}).get("name", "")
    out: list[tuple[str, str]] = []
    if rdzv_endpoint is None:
        host = ep.get("rdzvHost") or f"{name}-worker-0"
        port = ep.get("rdzvPort") or container_port(job, "Worker") or DEFAULT_PORT
        rdzv_endpoint = f"{host}:{port}"
    out.append(("PET_RDZV_ENDPOINT", rdzv_endpoint))
    out.append(("PET_RDZV_BACKEND", str(ep.get("rdzvBackend") or "c10d")))
    if ep.get("minReplicas") is None and ep.get("maxReplicas") is None:
        out.append(("PET_NNODES", str(replicas_of(job, "Worker"))))
    else:
        out.append(("PET_NNODES", f"{ep.get('minReplicas')}:{ep.get('maxReplicas')}"))
    if ep.get("maxRestarts") is not None:
        out.append(("PET_MAX_RESTARTS", str(ep["maxRestarts"])))
    if ep.get("nProcPerNode") is not None:
        out.append(("PET_NPROC_PER_NODE", str(ep["nProcPerNode"])))
    if ep.get("rdzvId") is not None:
        out.append(("PET_RDZV_ID", str(ep["rdzvId"])))
    if ep.get("rdzvConf"):
        out.append(("PET_RDZV_CONF", ",".join(f"{c['key']}={c['value']}" for c in ep["rdzvConf"])))
    if ep.get("standalone"):
        out.append(("PET_STANDALONE", ""))
    return out


# --------------------------------------------------------------------------- container env

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined names are replaced, `$$` escapes a `$`,
    unknown references stay as they are."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(sub, value)


class EnvError(RuntimeError):
    """A container's env references a missing ConfigMap/Secret key (the kubelet's
    CreateContainerConfigError)."""


def container_env(
    container: Mapping[str, Any],
    extra: Iterable[tuple[str, str]] = (),
    configmaps: Mapping[str, Mapping[str, str]] | None = None,
    secrets: SecretResolver | None = None,
) -> dict[str, str]:
    """Resolve a container's `envFrom` + `env` (+ `extra`, appended last, e.g. the operator's
    variables) the way the kubelet does: later sources win, `$(VAR)` expands against
    variables defined before it, `valueFrom` reads ConfigMaps/Secrets."""
    configmaps = configmaps or {}
    out: dict[str, str] = {}

    def cm_data(name: str, optional: bool) -> Mapping[str, str] | None:
        d = configmaps.get(name)
        if d is None and not optional:
            raise EnvError(f'configmap "{name}" not found')
        return d

    def secret_data(name: str, optional: bool) -> Mapping[str, str] | None:
        d = secrets(name) if secrets else None
        if d is None and not optional:
            raise EnvError(f'secret "{name}" not found')
        return d

    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        if "configMapRef" in src:
            ref = src["configMapRef"]
            data = cm_data(ref["name"], bool(ref.get("optional")))
        elif "secretRef" in src:
            ref = src["secretRef"]
            data = secret_data(ref["name"], bool(ref.get("optional")))
        else:
            data = None
        for k, v in (data or {}).items():
            out[prefix + k] = v
    for e in container.get("env") or []:
        name = e["name"]
        if "value" in e and e["value"] is not None:
            out[name] = expand(str(e["value"]), out)
        elif "valueFrom" in e:
            vf = e["valueFrom"]
            if "configMapKeyRef" in vf:
                ref = vf["configMapKeyRef"]
                d = cm_data(ref["name"], bool(ref.get("optional")))
                if d is None or ref["key"] not in d:
                    if ref.get("optional"):
                        continue
                    raise EnvError(f'couldn\'t find key {ref["key"]} in ConfigMap {ref["name"]}')
                out[name] = d[ref["key"]]
            elif "secretKeyRef" in vf:
                ref = vf["secretKeyRef"]
                d = secret_data(ref["name"], bool(ref.get("optional")))
                if d is None or ref["key"] not in d:
                    if ref.get("optional"):
                        continue
                    raise EnvError(f'couldn\'t find key {ref["key"]} in Secret {ref["name"]}')
                out[name] = d[ref["key"]]
            # fieldRef / resourceFieldRef are resolved by the caller (they need the pod)
        else:
            out[name] = ""
    for k, v in extra:
        out[k] = expand(v, out)
    return out


def decode_secret(secret: Mapping[str, Any]) -> dict[str, str]:
    """A Secret object's `data` (base64) and `stringData` as a plain dict."""
    out = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    out.update(secret.get("stringData") or {})
    return out
