"""The MovieLens reader (ratings.dat "::" and ratings.csv) against a sample-by-
sample Python model of its features, on small files the test writes."""
import math
import random
from collections import defaultdict

import numpy as np
import pytest

from example_data import SPARSE_FEATURES
from example_data.movielens import MOVIELENS_LABELS, read_movielens

SLOT = {name: slot for slot, name in MOVIELENS_LABELS.items()}


def _ratings(n, seed=0):
    """(user, movie, rating, timestamp), not in time order; some timestamps repeat."""
    rng = random.Random(seed)
    times = [978300000 + rng.randrange(0, 3 * 10**6, 7) for _ in range(n)]
    return [(rng.randrange(1, 8), rng.randrange(1, 15), rng.choice([1, 2, 3, 3.5, 4, 4.5, 5]),
             rng.choice(times[:5]) if rng.random() < 0.2 else t) for t in times]


def _write(path, ratings, kind):
    if kind == "dat":  # ml-1m / ml-10m: integer stars in 1m, halves in 10m
        path.write_text("".join(f"{u}::{m}::{r:g}::{t}\n" for u, m, r, t in ratings))
    else:
        path.write_text("userId,movieId,rating,timestamp\n" + "".join(f"{u},{m},{r:g},{t}\n" for u, m, r, t in ratings))


def _reference(ratings):
    """Per sample in time order (ties in file order): label, sparse ids, dense features."""
    out = []
    seen_user = defaultdict(list)  # user -> [(movie, rating, ts)]
    seen_movie = defaultdict(list)  # movie -> [(rating, ts)]
    start = min(t for *_, t in ratings)
    for u, m, r, t in sorted(ratings, key=lambda x: x[3]):
        hist, mhist = seen_user[u], seen_movie[m]
        hour, weekday = (t // 3600) % 24, (t // 86400 + 3) % 7
        sparse = {"user": u, "movie": m, "hour": hour, "weekday": weekday}
        if hist:
            sparse["previous movie"] = hist[-1][0]
        liked = [mv for mv, rr, _ in hist if rr >= 4]
        if liked:
            sparse["previous liked movie"] = liked[-1]
        un, us, ul = len(hist), sum(rr for _, rr, _ in hist), sum(rr >= 4 for _, rr, _ in hist)
        mn, ms, ml = len(mhist), sum(rr for rr, _ in mhist), sum(rr >= 4 for rr, _ in mhist)
        dense = [math.log1p(un), (us + 7) / (un + 2) - 3.5, (ul + 1) / (un + 2),
                 math.log1p(mn), (ms + 7) / (mn + 2) - 3.5, (ml + 1) / (mn + 2),
                 math.log1p((t - hist[-1][2]) / 3600) if hist else 0.0,
                 math.sin(2 * math.pi * hour / 24), math.cos(2 * math.pi * hour / 24),
                 math.sin(2 * math.pi * weekday / 7), math.cos(2 * math.pi * weekday / 7),
                 (t - start) / (365.25 * 86400), math.log1p((t - (mhist[0][1] if mhist else t)) / 86400)]
        out.append((float(r >= 4), sparse, dense))
        hist.append((m, r, t))
        mhist.append((r, t))
    return out


def _check(rows, ratings):
    want = _reference(ratings)
    assert len(rows) == len(want)
    for i, (label, sparse, dense) in enumerate(want):
        assert rows.labels[i].item() == label
        got = {MOVIELENS_LABELS[f]: rows.ids[i, j].item() for j, f in enumerate(SPARSE_FEATURES)
               if rows.present[i, j]}
        assert got == sparse, f"sample {i}"
        np.testing.assert_allclose(rows.dense[i].numpy(), dense, rtol=1e-5, atol=1e-6, err_msg=f"sample {i}")


@pytest.mark.parametrize("kind", ["dat", "csv"])
def test_features_match_the_history_before_each_rating(tmp_path, kind):
    ratings = _ratings(400)
    path = tmp_path / f"ratings.{kind}"
    _write(path, ratings, kind)
    _check(read_movielens(str(path)), ratings)
    _check(read_movielens(str(tmp_path)), ratings)  # the folder that holds it
    _check(read_movielens(str(path), max_rows=50), ratings[:50])  # the first lines of the file


def test_only_the_mapped_slots_are_filled(tmp_path):
    _write(tmp_path / "ratings.dat", _ratings(30, seed=1), "dat")
    rows = read_movielens(str(tmp_path))
    empty = [j for j, f in enumerate(SPARSE_FEATURES) if f not in MOVIELENS_LABELS]
    assert not rows.present[:, empty].any()
    assert rows.present[:, SPARSE_FEATURES.index(SLOT["user"])].all()


@pytest.mark.parametrize("text, message", [
    ("1::2::3::4\n1::2::3\n", "line 2 has 3 fields"),
    ("1::2::3::4\n1::2::x::4\n", "line 2: a field is not a number"),
    ("userId,movieId,rating,timestamp\n1,2,3,4\n5,6,7\n", "line 3 has 3 fields"),
    ("", "no ratings"),
])
def test_bad_files_are_named(tmp_path, text, message):
    (tmp_path / "ratings.dat").write_text(text)
    with pytest.raises(ValueError, match=message):
        read_movielens(str(tmp_path / "ratings.dat"))


def test_a_folder_without_ratings(tmp_path):
    with pytest.raises(FileNotFoundError, match="ratings.dat"):
        read_movielens(str(tmp_path))
