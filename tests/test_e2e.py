"""The whole spine, every arrow real:

GEMTraining (SDK) -> gem-operator (kopf, own process) -> PyTorchJob (validated against the official
CRD) -> master + worker processes with the training operator's environment -> `torchrun -m gem
train` with DeepSpeed -> checkpoints and an MLflow run (a real `mlflow server`) -> PyTorchJob
conditions -> GEMTraining status -> `GEMClient.wait()` returns with the final metrics.

Then a LoopFMDistill distils the finished GEMTraining the same way. The operator is killed and
restarted while the first job runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jsonschema
import pytest
import yaml

from gem.launcher import free_port
from tests.kubeapi.testing import wait_for

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow tracking server on 127.0.0.1 with a sqlite backend and proxied artifacts."""
    port = free_port()
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    log = open(tmp_path / "mlflow.log", "wb")
    proc = subprocess.Popen(
        [
            mlflow, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--artifacts-destination", str(tmp_path / "mlflow-artifacts"),
        ],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, (tmp_path / "mlflow.log").read_text()[-3000:]
        try:
            return urllib.request.urlopen(f"{url}/health", timeout=2).status == 200
        except OSError:
            return False

    wait_for(healthy, timeout=120, interval=0.5, what="mlflow server health")
    yield url
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


class OperatorProcess:
    def __init__(self, kubeconfig: Path, mlflow_url: str, log: Path):
        self.args = [sys.executable, "-m", "gem_operator", "--kubeconfig", str(kubeconfig), "-n", "default"]
        self.env = {**os.environ, "GEM_MLFLOW_TRACKING_URI": mlflow_url, "GEM_RESYNC_SECONDS": "2",
                    "GEM_TEACHER_POLL_SECONDS": "1"}
        self.log, self.proc = log, None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, env=self.env)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _pytorchjob_schema() -> dict:
    crd = yaml.safe_load((ROOT / "tests/kubeapi/crds/kubeflow.org_pytorchjobs.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def shortened(example: dict, steps: int) -> dict:
    """The example as shipped, with a fraction of its steps and data (still seen once): the plumbing
    is what is tested here (learning is tested in test_modules_gem_train.py), and both jobs run on 2 cores."""
    spec = example["spec"]
    spec["training"]["steps"] = steps
    spec["data"]["synthetic"]["numTrainExamples"] = steps * 300
    spec["checkpoint"]["everySteps"] = steps // 2
    return example


def _pod_report(kubeapi, pods: list[dict]) -> str:
    """Each pod's phase and the last lines of its log: what a stuck pod was doing."""
    lines = []
    for pod in pods:
        md = pod["metadata"]
        lines.append(f"--- {md['name']}: {pod['status'].get('phase')}")
        provided = kubeapi.executor.log_provider(md["namespace"], md["name"], None)
        if provided is not None and Path(provided[0]).is_file():
            lines += Path(provided[0]).read_text(errors="replace").splitlines()[-30:]
    return "\n".join(lines)


# A training and then a distillation, each on 2 pods: longer than the suite's default per-test
# limit on a loaded 2-core machine.
@pytest.mark.timeout(1500)
def test_gemtraining_then_loopfm_distill_end_to_end(kubeapi, mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    from gem_sdk import GEMClient, KubernetesBackendConfig

    operator = OperatorProcess(kubeapi.kubeconfig_path, mlflow_server, tmp_path / "operator.log")
    operator.start()
    client = GEMClient(KubernetesBackendConfig(kubeconfig=str(kubeapi.kubeconfig_path), namespace="default"))
    try:
        # 100 steps (the teacher of a distillation that runs 200): the suite's slowest test, mostly this training
        quickstart = shortened(yaml.safe_load((ROOT / "examples/quickstart.yaml").read_text()), steps=100)
        submitted = client.submit(quickstart)
        name = submitted.metadata.name

        # The PyTorchJob exists (the server validated it on create) and validates on its own too.
        job = wait_for(lambda: kubeapi.get("kubeflow.org/v1", "PyTorchJob", f"{name}-train"), timeout=60, what="PyTorchJob")
        jsonschema.validate(job, _pytorchjob_schema())
        assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1

        # Progress reaches the status while it trains; then the operator dies and comes back.
        running = wait_for(
            lambda: (obj := client.get(name)).status and obj.status.progress and obj.status.progress.step > 0 and obj,
            timeout=300, interval=0.5, what="progress while running",
        )
        assert running.status.phase == "Running"
        operator.stop()
        time.sleep(2)
        operator.start()

        done = client.wait(name, timeout=900)
        status = done.status
        assert status.phase == "Succeeded", status.message
        assert len(kubeapi.list("kubeflow.org/v1", "PyTorchJob")) == 1
        # 100 steps: click is learnt; post-click conversion (1 example in ~6) has only begun
        assert 0 < status.metrics["ne/click"] < 1.0 and status.metrics["auc/click"] > 0.55, status.metrics
        assert status.metrics["auc/conversion"] > 0.5 and status.metrics["ne/conversion"] < 1.1, status.metrics
        assert status.ne is not None and status.progress.percent == 100
        # The fake kubelet maps the checkpoint claim to a host directory, so the path the trainer
        # reported is readable here: a complete checkpoint a consumer can load from alone.
        checkpoint = Path(status.latest_checkpoint)
        assert (checkpoint / "model.pt").is_file() and (checkpoint / "gem.yaml").is_file(), checkpoint
        # The job succeeds when its Master does (the training operator's rule); the worker may still be
        # exiting at that moment, so wait for both pods to reach Succeeded rather than race them.
        # 300 s, not 60: on a stalled 2-core VM (CPU steal) a worker's interpreter exit has taken
        # longer than a minute; a real hang still fails, with the worker's log tail to show where.
        pods = lambda: kubeapi.list("v1", "Pod", label_selector=f"training.kubeflow.org/job-name={name}-train")
        try:
            wait_for(lambda: sorted(p["status"]["phase"] for p in pods()) == ["Succeeded", "Succeeded"],
                     timeout=300, interval=0.5, what="both train pods Succeeded")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{_pod_report(kubeapi, pods())}") from None

        # The MLflow run holds the metrics and the checkpoint.
        mlflow = MlflowClient(tracking_uri=mlflow_server)
        run = mlflow.get_run(status.mlflow.run_id)
        assert run.data.metrics["ne/click"] == pytest.approx(status.metrics["ne/click"], rel=1e-6)
        artifacts = {a.path for a in mlflow.list_artifacts(run.info.run_id)}
        assert "checkpoint" in artifacts, artifacts
        assert {a.path for a in mlflow.list_artifacts(run.info.run_id, "checkpoint")} >= {"checkpoint/model.pt"}

        # A LoopFMDistill that names the finished GEMTraining as its teacher.
        distill = shortened(yaml.safe_load((ROOT / "examples/loopfm-distill.yaml").read_text()), steps=200)
        assert distill["spec"]["teacher"]["gemTraining"] == name
        student = client.submit(distill)
        done = client.wait(student.metadata.name, kind="LoopFMDistill", timeout=900)
        assert done.status.phase == "Succeeded", done.status.message
        assert 0 < done.status.metrics["ne/click"] < 1.0
        assert done.status.mlflow and done.status.mlflow.run_id
        cm = kubeapi.get("v1", "ConfigMap", f"{student.metadata.name}-distill-config")
        assert yaml.safe_load(cm["data"]["config.yaml"])["spec"]["teacher"]["checkpoint"] == status.latest_checkpoint
    finally:
        operator.stop()
