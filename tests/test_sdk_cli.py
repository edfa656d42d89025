"""gemctl: output formats and exit codes, on the local backend and against the API test server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gem_sdk.backends.local import LocalBackend
from gem_sdk.cli import app
from tests.test_sdk_local import fake_trainer

MANIFEST = textwrap.dedent(
    """\
    apiVersion: gem.dev/v1alpha1
    kind: GEMTraining
    metadata:
      name: {name}
      labels: {{team: ads}}
    spec:
      parallelism: {{numNodes: 1}}
      training: {{steps: 3}}
      runPolicy: {{backoffLimit: 0}}
    """
)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("GEM_HOME", str(tmp_path / "gemhome"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(LocalBackend, "_patch_job", staticmethod(fake_trainer()))
    yield tmp_path
    for item in json.loads(gemctl("list", "-A", "--local", "-o", "json").stdout)["items"]:  # stop processes
        gemctl("delete", item["kind"], item["metadata"]["name"], "-n", item["metadata"]["namespace"], "--local")


def gemctl(*args: str):
    return CliRunner().invoke(app, list(args))


def write(tmp_path, name: str = "quick", text: str | None = None):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text if text is not None else MANIFEST.format(name=name))
    return str(path)


def test_submit_wait_prints_the_final_metrics_per_task(home):
    r = gemctl("submit", "-f", write(home), "--wait", "--timeout", "60", "--local")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "gemtraining.gem.dev/quick created" in out
    assert "gemtraining.gem.dev/quick succeeded" in out
    assert "final metrics (NE 0.9300" in out
    header = next(line for line in out.splitlines() if "METRIC" in line)
    assert "click" in header and "conversion" in header
    ne_row = next(line for line in out.splitlines() if line.strip("│ ").startswith("ne "))
    assert "0.9100" in ne_row and "0.9500" in ne_row
    assert "mlflow run: abc123" in out


def test_get_and_list_formats(home):
    assert gemctl("submit", "-f", write(home, "a"), "--wait", "--local").exit_code == 0
    assert gemctl("submit", "-f", write(home, "b"), "--local", "-n", "team-b").exit_code == 0

    table = gemctl("get", "gt", "a", "--local").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "PROGRESS", "NE", "AGE"]
    assert table[1].split()[:4] == ["a", "Succeeded", "100%", "0.9300"]

    as_yaml = yaml.safe_load(gemctl("get", "gemtraining", "a", "--local", "-o", "yaml").stdout)
    assert as_yaml["kind"] == "GEMTraining" and as_yaml["status"]["metrics"]["ne/click"] == 0.91
    as_json = json.loads(gemctl("get", "gemtrainings", "a", "--local", "-o", "json").stdout)
    assert as_json["metadata"]["name"] == "a"

    listing = gemctl("list", "--local").stdout.splitlines()
    assert listing[0].split() == ["KIND", "NAME", "PHASE", "PROGRESS", "NE", "AGE"]
    assert [line.split()[1] for line in listing[1:]] == ["a"]
    wide = gemctl("list", "gt", "-A", "--local").stdout.splitlines()
    assert wide[0].split() == ["NAMESPACE", "NAME", "PHASE", "PROGRESS", "NE", "AGE"]
    assert [line.split()[:2] for line in wide[1:]] == [["default", "a"], ["team-b", "b"]]
    assert all(line == line.rstrip() for line in table + listing + wide), "tables end their lines cleanly"
    assert json.loads(gemctl("list", "gemt", "-A", "-l", "team=ads", "--local", "-o", "json").stdout)["kind"] == "List"
    empty = gemctl("list", "lfd", "--local")
    assert empty.exit_code == 0 and "No resources found in default namespace." in empty.stderr


def test_submit_several_documents_and_stdin(home):
    both = MANIFEST.format(name="one") + "---\n" + MANIFEST.format(name="two")
    r = gemctl("submit", "-f", write(home, "both", both), "--local", "--wait", "-o", "json")
    assert r.exit_code == 0, r.output
    decoder, text, finals = json.JSONDecoder(), r.stdout.strip(), []
    while text:
        obj, end = decoder.raw_decode(text)
        finals.append(obj)
        text = text[end:].strip()
    assert [(o["metadata"]["name"], o["status"]["phase"]) for o in finals] == [("one", "Succeeded"), ("two", "Succeeded")]
    r = CliRunner().invoke(app, ["submit", "-f", "-", "--local"], input=MANIFEST.format(name="piped"))
    assert r.exit_code == 0 and "gemtraining.gem.dev/piped created" in r.stdout


def test_submit_follow_streams_the_master_log(home):
    r = gemctl("submit", "-f", write(home, "fol"), "--follow", "--local")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[:2] == ["gemtraining.gem.dev/fol created", "rank 0 of 1 on fol-train-master-0"]
    assert "gemtraining.gem.dev/fol succeeded" in lines


def test_logs_and_delete(home):
    assert gemctl("submit", "-f", write(home, "l"), "--wait", "--local").exit_code == 0
    r = gemctl("logs", "gt", "l", "--local")
    assert r.exit_code == 0 and r.stdout.splitlines()[0] == "rank 0 of 1 on l-train-master-0"
    assert gemctl("logs", "gt", "l", "--replica", "worker", "--index", "0", "--local").exit_code == 3
    r = gemctl("delete", "gt", "l", "--local")
    assert r.exit_code == 0 and 'gemtraining.gem.dev "l" deleted' in r.stdout
    assert gemctl("get", "gt", "l", "--local").exit_code == 3
    # delete waits for the job to be gone by reading it: one that cannot be read is removed all the same
    broken = home / "gemhome" / "default" / "gemtrainings" / "broken"
    broken.mkdir(parents=True)
    (broken / "object.yaml").write_text("{{{ not yaml")
    r = gemctl("delete", "gt", "broken", "--local")
    assert r.exit_code == 0 and not broken.exists(), r.output


def test_exit_codes(home, monkeypatch):
    # 2: usage and validation
    assert gemctl("get", "gt").exit_code == 2
    r = gemctl("get", "pods", "x", "--local")
    assert r.exit_code == 2 and "unknown kind 'pods'" in r.stderr
    bad = write(home, "bad", MANIFEST.format(name="bad").replace("steps: 3", "steps: 0"))
    r = gemctl("submit", "-f", bad, "--local")
    assert r.exit_code == 2 and "spec.training.steps" in r.stderr and "greater than or equal to 1" in r.stderr
    assert gemctl("get", "gt", "x", "--local", "--context", "prod").exit_code == 2
    # 3: not found
    r = gemctl("get", "gt", "ghost", "--local")
    assert r.exit_code == 3 and "GEMTraining default/ghost not found" in r.stderr
    # 1: the job failed
    monkeypatch.setattr(LocalBackend, "_patch_job", staticmethod(fake_trainer("fail")))
    r = gemctl("submit", "-f", write(home, "f"), "--wait", "--local")
    assert r.exit_code == 1 and "data.path /no/such/dir does not exist" in r.stderr
    assert gemctl("wait", "gt", "f", "--local").exit_code == 1
    # 4: timeout
    monkeypatch.setattr(LocalBackend, "_patch_job", staticmethod(fake_trainer("sleep")))
    assert gemctl("submit", "-f", write(home, "s"), "--local").exit_code == 0
    r = gemctl("wait", "gt", "s", "--timeout", "0.5", "--local")
    assert r.exit_code == 4 and "timed out" in r.stderr
    assert gemctl("wait", "gt", "s", "--for", "Running", "--timeout", "30", "--local").exit_code == 0
    # 5: backend (already exists, unreachable cluster)
    assert gemctl("submit", "-f", write(home, "s"), "--local").exit_code == 5
    kubeconfig = home / "kc"
    from tests.kubeapi import write_kubeconfig

    write_kubeconfig(kubeconfig, "http://127.0.0.1:9")
    assert gemctl("list", "--kubeconfig", str(kubeconfig)).exit_code == 5


def test_against_the_api_server(kubeapi, tmp_path):
    kc = str(kubeapi.kubeconfig_path)
    r = gemctl("submit", "-f", write(tmp_path, "k8s"), "--kubeconfig", kc, "-o", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["metadata"]["uid"]
    kubeapi.patch_status("gem.dev/v1alpha1", "GEMTraining", "k8s", {
        "phase": "Succeeded", "ne": 0.8, "progress": {"step": 3, "totalSteps": 3, "percent": 100},
        "metrics": {"ne/click": 0.79, "ne/conversion": 0.81}})
    r = gemctl("wait", "gt", "k8s", "--kubeconfig", kc, "--timeout", "10")
    assert r.exit_code == 0 and "succeeded" in r.stdout and "0.7900" in r.stdout
    rows = gemctl("list", "gt", "--kubeconfig", kc, "-l", "team=ads").stdout.splitlines()
    assert rows[1].split()[:4] == ["k8s", "Succeeded", "100%", "0.8000"]
    assert gemctl("delete", "gt", "k8s", "--kubeconfig", kc).exit_code == 0
    assert gemctl("get", "gt", "k8s", "--kubeconfig", kc).exit_code == 3


# --------------------------------------------------------------------------- review fixes


def test_submit_follow_keeps_to_the_timeout(home, monkeypatch):
    # The log stream must not get the whole timeout and then the wait all of it again.
    monkeypatch.setattr(LocalBackend, "_patch_job", staticmethod(fake_trainer(seconds=30)))
    r = gemctl("submit", "-f", write(home, "slow"), "--follow", "--timeout", "2", "--local")
    assert r.exit_code == 4, r.output
    assert "timed out after 2s waiting for GEMTraining default/slow" in r.stderr


def test_submit_follow_of_a_suspended_job_does_what_wait_does(home):
    def suspended(name: str) -> str:
        return write(home, name, MANIFEST.format(name=name).replace("spec:\n", "spec:\n  suspend: true\n"))

    waited = gemctl("submit", "-f", suspended("w"), "--wait", "--timeout", "1", "--local")
    followed = gemctl("submit", "-f", suspended("f"), "--follow", "--timeout", "1", "--local")
    assert waited.exit_code == followed.exit_code == 4, followed.output
    assert "pod" not in followed.stderr and "phase Suspended" in followed.stderr


def test_submit_follow_of_a_job_invalid_before_its_pod_starts(kubeapi, tmp_path):
    kc = str(kubeapi.kubeconfig_path)
    detail = "spec.data.path: /no/such/dir does not exist"

    def reject_like_the_operator() -> None:
        while kubeapi.get("gem.dev/v1alpha1", "GEMTraining", "inv") is None:
            time.sleep(0.05)
        kubeapi.patch_status("gem.dev/v1alpha1", "GEMTraining", "inv", {
            "phase": "Invalid", "message": detail,
            "conditions": [{"type": "Valid", "status": "False", "reason": "InvalidSpec", "message": detail}]})

    threading.Thread(target=reject_like_the_operator, daemon=True).start()
    r = gemctl("submit", "-f", write(tmp_path, "inv"), "--follow", "--timeout", "60", "--kubeconfig", kc)
    assert r.exit_code == 1, r.output
    assert f"invalid: InvalidSpec: {detail}" in r.stderr and "cleaned up" not in r.stderr


@pytest.mark.parametrize("text,field", [
    ("apiVersion: gem.dev/v1alpha1\nkind: GEMTraining\nmetadata:\n- name: x\n", "metadata: must be a mapping"),
    ("apiVersion: gem.dev/v1alpha1\nkind: [GEMTraining]\nmetadata: {name: x}\n", "kind: must be a string"),
])
def test_a_malformed_manifest_is_a_usage_error(home, text, field):
    r = gemctl("submit", "-f", write(home, "malformed", text), "--local")
    assert r.exit_code == 2 and field in r.stderr, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_an_unexpected_error_is_one_line_and_not_exit_1(home, monkeypatch):
    from gem_sdk._client import GEMClient

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(GEMClient, "get", broken)
    r = gemctl("get", "gt", "x", "--local")
    assert r.exit_code == 5 and r.stderr.strip().splitlines() == [
        "Error: unexpected RuntimeError: boom (a bug in gemctl; GEMCTL_DEBUG=1 shows the traceback)"]
    monkeypatch.setenv("GEMCTL_DEBUG", "1")
    r = gemctl("get", "gt", "x", "--local")
    assert isinstance(r.exception, RuntimeError)  # a developer sees the traceback


TICKER = "import time\nwhile True:\n    print('tick', flush=True)\n    time.sleep(0.05)\n"


def ticker(job: dict) -> dict:
    for rs in job["spec"]["pytorchReplicaSpecs"].values():
        rs["template"]["spec"]["containers"][0].update(command=[sys.executable, "-c", TICKER], args=[])
    return job


def test_a_closed_stdout_exits_0_quietly(home, monkeypatch):
    monkeypatch.setattr(LocalBackend, "_patch_job", staticmethod(ticker))
    assert gemctl("submit", "-f", write(home, "tick"), "--local").exit_code == 0
    # `gemctl logs gt tick -f | grep -m1 tick`: the reader goes away after one line.
    proc = subprocess.Popen([sys.executable, "-m", "gem_sdk.cli", "logs", "gt", "tick", "-f", "--local"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
    assert proc.stdout.readline() == b"tick\n"
    proc.stdout.close()
    try:
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert rc == 0 and proc.stderr.read() == b""


def _exit_code_example() -> str:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "sdk.md").read_text()
    section = doc[doc.index("### Exit codes"):]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("code,says", [(1, "training failed"), (4, "still running"), (5, "could not run")])
def test_the_documented_exit_code_example_works(tmp_path, code, says):
    fake = tmp_path / "gemctl"
    fake.write_text(f"#!/bin/sh\nexit {code}\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", _exit_code_example()], capture_output=True, text=True, env=env, timeout=30)
    assert says in out.stdout, out


def test_metrics_from_an_unreachable_in_cluster_mlflow_fails_soon_and_says_why(kubeapi, monkeypatch):
    # The job's trackingUri is where the trainer reaches MLflow; from a laptop it often answers
    # nothing useful. MLflow alone would retry for about 4 minutes before gemctl could say so.
    import http.server

    requests = []

    class Unavailable(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requests.append(self.path)
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)  # restored after the test
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")  # retry at once: a quick test
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        kubeapi.create("gem.dev/v1alpha1", "GEMTraining", {"metadata": {"name": "far"}, "spec": {
            "training": {"steps": 3}, "mlflow": {"trackingUri": uri}}})
        r = gemctl("metrics", "gt", "far", "--kubeconfig", str(kubeapi.kubeconfig_path))
    finally:
        server.shutdown()
    assert r.exit_code == 5, r.output
    assert f"MLflow at {uri}" in r.stderr and "spec.mlflow.trackingUri" in r.stderr
    assert "--mlflow-tracking-uri" in r.stderr
    assert 1 <= len(requests) <= 3  # the first request and at most 2 retries


# --------------------------------------------------------------------------- following across restarts

# A trainer that fails once and succeeds when restarted (in place, restartPolicy OnFailure). Its first
# container waits for GO (made once its last line was printed) so that it is surely followed before
# it fails; a follower that ends with it would never print the second container's lines.
RESTARTING_TRAINER = textwrap.dedent(
    """\
    import os, sys, time
    marker, go = sys.argv[1], sys.argv[2]
    if not os.path.exists(marker):
        open(marker, "w").close()
        print("first container: step 1", flush=True)
        print("first container: crashing", flush=True)
        for _ in range(1200):  # at most 60 s: a guard, not a timing
            if os.path.exists(go):
                break
            time.sleep(0.05)
        sys.exit(1)
    print("second container: resumed from checkpoint", flush=True)
    print("second container: done", flush=True)
    """
)
RESTART_LINE = "--- {pod} restarted (restart 1, backoffLimit 2); following the new container ---"


def _restarting_manifest(tmp_path: Path) -> str:
    return write(tmp_path, "again", MANIFEST.format(name="again").replace("backoffLimit: 0", "backoffLimit: 2"))


def _restarting_command(tmp_path: Path) -> list[str]:
    return [sys.executable, "-c", RESTARTING_TRAINER, str(tmp_path / "marker"), str(tmp_path / "go")]


def _go_after_the_first_container(monkeypatch, tmp_path: Path) -> None:
    """Let the first container fail once gemctl has printed its last line. backoffLimit 2: one restart."""
    import gem_sdk.cli as cli

    echo = cli._echo

    def echo_then_go(line: str) -> None:
        echo(line)
        if line == "first container: crashing":
            (tmp_path / "go").touch()

    monkeypatch.setattr(cli, "_echo", echo_then_go)


def _assert_followed_across_the_restart(r, pod: str, name: str) -> None:
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    logged = [line for line in lines if "container" in line]
    assert logged == ["first container: step 1", "first container: crashing", RESTART_LINE.format(pod=pod),
                      "second container: resumed from checkpoint", "second container: done"], r.output
    assert lines[-1] == f"gemtraining.gem.dev/{name} succeeded"


@pytest.mark.timeout(180)
def test_submit_follow_goes_on_after_a_restart_locally(home, monkeypatch):
    def patch(job: dict) -> dict:
        for rs in job["spec"]["pytorchReplicaSpecs"].values():
            ctr = rs["template"]["spec"]["containers"][0]
            ctr["command"], ctr["args"] = _restarting_command(home), []
        return job

    monkeypatch.setattr(LocalBackend, "_patch_job", staticmethod(patch))
    monkeypatch.setenv("GEM_LOCAL_RESTART_BACKOFF_S", "1")  # the 10 s default would only slow this test
    _go_after_the_first_container(monkeypatch, home)
    r = gemctl("submit", "-f", _restarting_manifest(home), "--follow", "--timeout", "120", "--local")
    _assert_followed_across_the_restart(r, "again-train-master-0", "again")
    pods = json.loads(gemctl("pods", "gt", "again", "--local", "-o", "json").stdout)
    assert [p["restartCount"] for p in pods] == [1], pods


@pytest.mark.timeout(180)
def test_submit_follow_goes_on_after_a_restart_on_a_cluster(kubeapi, tmp_path, monkeypatch):
    from tests.kubeapi.testing import condition, pytorchjob

    kc = str(kubeapi.kubeconfig_path)

    def operator() -> None:
        """What the gem operator does here: run the PyTorchJob, mirror its end into the resource."""
        while kubeapi.get("gem.dev/v1alpha1", "GEMTraining", "again") is None:
            time.sleep(0.05)
        kubeapi.create("kubeflow.org/v1", "PyTorchJob", pytorchjob(
            "again-train", _restarting_command(tmp_path), run_policy={"backoffLimit": 2}))
        kubeapi.patch_status("gem.dev/v1alpha1", "GEMTraining", "again", {"phase": "Running"})
        while not condition(kubeapi.get("kubeflow.org/v1", "PyTorchJob", "again-train"), "Succeeded"):
            time.sleep(0.05)
        kubeapi.patch_status("gem.dev/v1alpha1", "GEMTraining", "again", {"phase": "Succeeded"})

    threading.Thread(target=operator, daemon=True).start()
    _go_after_the_first_container(monkeypatch, tmp_path)
    r = gemctl("submit", "-f", _restarting_manifest(tmp_path), "--follow", "--timeout", "120", "--kubeconfig", kc)
    _assert_followed_across_the_restart(r, "again-train-master-0", "again")
    pod = kubeapi.get("v1", "Pod", "again-train-master-0")
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 1



def test_help_texts_keep_their_brackets():
    # rich reads [pod] as markup and dropped it: "each line prefixed with ."
    r = CliRunner().invoke(app, ["logs", "--help"], terminal_width=200)
    assert r.exit_code == 0 and "prefixed with [pod]." in r.output, r.output
