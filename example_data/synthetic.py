"""A generated click log with the skew of real ones, and labels a model can learn.

- Ids: per feature, a popularity rank drawn from a Zipf-like law (a
  discretised Pareto, exponent 1.15 to 1.8: a few ids in most samples, a
  long tail seen once), hashed into [0, 2**40).
- New ids over time: per feature, a share of the samples draws from ids
  that exist only in the current period of PERIOD samples (trending items,
  new users); the held-out samples come after the training ones, so they
  hold ids never trained on.
- Labels: a hidden model (a bias, an effect per id of 16 features, weights
  on the dense features, one pairwise interaction) gives each sample a click
  probability; the label is drawn from it.

Every value is a pure function of (seed, sample index): any rank, batch size
or world size sees the same log.
"""
import numpy as np

from example_data import NATIVE_FEATURES, NUM_DENSE, SPARSE_FEATURES, ClickLog, ClickRows, dense_transform

ID_SPACE = 2**40
PERIOD = 1 << 15  # samples per period of fresh ids
NATIVE_VOCAB = {"c6": 14, "c9": 3, "c17": 10, "c20": 4}  # Criteo's cardinalities
PAIR = ("c1", "c2")  # a user-like and an item-like feature that interact
PAIR_DIM = 4

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 in, uint64 out)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _hash(*parts) -> np.ndarray:
    """A 64-bit hash of the parts (ints or uint64 arrays, broadcast)."""
    with np.errstate(over="ignore"):
        h = np.uint64(0)
        for p in parts:
            h = _mix((h + _GOLDEN) ^ np.asarray(p, dtype=np.uint64))
    return h


def _uniform(*parts) -> np.ndarray:
    """Floats in [0, 1) from a hash of the parts."""
    return (_hash(*parts) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _normal(*parts) -> np.ndarray:
    """Standard normal floats (Box-Muller) from hashes of the parts."""
    u1, u2 = 1.0 - _uniform(*parts, 1), _uniform(*parts, 2)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2 * np.pi * u2)


class HiddenModel:
    """The log's generating process; its parameters come from the seed."""

    def __init__(self, seed: int):
        self.seed = seed
        rng = np.random.default_rng(seed)
        F = len(SPARSE_FEATURES)
        self.zipf = rng.uniform(1.15, 1.8, F)
        self.fresh = rng.uniform(0.0, 0.4, F)
        self.missing = np.where(rng.random(F) < 0.25, rng.uniform(0.05, 0.3, F), 0.0)
        # 16 features carry signal (8 strongly), the rest is noise.
        self.effect = np.zeros(F)
        order = rng.permutation(F)
        self.effect[order[:8]], self.effect[order[8:16]] = 0.6, 0.3
        self.dense_mu = rng.uniform(0.0, 4.0, NUM_DENSE)
        self.dense_sigma = rng.uniform(0.5, 1.5, NUM_DENSE)
        self.dense_missing = np.where(rng.random(NUM_DENSE) < 0.3, 0.2, 0.0)
        self.dense_weight = rng.uniform(-0.6, 0.6, NUM_DENSE)
        self.bias = -1.6

    def rows(self, start: int, count: int) -> ClickRows:
        return self.generate(start, count)[0]

    def generate(self, start: int, count: int):
        """(samples start .. start + count - 1, their click probabilities)."""
        s = self.seed
        i = np.arange(start, start + count, dtype=np.uint64)
        F = len(SPARSE_FEATURES)
        ids = np.zeros((count, F), dtype=np.int64)
        present = np.ones((count, F), dtype=bool)
        logit = np.full(count, self.bias)
        hidden = {}
        for f, name in enumerate(SPARSE_FEATURES):
            u = 1.0 - _uniform(s, i, f, 0)  # (0, 1]
            rank = np.minimum(np.floor(u ** (-1.0 / (self.zipf[f] - 1.0))) - 1, 2.0**31).astype(np.uint64)
            if name in NATIVE_VOCAB:
                k = rank % np.uint64(NATIVE_VOCAB[name])
                ids[:, f] = k.astype(np.int64)
            else:
                fresh = _uniform(s, i, f, 1) < self.fresh[f]
                period = i // np.uint64(PERIOD) + np.uint64(1)
                k = np.where(fresh, (period << np.uint64(32)) | rank, rank)
                ids[:, f] = (_hash(s, f, k, 2) % np.uint64(ID_SPACE)).astype(np.int64)
            present[:, f] = _uniform(s, i, f, 3) >= self.missing[f]
            effect = np.sqrt(3.0) * (2.0 * _uniform(s, f, k, 4) - 1.0)  # variance 1
            logit += np.where(present[:, f], self.effect[f] * effect, 0.0)
            hidden[name] = k
        a, b = (SPARSE_FEATURES.index(p) for p in PAIR)
        pair = sum(_normal(s, a, hidden[PAIR[0]], 10 + d) * _normal(s, b, hidden[PAIR[1]], 10 + d)
                   for d in range(PAIR_DIM))
        logit += np.where(present[:, a] & present[:, b], 0.4 * pair, 0.0)

        j = np.arange(NUM_DENSE, dtype=np.uint64)[None, :]
        z = _normal(s, i[:, None], j, 5)
        counts = np.floor(np.exp(self.dense_mu + self.dense_sigma * z)) - 1
        counts[_uniform(s, i[:, None], j, 6) < self.dense_missing] = 0  # missing reads as 0
        dense = dense_transform(counts)
        logit += ((dense - self.dense_mu) / self.dense_sigma) @ self.dense_weight

        probability = 1.0 / (1.0 + np.exp(-logit))
        labels = _uniform(s, i, 7) < probability
        return ClickRows.from_numpy(dense, ids, present, labels), probability


def generated_log(train_samples: int, eval_samples: int, seed: int = 0) -> ClickLog:
    """Training samples 0.., and the eval_samples after train_samples held out."""
    model = HiddenModel(seed)
    return ClickLog(name=f"generated click log (seed {seed})", train=model.rows,
                    eval=model.rows(train_samples, eval_samples), train_size=None, labels={})


assert set(NATIVE_VOCAB) == set(NATIVE_FEATURES)
