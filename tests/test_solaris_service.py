"""Solaris service: background precompute + the HTTP API on 127.0.0.1, and the CLI subcommand."""

import asyncio
import re

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


def test_bad_lookups_name_the_parameter_and_a_head_is_not_a_lookup():
    """400/404 said "need integer query parameters user and ad" / "unknown user U or ad A" whichever was wrong,
    and a HEAD /lookup (aiohttp's default for a GET route) was counted as a lookup and fed the predictor."""
    now = [0.0]
    service = make_service(now)
    now[0] = float(service.context.request_time.max())
    user = int(service.context.user_id[0])

    async def scenario():
        runner, port = await service.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}/lookup"
        try:
            async with aiohttp.ClientSession() as http:
                for params, status, error in (
                        ({"user": user}, 400, "query parameter ad is missing: pass integer ids"),
                        ({"user": "x", "ad": 1}, 400, "query parameter user is 'x', not an integer"),
                        ({"user": user, "ad": "1.5"}, 400, "query parameter ad is '1.5', not an integer"),
                        ({"user": -1, "ad": 3}, 404, "user -1 is not a user id: user ids are >= 0"),
                        ({"user": user, "ad": 40}, 404, "ad 40 is not an ad of this world: ad ids are 0-39")):
                    async with http.get(base, params=params) as r:
                        assert (r.status, (await r.json())["error"].startswith(error)) == (status, True), params
                async with http.head(base, params={"user": user, "ad": 39}) as r:
                    assert r.status == 405
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
    assert sum(service.tier_counts.values()) == 0 and 39 not in service.predictor._recent.get(user, {})


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


def test_serve_precompute_refuses_a_world_the_checkpoint_was_not_trained_on(tmp_path, capsys):
    """A --config whose synthetic world (seed, sizes) is not the checkpoint's was served: the FM scored ids
    of users and ads it never learnt, silently. It is a config error naming the fields, before the model
    loads (the port is taken, so a server that starts anyway exits 2 on the port instead)."""
    import socket

    ckpt = _tiny_checkpoint(tmp_path)
    synthetic = MANIFEST["spec"]["data"]["synthetic"]
    other = {**MANIFEST, "spec": {**MANIFEST["spec"], "data": {"synthetic": {**synthetic, "seed": 7, "numAds": 80}}}}
    # the same world with more history sampled and longer histories: the same users and ads, served
    more = {**MANIFEST, "spec": {**MANIFEST["spec"], "data": {"synthetic": {
        **synthetic, "numTrainExamples": 900, "meanHistoryLen": 12}}}}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert cli.main(["serve-precompute", "--config", _write(tmp_path / "other.yaml", other),
                         "--checkpoint", str(ckpt), "--port", port]) == 2
        err = capsys.readouterr().err
        assert "spec.data.synthetic.seed is 7, the checkpoint's 0" in err
        assert "spec.data.synthetic.numAds is 80, the checkpoint's 40" in err
        assert "pass the checkpoint's own gem.yaml as --config" in err and "cannot listen" not in err
        assert cli.main(["serve-precompute", "--config", _write(tmp_path / "more.yaml", more),
                         "--checkpoint", str(ckpt), "--port", port]) == 2
        assert "cannot listen there" in capsys.readouterr().err  # got as far as serving


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


def test_stopping_mid_round_ends_it_after_the_batch_in_flight():
    """On SIGTERM (runner.cleanup) a round in flight was scored to its last pair, however many it had, so the
    pod's grace period had to outlast the longest round; its values are lost with the in-memory store
    anyway. The round now ends after the batch in flight."""
    import threading

    now = [0.0]
    service = make_service(now)
    now[0] = float(service.context.request_time.max())
    service.scorer.batch_size = 4
    assert len(service.pending_pairs(now[0])) > 5 * 4
    batches, in_round, release = [], threading.Event(), threading.Event()
    rep = service.scorer.rep

    def scoring(batch):  # the first batch waits in its worker thread until the server is stopping
        batches.append(batch.size)
        if len(batches) == 1:
            in_round.set()
            release.wait(60)
        return rep(batch)

    service.scorer.rep = scoring

    async def scenario():
        runner, _ = await service.start("127.0.0.1", 0)
        assert await asyncio.to_thread(in_round.wait, 60)
        cleanup = asyncio.create_task(runner.cleanup())
        assert await asyncio.to_thread(service.stopping.wait, 60)
        release.set()
        await cleanup

    asyncio.run(scenario())
    assert batches == [4] and service.precomputed == 4 and service.store.stats()["pairs"] == 4


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


def test_a_pair_computed_from_an_older_user_state_is_computed_again():
    """pending_pairs skipped every pair still fresh in the store: once a newer impression of the user was
    observed (a new state to score from), the value of the older state was served as exact until its TTL."""
    import numpy as np

    service = make_service([0.0])
    ctx = service.context
    order = np.argsort(ctx.request_time, kind="stable")
    user = max(set(ctx.user_id.tolist()), key=ctx.user_id.tolist().count)
    rows = [int(r) for r in order if ctx.user_id[r] == user]  # the user's impressions, oldest first
    first, last = rows[0], rows[-1]
    t_last = float(ctx.request_time[last])
    assert ctx.request_time[first] < t_last
    service.user_row[user] = first  # the state known when the round ran
    computed_at = t_last - 60.0  # a minute before the newer impression: fresh at t_last (TTL 1 h)
    pairs = [(u, a) for u, a in service.pending_pairs(computed_at) if u == user]
    assert pairs and service.compute(pairs, computed_at) == len(pairs)
    assert not [p for p in service.pending_pairs(computed_at) if p[0] == user]  # fresh and of the latest state

    service.observe(user, pairs[0][1], t_last, row=last)  # a newer impression: the user's state moved on
    assert set(pairs) <= set(service.pending_pairs(t_last))


def test_expired_pairs_leave_healthz_and_metrics_once_users_go_idle():
    """Expired pairs were swept only by lookups and puts: once no user was active (no round puts) and no
    lookup came, /healthz "pairs" and solaris_store_entries kept counting pairs that had expired long ago."""
    now = [0.0]
    service = make_service(now)
    now[0] = float(service.context.request_time.max())
    assert service.compute(service.pending_pairs(now[0]), now[0]) > 0
    now[0] += 11 * 86400.0  # past the TTL (1 h) and the activity window (10 days): nothing is pending
    assert asyncio.run(service.precompute_once()) == 0
    assert service.store.stats()["pairs"] == 0


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

    ckpt = _tiny_checkpoint(tmp_path)
    config = _write(tmp_path / "fm.yaml", MANIFEST)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve-precompute", "--config", config, "--checkpoint", str(ckpt),
                         "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in err and "pass a free --port" in err


def _strict_json(text):
    """json.loads that fails on NaN / Infinity, which are not JSON (a strict client rejects them)."""
    import json

    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c} in {text}"))


def test_repeated_precompute_failures_are_counted_logged_once_and_fail_healthz(caplog):
    """Failed rounds were only logged (a full traceback every interval); /healthz said ok, /metrics had no counter."""
    import logging

    now = [0.0]
    service = make_service(now)
    now[0] = float(service.context.request_time.max())
    score = service.scorer.score

    def diverged(*args, **kw):
        raise RuntimeError("CUDA error: an illegal memory access")

    service.scorer.score = diverged

    async def scenario():
        runner, port = await service.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(400):  # rounds keep failing every interval_s
                    async with http.get(f"{base}/healthz") as r:
                        status, body = r.status, _strict_json(await r.text())
                    if status != 200 or body.get("consecutiveFailures", 0) > 6:
                        break
                    await asyncio.sleep(0.05)
                async with http.get(f"{base}/metrics") as r:
                    text = await r.text()
                assert status == 503 and body["status"] == "failing"  # a liveness probe restarts the pod
                assert body["consecutiveFailures"] >= 5  # unhealthy_after's default
                assert body["lastError"] == "RuntimeError: CUDA error: an illegal memory access"
                # rounds go on failing after /metrics answered: its count is at most the count read after it
                counted = float(re.search(r"^solaris_precompute_failures_total (\S+)$", text, re.M).group(1))
                assert body["consecutiveFailures"] <= counted <= service.failures
                service.scorer.score = score  # the model recovers
                for _ in range(400):
                    async with http.get(f"{base}/healthz") as r:
                        status, body = r.status, _strict_json(await r.text())
                    if status == 200:
                        break
                    await asyncio.sleep(0.05)
                assert status == 200 and body["status"] == "ok" and body["consecutiveFailures"] == 0
                assert body["lastError"] is None
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.INFO, logger="gem.solaris"):
        asyncio.run(scenario())
    failed = [r for r in caplog.records if "precompute round failed" in r.getMessage()]
    assert len(failed) == service.failures
    assert sum(r.exc_info is not None for r in failed) == 1  # one traceback per distinct error, not per round
    assert "(5 in a row)" in "\n".join(r.getMessage() for r in failed)
    assert any("recovered after" in r.getMessage() for r in caplog.records)


def test_a_diverged_model_is_never_served_and_lookup_json_is_standard():
    """NaN/inf FM values were stored and /lookup answered `{"value": [NaN, ...]}`, which is not JSON."""
    import numpy as np

    from gem.solaris.fallback import LookupResult

    now = [0.0]
    service = make_service(now)
    now[0] = float(service.context.request_time.max())
    user = int(service.context.user_id[int(service.context.request_time.argmax())])
    recent_ad = next(reversed(service.predictor._recent[user]))
    score = service.scorer.score

    def diverged(*args, **kw):
        values, embs = score(*args, **kw)
        return np.full_like(values, np.nan), embs

    service.scorer.score = diverged

    async def scenario():
        runner, port = await service.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(400):
                    if service.rounds >= 1:
                        break
                    await asyncio.sleep(0.05)
                async with http.get(f"{base}/lookup", params={"user": user, "ad": recent_ad}) as r:
                    body = _strict_json(await r.text())
                assert r.status == 200 and body["tier"] == "default" and body["value"] == [0.0, 0.0]
                async with http.get(f"{base}/metrics") as r:
                    text = await r.text()
                assert f"solaris_nonfinite_values_total {float(service.store.nonfinite)}" in text
                assert service.store.nonfinite > 0 and service.store.stats()["pairs"] == 0
                # and whatever a tier returns, /lookup never writes NaN: it answers an error instead
                service.lookup_.lookup = lambda u, a, now: LookupResult(np.array([np.inf, 0.0], np.float32),
                                                                         "neighbors", "test-v1")
                async with http.get(f"{base}/lookup", params={"user": user, "ad": recent_ad}) as r:
                    body = _strict_json(await r.text())
                assert r.status == 500 and "not finite" in body["error"]
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_predictor_that_forgets_users_still_active_is_refused():
    from gem.solaris.predictor import RequestPredictor
    from gem.solaris.service import SolarisService

    service = make_service([0.0])  # a 10-day activity window: build_service keeps users at least that long
    assert service.predictor.forget_after_s >= service.active_window_s
    short = RequestPredictor(segment_of=lambda u: None, campaign_of=lambda a: 0, forget_after_s=3600.0)
    with pytest.raises(ValueError, match="forget_after_s"):
        SolarisService(scorer=service.scorer, context=service.context, store=service.store, predictor=short,
                       lookup=service.lookup_, active_window_s=86400.0)


def _tiny_checkpoint(tmp_path):
    import torch

    ckpt = tmp_path / "fm" / "step-00000001"
    ckpt.mkdir(parents=True)
    _write(ckpt / "gem.yaml", MANIFEST)
    torch.save(build_model(parse_object(MANIFEST).spec.model).state_dict(), ckpt / "model.pt")
    return ckpt


def test_serve_precompute_stops_gracefully_on_sigterm(tmp_path):
    """Kubernetes stops a pod with SIGTERM: the server died at once (exit -15), the precompute task and the
    HTTP runner never cleaned up. It now stops as on Ctrl-C: exit 0 after both are stopped."""
    import re
    import signal
    import subprocess
    import sys
    import urllib.request

    ckpt = _tiny_checkpoint(tmp_path)
    config = _write(tmp_path / "fm.yaml", MANIFEST)
    proc = subprocess.Popen([sys.executable, "-m", "gem.cli", "serve-precompute", "--config", config,
                             "--checkpoint", str(ckpt), "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in proc.stderr:  # EOF if it exits before serving
            m = re.search(r"serving on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port, "serve-precompute exited before serving"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz") as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "solaris: precompute task stopped" in err and "solaris: stopped" in err
    assert "Traceback" not in err
