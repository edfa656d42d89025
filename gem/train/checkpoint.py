"""Checkpoints: atomic, resumable, and self-describing.

Layout, under <spec.checkpoint.path>/<namespace>/<name>/:

    step-00000200/
      COMPLETE                      # written last: only directories holding it are checkpoints
      gem.yaml                      # the manifest the model was trained from
      model.pt                      # consolidated fp32 state dict: the fp32 master weights (gathered under ZeRO-3)
      trainer_state.json            # step, totalSteps, loader position, MLflow run id
      rng/rank-00000.pt             # per-rank RNG states
      shards/rank-00000.pt          # ep / sparse_shard runs: this rank's expert and embedding-row shards,
                                    #   their AdamW state and schedule (DeepSpeed keeps only one rank's copy)
      mp_rank_00_model_states.pt    # DeepSpeed's own files (optimizer/ZeRO shards, scheduler)
      ...
    .tmp-step-00000300/             # a save in progress (or one that crashed): never loaded

Before the run sets up, every node's local rank 0 creates the job dir and writes a probe file in it
(`check_writable`): an unwritable root fails fast with a SpecError (exit 2) instead of at the first save.

Saving: all ranks write into the temp dir -> barrier -> rank 0 fsyncs every file and directory in
it, renames it to step-XXXXXXXX, fsyncs the job dir, writes COMPLETE (fsynced, with its directory)
-> prunes to keepLast (each old checkpoint's COMPLETE removed and fsynced before its files). The
job dir, and each directory above it that the run creates, is fsynced into its parent when made.
The rename is atomic on one filesystem, and a crash at any point leaves either a temp dir or a
directory without COMPLETE, both ignored by `latest_complete`; a checkpoint marked COMPLETE is on
disk before any older one is deleted.
A rank that fails to write its part (disk full on one node, a permission error) must not leave the
others in a barrier (NCCL: until the 30-minute collective timeout): each rank records its own write
errors and still joins every collective, DeepSpeed's save included (its checkpoint engine, which does
every torch.save of the save, is wrapped for that); the verdicts are all-gathered where the barriers
were, and every rank raises the same CheckpointSaveError naming each failed rank and its error. The
temp dir is removed and nothing of the step is marked COMPLETE; the run stops (exit 1) and a restart
resumes from the previous complete checkpoint.
With several nodes, checkpoint.path must be shared storage (checkpoint.claimName): otherwise a
node's shards are invisible to the others and resuming starts from scratch.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from gem.data.errors import SpecError
from gem.parallel.job import PLAN_KEY
from gem.train.dist import DistEnv, all_gather_objects, barrier, broadcast_object, failures_by_rank

log = logging.getLogger("gem.train")

COMPLETE = "COMPLETE"
MODEL_FILE = "model.pt"
MANIFEST_FILE = "gem.yaml"
STATE_FILE = "trainer_state.json"
SHARDS_DIR = "shards"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_LEFTOVER = re.compile(r"^(?:\.tmp-)?step-(\d{8})$")  # a step dir, or its save in progress


#: Set by the operator to the checkpoint volume's mount path; wins over spec.checkpoint.path, so the
#: pod spec (what is actually mounted) is the one source of truth inside a pod.
ENV_CHECKPOINT_DIR = "GEM_CHECKPOINT_DIR"


def checkpoint_root(spec_path: str) -> str:
    return os.environ.get(ENV_CHECKPOINT_DIR) or spec_path


def job_dir(root: str | os.PathLike, namespace: str, name: str) -> Path:
    return Path(root) / namespace / name


def job_dir_of(spec_path: str, namespace: str | None, name: str) -> Path:
    """The job dir of a job whose spec.checkpoint.path is spec_path, under the root in effect
    ($GEM_CHECKPOINT_DIR wins); a manifest without a namespace is the "local" one."""
    return job_dir(checkpoint_root(spec_path), namespace or "local", name)


def check_writable(env: DistEnv, job: Path, spec_path: str) -> None:
    """Create the job dir and write a probe file in it, or raise SpecError naming the fix. Collective.

    The first save comes checkpoint.everySteps steps in: an unwritable root found there would
    throw all of them away. Every node's local rank 0 checks, since every rank writes its own
    files into the checkpoint and a node may not share rank 0's filesystem; the verdicts are
    gathered so all ranks raise together instead of the healthy ones hanging in a collective.
    """
    problem = None
    if env.local_rank == 0:
        probe = job / f".write-probe-rank-{env.rank:05d}"
        try:
            _mkdir_durable(job)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            problem = e.strerror or str(e)
            if e.filename and Path(e.filename) != job:
                problem += f": {e.filename}"
    problems = list(failures_by_rank(problem).values())
    if not problems:
        return
    env_dir = os.environ.get(ENV_CHECKPOINT_DIR)
    if env_dir:
        where = (f"their root is ${ENV_CHECKPOINT_DIR} ({env_dir}), which wins over spec.checkpoint.path. Point "
                 f"{ENV_CHECKPOINT_DIR} at a writable directory, or unset it to use spec.checkpoint.path; in a "
                 "cluster it is the checkpoint volume's mount: the claim (spec.checkpoint.claimName) must be "
                 "writable by the pod")
    else:
        where = (f"their root is spec.checkpoint.path ({spec_path}; ${ENV_CHECKPOINT_DIR} is unset). Set "
                 f"spec.checkpoint.path to a writable directory, or run with {ENV_CHECKPOINT_DIR}=DIR "
                 f"(e.g. {ENV_CHECKPOINT_DIR}=.gem/checkpoints, as examples/quickstart.yaml says)")
    raise SpecError(f"spec.checkpoint.path: cannot write checkpoints under {job} ({problems[0]}): {where}")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(job: Path) -> list[Path]:
    """Complete checkpoints of a job, oldest first."""
    if not job.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in job.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / COMPLETE).is_file()]
    return [p for _, p in sorted(found)]


def latest_complete(job: Path) -> Path | None:
    ckpts = complete_checkpoints(job)
    return ckpts[-1] if ckpts else None


# --------------------------------------------------------------------------- model weights


def _fp32_masters(engine: Any) -> Any:
    """param -> its fp32 master weights (whole, on any device), or None where the module's own
    parameter is the master (fp32 without ZeRO).

    ZeRO-1/2/3 and DeepSpeed's BF16_Optimizer link each parameter to its master fragment:
    safe_get_full_fp32_param assembles it. ZeRO-0 in bf16 (and mxfp8, which runs DeepSpeed's bf16
    mode) wraps the trainer's torch AdamW in FP16_UnfusedOptimizer, which keeps the masters in
    `fp32_groups`, lists parallel to the module's low-precision parameters in `fp16_groups`, and
    links nothing: safe_get_full_fp32_param returns None for them, and the module's bf16 parameters
    are the masters rounded to bf16, not the masters.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    optimizer = getattr(engine, "optimizer", None)
    masters: dict[int, torch.Tensor] = {}
    low, high = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if low is not None and high is not None:
        for lp_group, hp_group in zip(low, high, strict=True):
            for lp, hp in zip(lp_group, hp_group, strict=True):
                masters[id(lp)] = hp

    def master(param: torch.Tensor) -> torch.Tensor | None:
        full = safe_get_full_fp32_param(param)
        return masters.get(id(param)) if full is None else full

    return master


def full_state_dict(engine: Any, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """The whole model in fp32 on CPU. Collective: every rank must call it (ZeRO gathers shards).

    With ZeRO or bf16 the fp32 master weights live in the optimizer (`_fp32_masters`), and they are
    what is saved, not the bf16 module parameters. Plain fp32 without ZeRO has no master copy: the
    module's parameters are it.

    keep=False (the ranks that do not write model.pt): join every gather, keep no copy, return {}.
    Before, every rank of a node held a whole fp32 copy in host memory at each save (8 GPUs: 8 copies).
    """
    master = _fp32_masters(engine)
    applied = getattr(engine.module, "gem_parallel", None)
    if applied is not None and (applied.tensor_parallel or applied.expert_parallel or applied.sparse):
        # sharded by gem.parallel: gather the single-device tensors (names and shapes of build_model)
        from gem.parallel.parallelize import full_state_dict as gather_full

        full = gather_full(engine.module, value=master)
        return {k: v.float() if v.is_floating_point() else v for k, v in full.items()} if keep else {}
    out: dict[str, torch.Tensor] = {}
    for name, param in engine.module.named_parameters():
        full = master(param)  # collective under ZeRO: every rank, kept or not
        if keep:
            out[name] = (param.detach() if full is None else full).float().cpu().clone()
    if keep:
        for name, buf in engine.module.named_buffers():
            out[name] = buf.detach().cpu().clone()
    return out


# --------------------------------------------------------------------------- save


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make the directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mkdir_durable(path: Path) -> None:
    """mkdir -p whose new entries survive a power loss: each directory it creates is fsynced into
    its parent (a rename and COMPLETE fsynced inside a job dir whose own entry was lost are lost too)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for new in reversed(missing):  # outermost first
        new.mkdir(exist_ok=True)
        _fsync_dir(new.parent)


def _fsync_tree(root: Path) -> None:
    """fsync every file under root (whoever wrote it: DeepSpeed, torch.save), then every directory, deepest first."""
    dirs = []
    for dirpath, _, filenames in os.walk(root):  # top-down
        dirs.append(Path(dirpath))
        for name in filenames:
            with open(Path(dirpath) / name, "rb") as f:
                os.fsync(f.fileno())
    for path in reversed(dirs):  # children before their parents
        _fsync_dir(path)


class CheckpointSaveError(RuntimeError):
    """A checkpoint some rank could not write: raised on every rank together, naming each failed rank."""


class _RankFailure:
    """This rank's first error while saving; the later non-collective steps of a failed rank are skipped.

    Each rank runs its own writes through `attempt`, which records the error instead of raising it, so
    the rank still enters every collective its peers enter; `verdict` then gathers all ranks' errors
    (a collective that replaces a barrier) and every rank raises the same CheckpointSaveError.
    """

    def __init__(self, env: DistEnv):
        self.env = env
        self.error: str | None = None

    def attempt(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self.error is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - OSError mostly; torch's writer raises RuntimeError
            self.error = f"{what}: {type(e).__name__}: {e}"
            log.error("rank %d: checkpoint save failed %s", self.env.rank, self.error)
            return None

    def write(self, path: str | os.PathLike, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`attempt` of a write to `path`; torch.save's zip writer reports a full disk only as an
        opaque RuntimeError ("unexpected pos 128 vs 0"), so its error gets the free space there."""
        result = self.attempt(f"writing {path}", fn, *args, **kwargs)
        if self.error is not None and self.error.startswith(f"writing {path}: RuntimeError"):
            try:
                free = shutil.disk_usage(Path(path).parent).free
                self.error += f" ({free / 2**20:.0f} MiB free on that filesystem)"
            except OSError:
                pass
        return result

    def verdict(self) -> list[str]:
        """Every failed rank's `rank N: what: error`, the same list on every rank. Collective."""
        return [f"rank {r}: {err}" for r, err in failures_by_rank(self.error).items()]


class _ErrorRecordingEngine:
    """DeepSpeed's checkpoint engine with this rank's write errors recorded (`_RankFailure`), not raised.

    DeepSpeed's save_checkpoint has a barrier after each rank wrote its own files (its module states
    on rank 0, each rank's ZeRO partition): a rank whose write raises never reaches it, and the others
    wait there (NCCL: until the collective timeout, 30 min). Its checkpoint engine (the object that does
    every torch.save and makedirs of a save) is pluggable: this one lets the save go on to that barrier
    and `save` raise afterwards on every rank. Anything else is passed through.
    """

    def __init__(self, inner: Any, failure: _RankFailure):
        self._inner, self._failure = inner, failure

    def save(self, state_dict: Any, path: str) -> None:
        self._failure.write(path, self._inner.save, state_dict, path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._failure.attempt(f"creating {path}", self._inner.makedirs, path, exist_ok=exist_ok)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _deepspeed_save(engine: Any, job: Path, tmp: Path, failure: _RankFailure) -> None:
    """engine.save_checkpoint into tmp, with this rank's write errors recorded. Collective."""
    inner = getattr(engine, "checkpoint_engine", None)
    if inner is None or inner.is_decoupled():  # a decoupled (async) engine writes after the call returns
        engine.save_checkpoint(str(job), tag=tmp.name, save_latest=False)
        return
    copy_scripts = getattr(engine, "_copy_recovery_script", None)  # rank 0 copies zero_to_fp32.py into `job`
    engine.checkpoint_engine = _ErrorRecordingEngine(inner, failure)
    if copy_scripts is not None:
        engine._copy_recovery_script = lambda path: failure.attempt(f"copying DeepSpeed's recovery scripts into "
                                                                     f"{path}", copy_scripts, path)
    try:
        engine.save_checkpoint(str(job), tag=tmp.name, save_latest=False)
    finally:
        engine.checkpoint_engine = inner
        if copy_scripts is not None:
            del engine._copy_recovery_script  # the method again


def _prepare_tmp(job: Path, tmp: Path) -> None:
    _mkdir_durable(job)
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt at this step
    tmp.mkdir()


def _write_own_files(env: DistEnv, tmp: Path, failure: _RankFailure, *, weights: dict[str, torch.Tensor],
                     manifest: dict[str, Any], state: dict[str, Any], rank_state: dict[str, Any] | None) -> None:
    """This rank's files outside DeepSpeed's (rank 0: the model, manifest and trainer state too), each
    write through `failure.attempt` (no fsync per file: _publish fsyncs the whole temp dir before renaming it)."""
    def mkdir(path: Path) -> None:
        failure.attempt(f"creating {path}", path.mkdir, exist_ok=True)

    mkdir(tmp / "rng")
    rng = tmp / "rng" / f"rank-{env.rank:05d}.pt"
    failure.write(rng, torch.save, _rng_state(), rng)
    if rank_state is not None:
        mkdir(tmp / SHARDS_DIR)
        shards = tmp / SHARDS_DIR / f"rank-{env.rank:05d}.pt"
        failure.write(shards, torch.save, rank_state, shards)
    if env.is_main:
        failure.write(tmp / MODEL_FILE, torch.save, weights, tmp / MODEL_FILE)
        failure.write(tmp / MANIFEST_FILE, (tmp / MANIFEST_FILE).write_text,
                      yaml.safe_dump(manifest, sort_keys=False), "utf-8")
        failure.write(tmp / STATE_FILE, (tmp / STATE_FILE).write_text, json.dumps(state, indent=2), "utf-8")


def _abandon(env: DistEnv, job: Path, tmp: Path, final: Path, step: int, failed: list[str], *,
             publishing: bool = False) -> CheckpointSaveError:
    """Remove what the failed save of `step` left; the error every rank raises. Collective.

    The temp dir is never loaded, but removed (a full disk gets its space back). `publishing`: rank 0
    failed while turning it into `final` (_publish), which may be renamed already and even hold a
    COMPLETE marker whose write failed half-way: the marker goes first, then the directory.
    """
    if env.is_main:
        if publishing and final.is_dir():
            try:
                (final / COMPLETE).unlink(missing_ok=True)
            except OSError as e:
                log.error("could not remove %s of the failed save: %s", final / COMPLETE, e)
            shutil.rmtree(final, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    if env.local_rank == 0 and not env.is_main:  # a node that does not share rank 0's filesystem
        shutil.rmtree(tmp, ignore_errors=True)
    previous = latest_complete(job)
    return CheckpointSaveError(
        f"checkpoint {step_dir_name(step)} under {job} was not saved: {'; '.join(failed)}. Every rank stopped "
        f"here and nothing of this step is marked {COMPLETE}: a restart resumes from "
        f"{previous.name if previous else 'scratch (no complete checkpoint yet)'}. Fix the storage of the "
        f"rank(s) named (free space, permissions, the volume of spec.checkpoint.claimName)")


def save(engine: Any, env: DistEnv, job: Path, *, step: int, manifest: dict[str, Any], state: dict[str, Any],
         keep_last: int, rank_state: dict[str, Any] | None = None) -> Path:
    """Save a checkpoint of `step` atomically; returns its final directory. Collective.

    `rank_state`: this rank's own state outside DeepSpeed (ShardOptimizer.state_dict()), written to
    shards/rank-NNNNN.pt inside the temp dir, so it is there before COMPLETE marks the checkpoint.

    A rank that cannot write its part (disk full, a permission error) does not leave the others in a
    barrier: each rank's writes record its error and the rank still joins every collective; the
    verdicts are gathered where the barriers were, and every rank raises the same
    CheckpointSaveError naming each failed rank and its error, with the temp dir removed and nothing
    of this step marked COMPLETE.
    """
    final = job / step_dir_name(step)
    tmp = job / f".tmp-{step_dir_name(step)}"
    failure = _RankFailure(env)
    if env.is_main:
        failure.attempt(f"preparing {tmp}", _prepare_tmp, job, tmp)
    failed = failure.verdict()  # rank 0 made tmp (a barrier)
    if failed:
        raise _abandon(env, job, tmp, final, step, failed)
    failure.attempt(f"creating {tmp}", tmp.mkdir, parents=True, exist_ok=True)  # a node not sharing the filesystem
    # DeepSpeed's files: module, optimizer/ZeRO partitions and the LR scheduler. save_latest=False:
    # the COMPLETE marker, not DeepSpeed's `latest` file, says which checkpoints exist.
    _deepspeed_save(engine, job, tmp, failure)
    weights = full_state_dict(engine, keep=env.is_main)  # collective: every rank, failed or not; rank 0 writes it
    _write_own_files(env, tmp, failure, weights=weights, manifest=manifest, state=state, rank_state=rank_state)
    failed = failure.verdict()  # every rank's files are in tmp (a barrier)
    if failed:
        raise _abandon(env, job, tmp, final, step, failed)
    if env.is_main:
        failure.attempt(f"publishing {tmp} as {final}", _publish, tmp, final, step)
        if failure.error is None:
            prune(job, keep_last)  # only once the new checkpoint is durable
    failed = failure.verdict()  # the checkpoint is complete (a barrier)
    if failed:
        raise _abandon(env, job, tmp, final, step, failed, publishing=True)
    if env.local_rank == 0 and not env.is_main and tmp.exists():
        # This node does not see rank 0's filesystem: its shards can never form a checkpoint.
        log.warning("checkpoint.path %s is not shared with rank 0: use a shared volume (checkpoint.claimName) "
                    "to resume multi-node jobs", job)
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _publish(tmp: Path, final: Path, step: int) -> None:
    """Durably turn the filled temp dir into a complete checkpoint: data, then name, then COMPLETE."""
    _fsync_tree(tmp)
    _remove(final)  # renamed but not yet marked before a crash, or a newer one that did not load
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    _fsync_write(final / COMPLETE, json.dumps({"step": step}) + "\n")
    _fsync_dir(final)


def prune(job: Path, keep_last: int) -> None:
    """Delete all but the newest keep_last complete checkpoints, and the leftovers older than the newest
    (a directory whose deletion or publication was cut short, a crashed save's temp dir)."""
    complete = complete_checkpoints(job)
    for old in complete[:-keep_last]:
        _remove(old)
    if not complete:
        return
    newest = int(_STEP_DIR.match(complete[-1].name).group(1))
    for path in job.iterdir():
        m = _LEFTOVER.match(path.name)
        if m and int(m.group(1)) < newest and not (path / COMPLETE).is_file():
            shutil.rmtree(path, ignore_errors=True)


def _remove(ckpt: Path) -> None:
    """Delete a checkpoint directory, its COMPLETE marker first: rmtree removes files in directory
    order, and a kill -9 part-way through must leave a directory that is not a checkpoint, not one
    marked complete with files missing (without rng/ it resumes with fresh RNG; without gem.yaml every
    restart fails). The marker's removal is fsynced before any other file goes, so that holds after a
    power loss too. Never raises: prune runs where the other ranks wait in a collective."""
    try:
        (ckpt / COMPLETE).unlink(missing_ok=True)
        if ckpt.is_dir():
            _fsync_dir(ckpt)
    except OSError as e:  # rmtree below fails the same way; the directory stays as it is
        log.warning("could not remove %s: %s", ckpt, e)
        return
    shutil.rmtree(ckpt, ignore_errors=True)


# --------------------------------------------------------------------------- load


def _owner_uid(ckpt: Path) -> str | None:
    return (read_manifest(ckpt).get("metadata") or {}).get("uid")


def set_aside_stale(job: Path, uid: str | None) -> Path | None:
    """Move a job dir left by a *different* resource of the same name out of the way.

    A GEMTraining deleted and created again under its name gets a new uid; it must start fresh,
    not resume the old one's weights. The old checkpoints are renamed, never deleted.
    """
    latest = latest_complete(job)
    if latest is None or uid is None:
        return None
    old = _owner_uid(latest)
    if old is None or old == uid:
        return None
    stale = job.with_name(f"{job.name}.stale-{old[:8]}-{int(time.time())}")
    job.rename(stale)
    log.warning("checkpoints in %s belong to an earlier resource (uid %s): moved to %s; starting fresh", job, old, stale)
    return stale


def resume_candidates(env: DistEnv, job: Path, uid: str | None = None) -> list[Path]:
    """This resource's (uid) complete checkpoints, newest first, if every rank can see them. Collective.

    Rank 0 decides; checkpoints of an earlier resource of the same name are set aside first. The
    trainer loads the first that loads on every rank (an older one when the newest is corrupt).
    """
    if env.is_main:
        set_aside_stale(job, uid)
    mine = [str(p) for p in reversed(complete_checkpoints(job))] if env.is_main else None
    chosen = broadcast_object(mine)
    if not chosen:
        return []
    visible = all_gather_objects((Path(chosen[0]) / COMPLETE).is_file())
    if not all(visible):
        log.warning("checkpoint %s is not visible on every node: starting from scratch "
                    "(use a shared volume, checkpoint.claimName, for multi-node resume)", chosen[0])
        return []
    return [Path(c) for c in chosen]


def _torch_file_problem(path: Path) -> str | None:
    """Why torch.load would fail on `path`, found cheaply; None when it looks whole."""
    try:
        if zipfile.is_zipfile(path):  # torch's format: a file cut short has lost the zip directory at its end
            with zipfile.ZipFile(path):
                return None
        torch.load(path, map_location="cpu", weights_only=False)  # legacy format, or a damaged zip: load it
    except Exception as e:  # noqa: BLE001 - whatever a damaged file raises
        return f"{path}: {type(e).__name__}: {e}"
    return None


def unreadable(env: DistEnv, ckpt: Path) -> str | None:
    """Why some rank could not read its files of `ckpt` (the same answer on every rank); None if all can. Collective.

    Checked before DeepSpeed's load, whose collectives sit between reading one rank's files and
    another's (ZeRO-3 gathers its persistent parameters once each rank has read its own partition):
    a rank failing on its own file there leaves its peers in a collective it never enters (gloo
    aborts on the mismatch, NCCL hangs) instead of falling back together. Every torch file a resume
    reads (all but model.pt) is checked once, the files split across the ranks, the verdicts gathered.
    """
    files = sorted(p for p in ckpt.rglob("*.pt") if p != ckpt / MODEL_FILE)
    problem = next(filter(None, map(_torch_file_problem, files[env.rank::env.world_size])), None)
    return next(iter(failures_by_rank(problem).values()), None)


def _or_unset(value: Any) -> Any:
    return "unset" if value is None else value


#: The spec fields a job's weights' shapes depend on, by section: GEMTraining's spec.model, a
#: distillation's spec.student and its method (and LoopFM's memoryK). Not maxSeqLen: no weight
#: depends on it (the GEM model's attention and the student's pooling read any history length).
SHAPE_FIELDS = {"model": ("preset", "embeddingDim", "numHeads", "numLayers", "affinityBranch", "generativeLossWeight"),
                "student": ("embeddingDim", "hiddenDim"),
                "distillation": ("method", "memoryK")}


def shape_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """["spec.student.hiddenDim is 128, was 64", ...]: the SHAPE_FIELDS that differ between a saved
    spec and this one (wire form), in SHAPE_FIELDS order. The one rule for both checks of them: a
    distillation's before its teacher loads (gem.distill.task.check_student_unchanged), and the
    explanation of a checkpoint that does not load (setup_changes)."""
    changes = []
    for section, names in SHAPE_FIELDS.items():
        was_s, now_s = saved.get(section), now.get(section)
        if not isinstance(was_s, dict) or not isinstance(now_s, dict):
            continue
        for name in names:
            was, cur = was_s.get(name), now_s.get(name)
            if name == "affinityBranch" and was is None:
                was = False  # the manifest predates the field (2026-12-07): its model had no branch
            if name == "generativeLossWeight" and bool(was or 0) == bool(cur or 0):
                continue  # only on / off changes the weights (its logit scales); absent: it predates the field, off
            if section != "model" and was is None:
                continue  # a field with a default, written into every manifest: absent, the manifest predates it
            if name == "memoryK" and "loopfm" not in (was_s.get("method"), now_s.get("method")):
                continue  # only the LoopFM student reads memoryK
            if was != cur:
                changes.append(f"spec.{section}.{name} is {_or_unset(cur)}, was {_or_unset(was)}")
    return changes


def _given_plan(spec: dict[str, Any]) -> Any:
    """The degrees a spec (wire form) gives: spec.parallelism.plan, else the deprecated
    training.deepspeed.parallelPlan (gem.parallel.job.explicit_degrees' rule), so that moving the
    one to the other, as its deprecation note says, is no change and a changed legacy plan is one."""
    return ((spec.get("parallelism") or {}).get("plan")
            or ((spec.get("training") or {}).get("deepspeed") or {}).get(PLAN_KEY))


def setup_changes(ckpt: Path, spec: Any, world_size: int) -> list[str]:
    """What DeepSpeed's files depend on that differs between the run that saved `ckpt` and this one
    (`spec`: the GEMTraining / LoopFMDistill spec): ZeRO stage, precision, parallel plan, world size,
    and the weights' shapes (shape_changes: spec.model / spec.student and the distillation method).

    ["spec.parallelism.zeroStage is 3, was 1", ...]; [] when nothing differs or `ckpt` has no readable gem.yaml.
    """
    try:
        saved = (read_manifest(ckpt) or {}).get("spec") or {}
    except (OSError, yaml.YAMLError):
        return []
    now = spec.to_wire()
    was_par, now_par = saved.get("parallelism") or {}, now.get("parallelism") or {}
    was_prec, now_prec = (saved.get("training") or {}).get("precision"), now["training"].get("precision")
    changes = []
    if was_par.get("zeroStage") is not None and was_par["zeroStage"] != now_par.get("zeroStage"):
        changes.append(f"spec.parallelism.zeroStage is {now_par.get('zeroStage')}, was {was_par['zeroStage']}")
    bf16 = ("bf16", "mxfp8")  # mxfp8 runs DeepSpeed's bf16 mode: the same files
    if was_prec is not None and was_prec != now_prec and not (was_prec in bf16 and now_prec in bf16):
        changes.append(f"spec.training.precision is {now_prec}, was {was_prec}")
    was_plan, now_plan = _given_plan(saved), _given_plan(now)
    if was_par and was_plan != now_plan:
        changes.append(f"spec.parallelism.plan is {now_plan or 'automatic'}, was {was_plan or 'automatic'}")
    changes += shape_changes(saved, now)  # the weights' shapes
    ranks = len(list((ckpt / "rng").glob("rank-*.pt")))  # every rank saves its RNG state
    # ZeRO-0 resumes on any world size; ZeRO partitions and ep / sparse_shard shards do not
    if ranks and ranks != world_size and (now_par.get("zeroStage") or (ckpt / SHARDS_DIR).is_dir()):
        changes.append(f"the world size (spec.parallelism.numNodes x procsPerNode) is {world_size}, was {ranks}")
    return changes


def load(engine: Any, env: DistEnv, ckpt: Path) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG; returns the trainer state. Collective."""
    loaded, _ = engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    if loaded is None:  # DeepSpeed only warns when its files are missing
        raise FileNotFoundError(f"{ckpt}: DeepSpeed found no model states to load")
    rng_file = ckpt / "rng" / f"rank-{env.rank:05d}.pt"
    if rng_file.is_file():  # absent when the world grew: the new ranks keep their fresh seeds
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((ckpt / STATE_FILE).read_text())


def load_rank_state(env: DistEnv, ckpt: Path) -> dict[str, Any]:
    """This rank's shards/rank-NNNNN.pt (what save's rank_state wrote). Raises FileNotFoundError naming it."""
    path = ckpt / SHARDS_DIR / f"rank-{env.rank:05d}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {ckpt} was saved without this rank's expert / embedding-row "
                                "shards (another parallel plan or world size); resume with the plan that saved it")
    return torch.load(path, map_location="cpu", weights_only=False)


def read_manifest(ckpt: str | os.PathLike) -> dict[str, Any]:
    return yaml.safe_load((Path(ckpt) / MANIFEST_FILE).read_text())


def checkpoint_kind(ckpt: str | os.PathLike) -> str | None:
    """The kind (GEMTraining, LoopFMDistill) its gem.yaml records, read without loading the model;
    None when it has no readable manifest (load_model then says what is missing)."""
    try:
        saved = read_manifest(ckpt)
    except OSError:
        return None
    return saved.get("kind") if isinstance(saved, dict) else None


def load_model(ckpt: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> tuple[torch.nn.Module, Any]:
    """Rebuild the model a checkpoint holds from its gem.yaml + model.pt alone: (model in eval mode, manifest)."""
    from gem.api import parse_object

    ckpt = Path(ckpt)
    if not (ckpt / MODEL_FILE).is_file():
        raise FileNotFoundError(f"{ckpt} is not a GEM checkpoint: it has no {MODEL_FILE}")
    saved = read_manifest(ckpt)
    weights = None
    if isinstance(saved, dict) and saved.get("kind") == "GEMTraining":
        weights = torch.load(ckpt / MODEL_FILE, map_location=map_location, weights_only=True)
        _default_affinity_branch(saved, weights)
    manifest = parse_object(saved)
    if manifest.kind == "GEMTraining":
        from gem.model import build_model

        model = build_model(manifest.spec.model)
    elif manifest.spec.distillation.method == "loopfm":
        from gem.loopfm.student import load_loopfm_student

        return load_loopfm_student(ckpt, map_location=map_location)  # also attaches the job's memory
    else:
        from gem.distill.student import build_student

        model = build_student(manifest.spec.student)
    if weights is None:
        weights = torch.load(ckpt / MODEL_FILE, map_location=map_location, weights_only=True)
    model.load_state_dict(weights)
    return model.eval(), manifest


def _default_affinity_branch(saved: dict[str, Any], weights: Any) -> None:
    """A gem.yaml written before spec.model.affinityBranch (2026-12-07) lacks it, and the field's
    default (true) would build a model its weights do not fit: the weights say whether the model
    has the branch (models trained before then do not)."""
    spec = saved.get("spec")
    if isinstance(spec, dict) and isinstance(spec.get("model", {}), dict) and isinstance(weights, dict):
        has_branch = any(str(k).startswith("affinity.") for k in weights)
        spec.setdefault("model", {}).setdefault("affinityBranch", has_branch)
