"""How `gem train` stops when told to: SIGTERM (Kubernetes deleting, preempting or draining the pod)
stops at a step boundary, ends the MLflow run KILLED with every step it trained logged, exits 143,
and a restart resumes the same run; and a rank-0 MLflow setup failure stops every rank alike."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest
import yaml

from gem.train import checkpoint
from tests.test_gem_distributed import base_env, kill_tree

pytestmark = pytest.mark.usefixtures("trainer_env")  # tests/conftest.py

HANG_S = 180


def manifest(tmp_path, *, steps: int) -> tuple[str, str]:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    obj = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "term"}, "spec": {
        "model": {"preset": "tiny"},
        "data": {"synthetic": {"numUsers": 50, "numAds": 20, "numTrainExamples": 256, "numEvalExamples": 64,
                               "meanHistoryLen": 4}},
        "training": {"steps": steps, "batchSize": 8, "warmupSteps": 0},
        # 7: most stops fall between checkpoints, where step metrics are still buffered
        "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 7, "keepLast": 3},
        "mlflow": {"enabled": True, "experiment": "term", "trackingUri": uri, "registerModel": False}}}
    path = tmp_path / "term.yaml"
    path.write_text(yaml.safe_dump(obj))
    return str(path), uri


def gem_train(config: str, tmp_path, *, sigterm_after: str | None = None) -> tuple[int, str]:
    """`gem train` in its own process; SIGTERM once a stderr line contains `sigterm_after`."""
    proc = subprocess.Popen([sys.executable, "-m", "gem", "train", "--config", config],
                            env=base_env(GEM_TERMINATION_MESSAGE_PATH=str(tmp_path / "termination-log")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = ""
    if sigterm_after:
        for line in proc.stderr:  # ends at EOF if the job exits first
            seen += line
            if sigterm_after in line:
                proc.send_signal(signal.SIGTERM)
                break
    try:
        return proc.wait(timeout=HANG_S), seen + proc.stderr.read()
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        pytest.fail(f"no exit {HANG_S}s after start (or after SIGTERM)\n{seen[-4000:]}")


def test_sigterm_stops_at_a_step_boundary_ends_the_mlflow_run_killed_and_a_restart_resumes_it(tmp_path):
    from mlflow.tracking import MlflowClient

    config, uri = manifest(tmp_path, steps=100_000)
    code, err = gem_train(config, tmp_path, sigterm_after="step step=10 ")
    assert code == 128 + signal.SIGTERM, err[-4000:]
    stopped = re.search(r"stopped by SIGTERM before step (\d+): nothing after step (\d+) was trained", err)
    assert stopped and "Traceback" not in err, err[-4000:]
    last = int(stopped.group(2))
    assert last >= 10
    error = json.loads((tmp_path / "termination-log").read_text())["error"]
    assert error.startswith("Terminated: stopped by SIGTERM")

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("term").experiment_id])
    assert run.info.status == "KILLED"
    # every step trained is in MLflow, those after the last checkpoint too (they were buffered)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(1, last + 1))
    # no checkpoint written on the way out: the newest is the last periodic one
    ckpt = checkpoint.latest_complete(tmp_path / "ckpt/local/term")
    resumed_at = int(json.loads((ckpt / "trainer_state.json").read_text())["step"])
    assert resumed_at == last - last % 7

    # the restart (a new pod) resumes from that checkpoint and continues the same run to the end
    config, _ = manifest(tmp_path, steps=resumed_at + 2)
    code, err = gem_train(config, tmp_path)
    assert code == 0, err[-4000:]
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report["mlflowRunId"] == run.info.run_id and report["step"] == resumed_at + 2
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    # steps after the checkpoint ran twice: before SIGTERM and after the resume
    assert set(steps) == set(range(1, max(last, resumed_at + 2) + 1))
    assert steps.count(resumed_at + 1) == (2 if last > resumed_at else 1)


# --------------------------------------------------------------------------- a rank-0 MLflow failure


def test_a_deleted_experiment_stops_every_rank_with_exit_2(tmp_path):
    """Only rank 0 starts the MLflow run: its config error (a deleted experiment, SpecError) reached
    no other rank, which trained on until torchrun tore it down (SIGTERM). Now every rank exits 2 with
    rank 0's message, before any step. 2 ranks (torchrun, gloo): ~25 s, stopped before training."""
    from mlflow.tracking import MlflowClient

    from tests.test_train_resume_multirank import manifest as multirank_manifest
    from tests.test_train_resume_multirank import run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    client.delete_experiment(client.create_experiment("gone"))
    path = multirank_manifest(tmp_path, "gone", zero_stage=1)
    obj = yaml.safe_load(path.read_text())
    obj["spec"]["mlflow"] = {"enabled": True, "experiment": "gone", "trackingUri": uri, "registerModel": False}
    path.write_text(yaml.safe_dump(obj))
    code, out = run(path, tmp_path)
    assert code != 0
    message = "gem train: spec.mlflow.experiment: the experiment 'gone' was deleted in MLflow"
    assert out.count(message) == 2, out[-4000:]  # by each rank, rank 1 too
    # torchrun's summary: exit 2 (a rank still exiting when the other is done may get its SIGTERM)
    codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)}
    assert 2 in codes and codes <= {2, -signal.SIGTERM}, out[-4000:]
    assert checkpoint.latest_complete(tmp_path / "ckpt/t/gone") is None



def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """torchrun signals each rank on its own, so one may get SIGTERM a step before the other: a rank
    stopping alone would leave its peer waiting in the next step's collectives. Rank 1 alone is
    signalled here; both stop at the same boundary and exit 143, and rank 0 ends the run KILLED."""
    import psutil
    from mlflow.tracking import MlflowClient

    from gem.launcher import free_port
    from tests.test_train_resume_multirank import manifest as multirank_manifest

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    path = multirank_manifest(tmp_path, "term2", zero_stage=1)
    obj = yaml.safe_load(path.read_text())
    obj["spec"]["training"]["steps"] = 100_000
    obj["spec"]["mlflow"] = {"enabled": True, "experiment": "term2", "trackingUri": uri, "registerModel": False}
    path.write_text(yaml.safe_dump(obj))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "gem", "train", "--config", str(path)],
                            env=base_env(GEM_TERMINATION_MESSAGE_PATH=str(tmp_path / "termination-log")),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = ""
    for line in proc.stdout:
        out += line
        if "mlflow: started run" in line:  # rank 0's: both ranks are in Trainer.run, SIGTERM caught
            (rank1,) = [p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1"]
            rank1.send_signal(signal.SIGTERM)
            break
    try:
        out += proc.communicate(timeout=HANG_S)[0]
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        pytest.fail(f"hung after SIGTERM to rank 1\n{(out + proc.communicate()[0])[-4000:]}")
    stops = re.findall(r"rank=(\d) gem: gem train: stopped by SIGTERM before step (\d+)", out)
    assert sorted(rank for rank, _ in stops) == ["0", "1"] and len({step for _, step in stops}) == 1, out[-4000:]
    # torchrun's summary: 143 (a rank still exiting when the other is done may get torchrun's own SIGTERM)
    codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)}
    assert 128 + signal.SIGTERM in codes and codes <= {128 + signal.SIGTERM, -signal.SIGTERM}, out[-4000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("term2").experiment_id])
    assert run.info.status == "KILLED"


def test_a_sigterm_recorded_during_the_stop_all_reduce_is_kept_for_the_next_step(monkeypatch):
    """A rank spends most of a step waiting in collectives, the stop flag's all-reduce among them, and
    Python runs the SIGTERM handler as soon as that call returns. The reduced 0 then overwrote the
    recorded signal, and the run never stopped (seen: both ranks training on 3,000 steps after rank 1's
    SIGTERM). The signal arrives inside this fake all-reduce, after the flag was sent."""
    from types import SimpleNamespace

    import torch.distributed as torch_dist

    from gem.train.trainer import Trainer

    rank = SimpleNamespace(env=SimpleNamespace(world_size=2, device="cpu"), _signal=None)

    def all_reduce(flag, op=None):  # the peer has no signal: MAX keeps this rank's value
        if rank._signal is None:
            rank._signal = signal.SIGTERM  # the handler, run as the collective returns
    monkeypatch.setattr(torch_dist, "all_reduce", all_reduce)
    assert Trainer._stop_requested(rank) is False  # this step's flag went out before the signal
    assert rank._signal == signal.SIGTERM
    assert Trainer._stop_requested(rank) is True  # the next step's carries it: every rank stops there
