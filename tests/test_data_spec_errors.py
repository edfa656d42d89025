"""Data a spec names but that cannot be used is a SpecError naming the field (gem/data/sources.py):
`gem train` / `gem eval` turn it into a config error, exit 2 (tests/test_train_setup.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pyarrow.parquet as pq
import pytest

from gem.api.types import DataSpec, SyntheticDataSpec
from gem.data import SyntheticWorld
from gem.data.errors import SpecError
from gem.data.parquet import examples_to_table, slice_examples, write_examples
from gem.data.sources import load_data

WORLD = {"numUsers": 50, "numAds": 20, "numTrainExamples": 64, "numEvalExamples": 16, "meanHistoryLen": 4}


def write_parquet(path, n_train: int, n_eval: int):
    """A data set of n_train / n_eval rows; an eval split of 0 rows is one file with no rows in it."""
    world = SyntheticWorld(SyntheticDataSpec(num_users=50, num_ads=20, num_train_examples=10, num_eval_examples=10,
                                             mean_history_len=4.0))
    write_examples(world.sample(n_train, split=0), path / "train")
    (path / "eval").mkdir(parents=True)
    pq.write_table(examples_to_table(slice_examples(world.sample(max(n_eval, 1), split=1), np.arange(n_eval))),
                   path / "eval" / "part-00000.parquet")
    return path


def test_a_missing_parquet_directory_names_data_path(tmp_path):
    with pytest.raises(SpecError, match=r"^spec\.data\.path: cannot read Parquet data at .*no-such-dir"):
        load_data(DataSpec.model_validate({"source": "parquet", "path": str(tmp_path / "no-such-dir")}))


def test_a_missing_source_names_its_index(tmp_path):
    spec = DataSpec.model_validate({"sources": [{"name": "a", "synthetic": WORLD},
                                                {"name": "b", "source": "parquet", "path": str(tmp_path / "nope")}]})
    with pytest.raises(SpecError, match=r"^spec\.data\.sources\[1\]\.path: "):
        load_data(spec)


def test_an_empty_eval_split_is_refused_before_training(tmp_path):
    path = write_parquet(tmp_path / "d", n_train=64, n_eval=0)
    with pytest.raises(SpecError, match=r"^spec\.data\.path: the eval split has no examples"):
        load_data(DataSpec.model_validate({"source": "parquet", "path": str(path)}))


@pytest.mark.parametrize("data, field", [
    ({"synthetic": WORLD}, "spec.data.synthetic.numTrainExamples"),
    ({"source": "parquet"}, "spec.data.path"),
    ({"sources": [{"name": "a", "synthetic": {**WORLD, "numTrainExamples": 256}}, {"name": "b", "source": "parquet"}]},
     "spec.data.sources[1].path"),
])
def test_too_few_training_examples_name_the_sources_field(tmp_path, data, field):
    path = str(write_parquet(tmp_path / "d", n_train=40, n_eval=8))
    for src in [data, *data.get("sources", [])]:
        if src.get("source") == "parquet":
            src["path"] = path
    splits = load_data(DataSpec.model_validate(data))
    with pytest.raises(SpecError) as e:
        splits.train_loader(batch_size=40, max_seq_len=8, rank=0, world_size=2, seed=0)
    assert str(e.value).startswith(f"{field}: ") and "spec.training.batchSize" in str(e.value)


@pytest.mark.parametrize("column, scale, unit", [("request_time", 1000, "milliseconds"),
                                                 ("seq_timestamp", 10**6, "microseconds")])
def test_timestamps_that_are_not_unix_seconds_name_the_path_and_the_unit(tmp_path, column, scale, unit):
    """The model's time features (rotary time encoding, recency) read seconds: data logged in ms trained
    silently on times 1000x apart. Refused at setup from the Parquet footers' statistics, no data read."""
    world = SyntheticWorld(SyntheticDataSpec(num_users=50, num_ads=20, num_train_examples=10, num_eval_examples=10,
                                             mean_history_len=4.0))
    train = world.sample(64, split=0)
    scaled = getattr(train, column) * scale
    train = train.__class__(**{**train.__dict__, column: scaled})
    write_examples(train, tmp_path / "d" / "train")
    write_examples(world.sample(16, split=1), tmp_path / "d" / "eval")
    with pytest.raises(SpecError, match=rf"^spec\.data\.path: .*{column}.*look like {unit}.*unix seconds"):
        load_data(DataSpec.model_validate({"source": "parquet", "path": str(tmp_path / "d")}))


def _world_splits():
    world = SyntheticWorld(SyntheticDataSpec(num_users=50, num_ads=20, num_train_examples=10, num_eval_examples=10,
                                             mean_history_len=4.0))
    return world.sample(64, split=0), world.sample(16, split=1)


def _with_event_types_shifted(table, by: int):
    types = table.column("seq_type").combine_chunks()
    shifted = pa.ListArray.from_arrays(types.offsets, pa.compute.add(types.flatten(), by))
    return table.set_column(table.schema.get_field_index("seq_type"), "seq_type", shifted)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.drop_columns(["click"]), r"has no click column in .*part-00000\.parquet"),
    (lambda t: t.set_column(t.schema.get_field_index("click"), "click",
                            pa.array([None] * 3 + [1.0] * (t.num_rows - 3), pa.float32())),
     r"has 3 null click values in .*\(row group 0\)"),
    (lambda t: t.set_column(t.schema.get_field_index("conversion"), "conversion",
                            pa.array([2.0] * t.num_rows, pa.float32())),
     r"has conversion values in \[2\.0, 2\.0\] .*labels are 0 or 1 \(NaN: unknown\)"),
    (lambda t: _with_event_types_shifted(t, 4), r"has seq_type values in \[4, 7\] .*event types are 0-3"),
])
def test_labels_the_model_cannot_train_on_are_refused_from_the_footers(tmp_path, change, message):
    """A Parquet split without click, with null clicks, labels outside [0, 1] or event types outside the
    schema's: BCE trained on them silently (a NaN click made every loss NaN from that batch on), and an
    unknown event type failed at the first forward (exit 1). Refused at setup, no data read."""
    train, eval_ = _world_splits()
    write_examples(eval_, tmp_path / "d" / "eval")
    (tmp_path / "d" / "train").mkdir(parents=True)
    pq.write_table(change(examples_to_table(train)), tmp_path / "d" / "train" / "part-00000.parquet")
    with pytest.raises(SpecError, match=rf"^spec\.data\.path: the Parquet data at .*{message}"):
        load_data(DataSpec.model_validate({"source": "parquet", "path": str(tmp_path / "d")}))


@pytest.mark.parametrize("split", ["train", "eval"])
def test_nan_and_fractional_labels_are_refused_when_read(tmp_path, split):
    """NaN is not in the footers' statistics, nor a 0.5 between 0 and 1: the rows are checked as read
    (the eval split at setup, train row groups as the loader reads them)."""
    train, eval_ = _world_splits()
    bad = train if split == "train" else eval_
    click = bad.click.copy()
    click[5] = np.nan
    bad = bad.__class__(**{**bad.__dict__, "click": click})
    write_examples(bad if split == "train" else train, tmp_path / "d" / "train")
    write_examples(bad if split == "eval" else eval_, tmp_path / "d" / "eval")
    data = DataSpec.model_validate({"source": "parquet", "path": str(tmp_path / "d")})
    if split == "eval":
        with pytest.raises(SpecError, match=r"^spec\.data\.path: .*a click of nan in row 5 of .*eval \(1 such rows\)"):
            load_data(data)
        return
    splits = load_data(data)
    loader = splits.train_loader(batch_size=16, max_seq_len=8, rank=0, world_size=1, seed=0)
    with pytest.raises(SpecError, match=r"a click of nan in row 5 of .*train.*\(row group 0\).*on every row"):
        for _ in range(loader.batches_per_epoch):
            loader.next_batch()
    dwell = eval_.dwell.copy()
    dwell[2] = 0.5
    write_examples(eval_.__class__(**{**eval_.__dict__, "dwell": dwell}), tmp_path / "e" / "eval")
    write_examples(train, tmp_path / "e" / "train")
    with pytest.raises(SpecError, match=r"a dwell of 0\.5 in row 2 .*\(NaN: unknown\)"):
        load_data(DataSpec.model_validate({"source": "parquet", "path": str(tmp_path / "e")}))
