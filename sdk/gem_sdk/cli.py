"""gemctl: submit and watch GEM jobs from a shell. A thin layer over GEMClient.

Exit codes (stable, for scripts):

    0  success
    1  the job failed (phase Failed or Invalid)
    2  usage or validation error (bad flags, bad kind, invalid spec)
    3  not found (job, teacher or pod)
    4  timed out (wait --timeout)
    5  backend or API error (unreachable cluster, forbidden, CRDs missing, already exists, ...),
       or an unexpected error in gemctl itself (GEMCTL_DEBUG=1 shows its traceback)

A closed stdout (`gemctl logs ... | head -1`) ends the command quietly with 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import click
import typer
import yaml
from rich.console import Console

from gem_sdk._client import GEMClient, _interleave, _time_left
from gem_sdk._exceptions import (
    GEMError,
    JobFailedError,
    NotFoundError,
    ValidationError,
    WaitTimeoutError,
    describe,
)
from gem_sdk._format import (
    ProgressReporter,
    history_table,
    history_to_wire,
    metrics_table,
    objects_table,
    pods_table,
    pods_to_wire,
    to_json,
    to_yaml,
)
from gem_sdk._objects import load_documents, phase_of, pod_name
from gem_sdk._types import KubernetesBackendConfig, LocalBackendConfig, Resource, resolve_kind

EXIT_OK, EXIT_JOB_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_TIMEOUT, EXIT_BACKEND = 0, 1, 2, 3, 4, 5
#: Set (to anything) to let an unexpected error out with its traceback instead of one line.
DEBUG_ENV = "GEMCTL_DEBUG"

app = typer.Typer(
    name="gemctl",
    help="Submit, inspect and wait for GEMTraining and LoopFMDistill jobs, on a cluster or locally (--local).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _console(stderr: bool = False) -> Console:
    # Like kubectl, never squeeze tables into 80 columns when the output is not a terminal.
    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, highlight=False, soft_wrap=True, width=None if stream.isatty() else 200)


def _print_table(table: Any) -> None:
    """A table without the padding rich puts after the last column (clean for grep, diff and awk)."""
    console = _console()
    with console.capture() as captured:
        console.print(table)
    console.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


class Output(str, Enum):
    table = "table"
    yaml = "yaml"
    json = "json"


class Replica(str, Enum):
    master = "master"
    worker = "worker"


KINDS_HELP = "gemtraining|gemtrainings|gemt|gt|loopfmdistill|loopfmdistills|lfd"
KindArg = Annotated[str, typer.Argument(help=f"Kind: {KINDS_HELP}.", show_default=False)]
NameArg = Annotated[str, typer.Argument(help="Name of the job.", show_default=False)]
LocalOpt = Annotated[bool, typer.Option("--local", help="Use the local backend: run jobs as processes on this machine ($GEM_HOME or ~/.gem).")]
KubeconfigOpt = Annotated[Optional[str], typer.Option("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or in-cluster).")]
ContextOpt = Annotated[Optional[str], typer.Option("--context", help="kubeconfig context.")]
NamespaceOpt = Annotated[Optional[str], typer.Option("-n", "--namespace", help="Namespace (default: the context's, or 'default').")]
OutputOpt = Annotated[Output, typer.Option("-o", "--output", help="Output format.")]
TimeoutOpt = Annotated[Optional[float], typer.Option("--timeout", help="Seconds to wait at most (default: forever).")]
ProgressOpt = Annotated[
    Optional[bool],
    typer.Option("--progress/--no-progress", help="Show the phase and progress on stderr while waiting "
                 "(default: a live bar on a terminal, a line per change otherwise).", show_default=False),
]


def _client(local: bool, kubeconfig: str | None, context: str | None, namespace: str | None,
            mlflow_tracking_uri: str | None = None) -> GEMClient:
    extra = {"mlflow_tracking_uri": mlflow_tracking_uri} if mlflow_tracking_uri else {}
    if local:
        if kubeconfig or context:
            raise ValidationError("--local runs jobs on this machine: drop --kubeconfig/--context")
        return GEMClient(LocalBackendConfig(**({"namespace": namespace} if namespace else {}), **extra))
    return GEMClient(KubernetesBackendConfig(kubeconfig=kubeconfig, context=context, namespace=namespace, **extra))


def exit_code(error: BaseException) -> int:
    """The documented exit code of an SDK error."""
    if isinstance(error, JobFailedError):
        return EXIT_JOB_FAILED
    if isinstance(error, ValidationError):
        return EXIT_USAGE
    if isinstance(error, NotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(error, WaitTimeoutError):
        return EXIT_TIMEOUT
    return EXIT_BACKEND


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """Print SDK errors as one `Error: ...` message on stderr and exit with their code.

    Exit 1 means "the job failed" to scripts, so nothing else may end with it: a closed stdout
    exits 0 and an unexpected exception (a bug) exits 5, in one line unless $GEMCTL_DEBUG is set.
    """
    try:
        yield
        sys.stdout.flush()  # a closed pipe fails here, not at interpreter exit
    except GEMError as e:
        _console(stderr=True).print(f"Error: {e}", style="red", markup=False)
        raise typer.Exit(exit_code(e)) from None
    except BrokenPipeError:
        _discard_stdout()
        raise typer.Exit(EXIT_OK) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except (typer.Exit, typer.Abort, click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
        raise  # click's own way out, with its own code
    except Exception as e:
        if os.environ.get(DEBUG_ENV):
            raise
        _console(stderr=True).print(
            f"Error: unexpected {type(e).__name__}: {e} (a bug in gemctl; {DEBUG_ENV}=1 shows the traceback)",
            style="red", markup=False,
        )
        raise typer.Exit(EXIT_BACKEND) from None


def _discard_stdout() -> None:
    """Point stdout at /dev/null once its reader has gone (`| head -1`), so that flushing it at
    exit does not fail a second time (what the Python docs on SIGPIPE recommend)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # no file descriptor behind sys.stdout (e.g. captured in tests)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _echo(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _ref(obj: Resource) -> str:
    return f"{obj.kind.lower()}.gem.dev/{obj.metadata.name}"


def _show(objs: list[Resource], output: Output, *, single: bool, show_namespace: bool = False,
          show_kind: bool = False) -> None:
    if output is Output.yaml:
        sys.stdout.write(to_yaml(objs, single=single))
    elif output is Output.json:
        sys.stdout.write(to_json(objs, single=single) + "\n")
    else:
        _print_table(objects_table(objs, show_namespace=show_namespace, show_kind=show_kind))


def _show_final(obj: Resource, output: Output) -> None:
    if output is not Output.table:
        _show([obj], output, single=True)
        return
    phase = obj.status.phase if obj.status else None
    _console().print(f"{_ref(obj)} {str(phase).lower()}", markup=False)
    table = metrics_table(obj)
    if table is not None:
        _print_table(table)
    if obj.status and obj.status.latest_checkpoint:
        _console().print(f"checkpoint: {obj.status.latest_checkpoint}", markup=False)
    mlflow = obj.status.mlflow if obj.status else None
    if mlflow and (mlflow.run_url or mlflow.run_id):
        _console().print(f"mlflow run: {mlflow.run_url or mlflow.run_id}", markup=False)


@app.command()
def submit(
    filename: Annotated[str, typer.Option("-f", "--filename", help="Manifest file (YAML or JSON; '-' reads stdin). Several documents are submitted in order.", show_default=False)],
    wait: Annotated[bool, typer.Option("--wait", help="Wait for the job to finish and print its final metrics.")] = False,
    follow: Annotated[bool, typer.Option("--follow", help="Stream the master's log while it runs, across restarts of its container (implies --wait).")] = False,
    timeout: TimeoutOpt = None,
    local: LocalOpt = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
    output: OutputOpt = Output.table,
    progress: ProgressOpt = None,
) -> None:
    """Create the jobs in a manifest; optionally wait for them and show their metrics."""
    with _errors():
        docs = load_documents(sys.stdin.read() if filename == "-" else Path(filename))
        if not docs:
            raise ValidationError(f"{filename} holds no manifest")
        client = _client(local, kubeconfig, context, namespace)
        created = [client.submit(doc, namespace=namespace) for doc in docs]
        if output is Output.table:
            for obj in created:
                _console().print(f"{_ref(obj)} created", markup=False)
        elif not (wait or follow):
            _show(created, output, single=len(created) == 1)
        if not (wait or follow):
            return
        # One deadline for the whole command: each log and wait gets only the time left.
        deadline = None if timeout is None else time.monotonic() + timeout
        for obj in created:
            try:
                followed = follow and _follow_log(client, obj, deadline)
                # Without a log on stdout, show the progress as --wait does.
                _wait_and_show(client, obj, output, progress=False if followed and progress is None else progress,
                               timeout=_time_left(deadline))
            except WaitTimeoutError as e:
                raise _timed_out(obj, timeout, e) from None


def _follow_log(client: GEMClient, obj: Resource, deadline: float | None) -> bool:
    """Stream the master's log until the job is done with it, across restarts of its container
    (`GEMClient.follow`), each announced by one line; WaitTimeoutError at the deadline.

    Returns False, with nothing streamed, when the pod never started: the job ended first (e.g.
    Invalid) or is suspended. The wait that comes next then says why, with its exit code.
    """
    pod = pod_name(obj.kind, obj.metadata.name, "master", 0)
    limit = obj.spec.run_policy.backoff_limit
    try:
        # Read by a thread so that the deadline holds while the stream blocks.
        for _, item in _interleave([(pod, lambda: client.follow(obj, timeout=_time_left(deadline)))],
                                   deadline=deadline):
            if isinstance(item, str):
                _echo(item)
            else:  # a new container: without this line a restart looks like a hang, or like one log
                _echo(f"--- {item.name} restarted (restart {item.restart_count}, backoffLimit {limit}); "
                      "following the new container ---")
    except NotFoundError:
        return False
    return True


def _timed_out(obj: Resource, timeout: float | None, error: WaitTimeoutError) -> WaitTimeoutError:
    """The error for a submit --timeout that ran out: it names the whole timeout, not what was
    left of it for the last step."""
    ref = {"kind": obj.kind, "namespace": obj.metadata.namespace, "name": obj.metadata.name}
    after = f" after {timeout:g}s" if timeout is not None else ""
    phase = f" (phase {phase_of(error.object)})" if error.object is not None else ""
    return WaitTimeoutError(f"timed out{after} waiting for {describe(**ref)} to finish{phase}",
                            object=error.object, **ref)


def _wait_and_show(client: GEMClient, obj: Resource | str, output: Output, *, progress: bool | None,
                   timeout: float | None, **kwargs: object) -> None:
    """Wait (showing progress on stderr unless told not to), then print the final state."""
    reporter = ProgressReporter(_console(stderr=True)) if progress is not False else None
    try:
        final = client.wait(obj, timeout=timeout, callback=reporter.update if reporter else None, **kwargs)  # type: ignore[arg-type]
    except JobFailedError as e:
        if e.object is not None:
            _show_final(e.object, output)
        raise
    finally:
        if reporter is not None:
            reporter.close()
    _show_final(final, output)


@app.command()
def get(
    kind: KindArg,
    name: NameArg,
    local: LocalOpt = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """Show one job (PHASE, PROGRESS, NE, AGE; -o yaml for everything)."""
    with _errors():
        kind = resolve_kind(kind)
        obj = _client(local, kubeconfig, context, namespace).get(name, kind=kind, namespace=namespace)
        _show([obj], output, single=True)


@app.command("list")
def list_(
    kind: Annotated[Optional[str], typer.Argument(help=f"Kind: {KINDS_HELP} (default: both).", show_default=False)] = None,
    selector: Annotated[Optional[str], typer.Option("-l", "--selector", help="Label selector, e.g. team=ads,tier!=dev.")] = None,
    all_namespaces: Annotated[bool, typer.Option("-A", "--all-namespaces", help="List across all namespaces.")] = False,
    local: LocalOpt = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """List jobs (both kinds unless KIND is given)."""
    with _errors():
        kind = resolve_kind(kind) if kind else None
        client = _client(local, kubeconfig, context, namespace)
        objs = client.list(kind=kind, namespace=namespace, label_selector=selector, all_namespaces=all_namespaces)
        if not objs and output is Output.table:
            where = "any namespace" if all_namespaces else f"{namespace or client.default_namespace} namespace"
            _console(stderr=True).print(f"No resources found in {where}.", markup=False)
            return
        _show(objs, output, single=False, show_namespace=all_namespaces, show_kind=kind is None)


@app.command()
def wait(
    kind: KindArg,
    name: NameArg,
    timeout: TimeoutOpt = None,
    for_: Annotated[Optional[list[str]], typer.Option("--for", help="Phase to wait for (repeatable; default: any terminal phase).")] = None,
    local: LocalOpt = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
    output: OutputOpt = Output.table,
    progress: ProgressOpt = None,
) -> None:
    """Wait for a job to finish (exit 1 if it failed, 4 on timeout) and show its final metrics."""
    with _errors():
        kind = resolve_kind(kind)
        client = _client(local, kubeconfig, context, namespace)
        kwargs = {"until": for_} if for_ else {}
        _wait_and_show(client, name, output, progress=progress, timeout=timeout, kind=kind, namespace=namespace,
                       **kwargs)


@app.command()
def logs(
    kind: KindArg,
    name: NameArg,
    replica: Annotated[Replica, typer.Option("--replica", help="Replica type.")] = Replica.master,
    index: Annotated[int, typer.Option("--index", help="Replica index (workers: 0..numNodes-2).")] = 0,
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep streaming until the pod exits.")] = False,
    all_replicas: Annotated[bool, typer.Option("--all-replicas", help="Every replica's log, each line prefixed with \\[pod].")] = False,
    timeout: Annotated[Optional[float], typer.Option("--timeout", help="Seconds to wait at most for the pod to start.")] = None,
    previous: Annotated[bool, typer.Option("-p", "--previous", help="The log of the container before the last "
                                           "restart (why a crash-looping container died), as kubectl's.")] = False,
    local: LocalOpt = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Print a trainer pod's log (the master's unless --replica/--index, or every one with --all-replicas)."""
    with _errors():
        kind = resolve_kind(kind)
        client = _client(local, kubeconfig, context, namespace)
        if all_replicas:
            if previous:
                raise ValidationError("--previous reads one replica's log: drop --all-replicas, pick it with "
                                      "--replica/--index")
            for pod, line in client.all_logs(name, kind=kind, namespace=namespace, follow=follow, timeout=timeout):
                _echo(f"[{pod}] {line}")
            return
        for line in client.logs(name, kind=kind, namespace=namespace, replica=replica.value, index=index,
                                follow=follow, timeout=timeout, previous=previous):
            _echo(line)


@app.command()
def delete(
    kind: KindArg,
    name: NameArg,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="Wait until the job is gone: on a cluster the gem "
                                       "operator's finalizer holds a running job (and its name) for a moment.")] = True,
    timeout: Annotated[Optional[float], typer.Option("--timeout", help="With --wait, seconds to wait at most "
                                                     "(default: forever).")] = None,
    local: LocalOpt = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Delete a job and stop everything it runs (waits until it is gone, as kubectl delete)."""
    with _errors():
        kind = resolve_kind(kind)
        _client(local, kubeconfig, context, namespace).delete(name, kind=kind, namespace=namespace, wait=wait,
                                                              timeout=timeout)
        _console().print(f'{kind.lower()}.gem.dev "{name}" deleted', markup=False)


@app.command()
def suspend(
    kind: KindArg,
    name: NameArg,
    local: LocalOpt = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """Suspend a job: its pods stop, its checkpoints stay (exit 2 if it has already ended)."""
    with _errors():
        kind = resolve_kind(kind)
        obj = _client(local, kubeconfig, context, namespace).suspend(name, kind=kind, namespace=namespace)
        _changed(obj, "suspended", output)


@app.command()
def resume(
    kind: KindArg,
    name: NameArg,
    local: LocalOpt = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """Resume a suspended job from its latest checkpoint."""
    with _errors():
        kind = resolve_kind(kind)
        obj = _client(local, kubeconfig, context, namespace).resume(name, kind=kind, namespace=namespace)
        _changed(obj, "resumed", output)


def _changed(obj: Resource, what: str, output: Output) -> None:
    if output is Output.table:
        _console().print(f"{_ref(obj)} {what}", markup=False)
    else:
        _show([obj], output, single=True)


@app.command()
def pods(
    kind: KindArg,
    name: NameArg,
    replica: Annotated[Optional[Replica], typer.Option("--replica", help="Only master or only worker pods.")] = None,
    local: LocalOpt = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """List a job's pods: NAME, REPLICA, INDEX, PHASE, RESTARTS, EXIT, AGE."""
    with _errors():
        kind = resolve_kind(kind)
        items = _client(local, kubeconfig, context, namespace).pods(
            name, kind=kind, namespace=namespace, replica=replica.value if replica else None)
        if output is Output.table:
            if not items:
                _console(stderr=True).print(f"No pods of {kind.lower()}.gem.dev/{name} exist now.", markup=False)
                return
            _print_table(pods_table(items))
        elif output is Output.yaml:
            sys.stdout.write(yaml.safe_dump(pods_to_wire(items), sort_keys=False))
        else:
            sys.stdout.write(json.dumps(pods_to_wire(items), indent=2) + "\n")


@app.command()
def metrics(
    kind: KindArg,
    name: NameArg,
    key: Annotated[Optional[list[str]], typer.Option("-k", "--key", help="Metric to show (repeatable; default: all).")] = None,
    mlflow_tracking_uri: Annotated[Optional[str], typer.Option(
        "--mlflow-tracking-uri", help="MLflow to read from (default: the job's spec.mlflow.trackingUri, "
        "then $MLFLOW_TRACKING_URI; locally the URI the job ran with).")] = None,
    timeout: Annotated[Optional[float], typer.Option(
        "--timeout", help="Seconds to take at most reading MLflow (default: 300).")] = 300,
    local: LocalOpt = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """Show a job's metric history from MLflow (a summary table; -o yaml|json for every point)."""
    with _errors():
        kind = resolve_kind(kind)
        client = _client(local, kubeconfig, context, namespace, mlflow_tracking_uri)
        # MLflow retries a failing request 7 times, over about 4 minutes (say, an in-cluster
        # address that does not resolve here); a command should answer sooner. $MLFLOW_... wins.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        # A tracking server that answers, but slowly, is not cut by MLflow's own per-request timeout.
        history = client.metrics(name, kind=kind, namespace=namespace, keys=key or None, timeout=timeout)
        if output is Output.table:
            _print_table(history_table(history, title=f"{kind} {name}: metric history"))
        elif output is Output.yaml:
            sys.stdout.write(yaml.safe_dump(history_to_wire(history), sort_keys=False))
        else:
            sys.stdout.write(json.dumps(history_to_wire(history), indent=2) + "\n")


def main() -> None:
    """Entry point of the `gemctl` console script."""
    app()


if __name__ == "__main__":
    main()
