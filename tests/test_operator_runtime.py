"""The operator's runtime around reconcile: configuration checked at start.

Each case runs `gem-operator` as its own process with a bad value; it must stop before it
connects to anything, with one line naming the variable (or flag) and what it takes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _start(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    kubeconfig = tmp_path / "kubeconfig"  # never read: every case stops before connecting
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    return subprocess.run(
        [sys.executable, "-m", "gem_operator", "--kubeconfig", str(kubeconfig), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("GEM_RESYNC_SECONDS", "abc", "must be a number >= 1"),
        ("GEM_RESYNC_SECONDS", "0", "must be a number >= 1"),  # would spin the timer against the API
        ("GEM_RESYNC_SECONDS", "-5", "must be a number >= 1"),
        ("GEM_METRICS_PORT", "x", "must be a whole number >= 0"),
        ("GEM_METRICS_PORT", "70000", "must be a TCP port"),
        ("GEM_API_TIMEOUT_SECONDS", "nan", "must be a number >= 1"),
        ("GEM_LOG_FORMAT", "text", "must be one of full, plain, json"),
        ("GEM_TRAINER_IMAGE_PULL_SECRETS", "regcred,Bad_Name", "'Bad_Name' is not a valid object name"),
    ],
)
def test_a_bad_env_value_stops_the_operator_naming_the_variable(tmp_path, name, value, expected):
    run = _start(tmp_path, "-n", "default", **{name: value})
    assert run.returncode != 0
    assert "Traceback" not in run.stderr, run.stderr
    assert f"{name}={value!r}" in run.stderr and expected in run.stderr, run.stderr


def test_a_bad_namespace_stops_the_operator_naming_it(tmp_path):
    run = _start(tmp_path, "-n", "team-a,Team_B")
    assert run.returncode != 0
    assert "Traceback" not in run.stderr, run.stderr
    assert "--namespace / GEM_WATCH_NAMESPACES: 'Team_B' is not a namespace name" in run.stderr, run.stderr


def test_namespaces_may_be_given_comma_separated(monkeypatch):
    from gem_operator import settings

    monkeypatch.setenv("GEM_WATCH_NAMESPACES", "team-a, team-b,,team-a")
    assert settings.OperatorConfig.from_env().namespaces == ("team-a", "team-b")


@pytest.mark.parametrize(
    "flag, url",
    [
        ("--readiness", "0.0.0.0:8081/readyz"),  # no scheme: the startup handler failed, retried every minute
        ("--readiness", "http://0.0.0.0/readyz"),  # no port
        ("--liveness", "0.0.0.0:8080/healthz"),  # no scheme: kopf's liveness server raised a traceback
    ],
)
def test_a_bad_probe_url_stops_the_operator_naming_the_flag(tmp_path, flag, url):
    run = _start(tmp_path, "-n", "default", flag, url)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr, run.stderr
    assert f"{flag}" in run.stderr and f"={url!r}: must be http://HOST:PORT/PATH" in run.stderr, run.stderr


def test_a_missing_kubeconfig_stops_the_operator_naming_it(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "gem_operator", "--kubeconfig", str(tmp_path / "nope.yaml"), "-n", "default"],
        capture_output=True, text=True, timeout=60,
    )
    assert run.returncode != 0
    assert "Traceback" not in run.stderr, run.stderr
    assert f"--kubeconfig {tmp_path / 'nope.yaml'}: no such file" in run.stderr, run.stderr


# --------------------------------------------------------------------------- handler errors


def test_a_permanent_api_error_leaves_a_warning_event_on_the_resource(tmp_path):
    # A 403 (say RBAC lacks a rule) is no hiccup: kopf retries it every minute, and before the
    # fix nothing on the resource said why it stayed without a phase.
    from tests.kubeapi import KubeAPIServer
    from tests.kubeapi.testing import wait_for

    with KubeAPIServer(executor=False, workdir=tmp_path / "kubeapi") as cluster:
        cluster.faults.add(method="POST", path=r"/pytorchjobs", status=403)
        with open(tmp_path / "op.log", "ab") as out:
            op = subprocess.Popen(
                [sys.executable, "-m", "gem_operator", "--kubeconfig", str(cluster.kubeconfig_path), "-n", "default"],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "GEM_RESYNC_SECONDS": "1"},
            )
        try:
            cluster.create("gem.dev/v1alpha1", "GEMTraining", {"metadata": {"name": "denied"}, "spec": {}})

            def warnings() -> list[dict]:
                return [
                    e for e in cluster.list("v1", "Event")
                    if e["involvedObject"]["name"] == "denied" and e["reason"] == "ReconcileError"
                ]

            events = wait_for(warnings, timeout=30, what="a ReconcileError event")
            assert events[0]["type"] == "Warning" and "403" in events[0]["message"], events
            # The handler and the resync timer both hit it, every second here: still one Event.
            wait_for(lambda: (tmp_path / "op.log").read_text().count("Timer 'resync' failed") >= 1, timeout=30,
                     what="the timer failing too")
            assert len(warnings()) == 1
        finally:
            op.kill()
            op.wait(10)


def test_trainer_image_pull_secrets_reach_every_trainer_pod(monkeypatch):
    from gem.api import render
    from gem.api.types import GEMTraining
    from gem_operator import settings

    monkeypatch.setenv("GEM_TRAINER_IMAGE_PULL_SECRETS", "regcred, mirror,")
    defaults = settings.OperatorConfig.from_env().platform_defaults()
    job = render.render_pytorchjob(GEMTraining.model_validate({"metadata": {"name": "q", "namespace": "ns", "uid": "u"},
                                                               "spec": {"parallelism": {"numNodes": 2}}}), defaults=defaults)
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        assert replica["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    monkeypatch.delenv("GEM_TRAINER_IMAGE_PULL_SECRETS")
    job = render.render_pytorchjob(GEMTraining.model_validate({"metadata": {"name": "q", "uid": "u"}, "spec": {}}),
                                   defaults=settings.OperatorConfig.from_env().platform_defaults())
    assert "imagePullSecrets" not in job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
