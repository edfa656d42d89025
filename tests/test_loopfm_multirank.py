"""The LoopFM task's memory under several ranks (gloo, 2 processes on CPU, no trainer): rank 0 logs the
memory; a failure there, or a rank that cannot see what it logged, is raised on every rank. So is a rank
that cannot load the teacher (both methods)."""

import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import yaml

WORLD = {"numUsers": 30, "numAds": 20, "numTrainExamples": 200, "numEvalExamples": 50, "meanHistoryLen": 6}
ROOT = Path(__file__).resolve().parents[1]
# (name, spec.data, whether the ranks share one checkpoint root)
SCENARIOS = [("shared", {"synthetic": WORLD}, True),
             ("not-shared", {"synthetic": WORLD}, False),
             ("bad-data", {"source": "parquet", "path": "/nonexistent/gem-data"}, True)]
# (name, distillation.method): spec.teacher.gemTraining on a checkpoint volume only rank 0's node mounts
TEACHER_SCENARIOS = [("teacher-not-shared-kd", "kd"), ("teacher-not-shared-loopfm", "loopfm"),
                     ("teacher-differs", "kd")]  # each node sees a checkpoint of that name, another one on rank 1


def _rank_main(rank: int, teacher: str, root: str) -> None:
    """One rank: build the job's memory as LoopFMTask does in each scenario; what happened goes to
    <root>/rank-N.json."""
    import torch.distributed as td

    from gem.api import parse_object
    from gem.data.errors import SpecError
    from gem.distill.task import DistillTask
    from gem.distill.teacher import load_teacher
    from gem.loopfm import task as loopfm_task
    from gem.train import checkpoint

    td.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=2,
                          timeout=datetime.timedelta(seconds=60))
    results = {}
    for name, data, shared in SCENARIOS:
        # not shared: each rank's checkpoint root is its own directory, as pods without a shared claim have
        os.environ["GEM_CHECKPOINT_DIR"] = str(Path(root) / name / ("shared" if shared else f"node-{rank}"))
        manifest = parse_object({
            "apiVersion": "gem.dev/v1alpha1", "kind": "LoopFMDistill", "metadata": {"name": "lf", "namespace": "local"},
            "spec": {"teacher": {"checkpoint": teacher},
                     "student": {"embeddingDim": 8, "hiddenDim": 16, "maxSeqLen": 8},
                     "distillation": {"method": "loopfm", "memoryK": 4}, "data": data,
                     "checkpoint": {"path": "/unused"}}})
        model, _, teacher_dir = load_teacher(manifest.spec, "local")
        try:
            memory, version = loopfm_task.build_memory(model, teacher_dir, manifest, is_main=rank == 0)
            results[name] = {"rows": len(memory.index(version))}
        except Exception as e:  # noqa: BLE001 - what this rank raised is the result
            results[name] = {"error": type(e).__name__, "message": str(e)}
        (Path(root) / f"rank-{rank}.json").write_text(json.dumps(results))
        if results[name].get("error", "SpecError") != SpecError.__name__:
            td.destroy_process_group()  # a peer's crash (gloo: 'Connection closed by peer'): the group is gone
            return
    for name, method in TEACHER_SCENARIOS:
        node = Path(root) / name / f"node-{rank}"
        os.environ["GEM_CHECKPOINT_DIR"] = str(node)
        if rank == 0 or name == "teacher-differs":  # the GEMTraining's checkpoint, on rank 0's node's volume
            copy = shutil.copytree(teacher, node / "local" / "fm" / Path(teacher).name)
            (copy / checkpoint.COMPLETE).touch()
            if rank == 1:  # a newer save of the same step name on rank 1's (say, a restarted teacher job)
                torch.save({k: v + 1 for k, v in torch.load(copy / "model.pt").items()}, copy / "model.pt")
        manifest = parse_object({
            "apiVersion": "gem.dev/v1alpha1", "kind": "LoopFMDistill", "metadata": {"name": "lf", "namespace": "local"},
            "spec": {"teacher": {"gemTraining": "fm"},
                     "student": {"embeddingDim": 8, "hiddenDim": 16, "maxSeqLen": 8},
                     "distillation": {"method": method, "memoryK": 4}, "data": {"synthetic": WORLD},
                     "checkpoint": {"path": "/unused"}}})
        try:  # what `gem distill` constructs on each rank (DistillTask is LoopFMTask for method loopfm)
            DistillTask(manifest, device=torch.device("cpu"))
            results[name] = {"loaded": True}
        except Exception as e:  # noqa: BLE001 - what this rank raised is the result
            results[name] = {"error": type(e).__name__, "message": str(e)}
        (Path(root) / f"rank-{rank}.json").write_text(json.dumps(results))
        if results[name].get("error", "SpecError") != SpecError.__name__:
            break
    td.destroy_process_group()


def test_rank_0s_logging_error_and_an_unshared_memory_are_raised_on_every_rank(tmp_path):
    from gem.api import parse_object
    from gem.model import build_model

    fm = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "fm"},
          "spec": {"model": {"preset": "tiny"}, "data": {"synthetic": WORLD}}}
    teacher = tmp_path / "fm" / "step-00000001"
    teacher.mkdir(parents=True)
    (teacher / "gem.yaml").write_text(yaml.safe_dump(fm))
    torch.save(build_model(parse_object(fm).spec.model).state_dict(), teacher / "model.pt")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(teacher), str(tmp_path)], cwd=ROOT, env=env)
             for rank in range(2)]
    for p in procs:
        p.wait(timeout=240)
    results = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]

    # a shared volume: both ranks read every logged row
    assert [r["shared"] for r in results] == [{"rows": 250}] * 2, results
    # pods without a shared checkpoint volume: rank 1 would read an empty memory (zeros for every user,
    # silently); every rank raises a SpecError naming spec.checkpoint.claimName instead
    for r in results:
        assert r["not-shared"].get("error") == "SpecError", results
        assert r["not-shared"]["message"].startswith("spec.checkpoint.claimName: rank(s) 1 cannot see the LoopFM memory")
    # rank 0 cannot read the data (a SpecError): rank 1 raises the same SpecError (exit 2) instead of waiting
    # in a barrier rank 0 never reaches (gloo: 'Connection closed by peer'; NCCL: a 30-minute hang)
    for r in results:
        assert r["bad-data"].get("error") == "SpecError", results
        assert r["bad-data"]["message"].startswith("spec.data.path: cannot read Parquet data"), results
    # only rank 0's node sees the teacher (spec.teacher.gemTraining on a volume not shared): rank 1's SpecError
    # is raised on rank 0 too, rather than rank 0 going on alone into the memory's / trainer's collectives
    for name, _ in TEACHER_SCENARIOS[:2]:
        for r in results:
            assert r[name].get("error") == "SpecError", (name, results)
            assert r[name]["message"].startswith("spec.teacher.gemTraining 'fm': no complete checkpoint"), results
            assert "rank(s) 1 of 2 failed, rank(s) 0 loaded the teacher" in r[name]["message"], results
    # the ranks loaded different teachers (resolved while the teacher saved): both raise, none distils alone
    for r in results:
        assert r["teacher-differs"].get("error") == "RuntimeError", results
        assert r["teacher-differs"]["message"].startswith("spec.teacher.gemTraining: the ranks resolved different")


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
