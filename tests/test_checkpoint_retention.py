"""Deleting checkpoints (checkpoint.prune, and a publish over an old step directory) under kill -9.

shutil.rmtree removes a directory's files in directory order (a hash order on ext4), so COMPLETE
went at some random point: a kill part-way through left a directory still marked COMPLETE with files
missing, which a resume then took for a checkpoint (without rng/ it resumes with fresh RNG, without
gem.yaml every restart fails). The marker now goes first; prune removes such leftovers later.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from gem.train import checkpoint

ROOT = Path(__file__).resolve().parents[1]

# prune in a child that SIGKILLs itself right after it deleted the first file that is not COMPLETE
KILLED_MID_PRUNE = """
import os, signal, sys
from pathlib import Path
from gem.train import checkpoint
real = os.unlink
def unlink(path, *args, **kwargs):
    real(path, *args, **kwargs)
    if os.path.basename(os.fsdecode(path)) != checkpoint.COMPLETE:
        os.kill(os.getpid(), signal.SIGKILL)
os.unlink = unlink
checkpoint.prune(Path(sys.argv[1]), int(sys.argv[2]))
"""


def _fake_checkpoint(job: Path, step: int, *, partitions: int = 64) -> Path:
    """A checkpoint's files: DeepSpeed's (one ZeRO partition per rank), ours, COMPLETE last."""
    d = job / checkpoint.step_dir_name(step)
    (d / "rng").mkdir(parents=True)
    names = [checkpoint.MANIFEST_FILE, checkpoint.STATE_FILE, checkpoint.MODEL_FILE, "mp_rank_00_model_states.pt"]
    names += [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(partitions)]
    names += [f"rng/rank-{r:05d}.pt" for r in range(partitions)]
    for name in names:
        (d / name).write_bytes(b"x")
    (d / checkpoint.COMPLETE).write_text(f'{{"step": {step}}}\n')
    return d


def _files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def test_a_kill_while_pruning_never_leaves_a_complete_checkpoint_with_files_missing(tmp_path):
    job = tmp_path / "job"
    whole = {d.name: _files(d) for d in (_fake_checkpoint(job, s) for s in (10, 20, 30))}
    child = subprocess.run([sys.executable, "-c", KILLED_MID_PRUNE, str(job), "1"], cwd=ROOT)
    assert child.returncode == -signal.SIGKILL  # killed inside rmtree of step 10
    left = checkpoint.complete_checkpoints(job)
    for d in left:
        assert _files(d) == whole[d.name], f"{d.name} is marked {checkpoint.COMPLETE} with files missing"
    assert [d.name for d in left] == ["step-00000020", "step-00000030"]
    checkpoint.prune(job, 1)  # the next save's prune finishes the job, the cut-short step 10 included
    assert sorted(p.name for p in job.iterdir()) == ["step-00000030"]


def test_prune_removes_leftovers_older_than_the_newest_checkpoint_only(tmp_path):
    job = tmp_path / "job"
    for step in (10, 20, 30):
        _fake_checkpoint(job, step, partitions=1)
    (job / "step-00000005").mkdir()  # a deletion cut short (its COMPLETE already gone)
    (job / ".tmp-step-00000015").mkdir()  # a save that crashed at a step never saved again
    (job / "step-00000040").mkdir()  # renamed, not yet marked: the next save of step 40 replaces it
    (job / "zero_to_fp32.py").write_text("")  # DeepSpeed's helper
    checkpoint.prune(job, 2)
    assert sorted(p.name for p in job.iterdir()) == ["step-00000020", "step-00000030", "step-00000040",
                                                     "zero_to_fp32.py"]


def test_publishing_over_an_old_step_directory_unmarks_it_before_deleting_it(tmp_path, monkeypatch):
    """A newer checkpoint that did not load is replaced when training saves its step again: a kill
    while its files are deleted must not leave it marked complete either."""
    job = tmp_path / "job"
    old = _fake_checkpoint(job, 40, partitions=2)
    tmp = job / ".tmp-step-00000040"
    tmp.mkdir()
    (tmp / "mp_rank_00_model_states.pt").write_bytes(b"new")
    seen = []
    real = checkpoint.shutil.rmtree
    monkeypatch.setattr(checkpoint.shutil, "rmtree",
                        lambda path, **kw: (seen.append((Path(path), (Path(path) / checkpoint.COMPLETE).exists())),
                                            real(path, **kw))[1])
    checkpoint._publish(tmp, old, 40)
    assert seen == [(old, False)]  # no longer a checkpoint by the time its files go
    assert checkpoint.complete_checkpoints(job) == [old] and _files(old) == ["COMPLETE", "mp_rank_00_model_states.pt"]
