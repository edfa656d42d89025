"""`gem`: what a training pod runs.

    gem train   --config FILE                 # FILE: a GEMTraining manifest
    gem distill --config FILE                 # FILE: a LoopFMDistill manifest
    gem eval    --config FILE [--checkpoint DIR]
    gem serve-precompute --config FILE --checkpoint DIR [--port N]   # Solaris (docs/solaris.md)
    torchrun --nnodes N --nproc-per-node P -m gem train --config /etc/gem/config.yaml
    torchrun --nproc-per-node P -m gem eval --config FILE    # each rank evaluates a shard, rank 0 reports

The operator writes the resolved manifest to /etc/gem/config.yaml and sets
GEM_TERMINATION_MESSAGE_PATH; the final report (or the error) goes there, see gem/train/report.py.
Exit codes: 0 done, 1 training failed, 2 bad config or usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("gem")

EXPECTED_KIND = {"train": "GEMTraining", "distill": "LoopFMDistill"}


class ConfigError(Exception):
    """The config file is missing, not YAML, or not a valid manifest; the message names the field."""


def load_manifest(path: str | os.PathLike, *, kind: str | None = None) -> Any:
    """Read and validate a GEMTraining / LoopFMDistill manifest; local runs default to namespace `local`."""
    from pydantic import ValidationError

    from gem.api import parse_object

    try:
        obj = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from e
    if not isinstance(obj, dict):
        raise ConfigError(f"{path} must hold one manifest (a mapping with apiVersion, kind, metadata, spec)")
    if kind and obj.get("kind") != kind:
        raise ConfigError(f"{path}: kind must be {kind} for this command, got {obj.get('kind')!r}")
    try:
        manifest = parse_object(obj)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(top level)"
            got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
            lines.append(f"  {field}: {err['msg']}{got}")
        raise ConfigError(f"{path} is not a valid {obj.get('kind')}:\n" + "\n".join(lines)) from e
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from e
    manifest.metadata.namespace = manifest.metadata.namespace or "local"
    return manifest


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO if rank == "0" else logging.WARNING,
        format=f"%(asctime)s %(levelname)s rank={rank} %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _writes_errors() -> bool:
    # Each pod has its own termination log: local rank 0 of every pod reports a failure there.
    return os.environ.get("LOCAL_RANK", "0") == "0"


@contextlib.contextmanager
def _spec_errors_as_config_errors() -> Iterator[None]:
    """Errors the run finds in the spec while setting up (e.g. data.path has no shards) exit 2 too."""
    from gem.data.errors import SpecError

    try:
        yield
    except SpecError as e:
        error = ConfigError(str(e))
        if getattr(e, "on_every_rank", False):  # raised by every rank together: so is this one
            error.on_every_rank = True  # type: ignore[attr-defined]
        raise error from e


def _task(manifest: Any, command: str, env: Any) -> Any:
    if command == "train":
        from gem.train.task import GEMTask

        return GEMTask(manifest)
    from gem.distill.task import DistillTask

    return DistillTask(manifest, device=env.device)


def _train(manifest: Any, command: str) -> int:
    from gem.train import checkpoint
    from gem.train import report as final_report
    from gem.train.dist import barrier, init_distributed, shutdown
    from gem.train.trainer import Trainer

    env = init_distributed()
    try:
        with _spec_errors_as_config_errors():
            # before the task (a LoopFM task loads its teacher and creates its memory dir under the root)
            # and the (slow) setup: an unwritable checkpoint root would otherwise surface at the first save
            meta, path = manifest.metadata, manifest.spec.checkpoint.path
            checkpoint.check_writable(env, checkpoint.job_dir_of(path, meta.namespace, meta.name), path)
            result = Trainer(_task(manifest, command, env), env).run()
        if env.is_main:
            final_report.write(result)
            print(json.dumps(result), flush=True)
        # Leave together: a rank tearing down its gloo pairs while a peer still talks to them can
        # abort that peer ("terminate called without an active exception", seen once under load).
        barrier()
        return 0
    except BaseException as e:
        if getattr(e, "on_every_rank", False):
            # every rank raised this one together (a config error found on one rank, a SIGTERM stop):
            # leave together too, or a peer may abort (exit -6 instead of 2, seen in a fresh-clone run)
            with contextlib.suppress(Exception):
                barrier()
        raise
    finally:
        shutdown()


def _latest_checkpoint(manifest: Any) -> str:
    """The job's newest complete checkpoint, under the root the trainer writes to ($GEM_CHECKPOINT_DIR wins)."""
    from gem.train import checkpoint

    meta = manifest.metadata
    job = checkpoint.job_dir_of(manifest.spec.checkpoint.path, meta.namespace, meta.name)
    latest = checkpoint.latest_complete(job)
    if latest is None:
        raise ConfigError(f"no complete checkpoint under {job}: train first or pass --checkpoint DIR")
    return str(latest)


_CHECKPOINT_DIR = "<checkpoint.path>/<namespace>/<name>/step-NNNNNNNN, holding model.pt and gem.yaml"


@contextlib.contextmanager
def _checkpoint_errors(checkpoint_dir: str) -> Iterator[None]:
    """A --checkpoint that is missing, or does not load, is a config error (exit 2) naming the flag."""
    import pickle

    try:
        yield
    except OSError as e:  # no such directory, or not a checkpoint (no model.pt / gem.yaml)
        raise ConfigError(f"--checkpoint {checkpoint_dir}: {e}; pass a checkpoint step directory "
                          f"({_CHECKPOINT_DIR})") from e
    except (yaml.YAMLError, ValueError, pickle.UnpicklingError, EOFError, RuntimeError) as e:
        # gem.yaml not YAML or not a manifest (pydantic's ValidationError is a ValueError); model.pt
        # truncated or corrupt (UnpicklingError, RuntimeError from the zip reader), or the weights of
        # another model than gem.yaml describes (RuntimeError from load_state_dict)
        first = (str(e).strip().splitlines() or [""])[0][:200]
        if isinstance(e, pickle.UnpicklingError):  # torch's text is about weights_only, not the file
            first = "model.pt is not a PyTorch state dict"
        raise ConfigError(f"--checkpoint {checkpoint_dir} does not load ({type(e).__name__}: {first}): "
                          f"it is corrupt, incomplete or not a GEM checkpoint; pass a complete checkpoint step "
                          f"directory ({_CHECKPOINT_DIR})") from e


def _load_checkpoint_model(checkpoint_dir: str, *, with_manifest: bool = False) -> Any:
    from gem.train import checkpoint

    with _checkpoint_errors(checkpoint_dir):
        model, saved = checkpoint.load_model(checkpoint_dir)
    return (model, saved) if with_manifest else model


def _on_every_rank(fn: Any) -> Any:
    """fn(), and on a failure of any rank the same failure on every rank (none left waiting in a collective)."""
    from gem.train.dist import on_every_rank

    return on_every_rank(fn, kept=ConfigError)


def _eval(manifest: Any, checkpoint_dir: str | None) -> int:
    """The checkpoint's metrics on spec.data's eval split: what the trainer's final evaluation reports
    (gem.eval.evaluate.predictions_by_source + evaluate_sources: per-source keys when spec.data mixes
    sources, the precision it trained in). Under torchrun each rank evaluates its shard of every
    source; rank 0 prints the one report."""
    from gem.data.sources import load_data
    from gem.eval.evaluate import (
        as_trained,
        eval_autocast,
        evaluate_sources,
        finite_or_none,
        predictions_by_source,
    )
    from gem.train.dist import all_gather_objects, barrier, broadcast_object, init_distributed, local_device, shutdown

    # a world of one needs no process group: the collectives below are then plain calls
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    env = init_distributed() if distributed else None
    try:
        rank, world_size = (env.rank, env.world_size) if env else (0, 1)
        device = env.device if env else local_device(int(os.environ.get("LOCAL_RANK", "0")))

        # rank 0 picks the newest checkpoint (another may complete while the ranks look): all load that one
        ckpt = broadcast_object(_on_every_rank(lambda: checkpoint_dir or (
            _latest_checkpoint(manifest) if rank == 0 else None)))

        def setup() -> tuple[Any, Any, Any]:
            model, saved = _load_checkpoint_model(ckpt, with_manifest=True)
            # the precision the checkpoint trained (and was evaluated) in: its gem.yaml's, not the --config's
            precision = getattr(getattr(saved.spec, "training", None), "precision", "fp32")
            with _spec_errors_as_config_errors():  # e.g. mxfp8 with a torchao lacking the MX op: exit 2
                model = as_trained(model, precision)
                data = load_data(manifest.spec.data, max_history=model.max_seq_len)
            return model, precision, data

        model, precision, data = _on_every_rank(setup)
        model = model.to(device).eval()

        def predict(batch: Any) -> Any:
            with eval_autocast(device, precision):
                return model(batch)

        per_source = predictions_by_source(predict, data.eval_sources, max_seq_len=model.max_seq_len, rank=rank,
                                           world_size=world_size, device=device,
                                           gather=all_gather_objects)
        if rank == 0:
            metrics = finite_or_none(evaluate_sources(per_source, data.evaluated).metrics)
            print(json.dumps({"checkpoint": ckpt, "ne": metrics["ne"], "metrics": metrics}), flush=True)
        barrier()
        return 0
    finally:
        if distributed:
            shutdown()


def _foundation_model(checkpoint_dir: str, data: Any) -> Any:
    """The GEM model of a GEMTraining checkpoint trained on data's synthetic world; a student's checkpoint,
    or one trained on another world, is a config error (checked before the model loads)."""
    from gem.api import parse_object
    from gem.solaris.service import require_trained_world
    from gem.train import checkpoint

    # None: not a checkpoint at all, which _load_checkpoint_model says
    with _checkpoint_errors(checkpoint_dir):  # a gem.yaml that is not YAML
        kind = checkpoint.checkpoint_kind(checkpoint_dir)
    if kind == "LoopFMDistill":
        saved = checkpoint.read_manifest(checkpoint_dir)
        method = ((saved.get("spec") or {}).get("distillation") or {}).get("method", "kd")
        raise ConfigError(f"--checkpoint {checkpoint_dir} holds a LoopFMDistill student (distillation.method {method}), "
                          "not a foundation model: Solaris precomputes GEM values; pass a GEMTraining's "
                          "checkpoint (<checkpoint.path>/<namespace>/<name>/step-NNNNNNNN), e.g. the teacher's")
    if kind == "GEMTraining":
        with _checkpoint_errors(checkpoint_dir):  # a gem.yaml that is not a manifest
            trained = parse_object(checkpoint.read_manifest(checkpoint_dir)).spec.data
        with _spec_errors_as_config_errors():
            require_trained_world(data, trained)
    return _load_checkpoint_model(checkpoint_dir)


def _port(text: str) -> int:
    """--port: checked when the flags are parsed (exit 2), not after minutes of loading the model."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: pass 0-65535 (0: any free port)")
    return port


def _ttl_seconds(text: str) -> float:
    try:
        ttl = float(text)
    except ValueError:
        ttl = float("nan")
    if not ttl > 0:  # NaN would keep every value fresh forever, <= 0 would serve no exact pair ever
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds, e.g. 21600 (6h)")
    return ttl


def _serve_precompute(manifest: Any, args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from gem.loopfm.logging import model_version_of
    from gem.solaris.service import build_service, require_synthetic_world

    with _spec_errors_as_config_errors():  # spec.data not one synthetic world: exit 2 before loading a model
        require_synthetic_world(manifest.spec.data)
    model = _foundation_model(args.checkpoint, manifest.spec.data)
    service = build_service(model, manifest, ttl_s=args.ttl, version=model_version_of(args.checkpoint))

    async def serve() -> None:
        try:
            runner, port = await service.start(args.host, args.port)
        except OSError as e:  # port taken, host not an address of this machine
            raise ConfigError(f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e}); "
                              "pass a free --port (0: any) and a --host of this machine (0.0.0.0: all)") from e
        log.info("solaris: serving on http://%s:%d (version %s)", args.host, port, service.store.version)
        stop = asyncio.Event()
        # Kubernetes stops a pod with SIGTERM (whose default kills at once): stop as on Ctrl-C instead
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()  # closes the listener and connections, stops the precompute task
            log.info("solaris: stopped")

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gem", description="Train, distil and evaluate GEM models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "train a GEM model from a GEMTraining manifest"),
                            ("distill", "distil a GEM teacher into a student from a LoopFMDistill manifest"),
                            ("eval", "NE/AUC of a checkpoint on the eval split, as JSON")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", required=True, help="path of the manifest (YAML)")
        if name == "eval":
            p.add_argument("--checkpoint", help="checkpoint directory (default: the job's latest)")
    p = sub.add_parser("serve-precompute", help="Solaris: speculative FM precompute + hierarchical lookup over HTTP")
    p.add_argument("--config", required=True, help="manifest whose spec.data names the synthetic world")
    p.add_argument("--checkpoint", required=True, help="the foundation model's checkpoint directory")
    p.add_argument("--port", type=_port, default=8080, help="TCP port, 0-65535 (0: any free port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--ttl", type=_ttl_seconds, default=6 * 3600.0,
                   help="seconds a precomputed value stays fresh (> 0; default 21600)")
    args = parser.parse_args(argv)
    _setup_logging()
    if args.command == "serve-precompute":
        try:
            return _serve_precompute(load_manifest(args.config), args)
        except ConfigError as e:
            print(f"gem {args.command}: {e}", file=sys.stderr)
            return 2
    from gem.train import report as final_report

    try:
        manifest = load_manifest(args.config, kind=EXPECTED_KIND.get(args.command))
        if args.command == "eval":
            return _eval(manifest, args.checkpoint)
        return _train(manifest, args.command)
    except ConfigError as e:
        print(f"gem {args.command}: {e}", file=sys.stderr)
        if _writes_errors():
            final_report.write(final_report.error_payload(e))
        return 2
    except BaseException as e:  # noqa: BLE001 - report every failure, including KeyboardInterrupt
        from gem.train.trainer import Terminated

        if isinstance(e, Terminated):  # stopped as asked, not a crash: no traceback
            log.warning("gem %s: %s", args.command, e)
            if _writes_errors():
                final_report.write(final_report.error_payload(e))
            return 128 + e.signum  # what Kubernetes and torchrun expect of a process SIGTERM ended
        log.exception("gem %s failed", args.command)
        if _writes_errors():
            final_report.write(final_report.error_payload(e))
        return 130 if isinstance(e, KeyboardInterrupt) else 1


if __name__ == "__main__":
    sys.exit(main())
