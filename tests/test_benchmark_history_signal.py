"""`python -m benchmarks.history_signal`: label-free co-occurrence features of the histories,
between the gap split's predictor without the affinity and the one given its campaign part."""

from __future__ import annotations

import json

import numpy as np

from benchmarks import history_signal, quality
from gem.api.types import SyntheticDataSpec
from gem.data.synthetic import SyntheticWorld


def test_history_signal_smoke(tmp_path):
    out = tmp_path / "hs.json"
    assert history_signal.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    mode = quality.MODES["smoke"]
    assert doc["command"] == "python -m benchmarks.history_signal --smoke"
    assert (doc["train_examples"], doc["eval_examples"]) == (mode["steps"] * mode["batch"], mode["eval_examples"])
    for task, row in doc["ne"].items():
        # Bayes below the predictor given the campaign affinity, which is below the one without it;
        # the co-occurrence features recover part of the affinity from the histories alone
        assert row["bayes"] < row["with_campaign_affinity"] < row["with_history_cooccurrence"] < row[
            "without_affinity"], task
    assert all(0.3 < r2 < 1 for r2 in doc["campaign_latent_r2"].values())


def test_the_embeddings_come_from_the_histories_and_recover_the_campaign_latents():
    """Histories drawn from a world recover its campaign latents far better than the same
    factorization of histories whose campaigns were shuffled across events (no co-favourites)."""
    world = SyntheticWorld(SyntheticDataSpec(seed=3, num_users=800, num_ads=400, num_train_examples=4000,
                                             num_eval_examples=10))
    train, _ = world.splits()
    counts = history_signal.campaign_counts(train, world.num_campaigns)
    assert counts.sum() == train.seq_lengths.sum()
    _, u, s = history_signal.ppmi_embeddings(counts)
    real = history_signal.latent_r2(world, u, s)
    rng = np.random.default_rng(0)
    shuffled = history_signal.campaign_counts(
        type(train)(**{**train.__dict__, "seq_campaign_id": rng.permutation(train.seq_campaign_id)}), world.num_campaigns)
    _, u0, s0 = history_signal.ppmi_embeddings(shuffled)
    noise = history_signal.latent_r2(world, u0, s0)
    for k in real:
        assert real[k] > noise[k] + 0.2, (k, real, noise)
