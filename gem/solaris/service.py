"""The Solaris service: background precompute fed by the predictor, and an HTTP lookup API.

    GET /lookup?user=U&ad=A   -> {"value": [click_logit, conversion_logit], "tier": "exact"|..., "tierIndex",
                                  "version", "user", "ad"}
    GET /healthz              -> {"status": "ok"|"failing", "version", "pairs", "consecutiveFailures", "lastError"}
                                 (503 once `unhealthy_after` precompute rounds in a row have failed)
    GET /metrics              -> Prometheus text (prometheus-client): lookups per tier, store entries,
                                 precomputed pairs, precompute rounds and failures, refused non-finite values

Every lookup is also a request observation: it feeds the predictor's recent candidates and the
segment popularity, so what is asked for now is what gets precomputed next. The background task
(`run_precompute`) wakes every `interval_s`, asks the predictor for the pairs of recently active
users, skips those still fresh in the store (and computed from the user's latest state), scores the rest with the FM in a worker thread (the
event loop keeps answering lookups) and writes them to the store with the model version and TTL.

A failed round is counted and logged (the traceback once per distinct error: type and place it was
raised; then one line per failed round) and the loop goes on. After `unhealthy_after` failures in a
row /healthz answers 503: as a liveness probe it restarts a pod whose model keeps failing (values
go stale and lookups degrade to the default tier meanwhile), rather than serving on silently.

Pairs are scored and stored a scorer batch at a time; when the app stops (SIGTERM) it sets `stopping`,
and a round in flight ends after its batch in flight rather than its last (the in-memory store is lost
on exit anyway, and a long round would outlast the pod's grace period).

Time: `clock()` returns the service's notion of now in seconds; the CLI maps wall time onto the
synthetic world's timeline, the benchmark and tests drive a simulated clock.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable

import numpy as np

from gem.data.synthetic import Examples
from gem.solaris.fallback import TIERS, HierarchicalLookup
from gem.solaris.predictor import DEFAULT_FORGET_AFTER_S, RequestPredictor
from gem.solaris.scorer import FMScorer, mean_ad_quality, user_segments
from gem.solaris.store import PrecomputeStore

log = logging.getLogger("gem.solaris")


class SolarisService:
    def __init__(self, *, scorer: FMScorer, context: Examples, store: PrecomputeStore,
                 predictor: RequestPredictor, lookup: HierarchicalLookup, clock: Callable[[], float] = time.time,
                 per_user: int = 8, active_window_s: float = 24 * 3600.0, interval_s: float = 1.0,
                 unhealthy_after: int = 5):
        if predictor.forget_after_s < active_window_s:
            raise ValueError(f"the predictor's forget_after_s ({predictor.forget_after_s:g}s) is shorter than "
                             f"active_window_s ({active_window_s:g}s): users still active would be forgotten")
        self.scorer = scorer
        self.context = context
        self.store = store
        self.predictor = predictor
        self.lookup_ = lookup
        self.clock = clock
        self.per_user = per_user
        self.active_window_s = active_window_s
        self.interval_s = interval_s
        # The latest context row (impression) of each user: the state pairs are scored with.
        order = np.argsort(context.request_time, kind="stable")
        self.user_row: dict[int, int] = dict(zip(context.user_id[order].tolist(), order.tolist()))
        self.tier_counts: Counter[str] = Counter()
        self.rounds = 0
        self.precomputed = 0
        self.unhealthy_after = unhealthy_after
        self.failures = 0  # failed rounds, ever
        self.consecutive_failures = 0
        self.last_error: str | None = None  # of the current run of failures; None after a round succeeds
        self._logged_errors: set[tuple] = set()  # (type, file, line) already logged with a traceback
        # set when the app stops (SIGTERM): a round in flight ends after its current batch, not its last
        self.stopping = threading.Event()

    # ------------------------------------------------------------------ core

    def observe(self, user: int, ad: int, now: float, row: int | None = None) -> None:
        self.predictor.observe(user, ad, now)
        if row is not None:
            self.user_row[user] = row

    def lookup(self, user: int, ad: int, now: float | None = None, *, observe: bool = True):
        now = self.clock() if now is None else now
        result = self.lookup_.lookup(user, ad, now=now)
        self.tier_counts[result.tier] += 1
        if observe:
            self.observe(user, ad, now)
        return result

    def pending_pairs(self, now: float) -> list[tuple[int, int]]:
        """The predicted pairs of recently active users that the store holds no fresh value for, or one
        computed before the user's latest state (an impression observed since: the value is of an older state)."""
        users = [u for u in self.predictor.active_users(now, self.active_window_s) if u in self.user_row]
        state_time = {u: float(self.context.request_time[self.user_row[u]]) for u in users}
        pending = []
        for u, a in self.predictor.predict(users, self.per_user):
            e = self.store.get(u, a, now=now)
            if e is None or e.computed_at < state_time[u]:
                pending.append((u, a))
        return pending

    def compute(self, pairs: list[tuple[int, int]], now: float, version: str | None = None) -> int:
        """Score pairs with the FM and store them, a scorer batch at a time (synchronous; run it in a thread
        from asyncio). Once `stopping` is set it stops after the batch in flight."""
        if not pairs:
            return 0
        # the version live *before* scoring: values of a model swapped out meanwhile are refused by put
        version = version or self.store.version
        n, nonfinite, step = 0, self.store.nonfinite, self.scorer.batch_size
        quality = mean_ad_quality(self.context, len(self.scorer.ad_campaign))  # once a round, not a batch
        for lo in range(0, len(pairs), step):
            if self.stopping.is_set():  # shutting down: the rest would be lost with the in-memory store anyway
                log.info("precompute: stopping; %d of the round's %d pairs left unscored", len(pairs) - lo, len(pairs))
                break
            n += self._compute_batch(pairs[lo : lo + step], now, version, quality)
        if self.store.nonfinite > nonfinite:
            log.warning("precompute: the store refused %d of %d pairs whose FM value or embedding is NaN/inf "
                        "(a diverged model?)", self.store.nonfinite - nonfinite, len(pairs))
        self.precomputed += n
        return n

    def _compute_batch(self, pairs: list[tuple[int, int]], now: float, version: str, quality: np.ndarray) -> int:
        users = np.array([u for u, _ in pairs], np.int64)
        ads = np.array([a for _, a in pairs], np.int64)
        rows = np.array([self.user_row[u] for u in users.tolist()], np.int64)
        values, embs = self.scorer.score(self.context, rows, ads, quality=quality)
        campaign = self.scorer.ad_campaign[ads]
        segment_of = self.lookup_.segment_of
        n = 0
        for i in range(len(pairs)):
            n += self.store.put(int(users[i]), int(ads[i]), int(campaign[i]), segment_of(int(users[i])), values[i],
                                now=now, version=version, user_embedding=embs[i])
        return n

    async def precompute_once(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        self.store.evict_expired(now)  # lookups and puts sweep too, but neither may come while users are idle
        pairs = self.pending_pairs(now)
        version = self.store.version
        n = await asyncio.to_thread(self.compute, pairs, now, version)
        self.rounds += 1
        return n

    async def run_precompute(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.precompute_once()
            except Exception as e:  # noqa: BLE001 - a failed round must not kill the service
                self._round_failed(e)
            else:
                if self.consecutive_failures:
                    log.info("precompute recovered after %d failed rounds", self.consecutive_failures)
                self.consecutive_failures, self.last_error = 0, None
                self._logged_errors.clear()
            try:  # asyncio.timeout: 3.11's wait_for can swallow a cancel that lands as stop is set
                async with asyncio.timeout(self.interval_s):
                    await stop.wait()
            except TimeoutError:
                pass

    def _round_failed(self, e: Exception) -> None:
        self.failures += 1
        self.consecutive_failures += 1
        self.last_error = f"{type(e).__name__}: {e}"
        where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        key = (type(e), where and where.filename, where and where.lineno)
        # the traceback once per distinct error (type and where raised, not the message: it may carry
        # varying numbers), then one line per round, so a persistent failure does not flood the log
        log.error("precompute round failed (%d in a row): %s", self.consecutive_failures, self.last_error,
                  exc_info=e if key not in self._logged_errors else None)
        self._logged_errors.add(key)
        if self.consecutive_failures == self.unhealthy_after:
            log.error("precompute failed %d rounds in a row: /healthz answers 503 until a round succeeds",
                      self.consecutive_failures)

    def metrics_registry(self):
        """A prometheus-client registry whose collector reads this service's counters at scrape time."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        service = self

        class Collector:
            def collect(self):
                lookups = CounterMetricFamily("solaris_lookups_total", "Lookups answered, by the tier that answered.",
                                              labels=["tier"])
                for t in TIERS:
                    lookups.add_metric([t], service.tier_counts.get(t, 0))
                yield lookups
                entries = GaugeMetricFamily("solaris_store_entries", "Entries held by the store, by table.",
                                            labels=["table"])
                for k, v in service.store.stats().items():
                    if k != "puts":
                        entries.add_metric([k], v)
                yield entries
                yield CounterMetricFamily("solaris_precomputed_total", "Pairs precomputed and stored.",
                                          value=service.precomputed)
                yield CounterMetricFamily("solaris_precompute_rounds_total", "Precompute rounds completed.",
                                          value=service.rounds)
                yield CounterMetricFamily("solaris_precompute_failures_total",
                                          "Precompute rounds that failed with an exception.", value=service.failures)
                yield CounterMetricFamily("solaris_nonfinite_values_total",
                                          "Computed pairs the store refused because the value or embedding was "
                                          "NaN or infinite.", value=service.store.nonfinite)

        registry = CollectorRegistry()
        registry.register(Collector())
        return registry

    # ------------------------------------------------------------------ HTTP

    def app(self):
        from aiohttp import web

        num_ads = len(self.scorer.ad_campaign)

        async def lookup(request: web.Request) -> web.Response:
            ids = {}
            for name in ("user", "ad"):
                text = request.query.get(name)
                try:
                    ids[name] = int(text)
                except (TypeError, ValueError):
                    got = "missing" if text is None else f"{text!r}, not an integer"
                    return web.json_response({"error": f"query parameter {name} is {got}: pass integer ids, "
                                                       "/lookup?user=U&ad=A"}, status=400)
            user, ad = ids["user"], ids["ad"]
            if user < 0:
                return web.json_response({"error": f"user {user} is not a user id: user ids are >= 0"}, status=404)
            if not 0 <= ad < num_ads:
                return web.json_response({"error": f"ad {ad} is not an ad of this world: ad ids are 0-{num_ads - 1}"},
                                         status=404)
            result = self.lookup(user, ad)
            if not np.isfinite(result.value).all():  # the store refuses NaN/inf; never write them as `NaN` (not JSON)
                log.error("lookup user %d ad %d: the %s tier's value is not finite", user, ad, result.tier)
                return web.json_response({"error": f"the {result.tier} tier's value for user {user} ad {ad} is "
                                                   "not finite"}, status=500)
            return web.json_response({**result.to_json(), "user": user, "ad": ad})

        async def healthz(request: web.Request) -> web.Response:
            failing = self.consecutive_failures >= self.unhealthy_after
            return web.json_response({"status": "failing" if failing else "ok", "version": self.store.version,
                                      "pairs": self.store.stats()["pairs"],
                                      "consecutiveFailures": self.consecutive_failures, "lastError": self.last_error},
                                     status=503 if failing else 200)

        registry = self.metrics_registry()

        async def metrics(request: web.Request) -> web.Response:
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/lookup", lookup, allow_head=False)  # a HEAD would count and observe a lookup
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/metrics", metrics)
        stop = asyncio.Event()

        async def background(app: web.Application):
            self.stopping.clear()
            task = asyncio.create_task(self.run_precompute(stop))
            yield
            stop.set()
            self.stopping.set()
            await task  # the round in flight ends after its batch in flight (a worker thread cannot be cancelled)
            log.info("solaris: precompute task stopped after %d rounds", self.rounds)

        app.cleanup_ctx.append(background)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0):
        """Start serving; returns (runner, bound port). Stop with `await runner.cleanup()`."""
        from aiohttp import web

        runner = web.AppRunner(self.app())
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except BaseException:  # e.g. the port is taken: stop the precompute task setup() already started
            await runner.cleanup()
            raise
        bound = runner.addresses[0][1]
        return runner, bound


def require_synthetic_world(data) -> None:
    """Solaris serves the synthetic world of spec.data.synthetic only; any other source is a SpecError."""
    from gem.api.types import DataSourceKind
    from gem.data.errors import SpecError

    if data.sources:
        raise SpecError("spec.data.sources: Solaris (serve-precompute) serves one synthetic world and would ignore "
                        "data.sources: remove data.sources and describe the world under data.synthetic "
                        "(data.source: synthetic)")
    if data.source != DataSourceKind.synthetic.value:
        raise SpecError(f"spec.data.source is {data.source!r}: Solaris (serve-precompute) serves only the synthetic "
                        "world (data.source: synthetic, settings under data.synthetic); serving from "
                        f"{data.source} data is not supported yet")


# The SyntheticWorld fields its constructor draws the users and ads from: another value is another world,
# whose ids the FM never learnt. The rest (sizes of the splits, history length, noise) shape the traffic only.
WORLD_FIELDS = ("seed", "num_users", "num_ads", "ads_per_campaign", "campaigns_per_advertiser", "num_organic_posts",
                "install_share", "interest_drift", "surface_mix")


def require_trained_world(data, trained) -> None:
    """spec.data's world must be the one the model was trained on (`trained`: the checkpoint's spec.data),
    when that was one synthetic world; else a SpecError naming the fields that differ."""
    from gem.api.types import DataSourceKind
    from gem.data.errors import SpecError

    if trained.sources or trained.source != DataSourceKind.synthetic.value:
        return  # trained on other data: nothing to compare the world with
    served, seen = data.synthetic, trained.synthetic
    fields = type(served).model_fields
    differ = [f"spec.data.synthetic.{fields[f].alias or f} is {getattr(served, f)!r}, the checkpoint's "
              f"{getattr(seen, f)!r}" for f in WORLD_FIELDS if getattr(served, f) != getattr(seen, f)]
    if differ:
        raise SpecError("; ".join(differ) + ": --config describes another synthetic world than the one the "
                        "--checkpoint's model was trained on (its users and ads are other ids), so every value "
                        "would be scored for ids the model never learnt; pass the checkpoint's own gem.yaml as "
                        "--config, or set these fields to the checkpoint's values")


def build_service(model, manifest, *, ttl_s: float = 24 * 3600.0, num_segments: int = 16, version: str = "v0",
                  clock: Callable[[], float] | None = None, warmup: bool = True, **kw) -> SolarisService:
    """A service over the synthetic world of `manifest.spec.data`: the train split is the history
    (user states, predictor warm-up); the clock maps wall time onto the end of that history.

    Raises SpecError when spec.data is not one synthetic world. Segments are k-means of the FM
    user representations of the history's users; a user outside the history has no segment.
    """
    from gem.data.synthetic import SyntheticWorld

    require_synthetic_world(manifest.spec.data)
    world = SyntheticWorld(manifest.spec.data.synthetic)
    context = world.sample(manifest.spec.data.synthetic.num_train_examples, split=0)
    scorer = FMScorer(model, ad_campaign=world.ad_campaign, campaign_advertiser=world.campaign_advertiser)
    # Segments: k-means over each user's FM representation at their latest impression.
    seg = user_segments(scorer, context, num_segments)

    def segment_of(u: int) -> int | None:
        return seg.get(u)  # None for a user k-means never saw: no segment's mean is theirs

    def campaign_of(a: int) -> int:
        return int(world.ad_campaign[a])

    end = float(context.request_time.max())
    if clock is None:
        # elapsed time from the monotonic clock: a wall-clock step back (NTP) must not move the store's now back
        start = time.monotonic()
        clock = lambda: end + (time.monotonic() - start)  # noqa: E731
    store = PrecomputeStore(ttl_s=ttl_s, version=version)
    # remember users at least as long as they count as active (longer activity windows than the default horizon)
    predictor = RequestPredictor(segment_of=segment_of, campaign_of=campaign_of,
                                 forget_after_s=max(DEFAULT_FORGET_AFTER_S, kw.get("active_window_s", 0.0)))
    lookup = HierarchicalLookup(store, campaign_of=campaign_of, segment_of=segment_of)
    service = SolarisService(scorer=scorer, context=context, store=store, predictor=predictor, lookup=lookup,
                             clock=clock, **kw)
    if warmup:
        order = np.argsort(context.request_time, kind="stable")
        recent = order[context.request_time[order] >= end - service.active_window_s]
        predictor.observe_many(context.user_id[recent], context.ad_id[recent], context.request_time[recent])
    return service
