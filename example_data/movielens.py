"""MovieLens ratings as a click log: label = rating >= 4 (a "like").

Files: ml-1m / ml-10m `ratings.dat` (UserID::MovieID::Rating::Timestamp) and
ml-20m / ml-25m `ratings.csv` (a header, then userId,movieId,rating,timestamp);
PATH is the file or the folder holding it. Samples are put in time order, so
the held-out ones are the latest.

Features, all from what happened before the sample (nothing leaks its label):
sparse: c1 user, c2 movie, c3 the user's previous movie, c4 the user's
previous liked movie, c6 hour of day (UTC), c9 day of week; the other slots
are empty bags. Dense: the user's and the movie's rating counts, mean
ratings and like rates so far, hours since the user's previous rating, hour
and weekday as sine / cosine, years since the log began, days since the
movie's first rating.
"""
import itertools
import os
import warnings
from typing import Optional

import numpy as np

from example_data import NUM_DENSE, SPARSE_FEATURES, ClickRows

MOVIELENS_LABELS = {"c1": "user", "c2": "movie", "c3": "previous movie", "c4": "previous liked movie",
                    "c6": "hour", "c9": "weekday"}
_SLOT = {name: SPARSE_FEATURES.index(slot) for slot, name in MOVIELENS_LABELS.items()}
_FILES = ("ratings.dat", "ratings.csv")


def ratings_file(path: str) -> str:
    if not os.path.isdir(path):
        return path
    for name in _FILES:
        if os.path.exists(os.path.join(path, name)):
            return os.path.join(path, name)
    raise FileNotFoundError(f"{path}: holds neither of {list(_FILES)} (MovieLens ml-1m/10m or ml-20m/25m)")


def parse_ratings(text: bytes, path: str = "<input>") -> np.ndarray:
    """[N, 4] float64 (user, movie, rating, timestamp) of ratings.dat ("::")
    or ratings.csv (",", a header line allowed) text."""
    text = text.replace(b"\r\n", b"\n").replace(b"::", b",")
    first_line = 1
    if text[:1].isalpha():  # the csv header
        text = text.split(b"\n", 1)[1] if b"\n" in text else b""
        first_line = 2
    text = text.strip(b"\n")
    if not text:
        raise ValueError(f"{path}: no ratings")
    text += b"\n"
    lines = text.count(b"\n")
    if text.count(b",") != 3 * lines:  # find the line (the slow way: this is the error path)
        for n, line in enumerate(text.split(b"\n")):
            if line.count(b",") != 3:
                raise ValueError(f"{path}: line {first_line + n} has {line.count(b',') + 1} fields, expected 4 "
                                 f"(user, movie, rating, timestamp)")
    try:
        with warnings.catch_warnings():  # older numpy warns and stops early at a bad field: counted below
            warnings.simplefilter("ignore")
            values = np.fromstring(text.replace(b"\n", b","), dtype=np.float64, sep=",")
    except ValueError:
        values = np.empty(0)
    if values.size != 4 * lines:  # find the line (the slow way: this is the error path)
        for n, line in enumerate(text.split(b"\n")):
            try:
                [float(v) for v in line.split(b",")]
            except ValueError:
                raise ValueError(f"{path}: line {first_line + n}: a field is not a number: {line[:80]!r}") from None
    return values.reshape(-1, 4)


def _by_key(key: np.ndarray):
    """(order sorting samples by key, time order kept; the position where
    each sorted sample's key group starts)."""
    order = np.argsort(key, kind="stable")
    k = key[order]
    first = np.r_[True, k[1:] != k[:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(k.size), 0))
    return order, start


def _prior_sums(order, start, values: np.ndarray) -> np.ndarray:
    """Per sample, the sum of `values` over earlier samples of its key."""
    v = values[order]
    before = np.cumsum(v) - v  # over all earlier sorted samples
    out = np.empty_like(before)
    out[order] = before - before[start]
    return out


def movielens_rows(ratings: np.ndarray) -> ClickRows:
    """ClickRows (time order) of [N, 4] (user, movie, rating, timestamp) ratings."""
    ratings = ratings[np.argsort(ratings[:, 3], kind="stable")]
    user, movie = ratings[:, 0].astype(np.int64), ratings[:, 1].astype(np.int64)
    rating, ts = ratings[:, 2], ratings[:, 3].astype(np.int64)
    liked = (rating >= 4).astype(np.float64)
    n = len(ratings)
    ones = np.ones(n)

    ids = np.zeros((n, len(SPARSE_FEATURES)), dtype=np.int64)
    present = np.zeros_like(ids, dtype=bool)

    def put(name, values, has=None):
        ids[:, _SLOT[name]] = values
        present[:, _SLOT[name]] = True if has is None else has

    hour = (ts // 3600) % 24
    weekday = (ts // 86400 + 3) % 7  # 1970-01-01 was a Thursday; Monday = 0
    put("user", user)
    put("movie", movie)
    put("hour", hour)
    put("weekday", weekday)

    # The user's history: previous movie, previous liked movie, gap.
    order, start = _by_key(user)
    pos = np.arange(n)
    has_prev = pos > start
    prev = np.where(has_prev, order[np.maximum(pos - 1, 0)], 0)
    prev_movie, gap = np.zeros(n, dtype=np.int64), np.zeros(n)
    prev_movie[order], gap[order] = movie[prev], np.where(has_prev, ts[order] - ts[prev], 0)
    put("previous movie", prev_movie, _scatter(order, has_prev))
    last_like = np.maximum.accumulate(np.where(liked[order] > 0, pos, -1))
    last_like = np.r_[-1, last_like[:-1]]  # strictly earlier
    has_like = last_like >= start
    prev_liked = np.zeros(n, dtype=np.int64)
    prev_liked[order] = movie[order[np.maximum(last_like, 0)]]
    put("previous liked movie", prev_liked, _scatter(order, has_like))
    user_n, user_sum, user_likes = (_prior_sums(order, start, v) for v in (ones, rating, liked))

    order, start = _by_key(movie)
    movie_n, movie_sum, movie_likes = (_prior_sums(order, start, v) for v in (ones, rating, liked))
    first_seen = np.empty(n)
    first_seen[order] = ts[order[start]]

    # Means and rates smoothed towards a prior (3.5 stars, a 50% like rate).
    dense = np.stack([
        np.log1p(user_n), (user_sum + 3.5 * 2) / (user_n + 2) - 3.5, (user_likes + 1) / (user_n + 2),
        np.log1p(movie_n), (movie_sum + 3.5 * 2) / (movie_n + 2) - 3.5, (movie_likes + 1) / (movie_n + 2),
        np.log1p(gap / 3600.0),
        np.sin(2 * np.pi * hour / 24), np.cos(2 * np.pi * hour / 24),
        np.sin(2 * np.pi * weekday / 7), np.cos(2 * np.pi * weekday / 7),
        (ts - ts[0]) / (365.25 * 86400), np.log1p((ts - first_seen) / 86400.0),
    ], axis=1)
    assert dense.shape[1] == NUM_DENSE
    return ClickRows.from_numpy(dense, ids, present, liked)


def _scatter(order: np.ndarray, sorted_values: np.ndarray) -> np.ndarray:
    out = np.empty_like(sorted_values)
    out[order] = sorted_values
    return out


def read_movielens(path: str, max_rows: Optional[int] = None) -> ClickRows:
    """The first `max_rows` ratings (all by default) of a MovieLens ratings file, in time order."""
    path = ratings_file(path)
    with open(path, "rb") as f:
        if max_rows is None:
            return movielens_rows(parse_ratings(f.read(), path))
        lines = list(itertools.islice(f, max_rows + 1))  # a csv's header line, then max_rows ratings
    if lines and not lines[0][:1].isalpha():
        lines = lines[:max_rows]
    return movielens_rows(parse_ratings(b"".join(lines), path))
