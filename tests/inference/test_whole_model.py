"""The whole model: a TorchRec ranking model (dynamic and native tables in one
EBC, an MLP on top) trained a few steps on 2 ranks, turned into a plain
module by to_inference, exported with dynamic KeyedJaggedTensor inputs,
served in a fresh process: its predictions equal the sharded model's eval."""
import os
import subprocess
import sys

import torch
import torchrec

import models
from ckpt_helpers import run_ranks
from dynamicemb.inference.convert import to_inference
from dynamicemb.inference.export import export_model

TABLES = {"user_table": True, "item_table": True, "cat_table": False}  # dynamic?
FEATURES = [t.replace("table", "feature") for t in TABLES]
B = 8  # samples per rank

_SERVE = r"""
import sys, torch
import torchrec, dynamicemb  # torchrec: the program's KJT inputs; dynamicemb: the lookup op
program = torch.export.load(sys.argv[1])
torch.save([program.module()(torchrec.KeyedJaggedTensor.from_lengths_sync(FEATURES, v, l))
            for v, l in torch.load(sys.argv[2])], sys.argv[3])
""".replace("FEATURES", repr(FEATURES))


class Ranker(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ebc = torchrec.EmbeddingBagCollection(tables=models.ebc_configs(list(TABLES), dim=8, num_embeddings=1000),
                                                   device=torch.device("meta"))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8 * len(TABLES), 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, kjt):
        kt = self.ebc(kjt)
        return self.mlp(torch.cat([kt[f] for f in FEATURES], 1)).squeeze(1)


def _batch(rank, step, world=2):
    batch = models.random_batch(FEATURES, B * world, 800, seed=step, max_len=3)
    return models.kjt(batch, slice(rank * B, (rank + 1) * B))


def _train_export(rank, world, path):
    pg = models.rank_groups()[0]
    dynamic = [t for t, d in TABLES.items() if d]
    torch.manual_seed(0)  # the same dense initial weights on every rank
    module = Ranker()
    model = models.shard(module, models.ebc_configs(list(TABLES), dim=8, num_embeddings=1000), world,
                         models.dynamic_constraints(dynamic), models.SGD, env=models.ShardingEnv.from_process_group(pg))
    dense = torch.optim.SGD([p for n, p in model.named_parameters() if "mlp" in n], lr=0.1)
    for step in range(3):
        loss = (model(_batch(rank, step)) - 1).pow(2).sum()
        loss.backward()
        dense.step()
        dense.zero_grad()
    model.eval()
    kjts = [_batch(rank, 100 + i) for i in range(2)]
    preds = [model(k).detach() for k in kjts]
    served = to_inference(model)
    local = [served(k) for k in kjts]
    if rank == 0:
        torch.export.save(export_model(served, (kjts[0],)), path)
    return preds, local, [(k.values(), k.lengths()) for k in kjts]


def test_trained_model_exports_and_serves(tmp_path):
    path = str(tmp_path / "model.pt2")
    ranks = run_ranks(_train_export, 2, path)
    inputs, expected = [], []
    for preds, local, kjts in ranks:
        for p, q in zip(preds, local):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)  # RW partial sums: float rounding
        inputs += kjts
        expected += preds
    torch.save(inputs, tmp_path / "in.pt")
    subprocess.run([sys.executable, "-c", _SERVE, path, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    for got, want in zip(torch.load(tmp_path / "out.pt"), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
