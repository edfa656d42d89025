"""A seeded synthetic ads world whose label probabilities are known exactly.

The world (every knob is a field of `SyntheticDataSpec`; docs/data.md describes each):

* **users** with latent interest vectors that *drift*: user u's interest at time t is
  cos(θ) u0 + sin(θ) u1 with θ = interest_drift · days since the start of the month, so it stays
  unit-variance and interests d days apart correlate as cos(interest_drift · d);
* **ads** with latent vectors grouped into campaigns (ad a belongs to campaign a % C), campaigns
  into advertisers; each campaign has an **objective**: off-site purchase (0) or app install (1);
* four **surfaces**: feed (0), stories (1), reels (2), off-site / audience network (3), each with
  its own click, dwell and conversion biases; every user has their own mix of surfaces;
* **event histories**: a time-ordered, long-tailed list of (item, event type, timestamp,
  surface). Types: ad impression (0), ad click (1), ad conversion (2) and organic engagement (3:
  a like or share of an organic post). Events concentrate on the campaigns the user favoured
  *at the event's time* (drift shows in the history); organic posts have topics that are
  campaigns, so engaging with a post about a campaign's topic is interest signal.

Labels, each drawn from a probability stored beside it (so the Bayes-optimal NE is computable):

    dwell (awareness)        affinity + creative + surface + recent activity on that surface
    click (consideration)    affinity + ad quality + user/surface bias
                             + history: recent events on the candidate's campaign, decaying with age
    conversion (post-click)  affinity + ad/objective/surface bias + past conversions on the campaign,
                             times P(delay <= attribution window)

Affinity uses the user's interest *at the request time*. A clicked impression converts
eventually with probability p_eventual after a delay ~ Exponential(mean by objective); a
conversion later than `attribution_window_hours` is labelled 0 (the label a trainer sees when
it closes the window), so the stored `p_conversion` is p_eventual · P(delay <= window): the true
probability of the label itself. `conversion_delay` keeps the drawn delay (NaN: no conversion).

Item ids: ads are 0..num_ads-1; organic post p is item num_ads + p (one shared item-id space, so a
model's item table covers both). An organic event's `seq_campaign_id` is its post's topic.

Vectorised numpy with float32 draws: benchmarks/data.py measures the rate on one core.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from gem.api.types import SyntheticDataSpec

LATENT_DIM = 8  # width of the hidden user/ad vectors (the model never sees them)
SURFACES = ("feed", "stories", "reels", "offsite")
NUM_SURFACES = len(SURFACES)
EVENT_TYPES = ("impression", "click", "conversion", "organic")
NUM_EVENT_TYPES = len(EVENT_TYPES)
OBJECTIVES = ("purchase", "install")  # what a campaign's conversion means
NUM_FAVOURITE_CAMPAIGNS = 3  # campaigns a user's own history concentrates on (at a given time)
AD_EVENT_TYPE_PROBS = (0.6, 0.3, 0.1)  # impression, click, conversion among ad events
EVENT_TYPE_WEIGHT = np.array([0.3, 1.0, 1.5, 0.5], np.float32)  # how much each past event type moves the click
MEAN_EVENT_GAP_S = 2 * 3600.0  # mean time between a user's events
HISTORY_DECAY_S = 12 * 3600.0  # an event's influence e-folds every 12h
DWELL_DECAY_S = HISTORY_DECAY_S / 2  # surface activity e-folds in 6h (the square of the history decay)
HISTORY_LEN_SIGMA = 0.8  # log-normal shape: a long tail of heavy users
HISTORY_FROM_FAVOURITES = 0.6  # share of history events on the user's favourite campaigns
CANDIDATE_FROM_FAVOURITES = 0.35  # share of candidates the targeting picks from them
NUM_DENSE = 2  # log1p(history length), a noisy ad-quality score
DENSE_HISTORY_LEN, DENSE_AD_QUALITY = 0, 1  # the dense columns, by name
CLICK_SURFACE_BIAS = np.array([0.0, -0.3, -0.5, -1.0])  # off-site placements are clicked least
DWELL_SURFACE_BIAS = np.array([0.0, 0.4, 0.6, -0.5])  # full-screen stories/reels hold the eye longest
CVR_SURFACE_BIAS = np.array([0.0, -0.1, -0.2, -0.4])
CVR_OBJECTIVE_BIAS = np.array([0.0, 0.7])  # an install is a smaller step than a purchase
CLICK_INTERCEPT, CVR_INTERCEPT, DWELL_INTERCEPT = -3.0, -1.8, -0.6
CAMPAIGN_SHARE = 0.8  # ad latent = 0.8 x its campaign's latent + 0.6 x its own (0.8² + 0.6² = 1)
INSTALL_DELAY_FACTOR = 0.1  # installs land ~10x sooner than off-site purchases
SURFACE_CONCENTRATION = 4.0  # Dirichlet total of a user's surface mix around spec.surface_mix
START_TIME = 1_700_000_000  # requests span the month after this
REQUEST_SPAN_S = 30 * 86400
DRIFT_ANCHOR_RAD = 0.1  # favourites are recomputed every 0.1 rad of drift (cheap, fine-grained)
MAX_DRIFT_ANCHORS = 32


@dataclass(frozen=True)
class Examples:
    """A split of impressions in columnar numpy form; history is jagged (values + offsets)."""

    user_id: np.ndarray  # int64 [N]
    ad_id: np.ndarray  # int64 [N]
    campaign_id: np.ndarray  # int64 [N]
    advertiser_id: np.ndarray  # int64 [N]
    surface: np.ndarray  # int64 [N], index into SURFACES
    request_time: np.ndarray  # int64 [N], seconds
    dense: np.ndarray  # float32 [N, NUM_DENSE]
    click: np.ndarray  # float32 [N] in {0, 1}
    conversion: np.ndarray  # float32 [N] in {0, 1}; 1 only if click and inside the attribution window
    p_click: np.ndarray  # float32 [N], the true click probability
    p_conversion: np.ndarray  # float32 [N], the true probability of the conversion label given a click
    seq_offsets: np.ndarray  # int64 [N+1], offsets[0] = 0
    seq_ad_id: np.ndarray  # int64 [E], oldest event first; organic posts are num_ads + post
    seq_campaign_id: np.ndarray  # int64 [E], campaign (organic: the post's topic)
    seq_type: np.ndarray  # int64 [E], index into EVENT_TYPES
    seq_timestamp: np.ndarray  # int64 [E], seconds, ascending within each example
    seq_surface: np.ndarray  # int64 [E], the surface the event happened on
    dwell: np.ndarray  # float32 [N] in {0, 1} (NaN: unknown): the awareness label
    p_dwell: np.ndarray  # float32 [N], the true dwell probability
    objective: np.ndarray  # int64 [N], the campaign's objective, index into OBJECTIVES
    conversion_delay: np.ndarray  # float32 [N], seconds from click to conversion; NaN: none (ever)

    def __len__(self) -> int:
        return int(self.user_id.shape[0])

    @property
    def seq_lengths(self) -> np.ndarray:
        return np.diff(self.seq_offsets)


class SyntheticWorld:
    """The fixed part of the world (users, ads, campaigns, posts) plus a sampler of impressions."""

    def __init__(self, spec: SyntheticDataSpec):
        self.spec = spec
        rng = np.random.default_rng([spec.seed, 0])
        k = LATENT_DIM
        self.num_users = spec.num_users
        self.num_ads = spec.num_ads
        self.num_campaigns = max(1, spec.num_ads // spec.ads_per_campaign)
        self.num_advertisers = max(1, self.num_campaigns // spec.campaigns_per_advertiser)
        C = self.num_campaigns
        # Every topic (= campaign) gets at least one organic post.
        self.num_organic_posts = max(spec.num_organic_posts, C)

        # Ad a belongs to campaign a % C: the ads of campaign c are c, c+C, c+2C, ... (posts: same by topic)
        self.ad_campaign = np.arange(self.num_ads) % C  # [A]
        self.campaign_advertiser = np.arange(C) % self.num_advertisers  # [C]
        self.campaign_size = np.bincount(self.ad_campaign, minlength=C)  # [C]
        self.topic_size = np.bincount(np.arange(self.num_organic_posts) % C, minlength=C)  # [C]
        self.campaign_objective = (rng.random(C) < spec.install_share).astype(np.int64)  # [C]

        self.campaign_latent = rng.normal(size=(C, k))  # [C, k]
        self.ad_latent = CAMPAIGN_SHARE * self.campaign_latent[self.ad_campaign] + 0.6 * rng.normal(size=(self.num_ads, k))
        self.ad_quality = rng.normal(0.0, 0.5, self.num_ads)  # [A], click bias
        self.ad_cvr_bias = rng.normal(0.0, 0.7, self.num_ads)  # [A]
        self.ad_dwell_bias = rng.normal(0.0, 0.5, self.num_ads)  # [A], how eye-catching the creative is
        self.interest_start = rng.normal(size=(self.num_users, k))  # [U, k]: u0
        self.interest_turn = rng.normal(size=(self.num_users, k))  # [U, k]: u1, where drift takes it
        self.user_bias = rng.normal(0.0, 0.3, self.num_users)  # [U]
        # Each user's surface mix: Dirichlet around spec.surface_mix (gamma draws: a 0 share stays 0).
        mix = np.asarray(spec.surface_mix, np.float64)
        g = rng.standard_gamma(SURFACE_CONCENTRATION * mix / mix.sum(), size=(self.num_users, NUM_SURFACES))
        g[:, int(np.argmax(mix))] += 1e-12  # a row of underflowed draws still has a surface
        self.user_surface_cdf = (np.cumsum(g, axis=1) / g.sum(axis=1, keepdims=True))[:, :-1].astype(np.float32)
        self._surface_cdf_cols = [np.ascontiguousarray(c) for c in self.user_surface_cdf.T]

        # Favourite campaigns at a grid of "anchor" times (one when interests are static).
        lo, hi = START_TIME - REQUEST_SPAN_S, START_TIME + REQUEST_SPAN_S  # histories reach back ~ a month
        span_rad = spec.interest_drift * (hi - lo) / 86400
        n_anchor = 1 if span_rad == 0 else min(MAX_DRIFT_ANCHORS, max(2, math.ceil(span_rad / DRIFT_ANCHOR_RAD) + 1))
        self.anchor_times = np.array([START_TIME], np.float64) if n_anchor == 1 else np.linspace(lo, hi, n_anchor)
        F = NUM_FAVOURITE_CAMPAIGNS
        top = min(F, C)
        favourites = np.empty((n_anchor, self.num_users, F), dtype=np.int64)
        theta = self.drift_angle(self.anchor_times)
        campaign_t = self.campaign_latent.T.astype(np.float32)
        for lo_u in range(0, self.num_users, 4096):  # chunked: U x C scores
            users = np.arange(lo_u, min(lo_u + 4096, self.num_users))
            s0 = self.interest_start[users].astype(np.float32) @ campaign_t  # [u, C]
            s1 = self.interest_turn[users].astype(np.float32) @ campaign_t
            rows = np.arange(len(users))
            for a in range(n_anchor):  # interest(t) . c = cos θ (u0 . c) + sin θ (u1 . c)
                scores = np.float32(math.cos(theta[a])) * s0 + np.float32(math.sin(theta[a])) * s1
                best = np.empty((len(users), top), np.int64)
                for j in range(top):  # top-3 by repeated argmax: cheaper than a sort of C columns
                    best[:, j] = np.argmax(scores, axis=1)
                    scores[rows, best[:, j]] = -np.inf
                favourites[a, users] = best[:, np.arange(F) % top]
        self.favourites = favourites  # [anchors, U, F]
        self._favourites_flat = favourites.reshape(-1)

    # ------------------------------------------------------------------ the true model

    def drift_angle(self, t: np.ndarray) -> np.ndarray:
        """θ(t): how far interests have rotated at time t (seconds)."""
        return self.spec.interest_drift * (np.asarray(t, np.float64) - START_TIME) / 86400.0

    def interest_at(self, users: np.ndarray, t: np.ndarray) -> np.ndarray:
        """[N, k] interest vectors of users at times t (unit variance at every time)."""
        theta = self.drift_angle(t)[:, None]
        return np.cos(theta) * self.interest_start[users] + np.sin(theta) * self.interest_turn[users]

    def affinity(self, users: np.ndarray, ads: np.ndarray, t: np.ndarray | None = None) -> np.ndarray:
        """User x ad affinity at times t (default: the start), unit variance."""
        ad = self.ad_latent[ads]
        a0 = np.einsum("nk,nk->n", self.interest_start[users], ad)
        if t is None or self.spec.interest_drift == 0:
            return a0 / np.sqrt(LATENT_DIM)
        theta = self.drift_angle(t)
        a1 = np.einsum("nk,nk->n", self.interest_turn[users], ad)
        return (np.cos(theta) * a0 + np.sin(theta) * a1) / np.sqrt(LATENT_DIM)

    def history_signal(self, ex_ads: np.ndarray, seq_owner: np.ndarray, seq_campaign: np.ndarray,
                       seq_type: np.ndarray, seq_age: np.ndarray, types: tuple[int, ...] | None = None) -> np.ndarray:
        """sum over past events on the candidate's campaign of type weight x exp(-age / decay)."""
        match = seq_campaign == self.ad_campaign[ex_ads][seq_owner]  # [E]
        if types is not None:
            match &= np.isin(seq_type, types)
        w = EVENT_TYPE_WEIGHT[seq_type] * np.exp(-np.asarray(seq_age, np.float32) / np.float32(HISTORY_DECAY_S)) * match
        return np.bincount(seq_owner, weights=w, minlength=len(ex_ads))  # [N]

    def logit_terms(self, ex: Examples) -> dict[str, dict[str, np.ndarray]]:
        """The true logit of every task split into its additive terms, float64 [N] each:
        {"click" | "conversion" | "dwell": {term: values}}; the terms of a task sum to its logit
        (conversion: the logit of p_eventual; p_conversion = sigmoid(logit) x conversion_window_prob).

        Recomputed from the examples (their ids, times and histories), so an analysis can ask what
        each term is worth: e.g. how close a predictor that knows every term but the latent
        affinity gets to the Bayes-optimal NE (benchmarks.quality's gap split). Affinity is split
        into its campaign part (the user's interest in the ad's campaign) and the ad's own part.
        """
        n = len(ex)
        lengths = np.diff(ex.seq_offsets)
        owner = np.repeat(np.arange(n), lengths)
        age = (np.repeat(ex.request_time, lengths) - ex.seq_timestamp).astype(np.float64)
        hist = self.history_signal(ex.ad_id, owner, ex.seq_campaign_id, ex.seq_type, age)
        conv_hist = self.history_signal(ex.ad_id, owner, ex.seq_campaign_id, ex.seq_type, age, types=(2,))
        same_surface = (ex.seq_surface == np.repeat(ex.surface, lengths)) * np.exp(-age / DWELL_DECAY_S)
        surface_activity = np.bincount(owner, weights=same_surface, minlength=n)
        aff = self.affinity(ex.user_id, ex.ad_id, ex.request_time)
        interest = self.interest_at(ex.user_id, ex.request_time)
        aff_campaign = CAMPAIGN_SHARE * np.einsum(
            "nk,nk->n", interest, self.campaign_latent[self.ad_campaign[ex.ad_id]]) / np.sqrt(LATENT_DIM)
        aff_ad = aff - aff_campaign
        ones = np.ones(n)
        return {
            "click": {"intercept": CLICK_INTERCEPT * ones, "surface": CLICK_SURFACE_BIAS[ex.surface],
                      "ad_quality": self.ad_quality[ex.ad_id], "user_bias": self.user_bias[ex.user_id],
                      "history": 2.5 * (1.0 - np.exp(-hist)),
                      "affinity_campaign": aff_campaign, "affinity_ad": aff_ad},
            "conversion": {"intercept": CVR_INTERCEPT * ones,
                           "surface": CVR_SURFACE_BIAS[ex.surface] + CVR_OBJECTIVE_BIAS[ex.objective],
                           "ad_cvr_bias": self.ad_cvr_bias[ex.ad_id], "history": 1.5 * (1.0 - np.exp(-conv_hist)),
                           "affinity_campaign": 0.6 * aff_campaign, "affinity_ad": 0.6 * aff_ad},
            "dwell": {"intercept": DWELL_INTERCEPT * ones, "surface": DWELL_SURFACE_BIAS[ex.surface],
                      "ad_dwell_bias": self.ad_dwell_bias[ex.ad_id],
                      "history": 1.5 * (1.0 - np.exp(-0.5 * surface_activity)),
                      "affinity_campaign": 0.6 * aff_campaign, "affinity_ad": 0.6 * aff_ad},
        }

    def conversion_window_prob(self, objective: np.ndarray) -> np.ndarray:
        """P(delay <= attribution window) per objective: the share of conversions that get labelled."""
        return 1.0 - np.exp(-self.spec.attribution_window_hours / self._mean_delay_hours(objective))

    def _mean_delay_hours(self, objective: np.ndarray) -> np.ndarray:
        return self.spec.conversion_delay_hours * np.where(objective == 1, INSTALL_DELAY_FACTOR, 1.0)

    # ------------------------------------------------------------------ sampling helpers

    def _anchor_of(self, t: np.ndarray) -> np.ndarray:
        """Index of the anchor time nearest to each t."""
        n = len(self.anchor_times)
        if n == 1:
            return np.zeros(t.shape, np.int64)
        lo, hi = self.anchor_times[0], self.anchor_times[-1]
        pos = (t.astype(np.float32) - np.float32(lo)) * np.float32((n - 1) / (hi - lo))
        return np.clip(np.rint(pos), 0, n - 1).astype(np.int64)

    def _campaigns(self, rng: np.random.Generator, users: np.ndarray, anchors: np.ndarray,
                   p_favourite: float) -> np.ndarray:
        """One of the users' favourite campaigns at the anchor time with probability p_favourite, else any."""
        n, C, F = users.shape[0], self.num_campaigns, NUM_FAVOURITE_CAMPAIGNS
        f = (rng.random(n, np.float32) * F).astype(np.int64)
        fav = self._favourites_flat[(anchors * self.num_users + users) * F + np.minimum(f, F - 1)]
        uniform = np.minimum((rng.random(n, np.float32) * C).astype(np.int64), C - 1)
        return np.where(rng.random(n, np.float32) < p_favourite, fav, uniform)

    def _members(self, rng: np.random.Generator, campaigns: np.ndarray, size: np.ndarray) -> np.ndarray:
        """A uniformly random member c + C * slot of each campaign (topic) c, which has `size` members."""
        slot = np.minimum((rng.random(campaigns.shape, np.float32) * size).astype(np.int64), size - 1)
        return campaigns + self.num_campaigns * slot

    def _surfaces(self, rng: np.random.Generator, users: np.ndarray) -> np.ndarray:
        u = rng.random(users.shape, np.float32)
        out = (u >= self._surface_cdf_cols[0][users]).astype(np.int64)
        for col in self._surface_cdf_cols[1:]:  # 1-D gathers: much cheaper than one [n, S-1] gather
            out += u >= col[users]
        return out

    def _history_lengths(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mean = self.spec.mean_history_len
        mu = np.log(mean) - HISTORY_LEN_SIGMA**2 / 2  # so that E[length] = mean
        lengths = np.rint(rng.lognormal(mu, HISTORY_LEN_SIGMA, n)).astype(np.int64)
        return np.clip(lengths, 1, max(16, int(8 * mean)))  # cap the tail; models truncate further

    # ------------------------------------------------------------------ impressions

    def sample(self, n: int, split: int) -> Examples:
        """n impressions of a split (0: train, 1: eval, ...); deterministic in (world, split)."""
        return self._sample(n, np.random.default_rng([self.spec.seed, 1, split]))

    def splits(self) -> tuple[Examples, Examples]:
        """(train, eval): the spec's num_train_examples of split 0 and num_eval_examples of split 1."""
        return self.sample(self.spec.num_train_examples, split=0), self.sample(self.spec.num_eval_examples, split=1)

    def stream(self, n: int, split: int, chunk_size: int = 65536) -> Iterator[Examples]:
        """n impressions of a split in chunks of chunk_size, never all in memory (e.g. to Parquet).

        Deterministic in (world, split, chunk_size); not the same draws as sample(n, split).
        """
        # a chunk_size <= 0 would yield nothing (or fail inside range()): an empty split, silently
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer (examples per chunk), got {chunk_size!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0 (examples to draw), got {n}")
        for i, lo in enumerate(range(0, n, chunk_size)):
            yield self._sample(min(chunk_size, n - lo), np.random.default_rng([self.spec.seed, 3, split, i]))

    def _sample(self, n: int, rng: np.random.Generator) -> Examples:
        spec = self.spec
        f32 = np.float32
        users = rng.integers(0, self.num_users, n)  # [N]
        request_time = START_TIME + rng.integers(0, REQUEST_SPAN_S, n)  # [N], a month of requests
        campaign = self._campaigns(rng, users, self._anchor_of(request_time), CANDIDATE_FROM_FAVOURITES)
        ads = self._members(rng, campaign, self.campaign_size[campaign])  # [N]
        surface = self._surfaces(rng, users)  # [N]
        objective = self.campaign_objective[campaign]  # [N]

        # Histories: long-tailed lengths; ages = sums of exponential gaps back from the request.
        lengths = self._history_lengths(rng, n)  # [N]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        E = int(offsets[-1])
        owner = np.repeat(np.arange(n), lengths)  # [E], the example each event belongs to
        seq_user = np.repeat(users, lengths)  # np.repeat of per-example values: cheaper than x[owner]
        gaps = rng.standard_exponential(E, dtype=f32) * f32(MEAN_EVENT_GAP_S) + f32(1.0)  # [E]
        csum = np.cumsum(gaps, dtype=np.float64)  # float64: sums reach ~1e10 s
        seq_age = np.repeat(csum[offsets[1:] - 1], lengths) - csum + gaps  # [E], descending within a segment
        seq_timestamp = np.repeat(request_time, lengths) - np.rint(seq_age).astype(np.int64)
        # Types: organic with probability organic_share, else ad impression / click / conversion.
        u = rng.random(E, f32)
        share = spec.organic_share
        t1 = share + AD_EVENT_TYPE_PROBS[0] * (1 - share)
        t2 = share + (AD_EVENT_TYPE_PROBS[0] + AD_EVENT_TYPE_PROBS[1]) * (1 - share)
        organic = u < share
        seq_type = np.where(organic, 3, (u >= t1).astype(np.int64) + (u >= t2))
        # Items: campaigns favoured at the event's own time (drift), then an ad or a post of it.
        seq_campaign = self._campaigns(rng, seq_user, self._anchor_of(seq_timestamp), HISTORY_FROM_FAVOURITES)
        size = np.where(organic, self.topic_size[seq_campaign], self.campaign_size[seq_campaign])
        seq_ad = self._members(rng, seq_campaign, size) + organic * self.num_ads  # [E]
        seq_surface = self._surfaces(rng, seq_user)

        # History terms (float32; one exp per event, the dwell decay is its square).
        decay = np.exp(seq_age.astype(f32) * f32(-1.0 / HISTORY_DECAY_S))  # [E]
        weighted = EVENT_TYPE_WEIGHT[seq_type] * decay * (seq_campaign == np.repeat(campaign, lengths))  # [E]
        hist = np.bincount(owner, weights=weighted, minlength=n)
        conv_hist = np.bincount(owner, weights=weighted * (seq_type == 2), minlength=n)
        same_surface = (seq_surface == np.repeat(surface, lengths)) * (decay * decay)  # exp(-age / DWELL_DECAY_S)
        surface_activity = np.bincount(owner, weights=same_surface, minlength=n)

        aff = self.affinity(users, ads, request_time)  # the interest *at the request time*
        click_logit = (CLICK_INTERCEPT + aff + self.ad_quality[ads] + self.user_bias[users] + CLICK_SURFACE_BIAS[surface]
                       + 2.5 * (1.0 - np.exp(-hist)))  # saturating: a few recent matching events are enough
        p_click = _sigmoid(click_logit)
        cvr_logit = (CVR_INTERCEPT + self.ad_cvr_bias[ads] + 0.6 * aff + CVR_OBJECTIVE_BIAS[objective]
                     + CVR_SURFACE_BIAS[surface] + 1.5 * (1.0 - np.exp(-conv_hist)))
        p_eventual = _sigmoid(cvr_logit)
        p_conversion = p_eventual * self.conversion_window_prob(objective)  # the label's own probability
        dwell_logit = (DWELL_INTERCEPT + 0.6 * aff + self.ad_dwell_bias[ads] + DWELL_SURFACE_BIAS[surface]
                       + 1.5 * (1.0 - np.exp(-0.5 * surface_activity)))
        p_dwell = _sigmoid(dwell_logit)

        draws = rng.random((4, n), f32)
        click = draws[0] < p_click
        converts = click & (draws[1] < p_eventual)
        delay_s = -np.log1p(-draws[2].astype(np.float64)) * self._mean_delay_hours(objective) * 3600.0
        conversion = converts & (delay_s <= spec.attribution_window_hours * 3600.0)
        dwell = draws[3] < p_dwell
        quality_obs = self.ad_quality[ads] + spec.quality_noise * rng.standard_normal(n, f32)
        dense = np.stack([np.log1p(lengths) - np.log1p(spec.mean_history_len), quality_obs], axis=1)  # DENSE_* order

        return Examples(
            user_id=users,
            ad_id=ads,
            campaign_id=campaign,
            advertiser_id=self.campaign_advertiser[campaign],
            surface=surface,
            request_time=request_time,
            dense=dense.astype(f32),
            click=click.astype(f32),
            conversion=conversion.astype(f32),
            p_click=p_click.astype(f32),
            p_conversion=p_conversion.astype(f32),
            seq_offsets=offsets,
            seq_ad_id=seq_ad,
            seq_campaign_id=seq_campaign,
            seq_type=seq_type,
            seq_timestamp=seq_timestamp,
            seq_surface=seq_surface,
            dwell=dwell.astype(f32),
            p_dwell=p_dwell.astype(f32),
            objective=objective,
            conversion_delay=np.where(converts, delay_s, np.nan).astype(f32),
        )


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def build_splits(spec: SyntheticDataSpec) -> tuple[Examples, Examples]:
    """The (train, eval) splits of the world spec describes; identical on every rank."""
    return SyntheticWorld(spec).splits()
