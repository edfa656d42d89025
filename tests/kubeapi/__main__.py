"""Standalone: `python -m tests.kubeapi --port 0 --kubeconfig PATH [--state-dir DIR]`.

Prints the URL, writes a kubeconfig, installs the vendored PyTorchJob CRD and
manifests/crds/*.yaml, creates namespace `default`, runs PyTorchJobs as local processes
(unless --no-executor) and serves until killed.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from .server import KubeAPIServer, default_crd_paths, write_kubeconfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.kubeapi", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--kubeconfig", help="write a kubeconfig here (default: <state-dir>/kubeconfig)")
    p.add_argument("--state-dir", help="pod sandboxes, logs and PVC dirs (default: a temporary dir)")
    p.add_argument("--crd", action="append", default=None, help="extra CRD yaml files (repeatable)")
    p.add_argument("--no-executor", action="store_true", help="do not run PyTorchJobs")
    args = p.parse_args(argv)
    crds = default_crd_paths() + list(args.crd or [])
    server = KubeAPIServer(crd_paths=crds, executor=not args.no_executor, workdir=args.state_dir,
                           port=args.port, host=args.host)
    server.start()
    if args.kubeconfig:
        write_kubeconfig(args.kubeconfig, server.url)
    print(server.url, flush=True)
    print(f"kubeconfig: {args.kubeconfig or server.kubeconfig_path}", file=sys.stderr, flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
