"""`gem distill` with distillation.method: loopfm, as a trainer Task.

Every rank loads the teacher (collectively: one rank failing fails them all). Then rank 0 runs the
teacher over the job's data (train and eval impressions, in request-time order, histories of the
teacher's max_seq_len events) and logs its user representation into the job's embedding memory,
<checkpoint root>/<namespace>/<name>/memory/. Only once both splits are logged does it write a
completion marker keyed by (teacher version, hash of spec.data, history window); without a matching
marker (a log cut short by preemption, one made from another spec.data under the same job name, or
with another window) the version's rows are dropped and logged again. One data source only
(data.sources with several entries is refused: the memory's key has no source; Parquet files must have
user_id and request_time, its key). The memory version is recorded in the manifest the
checkpoints carry (annotation MEMORY_VERSION_ANNOTATION), so a reloaded student reads the memory
it was trained with. The student reads the memory point-in-time in its forward pass, so training,
evaluation and serving see the same features.

Per task (click on all impressions, conversion on clicked ones), α = distillation.alpha,
T = distillation.temperature, β = distillation.beta; the student reads the user's
distillation.memoryK most recent embeddings, within distillation.memoryRetentionSeconds of the request:

    BCE(serving, label)                                     serving head: labels only, full weight
  + α·½·[BCE(aux/T, σ(teacher/T)) + BCE(aux, σ(adapter))]    aux head, gradient ×β into the backbone
  + BCE(adapter(teacher), label)                            adapter: FM prediction -> label estimate
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from gem.api.types import DataSpec, LoopFMDistill
from gem.data import Batch
from gem.data.errors import SpecError
from gem.distill.task import check_student_unchanged
from gem.distill.teacher import load_teacher_on_every_rank, with_teacher
from gem.loopfm.logging import LOGGED_KIND, UserRepresentation, log_stream, logged_version
from gem.loopfm.memory import EmbeddingMemory, TimestampRangeError
from gem.loopfm.student import LoopFMStudent
from gem.model.loss import masked_bce, task_labels, task_masks
from gem.train import checkpoint
from gem.train.dist import failures_by_rank, on_every_rank
from gem.train.task import LossFn, load_splits

log = logging.getLogger("gem.distill")


def memory_dir_of(manifest: LoopFMDistill) -> Path:
    meta = manifest.metadata
    return checkpoint.job_dir_of(manifest.spec.checkpoint.path, meta.namespace, meta.name) / "memory"


#: Where a LoopFM checkpoint's gem.yaml records the memory version its student was trained with.
MEMORY_VERSION_ANNOTATION = "loopfm.gem.dev/memory-version"


def data_spec_hash(data: DataSpec) -> str:
    """A stable hash of spec.data: a memory logged from other data is not this job's memory."""
    return hashlib.sha1(json.dumps(data.to_wire(), sort_keys=True).encode()).hexdigest()[:16]


def _marker_path(memory: EmbeddingMemory, version: str) -> Path:
    return memory.root / f"logged-{hashlib.sha1(version.encode()).hexdigest()[:16]}.json"


def logged_completely(memory: EmbeddingMemory, version: str, data_hash: str, window: int) -> bool:
    """Whether every split of this data was logged under `version`, from histories of `window` events (the
    teacher's max_seq_len): its completion marker matches. A marker without a window (logged when the data
    was loaded with 64 events whatever the teacher read) does not."""
    try:
        record = json.loads(_marker_path(memory, version).read_text())
    except (OSError, ValueError):
        return False
    return (record.get("modelVersion") == version and record.get("dataSpecHash") == data_hash
            and record.get("historyWindow") == window)


def _mark_logged(memory: EmbeddingMemory, version: str, data_hash: str, window: int, rows: int) -> None:
    path = _marker_path(memory, version)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"modelVersion": version, "dataSpecHash": data_hash, "historyWindow": window, "rows": rows}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # the marker appears whole, after every shard


def _timestamp_error(data: DataSpec, e: TimestampRangeError) -> SpecError:
    """Data whose request_time is not unix seconds (docs/data.md), as a config error naming its field."""
    src, field = (data.sources[0], "spec.data.sources[0]") if data.sources else (data, "spec.data")  # one source
    if str(src.source) == "parquet":
        where = f"{field}.path: the Parquet data at {src.path!r}"
    else:
        where = f"{field}.source: the {src.source} data"
    fix = (f"divide request_time and seq_timestamp by {e.scale} where the data is written" if e.unit
           else "write request_time and seq_timestamp as unix seconds")
    looks = f" (these look like {e.unit})" if e.unit else ""
    return SpecError(f"{where} has request_time values in [{e.low}, {e.high}]{looks}: the LoopFM memory takes unix "
                     f"seconds in [0, 2^32), as docs/data.md specifies: {fix} (gem.data.parquet.write_splits)")


def _log_memory(teacher: nn.Module, memory: EmbeddingMemory, version: str, data: DataSpec) -> None:
    """Log the teacher over both splits of `data` unless that exact log is complete; replaces a partial one."""
    data_hash = data_spec_hash(data)
    window = teacher.max_seq_len  # the events the teacher reads: the logged vector pools exactly those
    if logged_completely(memory, version, data_hash, window):
        return
    _marker_path(memory, version).unlink(missing_ok=True)  # a crash from here on leaves it incomplete
    stale = memory.drop_version(version)
    if stale:
        log.warning("loopfm memory: replacing %d rows of %s in %s (a log cut short, or logged from another "
                    "spec.data or history window)", stale, version, memory.root)
    # Sources that build histories (movielens) keep max_history events: the teacher's window, not the default 64.
    train, evaluation = load_splits(data, max_history=window)
    try:
        rows = log_stream(teacher, [train, evaluation], memory, version, kind=LOGGED_KIND)
    except TimestampRangeError as e:
        raise _timestamp_error(data, e) from e
    _mark_logged(memory, version, data_hash, window, rows)
    log.info("loopfm memory: logged %d embeddings of %s into %s", rows, version, memory.root)


def build_memory(teacher: nn.Module, teacher_dir: Path, manifest: LoopFMDistill, *, is_main: bool = True
                 ) -> tuple[EmbeddingMemory, str]:
    """The job's memory with this teacher's embeddings logged (rank 0 writes, everyone waits). Collective:
    rank 0's failure is raised on every rank, and a rank that cannot see the logged memory is a SpecError."""
    memory = EmbeddingMemory(memory_dir_of(manifest))
    version = logged_version(teacher_dir, LOGGED_KIND)
    # In place of a barrier: a rank 0 that fails here must not leave the others waiting for it (NCCL: until
    # the 30-minute timeout); every rank raises its error, a SpecError as a SpecError (exit 2).
    on_every_rank(lambda: _log_memory(teacher, memory, version, manifest.spec.data) if is_main else None,
                  kept=SpecError, what="log the LoopFM memory")
    # A node that does not see rank 0's memory would train on zeros for every user, silently.
    unseen = failures_by_rank(not logged_completely(memory, version, data_spec_hash(manifest.spec.data),
                                                    teacher.max_seq_len))
    if unseen:
        raise SpecError(
            f"spec.checkpoint.claimName: rank(s) {', '.join(map(str, unseen))} cannot see the LoopFM memory rank 0 "
            f"logged under {memory.root}: every node reads the job's memory from the checkpoint volume, which must "
            "be shared by all pods (set spec.checkpoint.claimName to a ReadWriteMany claim)")
    return memory, version


def with_memory_version(manifest: LoopFMDistill, version: str) -> LoopFMDistill:
    """A copy of the manifest recording the memory version (what checkpoints save as gem.yaml)."""
    recorded = manifest.model_copy(deep=True)
    recorded.metadata.annotations[MEMORY_VERSION_ANNOTATION] = version
    return recorded


def check_single_source(manifest: LoopFMDistill) -> None:
    """data.sources mixing several sources is refused for LoopFM: a SpecError saying why, raised alike on every
    rank (one entry is one source)."""
    if len(manifest.spec.data.sources) > 1:
        raise SpecError(
            "spec.data.sources: distillation.method loopfm reads one data source: its memory is keyed by "
            "(user_id, request_time) alone, so the sources' users would share one history (user 5 of one source "
            "reading the teacher's embeddings of user 5 of another) and their timelines would interleave in each "
            "user's point-in-time reads. Use data.source (or one entry in data.sources); for mixed data "
            "distil with distillation.method kd")


#: The columns the memory is keyed by: a Parquet file without one reads it as 0 (docs/data.md).
MEMORY_KEY_COLUMNS = ("user_id", "request_time")


def check_memory_keys(data: DataSpec) -> None:
    """Parquet data whose files lack user_id or request_time is a SpecError naming spec.data.path (footers only):
    read as 0, every example would be one user (reading other users' embeddings) or every request at time 0
    (reading none), and the student would train on it silently."""
    import pyarrow.parquet as pq

    src, field = (data.sources[0], "spec.data.sources[0]") if data.sources else (data, "spec.data")  # one source
    if str(src.source) != "parquet":
        return
    for split in ("train", "eval"):
        for f in sorted((Path(src.path) / split).glob("*.parquet")):
            missing = [c for c in MEMORY_KEY_COLUMNS if c not in pq.read_schema(f).names]
            if missing:
                raise SpecError(
                    f"{field}.path: {f} has no {' or '.join(missing)} column: the LoopFM memory is keyed by "
                    "(user_id, request_time), which a missing column reads as 0 for every row (one user, or every "
                    "request at time 0: the student would read other users' embeddings, or none). Write both "
                    "(docs/data.md), or distil this data with distillation.method kd")


class LoopFMTask:
    def __init__(self, manifest: LoopFMDistill, *, device: torch.device, is_main: bool | None = None):
        if is_main is None:
            import torch.distributed as td

            is_main = not td.is_initialized() or td.get_rank() == 0
        spec = manifest.spec
        self.device = device
        check_single_source(manifest)  # before the (slow) teacher load
        check_memory_keys(spec.data)
        check_student_unchanged(manifest)  # before the (slow) memory log
        # collective: a rank that cannot load the teacher fails every rank, not only itself
        self.teacher, self.teacher_manifest, self.teacher_dir = load_teacher_on_every_rank(
            spec, manifest.metadata.namespace, job_manifest=manifest)
        # on the training device before rank 0 logs the memory with it (log_stream runs it where its weights are)
        self.teacher.to(device)
        self.memory, self.model_version = build_memory(self.teacher, self.teacher_dir, manifest, is_main=is_main)
        # the trainer saves this one: a reloaded student reads its memory version, a resumed run keeps its teacher
        self.manifest = with_memory_version(with_teacher(manifest, self.teacher_dir), self.model_version)
        self.memory_dim = UserRepresentation(self.teacher, LOGGED_KIND).dim
        self.max_seq_len = max(self.teacher.max_seq_len, spec.student.max_seq_len)
        self.alpha = spec.distillation.alpha
        self.temperature = spec.distillation.temperature

    def build_model(self) -> nn.Module:
        spec = self.manifest.spec
        model = LoopFMStudent.from_spec(spec.student, spec.distillation, self.memory_dim)  # memoryK, beta, retention
        return model.attach_memory(self.memory.index(self.model_version))

    def loss(self, model: nn.Module, batch: Batch) -> LossFn:
        with torch.no_grad():
            teacher = self.teacher(batch)
        out = model(batch, teacher)
        return loopfm_loss(out, teacher, batch, alpha=self.alpha, temperature=self.temperature)

    def reference_metrics(self, evaluate) -> dict[str, float]:
        return evaluate(self.teacher, self.teacher.max_seq_len, "teacher_")


def loopfm_loss(out: dict[str, torch.Tensor], teacher: dict[str, torch.Tensor], batch: Batch, *,
                alpha: float, temperature: float) -> LossFn:
    labels, masks = task_labels(batch), task_masks(batch)
    T, a = temperature, alpha
    parts: dict[str, torch.Tensor] = {}
    for task in labels:
        hard = masked_bce(out[task], labels[task], masks[task])
        soft = masked_bce(out[f"aux/{task}"].float() / T, torch.sigmoid(teacher[task].detach().float() / T), masks[task])
        adapted = masked_bce(out[f"aux/{task}"], torch.sigmoid(out[f"adapter/{task}"]).detach(), masks[task])
        adapter = masked_bce(out[f"adapter/{task}"], labels[task], masks[task])
        parts[task] = hard + a * 0.5 * (soft + adapted) + adapter
        parts[f"adapter/{task}"] = adapter.detach()
    total = sum(v for k, v in parts.items() if "/" not in k)
    return total, {k: v for k, v in parts.items()}
