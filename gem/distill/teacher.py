"""Finding and loading the teacher of a LoopFMDistill.

The teacher is a GEM checkpoint directory (gem.yaml + model.pt, see gem/train/checkpoint.py),
named in one of three ways:
  teacher.checkpoint:      a checkpoint directory (or a job directory: its latest complete one)
  teacher.gemTraining:     a GEMTraining of the same namespace: the latest complete checkpoint
                           under <checkpoint.path>/<namespace>/<name>/ (the jobs share the volume)
  teacher.mlflowModelUri:  MLflow artifacts (e.g. runs:/<id>/checkpoint, models:/gem/3),
                           downloaded and loaded the same way

A resumed distillation keeps the teacher its checkpoints record (TEACHER_ANNOTATION in their gem.yaml),
even when spec.teacher now resolves to another checkpoint (a GEMTraining still training, a registered
model's newer version); that teacher gone, it is a SpecError. A teacher from MLflow is recorded as the
exact version downloaded (models:/<name>/latest, a stage or an alias as models:/<name>/<N>), which a
restart downloads again. Downloads go to a temp dir removed when the process exits.

A teacher that is not there, is not a GEM model, or does not load (a corrupt or truncated
model.pt, weights of another model config than its gem.yaml) is a SpecError naming
spec.teacher.<field>: `gem distill` reports it as a config error (exit 2).

Under torchrun every rank loads the teacher (load_teacher_on_every_rank): a rank that cannot (a node
without the teacher's volume, an MLflow download failing on one pod) makes every rank raise, instead
of leaving the others waiting in the trainer's first collective.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml
from torch import nn

from gem.api.types import LoopFMDistillSpec
from gem.data.errors import SpecError
from gem.train import checkpoint

log = logging.getLogger("gem.distill")


def _checkpoint_in(path: Path, what: str, fix: str) -> Path:
    """path itself if it is a checkpoint, else its latest complete checkpoint."""
    if (path / checkpoint.MODEL_FILE).is_file():
        return path
    for candidate in (path / "checkpoint", checkpoint.latest_complete(path)):
        if candidate is not None and (candidate / checkpoint.MODEL_FILE).is_file():
            return candidate
    raise SpecError(f"{what}: no GEM checkpoint (gem.yaml + model.pt) at {path}: {fix}")


class _NotInMLflow(Exception):
    """MLflow has no such registered model, version, alias or run (RESOURCE_DOES_NOT_EXIST)."""


#: The teachers this process downloaded from MLflow: their directory -> the URI of that exact version, which
#: their record keeps (with_teacher) so that a restart downloads the same teacher again.
_DOWNLOADED: dict[Path, str] = {}


def _pinned(uri: str) -> str:
    """A registered model's latest version, stage or alias (models:/<name>/latest, models:/<name>@<alias>) as the
    version it names now, models:/<name>/<N>; any other URI as it is (a version, a run's artifacts)."""
    from mlflow.store.artifact.utils.models import get_model_name_and_version
    from mlflow.tracking import MlflowClient

    if not uri.startswith("models:"):
        return uri
    found = get_model_name_and_version(MlflowClient(), uri)
    return f"models:/{found[0]}/{found[1]}" if len(found) == 2 else uri  # (model id,): a logged model, fixed


def _download(uri: str, tracking_uri: str | None) -> tuple[Path, str]:
    """(the downloaded files, the URI of the exact version downloaded). Raises _NotInMLflow."""
    import mlflow
    from mlflow.exceptions import MlflowException

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    root = Path(tempfile.mkdtemp(prefix="gem-teacher-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # a teacher may be GBs: not left behind per start
    # A registered model's (models:/...) files land in dst itself: a fixed last component keeps the
    # teacher's version (directory name + weights hash) the same on every rank and after a restart.
    try:
        pinned = _pinned(uri)
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=pinned, dst_path=str(root / "checkpoint"))), pinned
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise  # the server unreachable, say: a restart may succeed
        raise _NotInMLflow(" ".join(str(e).split())[:300]) from e  # a config error no restart fixes (exit 2)


def _mlflow_teacher(uri: str, spec: LoopFMDistillSpec) -> Path:
    """The checkpoint of MLflow's `uri`, downloaded; remembered with the exact version it is (_DOWNLOADED)."""
    path, pinned = _download(uri, spec.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
    path = _checkpoint_in(path, "spec.teacher.mlflowModelUri",
                          "point it at the artifacts of a GEM checkpoint (e.g. runs:/<id>/checkpoint)")
    _DOWNLOADED[path] = pinned
    return path


def teacher_field(spec: LoopFMDistillSpec) -> str:
    """The spec field that names the teacher (for messages)."""
    teacher = spec.teacher
    name = "checkpoint" if teacher.checkpoint else "gemTraining" if teacher.gem_training else "mlflowModelUri"
    return f"spec.teacher.{name}"


def resolve_teacher(spec: LoopFMDistillSpec, namespace: str) -> Path:
    teacher = spec.teacher
    if teacher.checkpoint:
        return _checkpoint_in(Path(teacher.checkpoint), "spec.teacher.checkpoint",
                              "set it to a checkpoint step directory or its job directory")
    if teacher.gem_training:
        job = checkpoint.job_dir_of(spec.checkpoint.path, namespace, teacher.gem_training)
        latest = checkpoint.latest_complete(job)
        if latest is None:
            raise SpecError(
                f"spec.teacher.gemTraining {teacher.gem_training!r}: no complete checkpoint under {job}: train "
                "that GEMTraining first, mount the same checkpoint volume in both jobs (spec.checkpoint), "
                "or name the teacher by spec.teacher.checkpoint / mlflowModelUri")
        return latest
    try:
        return _mlflow_teacher(teacher.mlflow_model_uri, spec)
    except _NotInMLflow as e:
        raise SpecError(f"spec.teacher.mlflowModelUri {teacher.mlflow_model_uri!r}: MLflow has no such model, version "
                        f"or run ({e}): name a registered model version (models:/<name>/<version>) or a run's "
                        "checkpoint artifacts (runs:/<run id>/checkpoint)") from e


#: Where a distillation's checkpoints (gem.yaml) record the teacher they were trained with, as JSON
#: {"checkpoint": its directory, "version": gem.loopfm.logging.model_version_of(it)}, and for a teacher from
#: MLflow "mlflowModelUri": the exact version downloaded (models:/<name>/<N> where the spec says latest).
TEACHER_ANNOTATION = "distill.gem.dev/teacher"


def with_teacher(manifest: Any, teacher_dir: Path) -> Any:
    """A copy of the manifest recording its teacher (what the trainer saves as each checkpoint's gem.yaml)."""
    from gem.loopfm.logging import model_version_of

    record = {"checkpoint": str(teacher_dir), "version": model_version_of(teacher_dir)}
    if Path(teacher_dir) in _DOWNLOADED:
        record["mlflowModelUri"] = _DOWNLOADED[Path(teacher_dir)]
    recorded = manifest.model_copy(deep=True)
    recorded.metadata.annotations[TEACHER_ANNOTATION] = json.dumps(record)
    return recorded


def resumed_manifest(job_manifest: Any) -> tuple[dict[str, Any], Path] | None:
    """(gem.yaml of the complete checkpoint a restarted job resumes from, that checkpoint), None on a
    fresh start: no checkpoint, no readable gem.yaml (the trainer decides), or an earlier resource's."""
    meta = job_manifest.metadata
    job = checkpoint.job_dir_of(job_manifest.spec.checkpoint.path, meta.namespace, meta.name)
    latest = checkpoint.latest_complete(job)
    if latest is None:
        return None
    try:
        saved = checkpoint.read_manifest(latest)
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(saved, dict):
        return None
    saved_uid = (saved.get("metadata") or {}).get("uid")
    if meta.uid and saved_uid and saved_uid != meta.uid:
        return None  # an earlier resource of this name: the trainer sets its checkpoints aside, a fresh start
    return saved, latest


def _recorded_teacher(job_manifest: Any) -> tuple[dict[str, str], Path] | None:
    """(the teacher the job's latest complete checkpoint records, that checkpoint), None on a fresh start."""
    found = resumed_manifest(job_manifest)
    if found is None:
        return None
    saved, latest = found
    try:
        recorded = json.loads(((saved.get("metadata") or {}).get("annotations") or {})[TEACHER_ANNOTATION])
    except (AttributeError, KeyError, TypeError, ValueError):
        return None  # saved before the record was kept
    return (recorded, latest) if isinstance(recorded, dict) else None


def _teacher_of_resumed_job(spec: LoopFMDistillSpec, found: tuple[dict[str, str], Path] | None, path: Path) -> Path:
    """The teacher a resumed distillation must keep: the one its checkpoints were trained with (`found`,
    from `_recorded_teacher`), even when spec.teacher now resolves to another (a GEMTraining still
    training, models:/<name>/latest moved on)."""
    from gem.loopfm.logging import model_version_of

    if found is None:
        return path
    recorded, latest = found
    version = model_version_of(path)
    if recorded.get("version") == version:
        return path
    field = teacher_field(spec)
    old = Path(recorded.get("checkpoint") or "")
    if (old / checkpoint.MODEL_FILE).is_file() and model_version_of(old) == recorded.get("version"):
        log.warning("%s now names teacher %s (%s), but this job's checkpoints (%s) were trained with %s: "
                    "resuming with that one (start a new job to distil the new teacher)",
                    field, version, path, latest.name, old)
        return old
    job = latest.parent
    pin = (" (checkpoints recorded before the version was: set it to the version they were trained with, "
           "models:/<name>/<N>)" if spec.teacher.mlflow_model_uri else "")
    raise SpecError(
        f"{field}: this job's checkpoints ({latest.name}) were trained with teacher {recorded.get('version')} "
        f"({old}), which is gone; {field} now names {version} ({path}). A resumed distillation keeps its "
        f"teacher: restore that checkpoint{pin}, or distil the new teacher from scratch under another "
        f"metadata.name (or move {job} away)")


def _recorded_mlflow_teacher(spec: LoopFMDistillSpec, recorded: dict[str, str], latest: Path) -> Path:
    """The MLflow version a resumed job's checkpoints record, downloaded again (the first start's download was in
    its own temp dir), whatever spec.teacher.mlflowModelUri's latest / stage / alias names now."""
    source, uri = recorded["mlflowModelUri"], spec.teacher.mlflow_model_uri
    if uri != source:
        log.info("spec.teacher.mlflowModelUri %s: resuming with %s, the version this job's checkpoints (%s) were "
                 "trained with (a new job distils the version it names now)", uri, source, latest.name)
    try:
        return _mlflow_teacher(source, spec)
    except _NotInMLflow as e:
        raise SpecError(
            f"spec.teacher.mlflowModelUri: this job's checkpoints ({latest.name}) were trained with teacher {source}, "
            f"which MLflow no longer has ({e}). A resumed distillation keeps its teacher: restore that version, or "
            f"distil {uri} from scratch under another metadata.name (or move {latest.parent} away)") from e


def _check_not_in_own_job(field: str, path: Path, job_manifest: Any) -> None:
    """A teacher inside the distillation's own job directory (a LoopFMDistill named like its teacher
    GEMTraining, under the same checkpoint root) is a SpecError: the trainer would resume the student from
    the teacher's checkpoints (a state-dict mismatch, exit 1), or set them aside as an earlier resource's."""
    meta = job_manifest.metadata
    job = checkpoint.job_dir_of(job_manifest.spec.checkpoint.path, meta.namespace, meta.name)
    if Path(path).resolve().is_relative_to(job.resolve()):
        raise SpecError(f"{field}: the teacher {path} is in this distillation's own job directory {job}, where "
                        "its student's checkpoints go: a LoopFMDistill and its teacher GEMTraining of the same "
                        "name share one. Rename the distillation (metadata.name) or give it another "
                        "spec.checkpoint.path")


def load_teacher(spec: LoopFMDistillSpec, namespace: str, *, job_manifest: Any = None) -> tuple[nn.Module, Any, Path]:
    """(frozen teacher in eval mode, its GEMTraining manifest, its checkpoint dir).

    job_manifest: the distillation's manifest; when its job already has checkpoints (a restart), the
    teacher they record (TEACHER_ANNOTATION) is kept, so a resume trains on against the same teacher.
    """
    field = teacher_field(spec)
    found = _recorded_teacher(job_manifest) if job_manifest is not None else None
    if found is not None and spec.teacher.mlflow_model_uri and found[0].get("mlflowModelUri"):
        # not what latest (a stage, an alias) names now: the version the checkpoints were trained with
        path = _teacher_of_resumed_job(spec, found, _recorded_mlflow_teacher(spec, *found))
    else:
        path = resolve_teacher(spec, namespace)
        if job_manifest is not None:
            _check_not_in_own_job(field, path, job_manifest)
            path = _teacher_of_resumed_job(spec, found, path)
    try:
        kind = checkpoint.checkpoint_kind(path)  # before loading: a student's checkpoint may not even load as one
    except yaml.YAMLError as e:
        raise SpecError(f"{field}: {path / checkpoint.MANIFEST_FILE} is not YAML ({type(e).__name__}): "
                        "name a complete GEMTraining checkpoint as the teacher") from e
    if kind is None:
        raise SpecError(f"{field}: checkpoint {path} has no readable {checkpoint.MANIFEST_FILE} manifest: it is "
                        "incomplete or not a GEM checkpoint; name a complete GEMTraining checkpoint as the teacher")
    if kind != "GEMTraining":
        raise SpecError(f"spec.teacher: checkpoint {path} holds a {kind} student, not a GEM model: "
                        "name a GEMTraining's checkpoint as the teacher")
    try:
        model, manifest = checkpoint.load_model(path)
    except (OSError, yaml.YAMLError, ValueError, pickle.UnpicklingError, EOFError, RuntimeError) as e:
        # model.pt truncated or corrupt (UnpicklingError, EOFError, RuntimeError from the zip reader), or the
        # weights of another model than gem.yaml describes (RuntimeError from load_state_dict): the spec names
        # a teacher that cannot be used, a config error (exit 2) that no restart fixes
        first = " ".join(str(e).split())[:300]  # load_state_dict's first line names no key
        raise SpecError(f"{field}: teacher checkpoint {path} does not load ({type(e).__name__}: {first}): it is "
                        "corrupt, incomplete, or its model.pt is not the model its gem.yaml describes; name a "
                        "complete GEMTraining checkpoint as the teacher") from e
    for p in model.parameters():
        p.requires_grad_(False)
    log.info("teacher: %s (preset %s)", path, manifest.spec.model.preset)
    return model, manifest, path


def load_teacher_on_every_rank(spec: LoopFMDistillSpec, namespace: str, *, job_manifest: Any = None
                               ) -> tuple[nn.Module, Any, Path]:
    """load_teacher on every rank of the job. Collective: a rank that fails makes every rank raise (a
    SpecError as a SpecError, exit 2), rather than the others going on into the next collective and waiting
    for it (gloo: 'Connection closed by peer'; NCCL: until the 30-minute timeout); ranks that loaded
    different teachers (spec.teacher resolved while a GEMTraining saved a newer checkpoint) raise too."""
    from gem.loopfm.logging import model_version_of
    from gem.train.dist import all_gather_objects

    loaded: tuple[nn.Module, Any, Path] | None = None
    error: Exception | None = None
    try:
        loaded = load_teacher(spec, namespace, job_manifest=job_manifest)
        outcome: tuple[str, Any] = ("version", model_version_of(loaded[2]))  # hashed once per process
    except Exception as e:  # noqa: BLE001 - gathered, then raised on every rank
        error = e
        outcome = ("spec" if isinstance(e, SpecError) else "error", str(e) if isinstance(e, SpecError)
                   else f"{type(e).__name__}: {e}")
    outcomes = all_gather_objects(outcome)
    failed = {rank: o for rank, o in enumerate(outcomes) if o[0] != "version"}
    if error is not None and len(failed) == len(outcomes):
        raise error  # every rank failed (one process, or a spec no pod can load): its own error, unchanged
    if failed:
        rank, (what, message) = min(failed.items())
        ok = [r for r in range(len(outcomes)) if r not in failed]
        where = (f" [rank(s) {', '.join(map(str, sorted(failed)))} of {len(outcomes)} failed, rank(s) "
                 f"{', '.join(map(str, ok))} loaded the teacher: every pod must see it (the checkpoint volume of "
                 "spec.teacher.gemTraining / checkpoint shared by all nodes, spec.checkpoint.claimName; MLflow "
                 "reachable from every pod)]")
        if what == "spec":
            raise SpecError(message + where) from error
        raise RuntimeError(f"rank {rank} failed to load the teacher: {message}{where}") from error
    versions = {o[1] for o in outcomes}
    if len(versions) > 1:
        raise RuntimeError(f"{teacher_field(spec)}: the ranks resolved different teachers ({', '.join(sorted(versions))}"
                           "): a GEMTraining saved a checkpoint, or a registered model moved, while they resolved it; "
                           "a restart resolves it again (name a checkpoint directory to pin it)")
    assert loaded is not None
    return loaded
