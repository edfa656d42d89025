"""`gem-operator`: run the operator against the cluster in the kubeconfig (or in-cluster)."""

from __future__ import annotations

import argparse
import logging
import os
import random


LOG_FORMATS = ("full", "plain", "json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gem-operator", description="Reconcile GEMTraining and LoopFMDistill into PyTorchJobs.")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="Namespace to serve (repeatable).")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="Serve every namespace (default).")
    p.add_argument("--kubeconfig", help="Path of a kubeconfig; default: in-cluster, then $KUBECONFIG, then ~/.kube/config.")
    p.add_argument("--liveness", default=None, help="Serve liveness on this URL, e.g. http://0.0.0.0:8080/healthz.")
    p.add_argument(
        "--readiness",
        default=None,
        help="Serve readiness on this URL, e.g. http://0.0.0.0:8081/readyz: ready once started and while the API "
        "server answers for every watched kind (or $GEM_READINESS_URL).",
    )
    p.add_argument(
        "--peering", default=None, help="Peering object name: replicas that share one never act at once (default: standalone)."
    )
    p.add_argument(
        "--priority",
        type=int,
        default=None,
        help="Peering priority: the highest-priority replica acts, the others wait (default: random).",
    )
    p.add_argument("--mlflow-tracking-uri", default=None, help="MLflow URI given to trainer pods (or $GEM_MLFLOW_TRACKING_URI).")
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=os.environ.get("GEM_LOG_FORMAT", "full"),
        help="full: timestamped text (default); plain: messages only; json: one JSON object per line, with the "
        "resource as `object` (or $GEM_LOG_FORMAT).",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="Debug logging.")
    args = p.parse_args(argv)
    if args.log_format not in LOG_FORMATS:  # argparse checks choices on the command line, not on a default
        p.error(f"GEM_LOG_FORMAT={args.log_format!r}: must be one of {', '.join(LOG_FORMATS)}")
    if args.kubeconfig and not os.path.isfile(args.kubeconfig):  # else kopf's 'Ran out of valid credentials' traceback
        p.error(f"--kubeconfig {args.kubeconfig}: no such file (leave it out to use the in-cluster service account)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig
    if args.mlflow_tracking_uri:
        os.environ["GEM_MLFLOW_TRACKING_URI"] = args.mlflow_tracking_uri
    if args.readiness:
        os.environ["GEM_READINESS_URL"] = args.readiness
    os.environ["GEM_WATCH_NAMESPACES"] = ",".join(args.namespace)
    import kopf

    import gem_operator.handlers  # noqa: F401  (registers the handlers; a bad GEM_* value exits here, named)
    from gem_operator.settings import CONFIG, SettingsError, probe_url

    try:
        probe_url(args.liveness, "--liveness", "http://0.0.0.0:8080/healthz")
    except SettingsError as e:
        raise SystemExit(f"gem-operator: {e}") from None

    log_format = {"full": kopf.LogFormat.FULL, "plain": kopf.LogFormat.PLAIN, "json": kopf.LogFormat.JSON}[args.log_format]
    kopf.configure(verbose=args.verbose, log_format=log_format, log_prefix=args.log_format != "json")
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    kopf.run(
        clusterwide=not CONFIG.namespaces,
        namespaces=CONFIG.namespaces,
        standalone=args.peering is None,
        peering_name=args.peering,
        # Replicas with equal priorities would all freeze: give each its own unless told.
        priority=args.priority if args.priority is not None else random.randint(1, 10_000),
        liveness_endpoint=args.liveness,
    )


if __name__ == "__main__":
    main()
