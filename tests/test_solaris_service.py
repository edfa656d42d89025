"""Solaris service: background precompute + the HTTP API on 127.0.0.1, and the CLI subcommand."""

import asyncio

import aiohttp

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
                assert body["tier"] in ("segment", "default")  # an unseen user still gets a labelled answer
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
