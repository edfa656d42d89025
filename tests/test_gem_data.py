"""The synthetic world: determinism, jagged layout, known probabilities, drift, organic events,
objectives, delayed conversions, every knob; sharded resumable loading."""

import numpy as np
import pytest

from gem.api.types import SyntheticDataSpec
from gem.data import ShardedLoader, SyntheticWorld, build_splits, eval_batches, make_batch
from gem.data.synthetic import NUM_EVENT_TYPES, NUM_SURFACES
from gem.eval.metrics import auc, normalized_entropy

SPEC = SyntheticDataSpec(seed=3, num_users=300, num_ads=120, num_train_examples=3000, num_eval_examples=800,
                         mean_history_len=20)


@pytest.fixture(scope="module")
def splits():
    return build_splits(SPEC)


def test_same_seed_same_world_other_seed_other_world(splits):
    train, _ = splits
    again, _ = build_splits(SPEC)
    for name in train.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(train, name), getattr(again, name), err_msg=name)
    other, _ = build_splits(SPEC.model_copy(update={"seed": 4}))
    assert not np.array_equal(train.p_click, other.p_click)


def test_jagged_history_layout(splits):
    train, _ = splits
    lengths = train.seq_lengths
    assert train.seq_offsets[0] == 0 and train.seq_offsets[-1] == len(train.seq_ad_id)
    assert lengths.min() >= 1 and lengths.max() > 3 * np.median(lengths)  # long-tailed
    assert abs(lengths.mean() - SPEC.mean_history_len) < 0.2 * SPEC.mean_history_len
    owner = np.repeat(np.arange(len(train)), lengths)
    assert (train.seq_timestamp <= train.request_time[owner]).all()
    same_owner = owner[1:] == owner[:-1]
    assert (np.diff(train.seq_timestamp)[same_owner] >= 0).all()  # oldest first
    assert (train.conversion <= train.click).all()  # no conversion without a click
    assert set(np.unique(train.seq_type)) == set(range(NUM_EVENT_TYPES))
    assert set(np.unique(train.surface)) == set(np.unique(train.seq_surface)) == set(range(NUM_SURFACES))


def test_bayes_ne_is_informative(splits):
    _, ev = splits
    bayes = normalized_entropy(ev.click, ev.p_click)
    assert 0.4 < bayes < 0.9 and auc(ev.click, ev.p_click) > 0.75
    clicked = ev.click > 0
    assert normalized_entropy(ev.conversion[clicked], ev.p_conversion[clicked]) < 1.0
    assert normalized_entropy(ev.dwell, ev.p_dwell) < 0.95 and auc(ev.dwell, ev.p_dwell) > 0.7


def test_true_probabilities_beat_a_model_fitted_on_the_data(splits):
    """Bayes NE is below the NE of a logistic regression on observable features, for every task."""
    from sklearn.linear_model import LogisticRegression

    train, ev = splits

    def features(ex):
        return np.concatenate([ex.dense, np.eye(NUM_SURFACES)[ex.surface], np.eye(2)[ex.objective]], axis=1)

    for task, rows in (("click", None), ("dwell", None), ("conversion", "click")):
        tr = np.ones(len(train), bool) if rows is None else getattr(train, rows) > 0
        te = np.ones(len(ev), bool) if rows is None else getattr(ev, rows) > 0
        model = LogisticRegression().fit(features(train)[tr], getattr(train, task)[tr])
        y = getattr(ev, task)[te]
        fitted = normalized_entropy(y, model.predict_proba(features(ev)[te])[:, 1])
        bayes = normalized_entropy(y, getattr(ev, f"p_{task}")[te])
        assert bayes < fitted < 1.02, (task, bayes, fitted)


def test_true_probabilities_are_calibrated():
    """Labels are drawn from the stored probabilities: their means agree (conversion: given a click)."""
    ex = SyntheticWorld(SPEC).sample(40_000, split=5)
    clicked = ex.click > 0
    for y, p in ((ex.click, ex.p_click), (ex.dwell, ex.p_dwell), (ex.conversion[clicked], ex.p_conversion[clicked])):
        se = np.sqrt(np.mean(p * (1 - p)) / len(p))
        assert abs(y.mean() - p.mean()) < 4 * se


def test_interests_drift_with_time():
    world = SyntheticWorld(SPEC.model_copy(update={"interest_drift": 0.05}))
    users = np.arange(50)
    t0 = np.full(50, 1_700_000_000)
    a, b = world.interest_at(users, t0), world.interest_at(users, t0 + 10 * 86400)
    corr = np.mean(np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1))
    assert 0.7 < corr < 0.97  # cos(0.5) = 0.88 in expectation
    assert len(world.anchor_times) > 1 and (world.favourites[0] != world.favourites[-1]).any()
    static = SyntheticWorld(SPEC.model_copy(update={"interest_drift": 0.0}))
    np.testing.assert_array_equal(static.interest_at(users, t0), static.interest_at(users, t0 + 10 * 86400))
    assert len(static.anchor_times) == 1


def test_histories_follow_the_drifting_interests():
    """With strong drift, recent events sit on the request time's favourite campaigns more than old ones."""
    def recent_vs_old(drift):
        world = SyntheticWorld(SPEC.model_copy(update={"interest_drift": drift, "mean_history_len": 60}))
        ex = world.sample(3000, split=0)
        owner = np.repeat(np.arange(len(ex)), ex.seq_lengths)
        fav = world.favourites[world._anchor_of(ex.request_time)[owner], ex.user_id[owner]]  # [E, F]
        on_fav = (fav == ex.seq_campaign_id[:, None]).any(axis=1)
        age = ex.request_time[owner] - ex.seq_timestamp
        return on_fav[age < 86400].mean(), on_fav[age > 8 * 86400].mean()

    recent, old = recent_vs_old(0.3)
    assert recent > old + 0.15
    recent, old = recent_vs_old(0.0)
    assert abs(recent - old) < 0.05


def test_organic_events_carry_their_own_items_and_topics(splits):
    train, _ = splits
    world = SyntheticWorld(SPEC)
    organic = train.seq_type == 3
    assert abs(organic.mean() - SPEC.organic_share) < 0.02
    posts = train.seq_ad_id[organic] - SPEC.num_ads
    assert posts.min() >= 0 and posts.max() < world.num_organic_posts
    assert (train.seq_ad_id[~organic] < SPEC.num_ads).all()
    np.testing.assert_array_equal(train.seq_campaign_id[organic], posts % world.num_campaigns)  # the post's topic
    np.testing.assert_array_equal(train.seq_campaign_id[~organic], world.ad_campaign[train.seq_ad_id[~organic]])
    none = SyntheticWorld(SPEC.model_copy(update={"organic_share": 0.0})).sample(500, split=0)
    assert not (none.seq_type == 3).any()


def test_organic_engagement_raises_the_click():
    world = SyntheticWorld(SPEC)
    ads = np.array([5])
    campaign = np.array([world.ad_campaign[5]])
    owner, ages = np.array([0]), np.array([60.0])
    organic = world.history_signal(ads, owner, campaign, np.array([3]), ages)
    assert organic[0] > 0.4


def test_objectives_and_delayed_conversions():
    spec = SPEC.model_copy(update={"install_share": 0.5, "conversion_delay_hours": 20.0,
                                   "attribution_window_hours": 24.0})
    world = SyntheticWorld(spec)
    ex = world.sample(30_000, split=0)
    assert set(np.unique(ex.objective)) == {0, 1}
    np.testing.assert_array_equal(ex.objective, world.campaign_objective[ex.campaign_id])
    delay = ex.conversion_delay
    converted = np.isfinite(delay)
    assert (ex.click[converted] == 1).all()  # only a click converts
    window = spec.attribution_window_hours * 3600
    late = converted & (delay > window)
    assert late.sum() > 50 and (ex.conversion[late] == 0).all()  # landed after the window: labelled 0
    np.testing.assert_array_equal(ex.conversion > 0, converted & (delay <= window))
    # installs land 10x sooner, so fewer of them are cut by the window
    assert late[ex.objective == 1].sum() < 0.1 * late[ex.objective == 0].sum()
    # p_conversion is the probability of the windowed label: it matches its rate per objective
    clicked = ex.click > 0
    for o in (0, 1):
        m = clicked & (ex.objective == o)
        p = ex.p_conversion[m]
        assert abs(ex.conversion[m].mean() - p.mean()) < 4 * np.sqrt(np.mean(p * (1 - p)) / m.sum())
    # an endless window labels every conversion, and the label probability rises to p_eventual
    wide = SyntheticWorld(spec.model_copy(update={"attribution_window_hours": 1e6})).sample(30_000, split=0)
    np.testing.assert_array_equal(wide.conversion > 0, np.isfinite(wide.conversion_delay))
    assert wide.conversion.sum() > ex.conversion.sum() and (wide.p_conversion >= ex.p_conversion).all()


def test_surface_mix_knob():
    ex = SyntheticWorld(SPEC.model_copy(update={"surface_mix": [0.0, 0.0, 1.0, 0.0]})).sample(1000, split=0)
    assert (ex.surface == 2).all() and (ex.seq_surface == 2).all()


KNOBS = [
    ("seed", 9), ("num_users", 301), ("num_ads", 160), ("mean_history_len", 12.0), ("ads_per_campaign", 4),
    ("campaigns_per_advertiser", 2), ("interest_drift", 0.2), ("organic_share", 0.5), ("num_organic_posts", 50),
    ("surface_mix", [0.1, 0.1, 0.1, 0.7]), ("install_share", 0.9), ("conversion_delay_hours", 48.0),
    ("attribution_window_hours", 2.0), ("quality_noise", 1.0),
]


def test_every_knob_is_tested():
    sizes_of_splits = {"num_train_examples", "num_eval_examples"}  # how much is drawn, not the world
    assert {k for k, _ in KNOBS} == set(SyntheticDataSpec.model_fields) - sizes_of_splits


@pytest.mark.parametrize("knob,value", KNOBS)
def test_every_knob_changes_the_data(knob, value):
    base = SyntheticWorld(SPEC).sample(2000, split=0)
    other = SyntheticWorld(SPEC.model_copy(update={knob: value})).sample(2000, split=0)
    changed = [f for f in base.__dataclass_fields__
               if getattr(base, f).shape != getattr(other, f).shape
               or not np.array_equal(getattr(base, f), getattr(other, f), equal_nan=True)]
    assert changed, knob


def test_logit_terms_add_up_to_the_stored_probabilities(splits):
    """SyntheticWorld.logit_terms recomputes each task's logit from the examples alone, term by term."""
    world, (train, _) = SyntheticWorld(SPEC), splits
    terms = world.logit_terms(train)
    logit = {task: sum(t.values()) for task, t in terms.items()}
    sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
    np.testing.assert_allclose(sigmoid(logit["click"]), train.p_click, atol=1e-5)
    np.testing.assert_allclose(sigmoid(logit["dwell"]), train.p_dwell, atol=1e-5)
    window = world.conversion_window_prob(train.objective)
    np.testing.assert_allclose(sigmoid(logit["conversion"]) * window, train.p_conversion, atol=1e-5)
    # Affinity splits into the campaign's part and the ad's own, adding up to the world's affinity.
    aff = world.affinity(train.user_id, train.ad_id, train.request_time)
    np.testing.assert_allclose(terms["click"]["affinity_campaign"] + terms["click"]["affinity_ad"], aff, atol=1e-12)
    assert np.corrcoef(terms["click"]["affinity_campaign"], aff)[0, 1] > 0.6
    # The history term is nonzero exactly where a past event was on the candidate's campaign.
    lengths = np.diff(train.seq_offsets)
    match = np.bincount(np.repeat(np.arange(len(train)), lengths),
                        weights=train.seq_campaign_id == np.repeat(train.campaign_id, lengths), minlength=len(train))
    assert np.array_equal(terms["click"]["history"] > 0, match > 0)


def test_history_moves_the_click_probability():
    """Recent events on the candidate's campaign raise p_click: the sequence carries signal."""
    world = SyntheticWorld(SPEC)
    ads = np.array([5, 5])
    campaign = world.ad_campaign[5]
    owner, types, ages = np.array([0]), np.array([1]), np.array([60.0])
    recent = world.history_signal(ads, owner, np.array([campaign]), types, ages)
    old = world.history_signal(ads, owner, np.array([campaign]), types, np.array([30 * 86400.0]))
    other = world.history_signal(ads, owner, np.array([(campaign + 1) % world.num_campaigns]), types, ages)
    assert recent[0] > 0.9 and old[0] < 1e-6 and other[0] == 0


def test_make_batch_keeps_the_most_recent_events(splits):
    train, _ = splits
    index = np.array([0, 7, 3])
    batch = make_batch(train, index, max_seq_len=4)
    for b, i in enumerate(index):
        lo, hi = train.seq_offsets[i], train.seq_offsets[i + 1]
        keep = train.seq_timestamp[max(lo, hi - 4) : hi]
        got = batch.seq_timestamp[batch.seq_offsets[b] : batch.seq_offsets[b + 1]].numpy()
        np.testing.assert_array_equal(got, keep)
    assert batch.seq_offsets.dtype.is_floating_point is False and batch.seq_offsets[0] == 0


def test_shards_are_disjoint_and_resumable(splits):
    train, _ = splits
    loaders = [ShardedLoader(train, batch_size=50, max_seq_len=16, rank=r, world_size=2, seed=1) for r in range(2)]
    seen = [set(), set()]
    for r, loader in enumerate(loaders):
        for _ in range(loader.batches_per_epoch):
            b = loader.next_batch()
            seen[r].update(zip(b.user_id.tolist(), b.request_time.tolist(), b.ad_id.tolist()))
    assert not seen[0] & seen[1]
    # A fresh loader restored to position k yields exactly batch k.
    a = ShardedLoader(train, batch_size=50, max_seq_len=16, rank=1, world_size=2, seed=1)
    for _ in range(37):  # crosses an epoch boundary (30 batches per epoch)
        a.next_batch()
    b = ShardedLoader(train, batch_size=50, max_seq_len=16, rank=1, world_size=2, seed=1)
    b.load_state_dict(a.state_dict())
    assert (a.next_batch().request_time == b.next_batch().request_time).all()


def test_eval_batches_cover_every_example_once(splits):
    _, ev = splits
    counts = [sum(1 for _ in eval_batches(ev, batch_size=128, max_seq_len=8, rank=r, world_size=3)) for r in range(3)]
    assert len(set(counts)) == 1  # equal number of forwards on every rank
    weights = np.concatenate([b.weight.numpy() for r in range(3)
                              for b in eval_batches(ev, batch_size=128, max_seq_len=8, rank=r, world_size=3)])
    assert weights.sum() == len(ev)


def test_funnel_loss_is_masked_where_a_label_cannot_exist(splits):
    """Dwell trains where known (NaN: a source without it), conversion only after a click."""
    import torch
    from torch.nn import functional as F

    from gem.model.loss import multitask_bce

    train, _ = splits
    batch = make_batch(train, np.arange(64), max_seq_len=8)
    batch.dwell[::2] = float("nan")
    batch.conversion[batch.click == 0] = float("nan")  # unknown where no click: must not matter
    logits = {t: torch.randn(64) for t in ("click", "conversion", "dwell")}
    total, parts = multitask_bce(logits, batch)
    assert torch.isfinite(total)
    known = torch.isfinite(batch.dwell)
    want = F.binary_cross_entropy_with_logits(logits["dwell"][known], batch.dwell[known])
    assert torch.allclose(parts["dwell"], want)
    clicked = batch.click > 0
    want = F.binary_cross_entropy_with_logits(logits["conversion"][clicked], batch.conversion[clicked])
    assert torch.allclose(parts["conversion"], want)


@pytest.mark.parametrize("field,value", [
    ("interestDrift", float("inf")), ("meanHistoryLen", float("inf")), ("qualityNoise", float("inf")),
    ("conversionDelayHours", float("inf")), ("attributionWindowHours", float("inf")),
    ("surfaceMix", [float("inf"), 0.0, 0.0, 1.0]),
])
def test_non_finite_knobs_are_refused_naming_the_field(field, value):
    """inf passes ge=0: interestDrift .inf crashed building the world (OverflowError), meanHistoryLen
    .inf crashed sampling, qualityNoise .inf gave infinite dense features, an infinite surfaceMix share NaN; NaN was refused already."""
    with pytest.raises(ValueError, match=rf"(?s){field}.*finite number"):
        SyntheticDataSpec.model_validate({field: value})


@pytest.mark.parametrize("update", [
    {"num_users": 1, "num_ads": 1, "num_organic_posts": 1}, {"mean_history_len": 0.01},
    {"interest_drift": 1e9}, {"surface_mix": [0.0, 0.0, 0.0, 1e-300]}, {"ads_per_campaign": 10**9},
    {"conversion_delay_hours": 1e-6, "attribution_window_hours": 1e9},
])
def test_extreme_worlds_are_valid(update):
    ex = SyntheticWorld(SPEC.model_copy(update=update)).sample(2000, split=0)
    for p in (ex.p_click, ex.p_conversion, ex.p_dwell):
        assert np.isfinite(p).all() and ((p >= 0) & (p <= 1)).all()
    assert np.isfinite(ex.dense).all() and (ex.seq_lengths >= 1).all()
    assert (ex.seq_timestamp < np.repeat(ex.request_time, ex.seq_lengths)).all()  # strictly before the request


@pytest.mark.parametrize("chunk_size", [0, -5, 2.5])
def test_stream_refuses_a_chunk_size_that_is_not_a_positive_integer(chunk_size):
    """-5 used to yield no chunks at all (write_synthetic(chunk_size=-5) wrote empty splits); 0 failed inside range()."""
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        list(SyntheticWorld(SPEC).stream(10, split=0, chunk_size=chunk_size))


def test_mean_history_len_is_bounded_so_timestamps_stay_unix_seconds():
    """meanHistoryLen 60000 was accepted and its longest histories (8x the mean events, ~2 h apart)
    reached back before 1970: negative seq_timestamp, which the Parquet reader refuses as not seconds."""
    with pytest.raises(ValueError, match=r"(?s)meanHistoryLen.*less than or equal to 20000"):
        SyntheticDataSpec.model_validate({"meanHistoryLen": 60000})
    longest = SyntheticWorld(SPEC.model_copy(update={"mean_history_len": 20000.0}))
    ex = longest.sample(40, split=0)
    assert ex.seq_lengths.max() > 40000 and ex.seq_timestamp.min() > 0
