"""Render a GEMTraining or LoopFMDistill into the objects that run it: a ConfigMap and a PyTorchJob.

The operator applies what this renders on a cluster; the SDK's local backend runs the very same
PyTorchJob as local processes. Keeping one renderer is what makes `gemctl submit --local` behave
like the cluster. Torch-free.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import yaml

from gem.api.types import (
    API_VERSION,
    CONFIG_FILE_NAME,
    CONFIG_MOUNT_PATH,
    DEFAULT_TRAINER_IMAGE,
    KINDS,
    TERMINATION_MESSAGE_PATH,
    GEMTraining,
    LoopFMDistill,
    ParallelismSpec,
)
from gem.parallel.placement import PlacementMode, apply_placement
from gem.parallel.topology import Topology

PYTORCHJOB_API_VERSION = "kubeflow.org/v1"
CONTAINER_NAME = "pytorch"  # the training operator finds the trainer container by this name

LABEL_KIND = "gem.dev/kind"
LABEL_NAME = "gem.dev/name"
LABEL_UID = "gem.dev/uid"
LABEL_GENERATION = "gem.dev/generation"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "gem-operator"

#: Environment the trainer reads (see docs/trainer.md).
ENV_CHECKPOINT_DIR = "GEM_CHECKPOINT_DIR"
ENV_TERMINATION_PATH = "GEM_TERMINATION_MESSAGE_PATH"

_JOB_SUFFIX = {"GEMTraining": "train", "LoopFMDistill": "distill"}
#: The most pods a gang may have (spec.parallelism.numNodes' maximum).
_MAX_NODES = next(m.le for m in ParallelismSpec.model_fields["num_nodes"].metadata if getattr(m, "le", None))
# Service names are DNS-1035 labels (<= 63 chars) and the training operator gives every replica a
# Service named like its pod, "<job>-master-0" and "<job>-worker-<i>" up to i = numNodes - 2: keep
# job names short enough for the last worker of the largest gang (a name fit for "-master-0" only
# left the Services of workers 10 and up uncreatable, and the PyTorchJob's status never updated).
_MAX_JOB_NAME = 63 - len(f"-worker-{_MAX_NODES - 2}")


def job_name(kind: str, name: str) -> str:
    """The deterministic PyTorchJob name of a custom resource (one job per resource)."""
    full = f"{name}-{_JOB_SUFFIX[kind]}"
    if len(full) <= _MAX_JOB_NAME:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:8]
    return f"{full[: _MAX_JOB_NAME - 9].rstrip('-')}-{digest}"


def config_map_name(kind: str, name: str) -> str:
    return f"{job_name(kind, name)}-config"


#: The uid the trainer image runs as (docker/trainer.Dockerfile); fsGroup makes volumes writable for it.
TRAINER_UID = 10001


@dataclass(frozen=True)
class PlatformDefaults:
    """What the platform (the operator's configuration) fills in where a spec is silent."""

    trainer_image: str = DEFAULT_TRAINER_IMAGE
    mlflow_credentials_secret: str | None = None
    #: Kueue LocalQueue the PyTorchJob is queued in, as the label `queue_label`.
    queue_name: str | None = None
    queue_label: str = "kueue.x-k8s.io/queue-name"
    #: Secrets in the job's namespace the kubelet pulls the trainer image with (a private registry).
    image_pull_secrets: tuple[str, ...] = ()


@dataclass(frozen=True)
class TeacherMount:
    """Where a LoopFMDistill's resolved teacher checkpoint lives and which claim holds it."""

    checkpoint: str
    claim_name: str | None = None
    mount_path: str | None = None


@dataclass(frozen=True)
class JobPlacement:
    """How the operator places the job's pods (gem/parallel/placement.py) and what it tells the trainer."""

    topology: Topology
    """The full hierarchy of the spec's levels, sized by the node pool: what the annotations ask for."""
    mode: PlacementMode
    """kueue, affinity or none (auto already resolved, see `placement_mode`)."""
    env: dict[str, str] | None = None
    """The GEM_TOPOLOGY env entry (node pool, placement, the plan) for the trainer containers."""


def placement_mode(obj: GEMTraining | LoopFMDistill, defaults: PlatformDefaults) -> PlacementMode:
    """spec.parallelism.placement with auto resolved: kueue when the job has a Kueue queue, else affinity."""
    wanted = str(getattr(obj.spec.parallelism.placement, "value", obj.spec.parallelism.placement))
    if wanted == "auto":
        return PlacementMode.kueue if (obj.spec.scheduling.queue_name or defaults.queue_name) else PlacementMode.affinity
    return PlacementMode(wanted)


def pod_selector(obj: GEMTraining | LoopFMDistill) -> dict[str, str]:
    """Labels every pod of this resource's job carries (the pod-affinity term's selector)."""
    return {LABEL_KIND: obj.kind.lower(), LABEL_NAME: obj.metadata.name}


def trainer_manifest(obj: GEMTraining | LoopFMDistill, teacher: TeacherMount | None = None) -> dict[str, Any]:
    """The manifest the trainer reads from /etc/gem/config.yaml: spec plus identity, no status."""
    wire = obj.to_wire()
    meta = wire["metadata"]
    manifest: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": obj.kind,
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "generation") if meta.get(k) is not None},
        "spec": wire["spec"],
    }
    if teacher is not None:
        manifest["spec"]["teacher"] = {"checkpoint": teacher.checkpoint}
    return manifest


def owner_reference(obj: GEMTraining | LoopFMDistill) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": obj.kind,
        "name": obj.metadata.name,
        "uid": obj.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def labels_for(obj: GEMTraining | LoopFMDistill) -> dict[str, str]:
    labels = {
        LABEL_KIND: obj.kind.lower(),
        LABEL_NAME: obj.metadata.name,
        LABEL_MANAGED_BY: MANAGED_BY,
    }
    if obj.metadata.uid:
        labels[LABEL_UID] = obj.metadata.uid
    if obj.metadata.generation is not None:
        labels[LABEL_GENERATION] = str(obj.metadata.generation)
    return labels


def render_config_map(obj: GEMTraining | LoopFMDistill, teacher: TeacherMount | None = None) -> dict[str, Any]:
    cm: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": config_map_name(obj.kind, obj.metadata.name),
            "labels": labels_for(obj),
        },
        "data": {CONFIG_FILE_NAME: yaml.safe_dump(trainer_manifest(obj, teacher), sort_keys=False)},
    }
    if obj.metadata.namespace:
        cm["metadata"]["namespace"] = obj.metadata.namespace
    if obj.metadata.uid:
        cm["metadata"]["ownerReferences"] = [owner_reference(obj)]
    return cm


def _torchrun_args(kind: str) -> list[str]:
    # $(VAR) is expanded by the kubelet from the environment the training operator injects
    # (MASTER_ADDR, MASTER_PORT, PET_*): the pod spec shows exactly what runs.
    return [
        "--nnodes=$(PET_NNODES)",
        "--node-rank=$(PET_NODE_RANK)",
        "--nproc-per-node=$(PET_NPROC_PER_NODE)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        "-m",
        "gem",
        KINDS[kind]["trainer_command"],
        "--config",
        f"{CONFIG_MOUNT_PATH}/{CONFIG_FILE_NAME}",
    ]


def _mlflow_credentials(obj: GEMTraining | LoopFMDistill, defaults: PlatformDefaults) -> dict[str, Any] | None:
    """The secretRef of the MLflow credentials Secret, if any.

    A Secret the spec names is required: a typo shows at once (CreateContainerConfigError). The
    platform default is optional, so a namespace that has not created it still runs its jobs.
    """
    mlflow = obj.spec.mlflow
    if not mlflow.enabled:
        return None
    if mlflow.credentials_secret:
        return {"name": mlflow.credentials_secret}
    if defaults.mlflow_credentials_secret:
        return {"name": defaults.mlflow_credentials_secret, "optional": True}
    return None


def _pod_template(
    obj: GEMTraining | LoopFMDistill,
    *,
    mlflow_tracking_uri: str | None,
    teacher: TeacherMount | None,
    defaults: PlatformDefaults,
) -> dict[str, Any]:
    spec = obj.spec
    env = [
        {"name": ENV_CHECKPOINT_DIR, "value": spec.checkpoint.path},
        {"name": ENV_TERMINATION_PATH, "value": TERMINATION_MESSAGE_PATH},
    ]
    tracking_uri = spec.mlflow.tracking_uri or mlflow_tracking_uri
    if spec.mlflow.enabled and tracking_uri:
        env.append({"name": "MLFLOW_TRACKING_URI", "value": tracking_uri})
    if spec.resources.gpus_per_node == 0:
        env.append({"name": "DS_ACCELERATOR", "value": "cpu"})
    env.extend({"name": var.name, "value": var.value} for var in spec.env)

    resources: dict[str, Any] = {"requests": {"cpu": spec.resources.cpu, "memory": spec.resources.memory}}
    if spec.resources.gpus_per_node:
        gpus = str(spec.resources.gpus_per_node)
        resources["requests"]["nvidia.com/gpu"] = gpus
        resources["limits"] = {"nvidia.com/gpu": gpus}

    checkpoint_volume: dict[str, Any] = {"name": "checkpoints"}
    if spec.checkpoint.claim_name:
        checkpoint_volume["persistentVolumeClaim"] = {"claimName": spec.checkpoint.claim_name}
    else:
        checkpoint_volume["emptyDir"] = {}
    volumes = [
        {"name": "config", "configMap": {"name": config_map_name(obj.kind, obj.metadata.name)}},
        checkpoint_volume,
        # NCCL/gloo and data-loader workers use shared memory; the container default is 64 MiB.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts = [
        {"name": "config", "mountPath": CONFIG_MOUNT_PATH, "readOnly": True},
        {"name": "checkpoints", "mountPath": spec.checkpoint.path},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if teacher is not None and teacher.claim_name and teacher.mount_path and (
        teacher.claim_name != spec.checkpoint.claim_name or teacher.mount_path != spec.checkpoint.path
    ):
        volumes.append({"name": "teacher", "persistentVolumeClaim": {"claimName": teacher.claim_name, "readOnly": True}})
        mounts.append({"name": "teacher", "mountPath": teacher.mount_path, "readOnly": True})

    for i, vol in enumerate(spec.volumes):
        name = f"volume-{i}"  # ours, so it never collides with the operator's own volume names
        volumes.append({"name": name, "persistentVolumeClaim": {"claimName": vol.claim_name,
                                                                "readOnly": vol.read_only}})
        mount = {"name": name, "mountPath": vol.mount_path, "readOnly": vol.read_only}
        if vol.sub_path:
            mount["subPath"] = vol.sub_path
        mounts.append(mount)

    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image or defaults.trainer_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["torchrun"],
        "args": _torchrun_args(obj.kind),
        "env": env,
        "resources": resources,
        "volumeMounts": mounts,
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Hardened like the operator's pod, except readOnlyRootFilesystem: compilers, caches and
        # the GPU runtime write below $HOME and /tmp inside the image.
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    credentials = _mlflow_credentials(obj, defaults)
    if credentials:
        container["envFrom"] = [{"secretRef": credentials}]

    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": TRAINER_UID,
            "runAsGroup": TRAINER_UID,
            "fsGroup": TRAINER_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if defaults.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in defaults.image_pull_secrets]
    if spec.scheduling.priority_class_name:
        pod_spec["priorityClassName"] = spec.scheduling.priority_class_name
    if spec.resources.node_selector:
        pod_spec["nodeSelector"] = dict(spec.resources.node_selector)
    if spec.resources.tolerations:
        pod_spec["tolerations"] = [t.to_wire() for t in spec.resources.tolerations]
    return {"metadata": {"labels": labels_for(obj)}, "spec": pod_spec}


def render_pytorchjob(
    obj: GEMTraining | LoopFMDistill,
    *,
    mlflow_tracking_uri: str | None = None,
    teacher: TeacherMount | None = None,
    defaults: PlatformDefaults = PlatformDefaults(),
    placement: JobPlacement | None = None,
) -> dict[str, Any]:
    """The kubeflow.org/v1 PyTorchJob that runs this resource: one Master, numNodes-1 Workers.

    With `placement`, both pod templates get its Kueue annotations or pod affinity and the
    trainer container its GEM_TOPOLOGY env (the operator passes it; the local backend does not).
    """
    spec = obj.spec
    template = _pod_template(obj, mlflow_tracking_uri=mlflow_tracking_uri, teacher=teacher, defaults=defaults)
    if placement is not None and placement.env:
        template["spec"]["containers"][0]["env"].append(dict(placement.env))
    replica = {"restartPolicy": "OnFailure", "template": template}
    replica_specs: dict[str, Any] = {"Master": {"replicas": 1, **replica}}
    if spec.parallelism.num_nodes > 1:
        replica_specs["Worker"] = {"replicas": spec.parallelism.num_nodes - 1, **replica}

    run_policy: dict[str, Any] = {
        "backoffLimit": spec.run_policy.backoff_limit,
        "cleanPodPolicy": spec.run_policy.clean_pod_policy,
        "suspend": spec.suspend,
    }
    if spec.run_policy.active_deadline_seconds:
        run_policy["activeDeadlineSeconds"] = spec.run_policy.active_deadline_seconds

    job: dict[str, Any] = {
        "apiVersion": PYTORCHJOB_API_VERSION,
        "kind": "PyTorchJob",
        "metadata": {"name": job_name(obj.kind, obj.metadata.name), "labels": labels_for(obj)},
        "spec": {
            "runPolicy": run_policy,
            "nprocPerNode": str(spec.parallelism.procs_per_node),
            "pytorchReplicaSpecs": replica_specs,
        },
    }
    queue = spec.scheduling.queue_name or defaults.queue_name
    if queue:
        job["metadata"]["labels"][defaults.queue_label] = queue
    if spec.scheduling.priority_class_name:
        # The training operator's gang scheduling reads it, Kueue the workload priority (as it does
        # the pods' priorityClassName). Never the label kueue.x-k8s.io/priority-class: that names a
        # WorkloadPriorityClass, another kind of object, and Kueue creates no Workload (the job
        # stays suspended) while none of that name exists.
        run_policy["schedulingPolicy"] = {"priorityClass": spec.scheduling.priority_class_name}
    if obj.metadata.namespace:
        job["metadata"]["namespace"] = obj.metadata.namespace
    if obj.metadata.uid:
        job["metadata"]["ownerReferences"] = [owner_reference(obj)]
    if placement is not None and placement.mode is not PlacementMode.none:
        job = apply_placement(job, placement.topology, placement.mode, selector=pod_selector(obj))
    return job
