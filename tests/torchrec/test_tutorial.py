"""TorchRec's tutorial EBC (product_table, user_table; 64-dim, 4096 rows, SUM)
made dynamic, on 1 and on 2 ranks: each pooled output is the sum of the stored
rows of its keys, and the empty bag is zero."""
import torch
import torchrec

import models
from multiprocess import run_ranks

TABLES = ["product_table", "user_table"]
# The tutorial's batch of 3: product [101, 202], [], [303]; user [404], [505], [606].
BATCH = {"product_feature": [[101, 202], [], [303]], "user_feature": [[404], [505], [606]]}


def debug_row(key: int, dim: int = 64) -> torch.Tensor:
    """The DEBUG initializer's row of a key: (key mod 100000) / 100 + j / 10000."""
    return (key % 100000) / 100 + torch.arange(dim, dtype=torch.float64) / 10000


def _tutorial(rank, world):
    configs = models.ebc_configs(TABLES, dim=64, num_embeddings=4096)
    results = []
    for pg in models.rank_groups()[::-1]:  # 1 rank (own group), then all ranks
        model = models.build("ebc", configs, pg, models.dynamic_constraints(TABLES), models.SGD)
        out = model(models.kjt(BATCH)).to_dict()
        for feature, table in zip(BATCH, TABLES):
            pooled = out[feature].detach().to(torch.float64)
            assert pooled.shape == (3, 64), pooled.shape
            for b, bag in enumerate(BATCH[feature]):
                if not bag:
                    assert torch.equal(pooled[b], torch.zeros(64, dtype=torch.float64)), "empty bag is not zero"
                    continue
                rows, owner = models.stored_rows(model, table, torch.tensor(bag), pg)
                assert bool((owner >= 0).all()), f"{table}: keys {bag} not stored"
                torch.testing.assert_close(pooled[b], rows[:, :64].sum(0), rtol=0, atol=1e-5)
                # ... and the stored rows are the keys' initial values.
                torch.testing.assert_close(rows[:, :64], torch.stack([debug_row(k) for k in bag]),
                                           rtol=0, atol=1e-6)
        results.append((pg.size(), {f: out[f].detach().numpy() for f in out}))  # no tensors through the queue
    return results


def test_tutorial_on_1_and_2_ranks():
    per_rank = run_ranks(_tutorial, 2)
    # Every rank fed the same batch: same outputs whatever the world size.
    ref = per_rank[0][0][1]
    for results in per_rank:
        assert [w for w, _ in results] == [1, 2]
        for _, out in results:
            for f in ref:
                assert (out[f] == ref[f]).all()
