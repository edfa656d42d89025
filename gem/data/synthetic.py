"""A seeded synthetic ads world whose click and conversion probabilities are known.

The world: users with latent interest vectors, ads with latent vectors grouped into
campaigns (and campaigns into advertisers), and a few surfaces (feed, reels, ...).
Every impression carries the user's recent event history: a time-ordered, long-tailed
list of (ad, event type, timestamp). The true click probability depends on

    user x ad affinity + ad quality + user and surface bias
    + a *history* term: recent events on the candidate's campaign raise it, decaying with age

so a model that reads the sequence can beat one that only sees ids. A conversion happens
only after a click, with its own probability (post-click CVR). Each example stores both
true probabilities, so the Bayes-optimal NE of the data is computable.

The funnel's top: every impression also has an awareness label, `dwell` (the ad stayed on
screen long enough to be seen), whose probability depends on affinity, the ad's creative, the
request's surface and how active the user has recently been *on that surface*: every history
event carries the surface it happened on (`seq_surface`). These were added after v1 and come
from their own random streams, so every v1 field is bit-identical to what v1 generated.

Everything is vectorised numpy: 24k examples with 48-event histories take well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gem.api.types import SyntheticDataSpec

LATENT_DIM = 8  # width of the hidden user/ad vectors (the model never sees them)
ADS_PER_CAMPAIGN = 8
CAMPAIGNS_PER_ADVERTISER = 4
NUM_SURFACES = 2  # 0: feed, 1: reels
NUM_FAVOURITE_CAMPAIGNS = 3  # campaigns a user's own history concentrates on
NUM_EVENT_TYPES = 3  # 0: impression, 1: click, 2: conversion
EVENT_TYPE_PROBS = np.array([0.6, 0.3, 0.1])
EVENT_TYPE_WEIGHT = np.array([0.3, 1.0, 1.5])  # how much each past event type moves the click
MEAN_EVENT_GAP_S = 2 * 3600.0  # mean time between a user's events
HISTORY_DECAY_S = 12 * 3600.0  # an event's influence halves every ~8h (e-folds every 12h)
HISTORY_LEN_SIGMA = 0.8  # log-normal shape: a long tail of heavy users
HISTORY_FROM_FAVOURITES = 0.6  # share of history events on the user's favourite campaigns
CANDIDATE_FROM_FAVOURITES = 0.35  # share of candidates the targeting picks from them
NUM_DENSE = 2  # log1p(history length), a noisy ad-quality score
DWELL_DECAY_S = 6 * 3600.0  # recent activity on the request's surface raises dwell, e-folding in 6h
DWELL_SURFACE_BIAS = np.array([0.0, 0.6])  # full-screen reels hold the eye longer than feed


@dataclass(frozen=True)
class Examples:
    """A split of impressions in columnar numpy form; history is jagged (values + offsets)."""

    user_id: np.ndarray  # int64 [N]
    ad_id: np.ndarray  # int64 [N]
    campaign_id: np.ndarray  # int64 [N]
    advertiser_id: np.ndarray  # int64 [N]
    surface: np.ndarray  # int64 [N]
    request_time: np.ndarray  # int64 [N], seconds
    dense: np.ndarray  # float32 [N, NUM_DENSE]
    click: np.ndarray  # float32 [N] in {0, 1}
    conversion: np.ndarray  # float32 [N] in {0, 1}; 1 only if click
    p_click: np.ndarray  # float32 [N], the true click probability
    p_conversion: np.ndarray  # float32 [N], the true post-click conversion probability
    seq_offsets: np.ndarray  # int64 [N+1], offsets[0] = 0
    seq_ad_id: np.ndarray  # int64 [E], oldest event first within each example
    seq_campaign_id: np.ndarray  # int64 [E]
    seq_type: np.ndarray  # int64 [E]
    seq_timestamp: np.ndarray  # int64 [E], seconds, ascending within each example
    seq_surface: np.ndarray  # int64 [E], the surface the event happened on
    dwell: np.ndarray  # float32 [N] in {0, 1} (NaN: unknown): the awareness label
    p_dwell: np.ndarray  # float32 [N], the true dwell probability

    def __len__(self) -> int:
        return int(self.user_id.shape[0])

    @property
    def seq_lengths(self) -> np.ndarray:
        return np.diff(self.seq_offsets)


class SyntheticWorld:
    """The fixed part of the world (users, ads, campaigns) plus a sampler of impressions."""

    def __init__(self, spec: SyntheticDataSpec):
        self.spec = spec
        rng = np.random.default_rng([spec.seed, 0])
        k = LATENT_DIM
        self.num_users = spec.num_users
        self.num_ads = spec.num_ads
        self.num_campaigns = max(1, spec.num_ads // ADS_PER_CAMPAIGN)
        self.num_advertisers = max(1, self.num_campaigns // CAMPAIGNS_PER_ADVERTISER)

        # Ad a belongs to campaign a % C: the ads of campaign c are c, c+C, c+2C, ...
        self.ad_campaign = np.arange(self.num_ads) % self.num_campaigns  # [A]
        self.campaign_advertiser = np.arange(self.num_campaigns) % self.num_advertisers  # [C]
        self.campaign_size = np.bincount(self.ad_campaign, minlength=self.num_campaigns)  # [C]

        campaign_latent = rng.normal(size=(self.num_campaigns, k))  # [C, k]
        self.ad_latent = 0.8 * campaign_latent[self.ad_campaign] + 0.6 * rng.normal(size=(self.num_ads, k))
        self.ad_quality = rng.normal(0.0, 0.5, self.num_ads)  # [A], click bias
        self.ad_cvr_bias = rng.normal(0.0, 0.7, self.num_ads)  # [A]
        self.user_interest = rng.normal(size=(self.num_users, k))  # [U, k]
        self.user_bias = rng.normal(0.0, 0.3, self.num_users)  # [U]
        self.surface_bias = np.array([0.0, -0.5])[:NUM_SURFACES]

        # Each user's favourite campaigns: the top few by interest x campaign latent (chunked: U x C).
        favourites = np.empty((self.num_users, NUM_FAVOURITE_CAMPAIGNS), dtype=np.int64)
        top = min(NUM_FAVOURITE_CAMPAIGNS, self.num_campaigns)
        for lo in range(0, self.num_users, 8192):
            scores = self.user_interest[lo : lo + 8192] @ campaign_latent.T  # [u, C]
            best = np.argsort(-scores, axis=1)[:, :top]
            favourites[lo : lo + 8192] = best[:, np.arange(NUM_FAVOURITE_CAMPAIGNS) % top]
        self.favourites = favourites  # [U, F]
        # Added after v1 (drawn last, so the v1 world above is unchanged): the funnel's top.
        self.user_reels_share = rng.beta(2.0, 2.0, self.num_users)  # [U], share of a user's events on reels
        self.ad_dwell_bias = rng.normal(0.0, 0.5, self.num_ads)  # [A], how eye-catching the creative is

    # ------------------------------------------------------------------ sampling helpers

    def _ads_of(self, rng: np.random.Generator, campaigns: np.ndarray) -> np.ndarray:
        """A uniformly random ad of each given campaign."""
        slot = (rng.random(campaigns.shape) * self.campaign_size[campaigns]).astype(np.int64)
        return campaigns + self.num_campaigns * slot

    def _targeted_ads(self, rng: np.random.Generator, users: np.ndarray, p_favourite: float) -> np.ndarray:
        """Ads drawn from the users' favourite campaigns with probability p_favourite, else uniformly."""
        pick = self.favourites[users, rng.integers(0, NUM_FAVOURITE_CAMPAIGNS, users.shape)]
        ads = self._ads_of(rng, pick)
        uniform = rng.integers(0, self.num_ads, users.shape)
        return np.where(rng.random(users.shape) < p_favourite, ads, uniform)

    def _history_lengths(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mean = self.spec.mean_history_len
        mu = np.log(mean) - HISTORY_LEN_SIGMA**2 / 2  # so that E[length] = mean
        lengths = np.rint(rng.lognormal(mu, HISTORY_LEN_SIGMA, n)).astype(np.int64)
        return np.clip(lengths, 1, max(16, int(8 * mean)))  # cap the tail; models truncate further

    # ------------------------------------------------------------------ the true model

    def affinity(self, users: np.ndarray, ads: np.ndarray) -> np.ndarray:
        """User x ad affinity, unit variance."""
        return np.einsum("nk,nk->n", self.user_interest[users], self.ad_latent[ads]) / np.sqrt(LATENT_DIM)

    def history_signal(self, ex_ads: np.ndarray, seq_owner: np.ndarray, seq_campaign: np.ndarray,
                       seq_type: np.ndarray, seq_age: np.ndarray, types: tuple[int, ...] | None = None) -> np.ndarray:
        """sum over past events on the candidate's campaign of type weight x exp(-age / decay)."""
        match = seq_campaign == self.ad_campaign[ex_ads][seq_owner]  # [E]
        if types is not None:
            match &= np.isin(seq_type, types)
        w = EVENT_TYPE_WEIGHT[seq_type] * np.exp(-seq_age / HISTORY_DECAY_S) * match  # [E]
        return np.bincount(seq_owner, weights=w, minlength=len(ex_ads))  # [N]

    # ------------------------------------------------------------------ impressions

    def sample(self, n: int, split: int) -> Examples:
        """n impressions of a split (0: train, 1: eval, ...); deterministic in (seed, split)."""
        rng = np.random.default_rng([self.spec.seed, 1, split])
        users = rng.integers(0, self.num_users, n)  # [N]
        ads = self._targeted_ads(rng, users, CANDIDATE_FROM_FAVOURITES)  # [N]
        surface = rng.integers(0, NUM_SURFACES, n)  # [N]
        request_time = 1_700_000_000 + rng.integers(0, 30 * 86400, n)  # [N], a month of requests

        # Histories: long-tailed lengths, events mostly on the user's favourite campaigns.
        lengths = self._history_lengths(rng, n)  # [N]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        owner = np.repeat(np.arange(n), lengths)  # [E], the example each event belongs to
        seq_ad = self._targeted_ads(rng, users[owner], HISTORY_FROM_FAVOURITES)  # [E]
        seq_type = rng.choice(NUM_EVENT_TYPES, size=owner.shape, p=EVENT_TYPE_PROBS)  # [E]
        # Age of event j = sum of the gaps from j to the end of its segment (oldest first).
        gaps = rng.exponential(MEAN_EVENT_GAP_S, owner.shape) + 1.0  # [E]
        csum = np.cumsum(gaps)
        seq_age = csum[offsets[1:] - 1][owner] - csum + gaps  # [E], descending within a segment
        seq_campaign = self.ad_campaign[seq_ad]

        # True click probability.
        hist = self.history_signal(ads, owner, seq_campaign, seq_type, seq_age)
        click_logit = (
            -3.0
            + self.affinity(users, ads)
            + self.ad_quality[ads]
            + self.user_bias[users]
            + self.surface_bias[surface]
            + 2.5 * (1.0 - np.exp(-hist))  # saturating: a few recent matching events are enough
        )
        p_click = _sigmoid(click_logit)
        # True post-click conversion probability: its own ad bias, affinity and past conversions.
        conv_hist = self.history_signal(ads, owner, seq_campaign, seq_type, seq_age, types=(2,))
        cvr_logit = -1.8 + self.ad_cvr_bias[ads] + 0.6 * self.affinity(users, ads) + 1.5 * (1.0 - np.exp(-conv_hist))
        p_conversion = _sigmoid(cvr_logit)
        click = rng.random(n) < p_click
        conversion = click & (rng.random(n) < p_conversion)

        quality_obs = self.ad_quality[ads] + rng.normal(0.0, 0.3, n)  # a noisy, observable quality score
        dense = np.stack([np.log1p(lengths) - np.log1p(self.spec.mean_history_len), quality_obs], axis=1)

        # Awareness (added after v1, own random stream): surfaces of past events, then dwell.
        rng2 = np.random.default_rng([self.spec.seed, 2, split])
        seq_surface = (rng2.random(owner.shape) < self.user_reels_share[users[owner]]).astype(np.int64)
        same_surface = (seq_surface == surface[owner]) * np.exp(-seq_age / DWELL_DECAY_S)  # [E]
        surface_activity = np.bincount(owner, weights=same_surface, minlength=n)  # [N]
        dwell_logit = (-0.6 + 0.6 * self.affinity(users, ads) + self.ad_dwell_bias[ads]
                       + DWELL_SURFACE_BIAS[surface] + 1.5 * (1.0 - np.exp(-0.5 * surface_activity)))
        p_dwell = _sigmoid(dwell_logit)
        dwell = rng2.random(n) < p_dwell
        return Examples(
            user_id=users.astype(np.int64),
            ad_id=ads.astype(np.int64),
            campaign_id=self.ad_campaign[ads].astype(np.int64),
            advertiser_id=self.campaign_advertiser[self.ad_campaign[ads]].astype(np.int64),
            surface=surface.astype(np.int64),
            request_time=request_time.astype(np.int64),
            dense=dense.astype(np.float32),
            click=click.astype(np.float32),
            conversion=conversion.astype(np.float32),
            p_click=p_click.astype(np.float32),
            p_conversion=p_conversion.astype(np.float32),
            seq_offsets=offsets,
            seq_ad_id=seq_ad.astype(np.int64),
            seq_campaign_id=seq_campaign.astype(np.int64),
            seq_type=seq_type.astype(np.int64),
            seq_timestamp=(request_time[owner] - np.rint(seq_age)).astype(np.int64),
            seq_surface=seq_surface,
            dwell=dwell.astype(np.float32),
            p_dwell=p_dwell.astype(np.float32),
        )


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def build_splits(spec: SyntheticDataSpec) -> tuple[Examples, Examples]:
    """The (train, eval) splits of the world spec describes; identical on every rank."""
    world = SyntheticWorld(spec)
    return world.sample(spec.num_train_examples, split=0), world.sample(spec.num_eval_examples, split=1)
