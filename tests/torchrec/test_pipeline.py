"""TorchRec's TrainPipelineSparseDist over a model with dynamic tables gives,
step by step, what a plain training loop gives (2 ranks, 10 steps): the
pipeline runs the input distribution of batch i+1 before the backward of
batch i, which must not change what the tables learn."""
import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

import models
from multiprocess import run_ranks

TABLES = ["a_table", "b_table"]
FEATURES = [t.replace("table", "feature") for t in TABLES]
DIM, BATCH, KEYS, STEPS = 4, 6, 30, 10


class SparseDenseModel(nn.Module):
    """EBC -> linear -> BCE loss; forward(Batch) -> (loss, logits), as the
    pipeline expects."""

    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc
        torch.manual_seed(0)
        self.dense = nn.Linear(DIM * len(TABLES), 1)

    def forward(self, batch: Batch):
        pooled = self.ebc(batch.sparse_features).values()
        logits = self.dense(pooled).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
        return loss, logits.detach()


def _batches(pg):
    out = []
    for step in range(STEPS):
        batch = models.random_batch(FEATURES, BATCH * pg.size(), KEYS, seed=300 + step)
        mine = models.local_samples(BATCH * pg.size(), pg)
        labels = torch.tensor([float((step + i) % 2) for i in range(BATCH * pg.size())])[mine]
        out.append(Batch(dense_features=torch.zeros(BATCH, 1), sparse_features=models.kjt(batch, mine),
                         labels=labels))
    return out


def _build(pg):
    model = models.build("ebc", models.ebc_configs(TABLES, dim=DIM, num_embeddings=KEYS), pg,
                         models.dynamic_constraints(TABLES), models.SGD, wrap=SparseDenseModel)
    dense = [p for n, p in model.named_parameters() if "dense" in n]
    assert len(dense) == 2, [n for n, _ in model.named_parameters()]
    return model, torch.optim.SGD(dense, lr=0.05)


def _pipeline(rank, world):
    pg = models.rank_groups()[0]
    batches = _batches(pg)

    plain, opt = _build(pg)
    plain_logits = models.train_steps(plain, opt, batches)

    piped, opt = _build(pg)
    pipeline = TrainPipelineSparseDist(piped, opt, torch.device("cpu"))
    it = iter(batches)
    piped_logits = [pipeline.progress(it) for _ in range(STEPS)]
    # The pipeline did take over the sharded EBC's input distribution.
    assert [type(m).__name__ for m in pipeline._pipelined_modules] == ["ShardedDynamicEmbeddingBagCollection"]

    for step, (a, b) in enumerate(zip(piped_logits, plain_logits)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} logits: {m}")
    assert not torch.allclose(plain_logits[0], plain_logits[-1])  # it trained
    for (n, p), (_, q) in zip(piped.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    keys = torch.arange(KEYS)
    for t in TABLES:
        (a, held_a), (b, held_b) = models.stored_rows(piped, t, keys, pg), models.stored_rows(plain, t, keys, pg)
        assert torch.equal(held_a >= 0, held_b >= 0), f"{t}: stored keys differ"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{t} rows: {m}")
    return True


def test_train_pipeline_sparse_dist_matches_plain_loop():
    assert run_ranks(_pipeline, 2) == [True, True]
