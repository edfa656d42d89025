"""The training loop shared by `gem train` and `gem distill`.

    env = init_distributed()                     # torchrun's world, or a world of one
    checkpoint root writable?                    # else SpecError (exit 2) now, not at the first save
    parallel = setup_parallel(model, spec, env)  # parallel plan (logged with its reason), groups, parallelized model
                                                 # a plan the DeepSpeed path cannot run: SpecError (exit 2)
    engine = deepspeed.initialize(model, AdamW, warmup+cosine, config from the spec and plan, mpu)
        # ep / sparse_shard: expert and embedding-row shards stay out of DeepSpeed, with their own AdamW
        # (gem.train.optim.ShardOptimizer: synced after backward, clipped with the global norm)
    resume from the latest complete checkpoint   # model, optimizer, scheduler, data position, RNG
        (the one before it, with a warning, when it does not load); MLflow continues its run
    for step in start+1 .. training.steps:
        SIGTERM on any rank (a pod deleted, preempted, drained): every rank stops here, before the step;
            the MLflow run ends KILLED, and the process exits 143 (Terminated; no new checkpoint)
        loss = task.loss(engine, next batch); engine.backward(loss); engine.step()
        every evalEvery steps: evaluate;  every checkpoint.everySteps and at the end: save
            (a rank that cannot write its files: every rank raises checkpoint.CheckpointSaveError together)
    evaluate; log to MLflow; return the final report (rank 0 writes it, see gem/train/report.py)
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import torch
import torch.distributed as torch_dist

from gem.data import Batch
from gem.data.errors import SpecError
from gem.data.sources import load_data
from gem.eval.evaluate import (
    collect_predictions,
    evaluate_sources,
    finite_or_none,
    metrics_from_predictions,
    predictions_by_source,
)
from gem.parallel.plan import PlanError
from gem.train import checkpoint
from gem.train.dist import (
    DistEnv,
    all_gather_objects,
    deepspeed_config,
    failures_by_rank,
    on_every_rank,
    setup_parallel,
)
from gem.train.optim import ShardOptimizer, build_optimizer
from gem.train.precision import apply_precision
from gem.train.task import Task
from gem.train.tracking import Tracker

log = logging.getLogger("gem.train")

LOG_EVERY = 10  # steps between structured log lines
#: Fault injection for resume tests and chaos drills: fail right after finishing this step.
FAULT_ENV = "GEM_FAULT_AT_STEP"


class DivergedError(RuntimeError):
    """The training loss is not finite: the step just taken made the weights NaN/inf, so nothing after
    it is saved (a checkpoint of such weights would resume into the same failure, or be registered)."""

    def __init__(self, step: int, loss: float, rank: int, last_ckpt: Path | None):
        resume = f"the last complete checkpoint is {last_ckpt.name}" if last_ckpt else "no checkpoint was saved yet"
        super().__init__(
            f"the training loss is {loss} at step {step} (rank {rank}); nothing from this step on is saved and "
            f"{resume}. NaN/inf inputs (dense features) or a diverging model: check the data, lower "
            "spec.training.learningRate or spec.training.gradClip, or train in fp32 to rule out bf16 overflow")


class Terminated(Exception):
    """The job was told to stop (SIGTERM: Kubernetes deleting, preempting or draining its pod, or
    torchrun passing that on) and stopped at a step boundary; the process exits 128 + the signal."""

    on_every_rank = True  # the stop is all-reduced: every rank raises it at the same step

    def __init__(self, signum: int, step: int, last_ckpt: Path | None):
        self.signum = signum
        resume = f"a restart resumes from {last_ckpt.name}" if last_ckpt else "no checkpoint was saved yet"
        super().__init__(f"stopped by {signal.Signals(signum).name} before step {step + 1}: nothing after step "
                         f"{step} was trained; {resume}")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, task: Task, env: DistEnv):
        self.task = task
        self.env = env
        self.manifest = task.manifest
        self.spec = task.manifest.spec
        meta = self.manifest.metadata
        self.job_dir = checkpoint.job_dir_of(self.spec.checkpoint.path, meta.namespace, meta.name)
        self.total_steps = self.spec.training.steps
        self.step = 0
        self.resumed_from: Path | None = None
        self.tracker = Tracker(self.manifest, active=env.is_main)
        self.bf16 = str(self.spec.training.precision) in ("bf16", "mxfp8")
        self._signal: int | None = None  # the stop signal received, acted on at the next step boundary

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfigError
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        training = self.spec.training
        # Same seed on every rank: identical initial weights (ZeRO-3 partitions each rank's copy).
        seed_everything(training.seed)
        self.data = load_data(self.spec.data, max_history=self.task.max_seq_len)
        self.eval_examples = self.data.eval
        # mxfp8: MX matmuls (precision.py); the device: a GPU without MX kernels gets a warning (emulated)
        model = apply_precision(self.task.build_model(), training.precision, device=self.env.device)
        n_params = sum(p.numel() for p in model.parameters())  # whole: before tp / ep / ZeRO-3 shard it
        try:
            self.parallel = setup_parallel(model, self.spec, self.env, max_seq_len=self.task.max_seq_len)
        except PlanError as e:
            # a plan the spec asks for and the DeepSpeed path cannot run (the operator refuses the same
            # ones: gem.parallel.plan.check_deepspeed_plan): a config error, exit 2, not a restart loop.
            # Raised alike on every rank, before any process group is built.
            prefix = "" if str(e).startswith("spec.") else "spec.parallelism.plan: "
            raise SpecError(f"{prefix}{e}") from e
        model = self.parallel.model
        plan = self.parallel.job.plan
        self.shard_opt: ShardOptimizer | None = None
        if plan.ep > 1 or plan.sparse_shard > 1:  # fp32 only: check_deepspeed_plan refused bf16 / mxfp8
            from gem.parallel.deepspeed_config import split_for_deepspeed

            dense, shards = split_for_deepspeed(model, plan, self.parallel.mesh)
            if shards:
                self.shard_opt = ShardOptimizer(model, shards, self.parallel.mesh, training)
        if self.shard_opt is None:
            optimizer, scheduler = build_optimizer(model, training)
        else:
            optimizer, scheduler = build_optimizer(model, training, params=dense)
        ds_config = deepspeed_config(training, self.spec.parallelism, world_size=self.env.world_size,
                                     plan=self.parallel.job.plan)
        try:
            self.engine, _, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, mpu=self.parallel.mpu)
        except (DeepSpeedConfigError, pydantic.ValidationError) as e:
            if not training.deepspeed:
                raise
            # the config the spec derives is valid: what DeepSpeed refuses came with training.deepspeed
            raise SpecError(f"spec.training.deepspeed: DeepSpeed {deepspeed.__version__} refuses the config merged "
                            f"from it: {type(e).__name__}: {e}; fix or remove that key") from e
        if self.shard_opt is not None:
            self.shard_opt.attach(self.engine)
        # tensor- and context-parallel peers read the same data shard
        self.loader = self.data.train_loader(batch_size=training.batch_size, max_seq_len=self.task.max_seq_len,
                                             rank=self.parallel.data_rank,
                                             world_size=self.parallel.data_world_size, seed=training.seed)
        if self.env.is_main:
            log.info("job=%s world_size=%d zero_stage=%d precision=%s params=%d train_examples=%d eval_examples=%d",
                     self.job_dir, self.env.world_size, self.spec.parallelism.zero_stage,
                     training.precision, n_params, self.data.num_train_examples(), len(self.eval_examples))
            if self.data.mixed:
                log.info("data mixing: %s", " ".join(f"{n}={w:.3f}" for n, w in self.data.weights.items()))

    def _resume(self) -> dict[str, Any] | None:
        """Load the newest checkpoint that loads on every rank; its trainer state, or None for a fresh start."""
        candidates = checkpoint.resume_candidates(self.env, self.job_dir, uid=self.manifest.metadata.uid)
        first_error = None
        for ckpt in candidates:
            # a file one rank cannot read must be found before DeepSpeed's collective load (checkpoint.unreadable)
            problem = checkpoint.unreadable(self.env, ckpt)
            state, error = (None, problem) if problem else self._try_load(ckpt)
            errors = list(failures_by_rank(error).values())  # every rank must resume from the same one
            if not errors:
                self.resumed_from = ckpt
                if self.env.is_main:
                    log.info("resumed from %s at step %d", ckpt, self.step)
                return state
            first_error = first_error or errors[0]
            log.warning("checkpoint %s does not load (%s): trying the previous complete one", ckpt, errors[0])
        if candidates:
            failed = f"none of the {len(candidates)} complete checkpoints under {self.job_dir} loads; the newest, "
            # DeepSpeed's own error for a changed setup says nothing useful ("AssertionError: ", "KeyError:
            # 'dynamic_loss_scale'"): name the spec fields that changed since the checkpoint was saved
            changes = checkpoint.setup_changes(candidates[0], self.spec, self.env.world_size)
            if changes:
                first_line = (first_error.splitlines() or [""])[0][:300]  # a state-dict mismatch lists every key
                raise SpecError(f"{'; '.join(changes)} when {candidates[0].name} was saved: DeepSpeed resumes its "
                                "optimizer partitions only with the ZeRO stage, precision, parallel plan and world "
                                "size that wrote them, and its weights only into a model of their shape. Set them back, or start from scratch under another "
                                f"metadata.name (or move {self.job_dir} away). ({failed}{candidates[0].name}: "
                                f"{first_line})")
            raise RuntimeError(f"{failed}{candidates[0].name}: {first_error}")
        return None

    def _try_load(self, ckpt: Path) -> tuple[dict[str, Any] | None, str | None]:
        """(trainer state, None) once model, optimizer, loader and step are restored; (None, why) if not."""
        try:
            state = checkpoint.load(self.engine, self.env, ckpt)
            if self.shard_opt is not None:  # DeepSpeed's module file holds rank 0's shards: put back this rank's
                self.shard_opt.load_state_dict(checkpoint.load_rank_state(self.env, ckpt))
            self.loader.load_state_dict(state["loader"])
            self.step = int(state["step"])
        except Exception as e:  # noqa: BLE001 - a truncated or missing file shows up as any of several types
            return None, f"{type(e).__name__}: {e}"
        return state, None

    def _autocast(self) -> contextlib.AbstractContextManager:
        # DeepSpeed's bf16 mode stores the module in bf16 (fp32 masters in the optimizer);
        # autocast makes the fp32 inputs (dense features) and bf16 weights meet in bf16.
        return torch.autocast(self.env.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    # ------------------------------------------------------------------ steps

    def _train_step(self, batch: Batch) -> dict[str, float]:
        with self._autocast():
            loss, parts = self.task.loss(self.engine, batch)
        self.engine.backward(loss)
        if self.shard_opt is None:
            self.engine.step()
        else:
            self.shard_opt.sync()
            self.engine.step()
            self.shard_opt.step(self.engine)
        return {"loss": loss.item(), **{f"loss/{k}": v.item() for k, v in parts.items()}}

    def evaluate(self) -> dict[str, float]:
        """NE/AUC per task over the whole eval split (all ranks' shards), and per source when mixing. Collective."""
        self.engine.eval()

        def predict(batch: Batch) -> dict[str, torch.Tensor]:
            with self._autocast():
                return self.engine(batch)

        # one copy per data shard (tp/cp peers predicted the same examples); shard order = eval split order
        per_source = predictions_by_source(
            predict, self.data.eval_sources, max_seq_len=self.task.max_seq_len, rank=self.parallel.data_rank,
            world_size=self.parallel.data_world_size, device=self.env.device,
            gather=lambda mine: all_gather_objects(mine if self.parallel.is_data_writer else None))
        self.engine.train()
        # per-surface keys (ne/click@surface=feed, ...) go to MLflow only: the final report must fit
        # the pod's 4 KB termination message; the eval report holds them too (gem/eval/report.py)
        ev = evaluate_sources(per_source, self.data.evaluated, by_surface=True)
        self._predictions, self._surface_metrics = ev.predictions, ev.surface_metrics
        return ev.metrics

    def _save(self) -> Path:
        """checkpoint.save (collective): a write failure on any rank raises the same CheckpointSaveError on
        every rank, nothing of the step marked COMPLETE; it ends the run (exit 1) like any other failure."""
        state = {"step": self.step, "totalSteps": self.total_steps, "loader": self.loader.state_dict(),
                 "mlflowRunId": self.tracker.run_id}
        path = checkpoint.save(self.engine, self.env, self.job_dir, step=self.step,
                               manifest=self.manifest.to_wire(), state=state,
                               keep_last=self.spec.checkpoint.keep_last,
                               rank_state=self.shard_opt.state_dict() if self.shard_opt is not None else None)
        if self.env.is_main:
            log.info("checkpoint step=%d path=%s", self.step, path)
        return path

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        """Train to training.steps and return the final report (identical on every rank)."""
        previous = self._catch_sigterm()
        try:
            self._setup()
            try:
                state = self._resume()
                # a resumed run continues the MLflow run its checkpoint recorded; a fresh start gets a new
                # one. Rank 0 starts it: its failure (a deleted experiment: SpecError, exit 2) stops every
                # rank with the same error here, not only rank 0 while the others train on.
                on_every_rank(lambda: self.tracker.start(resume_run_id=(state or {}).get("mlflowRunId")),
                              kept=SpecError, what="start the MLflow run")
                return self._run()
            except BaseException as e:
                self.tracker.end("KILLED" if isinstance(e, Terminated) else "FAILED")  # flushes buffered metrics
                raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _catch_sigterm(self) -> Any:
        """Record SIGTERM instead of dying mid-step; the previous handler (None where this thread
        cannot set one: only the main thread can)."""
        def record(signum: int, frame: Any) -> None:
            self._signal = signum

        try:
            return signal.signal(signal.SIGTERM, record)
        except ValueError:
            return None

    def _stop_requested(self) -> bool:
        """Whether any rank got SIGTERM. Collective, once per step: torchrun signals each rank on its own,
        and a rank that stopped alone would leave the others waiting in the next step's collectives."""
        if self.env.world_size == 1:
            return self._signal is not None
        flag = torch.tensor([self._signal or 0], device=self.env.device)
        torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MAX)
        reduced = int(flag.item())
        # A SIGTERM recorded while the all-reduce ran (a rank waits there for its peers most of a step)
        # is not in `reduced`: keep it for the next step's, never overwrite it with this one's 0.
        if reduced and self._signal is None:
            self._signal = reduced
        return reduced != 0

    def _run(self) -> dict[str, Any]:
        last_ckpt = self.resumed_from
        training, every = self.spec.training, self.spec.checkpoint.every_steps
        progress = self._progress_bar()
        t0, seen = time.perf_counter(), 0
        while self.step < self.total_steps:
            if self._stop_requested():  # nothing of the next step started: no half-trained step to lose
                raise Terminated(self._signal, self.step, last_ckpt)
            batch = self.loader.next_batch().to(self.env.device)
            lr = self.scheduler.get_last_lr()[0]  # the rate this step trains with: engine.step moves the schedule on
            logs = self._train_step(batch)
            if not math.isfinite(logs["loss"]):
                raise DivergedError(self.step + 1, logs["loss"], self.env.rank, last_ckpt)
            self.step += 1
            seen += batch.size
            self.tracker.log_step(self.step, {"train/loss": logs["loss"], "train/lr": lr})
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{logs['loss']:.4f}", refresh=False)
            if self.env.is_main and (self.step % LOG_EVERY == 0 or self.step == self.total_steps):
                rate = seen * self.parallel.data_world_size / (time.perf_counter() - t0)
                self._log_line("step", step=self.step, total_steps=self.total_steps, lr=f"{lr:.3g}",
                               examples_per_s=f"{rate:.0f}", **{k: f"{v:.4f}" for k, v in logs.items()})
            if training.eval_every and self.step % training.eval_every == 0 and self.step < self.total_steps:
                self._log_eval(self.evaluate())
            if self.step % every == 0 or self.step == self.total_steps:
                last_ckpt = self._save()
            if os.environ.get(FAULT_ENV) == str(self.step):
                raise RuntimeError(f"fault injected after step {self.step} ({FAULT_ENV})")
        if progress is not None:
            progress.close()
        metrics = self.evaluate()
        metrics.update(self.task.reference_metrics(self._evaluate_fixed_model))
        self._log_eval(metrics)
        if last_ckpt is None:  # resumed at (or past) the last step: nothing new to save
            last_ckpt = self._save()
        self.tracker.log_checkpoint(last_ckpt)
        self._write_eval_report(metrics, last_ckpt)
        self.tracker.register_model()
        self.tracker.end()
        return self._report(metrics, last_ckpt)

    # ------------------------------------------------------------------ helpers

    def _write_eval_report(self, metrics: dict[str, float], ckpt: Path) -> None:
        """Rank 0: <job>/reports/step-N/eval_report.{json,png}, logged to MLflow under eval/."""
        if not self.env.is_main or getattr(self, "_predictions", None) is None:
            return
        try:
            from gem.eval.report import write_eval_report

            paths = write_eval_report(self._predictions, self.eval_examples, self.job_dir / "reports" / ckpt.name,
                                      metrics=metrics,
                                      step=self.step)
            self.tracker.log_artifacts(paths, artifact_path="eval")
        except Exception as e:  # the report is a by-product: never fail a finished run over it
            log.warning("eval report not written: %s: %s", type(e).__name__, e)

    def _evaluate_fixed_model(self, model: torch.nn.Module, max_seq_len: int, prefix: str) -> dict[str, float]:
        """Metrics of a plain (replicated, non-DeepSpeed) model, e.g. a distillation teacher."""
        model.eval()
        with torch.no_grad():
            mine = collect_predictions(model, self.eval_examples, max_seq_len=max_seq_len, rank=self.env.rank,
                                       world_size=self.env.world_size, device=self.env.device)
        return metrics_from_predictions(all_gather_objects(mine), prefix=prefix)

    def _progress_bar(self) -> Any:
        if not self.env.is_main:
            return None
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.step, desc=self.manifest.metadata.name, unit="step",
                    dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 15.0, leave=False)

    def _log_line(self, event: str, **fields: Any) -> None:
        """One structured line: `event key=value ...` (grep- and parser-friendly)."""
        log.info("%s %s", event, " ".join(f"{k}={v}" for k, v in fields.items()))

    def _log_eval(self, metrics: dict[str, float]) -> None:
        self.tracker.log_metrics(self.step, {**metrics, **getattr(self, "_surface_metrics", {})})
        if self.env.is_main:
            keys = [k for k in metrics if k.split("/")[0] in ("ne", "auc", "bayes_ne", "teacher_ne", "loss")]
            self._log_line("eval", step=self.step, **{k: f"{metrics[k]:.4f}" for k in keys})

    def _report(self, metrics: dict[str, float], ckpt: Path) -> dict[str, Any]:
        report: dict[str, Any] = {
            "metrics": finite_or_none(metrics),
            "ne": finite_or_none({"ne": metrics["ne"]})["ne"],
            "step": self.step,
            "totalSteps": self.total_steps,
            "checkpoint": str(ckpt),
            "mlflowRunId": self.tracker.run_id,
            "mlflowExperimentId": self.tracker.experiment_id,
            "mlflowRunUrl": self.tracker.run_url,
            "parallelPlan": self.parallel.report(),
        }
        return report
