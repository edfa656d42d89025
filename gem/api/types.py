"""The typed API of gem-platform: GEMTraining and LoopFMDistill.

These pydantic models are the single source of truth for both custom resources:
`make crds` renders `manifests/crds/*.yaml` from them (see `gem.api.crds`), the operator
validates specs with them, the SDK builds objects with them, and `gem train --config`
reads the same object the operator wrote into the job's ConfigMap.

Field names are camelCase on the wire (Kubernetes convention) and snake_case in Python.
This module must never import torch: the SDK and the operator depend on it.
"""

from __future__ import annotations

import datetime as dt
from enum import Enum
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

GROUP = "gem.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

#: Where the operator mounts the job's ConfigMap inside the trainer container.
CONFIG_MOUNT_PATH = "/etc/gem"
CONFIG_FILE_NAME = "config.yaml"
#: The trainer writes its final report here; Kubernetes copies it into the pod's status.
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
#: Where a distillation's teacher claim is mounted when its own path is taken by the student's mounts
#: (say both use the default /var/lib/gem/checkpoints on different claims).
TEACHER_MOUNT_PATH = "/var/lib/gem/teacher"
#: The trainer image used when a spec names none and the operator is configured with none.
DEFAULT_TRAINER_IMAGE = "ghcr.io/gem-platform/trainer:0.1.0"


class ApiModel(BaseModel):
    """Base for every API object: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_enum_values=True,
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready dict Kubernetes stores (camelCase, no unset optionals)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# --------------------------------------------------------------------------- model


class ModelPreset(str, Enum):
    tiny = "tiny"
    small = "small"
    base = "base"
    large = "large"


class ModelSpec(ApiModel):
    """The shape of the GEM model. A preset fixes every size; the fields below override it."""

    preset: ModelPreset = Field(
        ModelPreset.tiny,
        description="Model size: tiny (tests), small (CPU demo), base and large (GPU).",
    )
    embedding_dim: int | None = Field(
        None, ge=8, le=8192, description="Width of every token (d). Overrides the preset."
    )
    num_heads: int | None = Field(
        None, ge=1, le=128, description="Attention heads. embeddingDim must be divisible by it."
    )
    num_layers: int | None = Field(None, ge=1, le=64, description="Sequence/interaction layers.")
    max_seq_len: int | None = Field(
        None, ge=8, le=65536, description="Longest event history kept per example (most recent events)."
    )
    affinity_branch: bool = Field(
        True,
        description="A DLRM dot-interaction branch beside the Kunlun trunk (its own tables, age-decayed "
        "history pools), logits added: how the model learns the user x ad affinity. false: the trunk "
        "alone, with exact-match flags on the events instead (the design before 2026-12-07).",
    )
    generative_loss_weight: float = Field(
        0.0, ge=0.0, le=100.0,
        description="Weight of the generative objective over the event history, added to the task losses "
        "in training: each history event's item and campaign predicted from the rest of its history "
        "(label-free; docs/architecture.md). 0: off.",
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelSpec":
        if self.embedding_dim and self.num_heads and self.embedding_dim % self.num_heads:
            raise ValueError(
                f"model.embeddingDim ({self.embedding_dim}) must be divisible by "
                f"model.numHeads ({self.num_heads}); pick a head count that divides the width"
            )
        return self


# --------------------------------------------------------------------------- data


class DataSourceKind(str, Enum):
    synthetic = "synthetic"
    parquet = "parquet"
    movielens = "movielens"


class SyntheticDataSpec(ApiModel):
    """A seeded synthetic ads world with known click and conversion probabilities."""

    # an infinite knob (YAML .inf) passes ge=0 but crashes the world or makes its features infinite
    model_config = ConfigDict(allow_inf_nan=False)

    # numpy splits a seed >= 2^32 into 32-bit words and drops trailing zero words, so such seeds
    # would reuse smaller seeds' random streams (seed 2^32's train split is seed 0's eval split)
    seed: int = Field(0, ge=0, le=2**32 - 1, description="World seed: a different seed is a held-out world.")
    num_users: int = Field(2000, ge=1, description="Distinct users.")
    num_ads: int = Field(500, ge=1, description="Distinct ads.")
    num_train_examples: int = Field(20000, ge=1, description="Training impressions generated.")
    num_eval_examples: int = Field(4000, ge=1, description="Held-out impressions for evaluation.")
    # histories run back 8x the mean events at ~2 h each: above 20000 the longest reach before 1970
    mean_history_len: float = Field(
        48.0, gt=0, le=20000, description="Mean length of a user's event history (lengths are long-tailed)."
    )
    ads_per_campaign: int = Field(8, ge=1, description="Ads (creatives) per campaign.")
    campaigns_per_advertiser: int = Field(4, ge=1, description="Campaigns per advertiser.")
    interest_drift: float = Field(
        0.02, ge=0, description="Radians per day a user's interest vector rotates (0: static interests); "
        "interests d days apart have correlation cos(interestDrift * d).",
    )
    organic_share: float = Field(
        0.25, ge=0, le=1, description="Share of history events that are organic engagement (likes, shares).",
    )
    num_organic_posts: int = Field(2000, ge=1, description="Distinct organic posts users engage with.")
    # bounds on the items and values of lists and maps go into the CRD too (items / additionalProperties),
    # so the API server refuses such a value at apply, as pydantic does
    surface_mix: list[Annotated[float, Field(ge=0)]] = Field(
        default_factory=lambda: [0.4, 0.2, 0.3, 0.1], min_length=4, max_length=4,
        description="Average share of requests and events on feed, stories, reels, off-site (normalised; "
        "each user's own mix scatters around it).",
    )
    install_share: float = Field(
        0.3, ge=0, le=1, description="Share of campaigns whose objective is an app install (else off-site purchase).",
    )
    conversion_delay_hours: float = Field(
        12.0, gt=0, description="Mean delay from click to off-site purchase (app installs: a tenth of it).",
    )
    attribution_window_hours: float = Field(
        24.0, gt=0, description="Conversions later than this after the click are labelled 0.",
    )
    quality_noise: float = Field(
        0.3, ge=0, description="Std of the noise on the observable ad-quality dense feature.",
    )

    @model_validator(mode="after")
    def _surface_mix_positive(self) -> "SyntheticDataSpec":
        if sum(self.surface_mix) <= 0:
            raise ValueError(f"synthetic.surfaceMix must have a positive sum, got {self.surface_mix}")
        return self


class DataSourceRef(ApiModel):
    """One source of a mixed run: its examples are sampled with probability weight / sum(weights)."""

    name: str = Field(
        min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Name of the source in per-source metrics (e.g. ne/click@feed); a DNS label.",
    )
    source: DataSourceKind = Field(DataSourceKind.synthetic, description="synthetic, parquet or movielens.")
    synthetic: SyntheticDataSpec = Field(
        default_factory=SyntheticDataSpec, description="World settings (source synthetic)."
    )
    path: str | None = Field(None, description="Directory or URI of Parquet shards (source parquet).")
    weight: float = Field(1.0, gt=0, description="Sampling weight, normalised over all sources.")
    evaluate: bool = Field(
        True, description="Include this source's eval split in the headline metrics (per-source metrics always)."
    )

    @model_validator(mode="after")
    def _path_for_parquet(self) -> "DataSourceRef":
        if self.source == DataSourceKind.parquet.value and not self.path:
            raise ValueError(
                f"data.sources[{self.name}].path is required when its source is parquet: set it to the shards' directory"
            )
        return self


class DataSpec(ApiModel):
    source: DataSourceKind = Field(DataSourceKind.synthetic, description="Where examples come from.")
    synthetic: SyntheticDataSpec = Field(
        default_factory=SyntheticDataSpec, description="Settings of the synthetic world."
    )
    path: str | None = Field(
        None, description="Directory or URI of Parquet shards; required when source is parquet."
    )
    sources: list[DataSourceRef] = Field(
        default_factory=list,
        description="Several sources mixed in one run with per-source sampling weights; "
        "when set, source, synthetic and path above are ignored.",
    )

    @model_validator(mode="after")
    def _path_for_parquet(self) -> "DataSpec":
        if not self.sources and self.source == DataSourceKind.parquet.value and not self.path:
            raise ValueError("data.path is required when data.source is parquet: set it to the shards' directory")
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"data.sources names must be unique (repeated: {', '.join(dupes)}): rename one of them")
        if self.sources and not any(s.evaluate for s in self.sources):
            raise ValueError("data.sources: set evaluate: true on at least one source (the headline metrics)")
        return self


# --------------------------------------------------------------------------- training


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    mxfp8 = "mxfp8"


class TrainingSpec(ApiModel):
    steps: int = Field(200, ge=1, le=10_000_000, description="Optimizer steps to train.")
    batch_size: int = Field(
        64, ge=1, le=1_000_000, description="Examples per step on each data-parallel rank."
    )
    learning_rate: float = Field(2e-3, gt=0, le=10, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay.")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps before cosine decay.")
    grad_clip: float = Field(1.0, ge=0, description="Gradient norm clip; 0 disables clipping.")
    precision: Precision = Field(Precision.fp32, description="Matmul precision: fp32, bf16 autocast or mxfp8.")
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps (0: only at the end).")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of parameter init and data order.")
    deepspeed: dict[str, Any] | None = Field(
        None,
        description="Extra DeepSpeed config merged over the one derived from this spec (expert use).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


# --------------------------------------------------------------------------- parallelism


class TopologySpec(ApiModel):
    """Network hierarchy above the node, as node-label keys from the fastest to the slowest level."""

    levels: list[str] = Field(
        default_factory=list,
        description="Node-label keys from the innermost level up, e.g. [nvidia.com/gpu.clique, topology.kubernetes.io/zone].",
    )
    nodes_per_domain: dict[str, Annotated[int, Field(ge=1)]] = Field(
        default_factory=dict,
        description="Nodes in one domain of each level, by label key (e.g. {nvidia.com/gpu.clique: 18}); "
        "a level not listed is measured from the labels of the nodes the job may use.",
    )

    @model_validator(mode="after")
    def _sizes_for_known_levels(self) -> "TopologySpec":
        unknown = sorted(set(self.nodes_per_domain) - set(self.levels))
        if unknown:
            raise ValueError(
                f"parallelism.topology.nodesPerDomain names {', '.join(unknown)}, which are not in "
                "parallelism.topology.levels: add them to levels or remove them"
            )
        return self


class ParallelPlanSpec(ApiModel):
    """Explicit parallel degrees; a degree left out is chosen automatically from the topology.

    dpReplicate x dpShard x cp x tp must equal numNodes x procsPerNode; ep divides dpShard.
    """

    dp_replicate: int | None = Field(None, ge=-1, description="HSDP replicas (outermost); -1: the ranks left over.")
    dp_shard: int | None = Field(None, ge=-1, description="ZeRO shard group size; -1: the ranks left over.")
    ep: int | None = Field(None, ge=1, description="Expert parallel degree (Wukong experts split over ep ranks).")
    cp: int | None = Field(None, ge=1, description="Context parallel degree (a batch's sequences split over cp ranks).")
    tp: int | None = Field(None, ge=1, description="Tensor parallel degree (within a node).")
    sparse_shard: int | None = Field(
        None, ge=1, description="Data ranks that row-shard each large embedding table (default dpShard x cp)."
    )

    def given(self) -> dict[str, int]:
        """The degrees the user set, camelCase, for gem.parallel.plan.ParallelPlan.from_config."""
        return {k: v for k, v in self.model_dump(by_alias=True).items() if v is not None}


class PlacementMode(str, Enum):
    auto = "auto"
    kueue = "kueue"
    affinity = "affinity"
    none = "none"


class ParallelismSpec(ApiModel):
    num_nodes: int = Field(
        2, ge=1, le=100_000, description="Pods in the gang (one master plus numNodes-1 workers)."
    )
    procs_per_node: int = Field(
        1, ge=1, le=64, description="Trainer processes per pod (usually the GPUs per node)."
    )
    zero_stage: int = Field(1, ge=0, le=3, description="DeepSpeed ZeRO stage, 0 to 3.")
    topology: TopologySpec = Field(default_factory=TopologySpec, description="Network hierarchy for placement.")
    plan: ParallelPlanSpec | None = Field(
        None, description="Explicit parallel degrees; omitted ones (or all, when empty) are chosen from the topology."
    )
    placement: PlacementMode = Field(
        PlacementMode.auto,
        description="How consecutive node ranks are kept in one topology domain: kueue (topology-aware "
        "scheduling annotations), affinity (pod affinity on the topology labels), none; auto: kueue when "
        "the job has a Kueue queue, else affinity.",
    )


# --------------------------------------------------------------------------- placement


class Toleration(ApiModel):
    key: str | None = Field(None, description="Taint key to tolerate.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal.")
    value: str | None = Field(None, description="Taint value (with Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty means all."
    )


def _int_to_str(value: Any) -> Any:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


#: A Kubernetes quantity: a string, or an integer as a Pod's requests take it (`cpu: 8`); kept as a
#: string. The CRD says int-or-string (its pattern applies to strings only, as in kube-openapi).
Quantity = Annotated[str, BeforeValidator(_int_to_str)]
_INT_OR_STRING = {"x-kubernetes-int-or-string": True, "minimum": 0}  # minimum: integers; pattern: strings


class ResourcesSpec(ApiModel):
    gpus_per_node: int = Field(0, ge=0, le=64, description="nvidia.com/gpu requested by each pod.")
    cpu: Quantity = Field(
        "1", pattern=r"^[0-9]+(\.[0-9]+)?m?$", description="CPU request of each pod, e.g. 8 or 500m.",
        json_schema_extra=_INT_OR_STRING,
    )
    memory: Quantity = Field(
        "2Gi", pattern=r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?)?$", description="Memory request of each pod, e.g. 64Gi.",
        json_schema_extra=_INT_OR_STRING,
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods must match.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints of the GPU node pool to tolerate.")


# --------------------------------------------------------------------------- outputs


class CheckpointSpec(ApiModel):
    path: str = Field(
        "/var/lib/gem/checkpoints",
        description="Directory the trainer writes checkpoints to, inside the pod.",
    )
    claim_name: str | None = Field(
        None,
        description="PersistentVolumeClaim mounted at path; without it checkpoints live only as long as the pod.",
    )
    every_steps: int = Field(100, ge=1, description="Save a checkpoint every N steps (and at the end).")
    keep_last: int = Field(3, ge=1, le=1000, description="Complete checkpoints kept; older ones are deleted.")


class ClaimVolume(ApiModel):
    """A PersistentVolumeClaim mounted into every pod of the job, e.g. the Parquet logs data.path reads."""

    claim_name: str = Field(description="The PersistentVolumeClaim, in the resource's namespace.")
    mount_path: str = Field(description="Absolute directory it is mounted at inside the pod, e.g. /data.")
    read_only: bool = Field(True, description="Mount it read-only (the trainer only reads data).")
    sub_path: str | None = Field(None, description="Mount only this relative directory of the claim.")


class EnvVar(ApiModel):
    """An environment variable of the trainer container, e.g. NCCL_SOCKET_IFNAME."""

    name: str = Field(description="Variable name: letters, digits, '_', '-' and '.', not starting with a digit.")
    value: str = Field("", description="Its value, in clear text (credentials belong in mlflow.credentialsSecret).")


def is_file_store(uri: str) -> bool:
    """Whether an MLflow tracking URI names a file store: `file:///mnt/mlruns`, or a plain directory.
    Such a store keeps each metric in a file named after it, so the trainer's `ne` and `ne/click`
    (a file and a directory of one name) cannot both be logged there."""
    if uri in ("databricks", "databricks-uc", "uc"):  # MLflow's scheme-less names of remote stores
        return False
    return urlsplit(uri).scheme in ("", "file")


class MLflowSpec(ApiModel):
    enabled: bool = Field(True, description="Log params, metrics and the checkpoint to MLflow.")
    experiment: str = Field("gem", min_length=1, description="MLflow experiment name.")
    tracking_uri: str | None = Field(
        None,
        description="Overrides the operator's MLflow URI: a server (http://...) or a database store (sqlite:///...), "
        "not a file store. Credentials never go here: use credentialsSecret.",
    )
    credentials_secret: str | None = Field(
        None,
        description="Name of a Secret whose keys (e.g. MLFLOW_TRACKING_TOKEN) become the trainer's environment.",
    )
    register_model: bool = Field(True, description="Register the final model in the MLflow model registry.")
    registered_model_name: str | None = Field(
        None, min_length=1, description="Registered model name; empty means the experiment name (GEMTraining) or "
        "metadata.name (LoopFMDistill, so a student never becomes a version of its teacher's model)."
    )

    @model_validator(mode="after")
    def _no_credentials_in_uri(self) -> "MLflowSpec":
        if self.tracking_uri and "@" in self.tracking_uri.split("//", 1)[-1].split("/", 1)[0]:
            raise ValueError(
                "mlflow.trackingUri must not carry credentials (user:password@host): "
                "put them in a Secret and name it in mlflow.credentialsSecret"
            )
        if self.tracking_uri and is_file_store(self.tracking_uri):
            raise ValueError(
                f"mlflow.trackingUri {self.tracking_uri!r} is an MLflow file store, which cannot hold the trainer's "
                "metrics (ne and ne/click would be a file and a directory of one name): use an MLflow server "
                "(http://...) or a database store (e.g. sqlite:////mnt/mlruns/mlflow.db)"
            )
        return self


class SchedulingSpec(ApiModel):
    """Where and in which order the gang is admitted: Kueue queue and priority."""

    queue_name: str | None = Field(
        None,
        description="Kueue LocalQueue to submit the job to (label kueue.x-k8s.io/queue-name); "
        "empty means the operator's default queue, if any.",
    )
    priority_class_name: str | None = Field(
        None, description="PriorityClass of the pods (and Kueue workload priority): who is preempted first."
    )


class RunPolicySpec(ApiModel):
    backoff_limit: int = Field(
        3, ge=0, le=100,
        description="The PyTorchJob's runPolicy.backoffLimit: the job fails once its pods' summed restartCount "
        "reaches it (training-operator v1.9), so n allows n - 1 restarts, none for 0 or 1.",
    )
    active_deadline_seconds: int | None = Field(None, ge=1, description="Fail the job after this long.")
    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        "None", description="Pods deleted when the job ends: None, Running or All."
    )


class CommonJobSpec(ApiModel):
    """Fields shared by every job kind."""

    image: str | None = Field(
        None,
        min_length=1,
        description="Trainer container image; empty means the operator's configured trainer image.",
    )
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, description="Gang size and ZeRO stage.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Pod resources and node pool.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpoint location and cadence.")
    mlflow: MLflowSpec = Field(default_factory=MLflowSpec, description="Experiment tracking.")
    run_policy: RunPolicySpec = Field(default_factory=RunPolicySpec, description="Retries, deadline, cleanup.")
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, description="Queue and priority.")
    suspend: bool = Field(False, description="Suspend the job: pods are stopped; resuming continues from the last checkpoint.")
    env: list[EnvVar] = Field(
        default_factory=list, max_length=64,
        description="Extra environment of the trainer container (e.g. NCCL tuning); the variables the operator, "
        "the training operator and torchrun set are refused.",
    )
    volumes: list[ClaimVolume] = Field(
        default_factory=list, max_length=16,
        description="PersistentVolumeClaims mounted into every pod besides the checkpoint claim, e.g. the one "
        "holding the Parquet logs that data.path reads.",
    )


class GEMTrainingSpec(CommonJobSpec):
    model: ModelSpec = Field(default_factory=ModelSpec, description="Model architecture and size.")
    data: DataSpec = Field(default_factory=DataSpec, description="Training and evaluation data.")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Optimisation settings.")


# --------------------------------------------------------------------------- distillation


class TeacherSpec(ApiModel):
    """Exactly one of gemTraining, checkpoint or mlflowModelUri names the teacher."""

    gem_training: str | None = Field(
        None, description="Name of a GEMTraining in the same namespace; its latest checkpoint is the teacher."
    )
    checkpoint: str | None = Field(None, description="Path of a GEM checkpoint directory.")
    mlflow_model_uri: str | None = Field(None, description="MLflow model URI, e.g. models:/gem/3.")

    @model_validator(mode="after")
    def _exactly_one(self) -> "TeacherSpec":
        named = [n for n in ("gem_training", "checkpoint", "mlflow_model_uri") if getattr(self, n)]
        if len(named) != 1:
            raise ValueError(
                "teacher must name exactly one of gemTraining, checkpoint or mlflowModelUri "
                f"(got {', '.join(to_camel(n) for n in named) or 'none'})"
            )
        return self


class StudentSpec(ApiModel):
    embedding_dim: int = Field(32, ge=4, le=4096, description="Width of the student's tokens.")
    hidden_dim: int = Field(64, ge=4, le=65536, description="Width of the student's MLP.")
    max_seq_len: int = Field(32, ge=1, le=65536, description="Recent events the student reads.")


class DistillationSpec(ApiModel):
    method: Literal["kd", "loopfm"] = Field(
        "kd", description="kd: plain knowledge distillation on teacher scores; loopfm: teacher embeddings as features."
    )
    temperature: float = Field(1.0, gt=0, le=100, description="Softening temperature of teacher logits.")
    alpha: float = Field(0.5, ge=0, le=1, description="Weight of the distillation loss against the label loss.")
    beta: float = Field(
        1.0, ge=0, le=10,
        description="loopfm: scale of the auxiliary (distillation) head's gradient into the shared student body.",
    )
    memory_k: int = Field(
        16, ge=1, le=4096, description="loopfm: the user's most recent foundation-model embeddings the student reads."
    )
    memory_retention_seconds: int | None = Field(
        None, ge=1, description="loopfm: the student reads only embeddings logged within this many seconds before the request; empty reads all."
    )


class LoopFMDistillSpec(CommonJobSpec):
    teacher: TeacherSpec = Field(description="The foundation model to distil from.")
    student: StudentSpec = Field(default_factory=StudentSpec, description="The small vertical model.")
    distillation: DistillationSpec = Field(default_factory=DistillationSpec, description="How knowledge moves.")
    data: DataSpec = Field(default_factory=DataSpec, description="Student training and evaluation data.")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Optimisation settings.")


# --------------------------------------------------------------------------- status


class Phase(str, Enum):
    pending = "Pending"
    waiting_for_teacher = "WaitingForTeacher"
    created = "Created"
    running = "Running"
    restarting = "Restarting"
    suspended = "Suspended"
    succeeded = "Succeeded"
    failed = "Failed"
    invalid = "Invalid"


TERMINAL_PHASES = frozenset({Phase.succeeded.value, Phase.failed.value, Phase.invalid.value})


class Condition(ApiModel):
    type: str = Field(description="Condition type, e.g. Valid, Created, Running, Succeeded, Failed.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field("", description="One CamelCase word saying why.")
    message: str = Field("", description="What happened and, for a problem, how to fix it.")
    last_transition_time: str = Field(
        default_factory=lambda: dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        description="When status last changed (RFC 3339).",
    )


class Progress(ApiModel):
    step: int = Field(0, ge=0, description="Optimizer steps done.")
    total_steps: int = Field(0, ge=0, description="Optimizer steps planned.")
    percent: int = Field(0, ge=0, le=100, description="step / totalSteps, in percent.")


class MLflowRunRef(ApiModel):
    run_id: str | None = Field(None, description="MLflow run id.")
    run_url: str | None = Field(None, description="Link to the run in the MLflow UI.")
    experiment_id: str | None = Field(None, description="MLflow experiment id.")


class ReplicaCounts(ApiModel):
    active: int = Field(0, ge=0, description="Pods running.")
    succeeded: int = Field(0, ge=0, description="Pods that finished.")
    failed: int = Field(0, ge=0, description="Pods that failed.")


class ParallelPlanStatus(ApiModel):
    dp_replicate: int = Field(1, description="HSDP replicas.")
    dp_shard: int = Field(1, description="ZeRO shard group size.")
    ep: int = Field(1, description="Expert parallel degree.")
    cp: int = Field(1, description="Context parallel degree.")
    tp: int = Field(1, description="Tensor parallel degree.")
    sparse_shard: int = Field(1, description="Ranks sharding each large embedding table.")
    zero_stage: int = Field(1, description="DeepSpeed ZeRO stage.")
    chosen: Literal["auto", "spec"] = Field("auto", description="auto: chosen from the topology; spec: as given.")
    reason: str = Field("", description="Why this plan: which dimension sits on which network level.")
    group_levels: dict[str, str] = Field(
        default_factory=dict, description="Network level each group stays inside (tp: node, ep: block, ...)."
    )


class PlacementStatus(ApiModel):
    mode: str = Field("none", description="kueue, affinity or none, as applied to the pods.")
    domains: dict[str, dict[str, str]] = Field(
        default_factory=dict, description="Per topology level, domain -> node ranks landed in it (e.g. 0-3)."
    )
    violations: list[str] = Field(
        default_factory=list, description="Plan groups whose ranks left the level they must stay in."
    )


class JobStatus(ApiModel):
    phase: Phase | None = Field(None, description="Where the job is in its life.")
    message: str | None = Field(None, description="A one-line summary of the latest condition.")
    conditions: list[Condition] = Field(default_factory=list, description="Latest observations, one per type.")
    observed_generation: int | None = Field(None, description="The spec generation this status describes.")
    pytorch_job: str | None = Field(None, description="Name of the child PyTorchJob.")
    replicas: dict[str, ReplicaCounts] = Field(
        default_factory=dict, description="Pod counts per replica type (Master, Worker)."
    )
    progress: Progress | None = Field(None, description="Training progress reported by the trainer.")
    mlflow: MLflowRunRef | None = Field(None, description="The MLflow run of this job.")
    latest_checkpoint: str | None = Field(None, description="Path of the newest complete checkpoint.")
    metrics: dict[str, float] = Field(
        default_factory=dict, description="Final evaluation metrics, e.g. ne/click, auc/click."
    )
    ne: float | None = Field(None, description="Headline NE: mean normalized entropy over tasks (lower is better).")
    parallel_plan: ParallelPlanStatus | None = Field(None, description="The 5D parallel plan and why.")
    placement: PlacementStatus | None = Field(None, description="Where the node ranks landed in the topology.")
    start_time: str | None = Field(None, description="When the trainer pods started.")
    completion_time: str | None = Field(None, description="When the job finished.")


class ObjectMeta(BaseModel):
    """The subset of Kubernetes ObjectMeta the SDK and operator read; the rest passes through."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    uid: str | None = None
    generation: int | None = None
    resource_version: str | None = Field(None, alias="resourceVersion")
    creation_timestamp: str | None = Field(None, alias="creationTimestamp")


class _Resource(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="allow")

    api_version: Literal["gem.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    metadata: ObjectMeta
    status: JobStatus | None = None

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class GEMTraining(_Resource):
    """Train a GEM foundation model."""

    kind: Literal["GEMTraining"] = "GEMTraining"
    spec: GEMTrainingSpec


class LoopFMDistill(_Resource):
    """Distil a GEM foundation model into a small vertical model."""

    kind: Literal["LoopFMDistill"] = "LoopFMDistill"
    spec: LoopFMDistillSpec


#: Everything about each kind the CRD generator, operator and SDK need.
KINDS: dict[str, dict[str, Any]] = {
    "GEMTraining": {
        "model": GEMTraining,
        "spec": GEMTrainingSpec,
        "plural": "gemtrainings",
        "singular": "gemtraining",
        "short_names": ["gemt", "gt"],
        "trainer_command": "train",
    },
    "LoopFMDistill": {
        "model": LoopFMDistill,
        "spec": LoopFMDistillSpec,
        "plural": "loopfmdistills",
        "singular": "loopfmdistill",
        "short_names": ["lfd"],
        "trainer_command": "distill",
    },
}


def parse_object(obj: dict[str, Any]) -> GEMTraining | LoopFMDistill:
    """Parse a GEMTraining or LoopFMDistill manifest (a dict) into its typed model.

    Only the wire (camelCase) names: the CRD has no `batch_size`, so the API server prunes such a
    key (or kubectl refuses it) and the job would run with the default; here it is an unknown field.
    Python code still builds the models with snake_case keywords."""
    kind = obj.get("kind")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    return KINDS[kind]["model"].model_validate(obj, by_alias=True, by_name=False)
