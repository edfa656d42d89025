"""What a spec that pydantic accepts must also satisfy to run: the values it passes into the
PyTorchJob and its pods (names, label keys and values, paths), and `training.deepspeed` keys that
contradict what the trainer derives from the spec (which the trainer refuses at setup, exit 2).

Pure and torch-free: the operator (`gem_operator.validation`) refuses such a spec with
`Valid=False`, and the SDK's local backend refuses it at submit, with the same messages, so a spec
tried on a laptop gets the verdict it would get on a cluster.
"""

from __future__ import annotations

import re
from typing import Any

from gem.api.types import CONFIG_MOUNT_PATH, TEACHER_MOUNT_PATH
from gem.parallel.job import choose_plan, deepspeed_overrides, explicit_degrees, spec_hints
from gem.parallel.plan import DEEPSPEED_DIMS
from gem.parallel.topology import Topology

# --------------------------------------------------------------------------- what the children need
# Values the spec passes into the PyTorchJob and its pods, which the API server (or the kubelet)
# would refuse there: names, label values, paths. The CRD schema cannot say it, so a spec that
# passes it would otherwise create a job that never runs.

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
#: Paths the operator mounts itself, and what they hold; the checkpoint volume and spec.volumes may not take them.
RESERVED_MOUNTS = {CONFIG_MOUNT_PATH: "the config", "/dev/shm": "shared memory"}


def subdomain_problem(value: str) -> str | None:
    """What is wrong with `value` as an object name (a DNS subdomain), or None."""
    if len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        return (
            f"{value!r} is not a valid object name: lowercase letters, digits, '-' and '.', "
            "starting and ending with a letter or digit, at most 253 characters"
        )
    return None


def label_value_problem(value: str) -> str | None:
    """What is wrong with `value` as a label value, or None."""
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        return (
            f"{value!r} is not a valid label value: at most 63 letters, digits, '-', '_' and '.', "
            "starting and ending with a letter or digit"
        )
    return None


def label_key_problem(key: str) -> str | None:
    """What is wrong with `key` as a label key (an optional DNS prefix and '/', then a name), or None."""
    prefix, slash, name = key.rpartition("/")
    if (slash and subdomain_problem(prefix)) or len(name) > 63 or not _LABEL_NAME.match(name):
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


# --------------------------------------------------------------------------- training.deepspeed
# DeepSpeed keys the trainer derives from the spec. One comparison for both callers: the trainer
# (gem/train/dist.py deepspeed_config) against the config it built with the real plan and world
# size; runnable_field_problems against what the spec alone fixes, so that the operator and
# `gemctl --local` refuse the resource instead of starting pods that exit 2 at setup.

#: The batch keys: one optimizer step per batch the trainer hands out (the step counter, LR
#: schedule, checkpoints and loader position all count optimizer steps).
DEEPSPEED_BATCH_KEYS = {
    "gradient_accumulation_steps": "remove it (gradient accumulation is not supported): "
                                   "raise spec.training.batchSize or the number of ranks for a bigger global batch",
    "train_micro_batch_size_per_gpu": "remove it and set spec.training.batchSize instead",
    "train_batch_size": "remove it: it is spec.training.batchSize x the data-parallel ranks",
}
#: Other keys the trainer derives from a spec field. An override won over the field in DeepSpeed only:
#: the expert and embedding-row shards stepped outside DeepSpeed (gem/train/optim.py) kept clipping with
#: spec.training.gradClip, and the spec said another clip than the one the dense weights got.
DEEPSPEED_SPEC_KEYS = {
    "gradient_clipping": "remove it and set spec.training.gradClip (0 disables clipping)",
}
#: Sections DeepSpeed ignores next to the optimizer and LR schedule the trainer hands it
#: (deepspeed.initialize(optimizer=, lr_scheduler=)): an override here changed nothing, silently.
DEEPSPEED_IGNORED_KEYS = {
    "optimizer": "the trainer hands DeepSpeed its own AdamW, so DeepSpeed ignores this section; remove it and "
                 "set spec.training.learningRate / weightDecay",
    "scheduler": "the trainer hands DeepSpeed its own warmup + cosine schedule, so DeepSpeed ignores this "
                 "section; remove it and set spec.training.warmupSteps / steps",
}

#: DeepSpeed's precision sections ("bfloat16" is its old name for "bf16"): the trainer derives them
#: from spec.training.precision, which the rest of the job reads too (the autocast around each step,
#: gem eval's cast of the checkpoint, resume's check of what changed). One that differs would train
#: in another precision than the spec says: bf16.enabled false with precision bf16 trains fp32
#: weights that gem eval then evaluates cast to bf16; fp16 is not offered.
DEEPSPEED_PRECISION_KEYS = ("bf16", "bfloat16", "fp16")

#: DeepSpeed's names of each dtype (deepspeed.runtime.config.DtypeEnum), without importing it.
_DTYPE_NAMES = {
    "fp32": {"fp32", "float32", "float", "torch.float32"},
    "bf16": {"bf16", "bfloat16", "torch.bfloat16"},
    "fp16": {"fp16", "float16", "half", "torch.float16"},
}
#: data_types keys that set the dtype DeepSpeed trains in (DeepSpeed 0.19, runtime/engine.py):
#: param_dtype must equal the bf16/fp16 mode's (an assert at setup otherwise); grad_accum_dtype
#: other than it is NotImplementedError at ZeRO-0, and at ZeRO-1/2 accumulates and reduces the
#: gradients in another dtype than the spec's (fp32 with bf16 at ZeRO-1 swaps the ZeRO optimizer
#: for DeepSpeed's BF16_Optimizer, other checkpoint files). buffer_dtype and keep_in_fp32_modules
#: cast only floating buffers, which the GEM models and students have none of: merged as given.
DEEPSPEED_DTYPE_KEYS = ("param_dtype", "grad_accum_dtype")
_USE_PRECISION = "use spec.training.precision (fp32, bf16 or mxfp8; fp16 is not offered)"


def _dtype_name(value: Any) -> str | None:
    """'fp32' / 'bf16' / 'fp16' for one of DeepSpeed's names of it, else None."""
    return next((name for name, names in _DTYPE_NAMES.items() if str(value) in names), None)


def derived_deepspeed_keys(training: Any, *, data_world: int) -> dict[str, Any]:
    """The batch, clipping and precision keys of the DeepSpeed config the trainer derives from `training`, with
    `data_world` data-parallel ranks (world size / tp)."""
    precision = str(getattr(training.precision, "value", training.precision))
    return {
        "train_micro_batch_size_per_gpu": training.batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": training.batch_size * data_world,
        "gradient_clipping": training.grad_clip,
        # mxfp8: apply_precision (gem/train/precision.py) swaps the Linears for MXFP8 ones; DeepSpeed
        # itself runs its bf16 mode around them (bf16 module and autocast, fp32 master weights)
        "bf16": {"enabled": precision in ("bf16", "mxfp8")},
    }


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def deepspeed_override_problems(overrides: dict[str, Any], derived: dict[str, Any], *,
                                hpz: int | None = None) -> list[tuple[str, str]]:
    """(spec.training.deepspeed.<key>, problem) for each override that differs from the `derived`
    config: a batch key, gradient_clipping or zero_optimization.stage `derived` holds, optimizer /
    scheduler (which DeepSpeed ignores next to the trainer's), a precision section whose `enabled` differs (a section
    that agrees, e.g. bf16.enabled true with precision bf16, is merged as any other key), or amp /
    torch_autocast / data_types that would train in another dtype (_dtype_override_problems).
    `hpz`: the parallel plan's hpZ partition size (1: none), where a plan is known (the trainer's setup)."""
    problems = []
    for key, fix in {**DEEPSPEED_BATCH_KEYS, **DEEPSPEED_SPEC_KEYS}.items():
        if key in overrides and key in derived and overrides[key] != derived[key]:
            problems.append((f"spec.training.deepspeed.{key}",
                             f"{overrides[key]!r} differs from the trainer's {derived[key]!r}; {fix}"))
    for key, why in DEEPSPEED_IGNORED_KEYS.items():
        if key in overrides:
            problems.append((f"spec.training.deepspeed.{key}", why))
    zero, stage = overrides.get("zero_optimization"), (derived.get("zero_optimization") or {}).get("stage")
    if "zero_optimization" in overrides and stage is not None and (
            not isinstance(zero, dict) or zero.get("stage", stage) != stage):
        # the plan's rules (ep / sparseShard at ZeRO-1/2), resume's check and the report read zeroStage
        where = "spec.training.deepspeed.zero_optimization" + (".stage" if isinstance(zero, dict) else "")
        value = zero.get("stage") if isinstance(zero, dict) else zero
        problems.append((where, f"{value!r} differs from the trainer's {stage!r}; remove it and set "
                                "spec.parallelism.zeroStage"))
    given_hpz = zero.get("zero_hpz_partition_size") if isinstance(zero, dict) else None
    if hpz is not None and given_hpz is not None and given_hpz != hpz:
        # the trainer hands DeepSpeed the plan's dp_shard group as the hpZ group (prepare_deepspeed):
        # another partition size would contradict the group, or make DeepSpeed build its own across it
        problems.append(("spec.training.deepspeed.zero_optimization.zero_hpz_partition_size",
                         f"{given_hpz!r} differs from the parallel plan's {hpz!r} (dpShard at ZeRO-3 with "
                         "dpReplicate > 1, else 1); remove it and set spec.parallelism.plan.dpShard"))
    for key in DEEPSPEED_PRECISION_KEYS:
        if key not in overrides:
            continue
        derived_on = _enabled(derived.get("bf16" if key == "bfloat16" else key))
        section = overrides[key]
        if not isinstance(section, dict) or ("enabled" in section and section["enabled"] != derived_on):
            problems.append((f"spec.training.deepspeed.{key}",
                             f"{section!r} differs from the trainer's {{'enabled': {derived_on}}}, which "
                             f"spec.training.precision sets; remove it and {_USE_PRECISION}"))
    problems.extend(_dtype_override_problems(overrides, "bf16" if _enabled(derived.get("bf16")) else "fp32"))
    return problems


def _dtype_override_problems(overrides: dict[str, Any], dtype: str) -> list[tuple[str, str]]:
    """(field, problem) for DeepSpeed's other precision keys, against `dtype`, the one the spec trains in
    (bf16 for bf16 and mxfp8, else fp32): `amp`, `torch_autocast` and `data_types`."""
    problems = []
    if "amp" in overrides:
        # DeepSpeed 0.19 refuses the key at setup, enabled or not (DeepSpeedConfigError)
        problems.append(("spec.training.deepspeed.amp", "DeepSpeed 0.19 removed its NVIDIA Apex AMP integration and "
                                                        f"refuses the key; remove it and {_USE_PRECISION}"))
    if "torch_autocast" in overrides:
        section = overrides["torch_autocast"]
        if not isinstance(section, dict):
            problems.append(("spec.training.deepspeed.torch_autocast",
                             f"{section!r} is not a section; remove it and {_USE_PRECISION}"))
        elif section.get("enabled", False) and (dtype != "bf16" or _dtype_name(section.get("dtype")) != "bf16"):
            # enabled, DeepSpeed's autocast replaces the trainer's around the forward, in its dtype (torch's
            # default when unset: fp16 on GPUs), under precision fp32 too; only bf16 with bf16 is the same
            trainer = "bf16 autocast" if dtype == "bf16" else "fp32 (no autocast)"
            problems.append(("spec.training.deepspeed.torch_autocast",
                             f"{section!r} would run the forward under DeepSpeed's autocast in "
                             f"{section.get('dtype', 'fp16 on GPUs (dtype unset)')}, not the trainer's {trainer}, "
                             f"which spec.training.precision sets; remove it and {_USE_PRECISION}"))
    if "data_types" in overrides:
        section = overrides["data_types"]
        if not isinstance(section, dict):
            problems.append(("spec.training.deepspeed.data_types",
                             f"{section!r} is not a section; remove it and {_USE_PRECISION}"))
            section = {}
        for key in DEEPSPEED_DTYPE_KEYS:
            if section.get(key) is not None and _dtype_name(section[key]) != dtype:
                problems.append((f"spec.training.deepspeed.data_types.{key}",
                                 f"{section[key]!r} differs from the trainer's {dtype!r}, the dtype "
                                 f"spec.training.precision trains in; remove it and {_USE_PRECISION}"))
    return problems


def _given_tp(spec: Any) -> int | None:
    """The tp degree the spec fixes (spec.parallelism.plan, else the deprecated training.deepspeed
    parallelPlan); None when the plan chooses it, or when the given plan is malformed (the plan's own
    check names that)."""
    try:
        degrees, _, _ = explicit_degrees(spec.parallelism, spec.training)
    except (TypeError, ValueError):
        return None
    tp = degrees.get("tp")
    return tp if tp is not None and tp >= 1 else None


def _planned_data_world(spec: Any) -> int | None:
    """The data-parallel ranks of the plan the operator renders for a GEMTraining (gem_operator/
    parallel.py: plan_job with spec_hints), None where the spec alone does not fix them. Of the plan
    they depend on tp only (world / tp), which auto_plan chooses inside one node from the node's
    size, the given degrees and the model's shape, never from the node pool or the placement: this
    plan on the bare node shape has the operator's tp. A distillation's trainer plans with its
    student's real shape (the operator renders it no plan): None, as where planning fails (the
    operator refuses that plan with its own message)."""
    if getattr(spec, "model", None) is None:
        return None
    par = spec.parallelism
    try:
        topology = Topology.build(procs_per_node=par.procs_per_node, num_nodes=par.num_nodes)
        plan, _, _, _ = choose_plan(par, spec.training, topology, hints=spec_hints(spec), allowed=DEEPSPEED_DIMS)
    except (TypeError, ValueError):  # PlanError, TopologyError
        return None
    return plan.data_world


def _deepspeed_problems(spec: Any) -> list[tuple[str, str]]:
    """deepspeed_override_problems against what the spec alone derives, at its world size (numNodes x
    procsPerNode: what the operator and the local backend launch)."""
    overrides, _ = deepspeed_overrides(spec.training.deepspeed)
    if not overrides:
        return []
    world = spec.parallelism.num_nodes * spec.parallelism.procs_per_node
    tp = _given_tp(spec)
    data_world = _planned_data_world(spec) if "train_batch_size" in overrides else None
    if data_world is None and tp is not None and world % tp == 0:
        data_world = world // tp
    derived = {**derived_deepspeed_keys(spec.training, data_world=data_world or world),
               "zero_optimization": {"stage": spec.parallelism.zero_stage}}
    if data_world is None:
        # The data-parallel ranks are world / tp, and the trainer's plan picks tp (or refuses a tp that
        # does not divide the world, with its own message): refuse only a global batch no tp could give;
        # the trainer compares the exact value with its plan at setup.
        value, batch = overrides.get("train_batch_size"), spec.training.batch_size
        if isinstance(value, int) and value > 0 and value % batch == 0 and world % (value // batch) == 0:
            del derived["train_batch_size"]
    return deepspeed_override_problems(overrides, derived)


_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
#: Variables others set in the trainer container, by name or prefix, and what to set instead. The training
#: operator appends its own after ours (the last definition wins) and torchrun overrides its workers', so a
#: spec value there would be silently lost; the rest would contradict the spec.
_ENV_RESERVED = (
    (("GEM_",), "the operator sets GEM_* variables"),
    (("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PET_", "TORCHELASTIC_", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
      "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE"),
     "the training operator and torchrun set the rendezvous variables; use spec.parallelism"),
    (("MLFLOW_TRACKING_",), "use spec.mlflow.trackingUri, and spec.mlflow.credentialsSecret for credentials "
                            "(never in the spec in clear text)"),
    (("DS_ACCELERATOR",), "set from spec.resources.gpusPerNode (cpu when it is 0)"),
    (("CUDA_VISIBLE_DEVICES",), "the GPUs of the pod are the ones its nvidia.com/gpu request gets"),
)


def _env_problems(spec: Any) -> list[tuple[str, str | None]]:
    """spec.env: names Kubernetes takes, each once, none that the platform sets itself."""
    checks: list[tuple[str, str | None]] = []
    seen: set[str] = set()
    for i, var in enumerate(spec.env):
        where, name = f"spec.env[{i}].name", var.name
        if not _ENV_NAME.match(name):
            checks.append((where, f"{name!r} is not a valid variable name: letters, digits, '_', '-' and '.', "
                                  "not starting with a digit"))
            continue
        why = next((why for names, why in _ENV_RESERVED
                    if any(name == n or (n.endswith("_") and name.startswith(n)) for n in names)), None)
        if why:
            checks.append((where, f"{name!r} cannot be set here: {why}"))
        elif name in seen:
            checks.append((where, f"{name!r} is set twice; keep one"))
        seen.add(name)
    return checks


def paths_overlap(a: str, b: str) -> bool:
    """Whether one of two absolute paths is the other or lies below it."""
    a, b = a.rstrip("/") or "/", b.rstrip("/") or "/"
    return a == b or a.startswith(b + "/") or b.startswith(a + "/") or "/" in (a, b)


def _volume_problems(spec: Any) -> list[tuple[str, str | None]]:
    """spec.volumes: claim names, and mount paths the pod can carry beside the operator's own mounts."""
    taken = {what: path for path, what in RESERVED_MOUNTS.items()}
    taken["the checkpoint volume (spec.checkpoint.path)"] = spec.checkpoint.path
    if getattr(spec, "teacher", None) is not None:
        taken["a teacher mounted away from its own path"] = TEACHER_MOUNT_PATH
    checks: list[tuple[str, str | None]] = []
    for i, vol in enumerate(spec.volumes):
        where = f"spec.volumes[{i}]"
        checks.append((f"{where}.claimName", subdomain_problem(vol.claim_name)))
        path = vol.mount_path
        if not path.startswith("/") or ":" in path or not path.rstrip("/"):
            checks.append((f"{where}.mountPath", f"{path!r} must be an absolute path without ':', other than '/', "
                                                 "e.g. /data"))
        else:
            clash = next((what for what, other in taken.items() if paths_overlap(path, other)), None)
            if clash:
                checks.append((f"{where}.mountPath", f"{path!r} overlaps {clash} ({taken[clash]}); pick another "
                                                     "directory, e.g. /data"))
            taken[f"spec.volumes[{i}].mountPath"] = path
        if vol.sub_path is not None and (not vol.sub_path or vol.sub_path.startswith("/")
                                         or ".." in vol.sub_path.split("/")):
            checks.append((f"{where}.subPath", f"{vol.sub_path!r} must be a relative path inside the claim, "
                                               "without '..'"))
    return checks


def runnable_field_problems(obj: Any) -> list[tuple[str, str]]:
    """(path, problem) for each value of a parsed spec that its PyTorchJob or pods could not carry, or
    that its trainer would refuse at setup (training.deepspeed)."""
    spec = obj.spec
    checks: list[tuple[str, str | None]] = []
    if not obj.metadata.name[:1].isalpha():
        # The training operator names the job's Services after it: a DNS-1035 label.
        checks.append(("metadata.name", f"{obj.metadata.name!r} must start with a letter: its PyTorchJob and the "
                                        "job's Services are named after it (DNS-1035 labels)"))
    if spec.image is not None and (not spec.image.strip() or any(c.isspace() for c in spec.image)):
        checks.append(("spec.image", f"{spec.image!r} is not an image reference: no whitespace allowed"))
    if spec.scheduling.queue_name:
        checks.append(("spec.scheduling.queueName", label_value_problem(spec.scheduling.queue_name)))
    if spec.scheduling.priority_class_name:
        name = spec.scheduling.priority_class_name
        checks.append(("spec.scheduling.priorityClassName", subdomain_problem(name) or label_value_problem(name)))
    checks.append(("spec.parallelism.procsPerNode", _procs_fit_gpus(spec)))
    for i, level in enumerate(spec.parallelism.topology.levels):
        # node-label keys: they become pod-affinity topology keys and Kueue annotations
        checks.append((f"spec.parallelism.topology.levels[{i}]", label_key_problem(level)))
    if len(set(spec.parallelism.topology.levels)) != len(spec.parallelism.topology.levels):
        checks.append(("spec.parallelism.topology.levels", "each label key may appear once"))
    for key, value in spec.resources.node_selector.items():
        checks.append((f"spec.resources.nodeSelector[{key!r}]", label_key_problem(key) or label_value_problem(value)))
    for i, tol in enumerate(spec.resources.tolerations):
        where = f"spec.resources.tolerations[{i}]"
        if tol.key:
            checks.append((f"{where}.key", label_key_problem(tol.key)))
        if tol.operator == "Exists" and tol.value:
            checks.append((f"{where}.value", "must be empty when operator is Exists"))
        if not tol.key and tol.operator != "Exists":
            checks.append((f"{where}.operator", "must be Exists when key is empty (tolerate every taint)"))
        if tol.value:
            checks.append((f"{where}.value", label_value_problem(tol.value)))
    path = spec.checkpoint.path.rstrip("/")
    if not spec.checkpoint.path.startswith("/") or ":" in path:
        checks.append(("spec.checkpoint.path", f"{spec.checkpoint.path!r} must be an absolute path without ':'"))
    elif not path:
        checks.append(("spec.checkpoint.path", "'/' cannot be a volume: pick a directory such as /var/lib/gem/checkpoints"))
    elif any(paths_overlap(path, m) for m in RESERVED_MOUNTS):
        checks.append(("spec.checkpoint.path", f"{spec.checkpoint.path!r} overlaps a path the operator mounts itself "
                                               f"({', '.join(RESERVED_MOUNTS)}); pick another directory"))
    if spec.checkpoint.claim_name:
        checks.append(("spec.checkpoint.claimName", subdomain_problem(spec.checkpoint.claim_name)))
    checks.extend(_volume_problems(spec))
    checks.extend(_env_problems(spec))
    if spec.mlflow.credentials_secret:
        checks.append(("spec.mlflow.credentialsSecret", subdomain_problem(spec.mlflow.credentials_secret)))
    teacher = getattr(spec, "teacher", None)
    if teacher is not None and teacher.gem_training:
        checks.append(("spec.teacher.gemTraining", subdomain_problem(teacher.gem_training)))
    checks.extend(_deepspeed_problems(spec))
    return [(where, problem) for where, problem in checks if problem]


def runnable_problems(obj: Any) -> list[str]:
    """`path: problem` for each value of a parsed spec that its PyTorchJob or pods could not carry:
    the operator's `Valid=False` message (joined with "; ") and, one per field, the local backend's
    `ValidationError`."""
    return [f"{where}: {problem}" for where, problem in runnable_field_problems(obj)]
