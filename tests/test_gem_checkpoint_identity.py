"""A resource re-created under the same name starts fresh; its predecessor's checkpoints are kept."""

from __future__ import annotations

import yaml

from gem.train import checkpoint


def _fake_checkpoint(job, step: int, uid: str | None):
    d = job / checkpoint.step_dir_name(step)
    d.mkdir(parents=True)
    (d / checkpoint.MANIFEST_FILE).write_text(yaml.safe_dump({"metadata": {"name": "q", "uid": uid}}))
    (d / checkpoint.COMPLETE).write_text("")
    return d


def test_checkpoints_of_another_uid_are_set_aside_not_resumed(tmp_path):
    job = tmp_path / "default" / "q"
    _fake_checkpoint(job, 100, "old-uid-1234")
    stale = checkpoint.set_aside_stale(job, "new-uid")
    assert stale is not None and not job.exists()
    assert (stale / "step-00000100" / checkpoint.COMPLETE).is_file()  # nothing lost
    assert checkpoint.latest_complete(job) is None


def test_own_checkpoints_and_uidless_runs_are_resumed(tmp_path):
    job = tmp_path / "default" / "q"
    _fake_checkpoint(job, 100, "same")
    assert checkpoint.set_aside_stale(job, "same") is None
    assert checkpoint.latest_complete(job).name == "step-00000100"
    local = tmp_path / "local" / "q"
    _fake_checkpoint(local, 5, None)
    assert checkpoint.set_aside_stale(local, None) is None and checkpoint.latest_complete(local) is not None
