"""The synthetic world's labels are drawn from the probabilities stored beside them, bin by bin, and the
world is the same in every process (no dependence on Python's hash randomization)."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gem.api.types import SyntheticDataSpec
from gem.data.synthetic import SyntheticWorld

SPEC = SyntheticDataSpec(seed=11, num_users=300, num_ads=120, num_train_examples=10, num_eval_examples=10,
                         mean_history_len=12, install_share=0.5, conversion_delay_hours=20.0,
                         attribution_window_hours=24.0)
N = 200_000
BINS = 10
Z = 5.0  # per-bin margin in standard errors of the bin's mean label (40 bins: P(any beyond) ~ 2e-5)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


@pytest.fixture(scope="module")
def world_and_sample():
    world = SyntheticWorld(SPEC)
    return world, world.sample(N, split=7)


def _worst_z(y: np.ndarray, p: np.ndarray) -> float:
    """Largest |mean label - mean p| over equal-count bins of p, in standard errors of the bin's mean label."""
    p = p.astype(np.float64)
    worst = 0.0
    for chunk in np.array_split(np.argsort(p, kind="mergesort"), BINS):
        se = np.sqrt(np.sum(p[chunk] * (1 - p[chunk]))) / chunk.size
        worst = max(worst, abs(float(y[chunk].mean()) - float(p[chunk].mean())) / se)
    return worst


def test_labels_match_their_stored_probabilities_in_every_bin(world_and_sample):
    """Not just on average: within every decile of the stored probability the label rate is that
    probability (a label drawn from another example's p, or from a monotone transform of it with the
    same mean, fails here while the overall mean still agrees)."""
    world, ex = world_and_sample
    clicked = ex.click > 0
    assert clicked.sum() > 20_000  # bins of > 2000 examples
    eventual = _sigmoid(sum(world.logit_terms(ex)["conversion"].values()))  # before the attribution window
    checks = {
        "click": (ex.click, ex.p_click),
        "dwell": (ex.dwell, ex.p_dwell),
        "conversion | click (the windowed label)": (ex.conversion[clicked], ex.p_conversion[clicked]),
        "eventual conversion | click": (np.isfinite(ex.conversion_delay[clicked]).astype(np.float64),
                                        eventual[clicked]),
    }
    for name, (y, p) in checks.items():
        assert _worst_z(y, p) < Z, name


_HASH_WORLD = """
import hashlib, sys
import numpy as np
from gem.api.types import SyntheticDataSpec
from gem.data.synthetic import SyntheticWorld
world = SyntheticWorld(SyntheticDataSpec.model_validate_json(sys.argv[1]))
h = hashlib.sha256(world.favourites.tobytes())
for ex in (*world.splits(), *world.stream(300, split=1, chunk_size=128)):
    for name in ex.__dataclass_fields__:
        h.update(name.encode() + np.ascontiguousarray(getattr(ex, name)).tobytes())
print(h.hexdigest())
"""


def test_same_config_same_world_in_every_process():
    """Bit-identical across processes whatever PYTHONHASHSEED is (no set/dict-order or hash() dependence)."""
    spec = SyntheticDataSpec(seed=5, num_users=200, num_ads=64, num_train_examples=500, num_eval_examples=200,
                             mean_history_len=10, interest_drift=0.1)
    root = Path(__file__).resolve().parents[1]

    def digest(hash_seed: str) -> str:
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", _HASH_WORLD, spec.model_dump_json()], env=env, cwd=root,
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()

    first, second = digest("1"), digest("2")
    assert first == second and len(first) == 64
    # ...and it is this process's world too
    world = SyntheticWorld(spec)
    h = hashlib.sha256(world.favourites.tobytes())
    for ex in (*world.splits(), *world.stream(300, split=1, chunk_size=128)):
        for name in ex.__dataclass_fields__:
            h.update(name.encode() + np.ascontiguousarray(getattr(ex, name)).tobytes())
    assert h.hexdigest() == first
