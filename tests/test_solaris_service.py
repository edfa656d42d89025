"""Solaris service: background precompute + the HTTP API on 127.0.0.1, and the CLI subcommand."""

import asyncio

import aiohttp
import pytest
import yaml

from gem import cli
from gem.api import parse_object
from gem.model import build_model
from gem.solaris.service import build_service

MANIFEST = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "fm"},
            "spec": {"model": {"preset": "tiny"},
                     "data": {"synthetic": {"numUsers": 60, "numAds": 40, "numTrainExamples": 600,
                                            "numEvalExamples": 50, "meanHistoryLen": 8}}}}


def make_service(now):
    manifest = parse_object(MANIFEST)
    model = build_model(manifest.spec.model)  # untrained: the service only needs a GEM model
    return build_service(model, manifest, ttl_s=3600, num_segments=4, version="test-v1", clock=lambda: now[0],
                         interval_s=0.05, active_window_s=10 * 86400)


def test_service_precomputes_and_answers_over_http():
    now = [0.0]
    service = make_service(now)
    now[0] = float(service.context.request_time.max())
    user = int(service.context.user_id[int(service.context.request_time.argmax())])
    recent_ad = next(reversed(service.predictor._recent[user]))

    async def scenario():
        runner, port = await service.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{base}/healthz") as r:
                    assert r.status == 200 and (await r.json())["version"] == "test-v1"
                for _ in range(200):  # the background task precomputes the predicted pairs
                    if service.store.get(user, recent_ad, now=now[0]) is not None:
                        break
                    await asyncio.sleep(0.05)
                async with http.get(f"{base}/lookup", params={"user": user, "ad": recent_ad}) as r:
                    body = await r.json()
                assert r.status == 200 and body["tier"] == "exact" and len(body["value"]) == 2
                assert body["version"] == "test-v1" and body["tierIndex"] == 0
                async with http.get(f"{base}/lookup", params={"user": 10_000_000, "ad": 3}) as r:
                    body = await r.json()
                assert body["tier"] == "default"  # an unseen user (no segment, no embedding) still gets an answer
                async with http.get(f"{base}/lookup", params={"user": "x"}) as r:
                    assert r.status == 400
                async with http.get(f"{base}/metrics") as r:
                    text = await r.text()
                assert 'solaris_lookups_total{tier="exact"} 1' in text and "solaris_precomputed_total" in text
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
    assert service.rounds >= 1 and service.precomputed > 0


def test_building_a_service_leaves_autograd_alone():
    """A library object must not switch gradients off for the whole process (it broke later training)."""
    import torch

    make_service([0.0])
    assert torch.is_grad_enabled()


def test_a_user_never_seen_in_training_has_no_segment():
    """Not `user % num_segments`: an arbitrary k-means segment's mean is not the new user's (review r3)."""
    now = [0.0]
    service = make_service(now)
    now[0] = float(service.context.request_time.max())
    service.compute(service.pending_pairs(now[0]), now[0])
    known = int(service.context.user_id[0])
    assert service.lookup_.segment_of(known) is not None
    new_users = [10**9 + k for k in range(8)]
    assert all(service.lookup_.segment_of(u) is None for u in new_users)
    tiers = {service.lookup(u, a, now=now[0], observe=False).tier for u in new_users for a in range(40)}
    assert tiers == {"default"}
    # a segment x ad mean exists for some ad, yet a new user does not get it
    assert any(service.store.segment_ad(service.lookup_.segment_of(known), a, now=now[0]) is not None
               for a in range(40))


def _write(path, obj):
    path.write_text(yaml.safe_dump(obj))
    return str(path)


def test_serve_precompute_refuses_data_it_would_ignore(tmp_path, capsys):
    ckpt = tmp_path / "never-read"
    parquet = {**MANIFEST, "spec": {**MANIFEST["spec"], "data": {"source": "parquet", "path": str(tmp_path)}}}
    mixed = {**MANIFEST, "spec": {**MANIFEST["spec"], "data": {"sources": [
        {"name": "a", "synthetic": {"numUsers": 60}, "evaluate": True}]}}}
    assert cli.main(["serve-precompute", "--config", _write(tmp_path / "p.yaml", parquet),
                     "--checkpoint", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "spec.data.source is 'parquet'" in err and "data.source: synthetic" in err
    assert cli.main(["serve-precompute", "--config", _write(tmp_path / "m.yaml", mixed),
                     "--checkpoint", str(ckpt)]) == 2
    assert "spec.data.sources" in capsys.readouterr().err


def test_serve_precompute_refuses_a_student_checkpoint(tmp_path, capsys):
    student = tmp_path / "student" / "step-00000008"
    student.mkdir(parents=True)
    _write(student / "gem.yaml", {
        "apiVersion": "gem.dev/v1alpha1", "kind": "LoopFMDistill", "metadata": {"name": "lf"},
        "spec": {"teacher": {"gemTraining": "fm"}, "distillation": {"method": "loopfm"}}})
    (student / "model.pt").write_bytes(b"")
    config = _write(tmp_path / "fm.yaml", MANIFEST)
    assert cli.main(["serve-precompute", "--config", config, "--checkpoint", str(student)]) == 2
    err = capsys.readouterr().err
    assert f"--checkpoint {student} holds a LoopFMDistill student (distillation.method loopfm)" in err
    assert "GEMTraining's checkpoint" in err
    assert cli.main(["serve-precompute", "--config", config, "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_a_failed_start_stops_the_background_precompute():
    """A taken port used to leave the runner set up and its precompute task running for good."""
    import socket

    now = [0.0]
    service = make_service(now)
    now[0] = float(service.context.request_time.max())

    async def scenario():
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            with pytest.raises(OSError):
                await service.start("127.0.0.1", busy.getsockname()[1])
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert others == []  # no precompute task left behind

    asyncio.run(scenario())


def test_compute_stores_under_the_version_live_when_scoring_began():
    """A model swapped in while a round scores must not get the old model's values under its version."""
    now = [0.0]
    service = make_service(now)
    now[0] = float(service.context.request_time.max())
    pairs = service.pending_pairs(now[0])[:5]
    score = service.scorer.score

    def score_then_swap(*args, **kw):
        out = score(*args, **kw)
        service.store.set_version("test-v2")  # the new model goes live while the old one's values are in flight
        return out

    service.scorer.score = score_then_swap
    assert service.compute(pairs, now[0]) == 0
    assert service.store.stats()["pairs"] == 0 and service.store.get(*pairs[0], now=now[0]) is None


def test_the_cli_clock_does_not_go_back_with_the_wall_clock(monkeypatch):
    """The store expects its now to move forward; an NTP step back of time.time() moved it back."""
    import time

    manifest = parse_object(MANIFEST)
    service = build_service(build_model(manifest.spec.model), manifest, num_segments=4, warmup=False)
    end = float(service.context.request_time.max())
    first = service.clock()
    assert first >= end  # the service starts at the end of the world's history
    wall = time.time()
    monkeypatch.setattr(time, "time", lambda: wall - 3600.0)  # the wall clock steps back an hour
    assert service.clock() >= first


def test_serve_precompute_refuses_a_bad_port_or_ttl_before_loading(tmp_path, capsys):
    config = _write(tmp_path / "fm.yaml", MANIFEST)
    never_read = str(tmp_path / "never-read")  # checked at parse time: the checkpoint is never opened
    for flag, value in (("--port", "70000"), ("--port", "-1"), ("--port", "http"), ("--ttl", "0"), ("--ttl", "nan"),
                        ("--ttl", "-60")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["serve-precompute", "--config", config, "--checkpoint", never_read, flag, value])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: {value!r}" in err, err
        assert ("0-65535" if flag == "--port" else "positive number of seconds") in err


def test_serve_precompute_on_a_taken_port_is_a_config_error(tmp_path, capsys):
    import socket

    import torch

    ckpt = tmp_path / "fm" / "step-00000001"
    ckpt.mkdir(parents=True)
    _write(ckpt / "gem.yaml", MANIFEST)
    torch.save(build_model(parse_object(MANIFEST).spec.model).state_dict(), ckpt / "model.pt")
    config = _write(tmp_path / "fm.yaml", MANIFEST)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve-precompute", "--config", config, "--checkpoint", str(ckpt),
                         "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in err and "pass a free --port" in err
