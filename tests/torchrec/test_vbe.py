"""Variable batch sizes (TorchRec's VBE: a KJT whose features carry their
own number of samples, expanded to the batch by inverse indices) through
dynamic tables, on 2 ranks. The reference is the same model fed the
expanded batch (every feature with the full batch's bags): the outputs of
every step and the trained rows match, for SUM and weighted tables (one
kernel), a collection mixing SUM and MEAN tables (two kernels writing one
VBE output), one with a native TABLE_WISE table beside them, and in eval.
On the CPU, TorchRec's expansion of a VBE output (fbgemm's
batch_index_select_dim0) takes one batch size per rank for all features:
the batches here vary by rank and step. Features of different sizes (the
padding of vbe.py) are checked at the kernel (test_vbe_layout.py)."""
import torch
import torchrec
from torchrec.distributed.planner import ParameterConstraints

import models
from dynamicemb.stats import dynamic_modules
from multiprocess import run_ranks

KEYS, FULL, STEPS = 40, 5, 3


def _batches(features, rank, step, weighted):
    """(VBE KJT, the same batch expanded): every feature has 1..FULL distinct
    samples on this rank (the same count: see above), each sample of the full
    batch one of them."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    count = int(torch.randint(1, FULL + 1, (1,), generator=g))
    distinct = {f: count for f in features}
    bags = {f: [torch.randint(0, KEYS, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g)
                for _ in range(distinct[f])] for f in features}
    weights = {f: [torch.rand(len(b), generator=g) for b in bags[f]] for f in features}
    inverse = torch.stack([torch.randint(0, distinct[f], (FULL,), generator=g) for f in features])

    def kjt(rows, w, **kw):
        lengths = torch.tensor([len(b) for b in rows], dtype=torch.int64)
        values = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        return torchrec.KeyedJaggedTensor(keys=features, values=values, lengths=lengths,
                                          weights=(torch.cat(w) if w else torch.zeros(0)) if weighted else None, **kw)

    vbe = kjt([b for f in features for b in bags[f]], [x for f in features for x in weights[f]],
              stride_per_key_per_rank=[[distinct[f]] for f in features], inverse_indices=(features, inverse))
    expanded = [(bags[f][int(i)], weights[f][int(i)]) for k, f in enumerate(features) for i in inverse[k]]
    full = kjt([b for b, _ in expanded], [w for _, w in expanded], stride=FULL)
    return vbe, full


def _vs_expanded(pg, configs, weighted=False, kernels=1, native=()):
    """`native`: tables planned as TorchRec's FUSED TABLE_WISE ones beside the dynamic ones."""
    names = [c.name for c in configs]
    features = [c.feature_names[0] for c in configs]
    start = models.initial_weights(configs, seed=6)
    kind = "weighted_ebc" if weighted else "ebc"
    constraints = models.dynamic_constraints([n for n in names if n not in native])
    constraints.update({n: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
                        for n in native})
    pair = []
    for _ in range(2):
        m = models.build(kind, configs, pg, constraints, models.SGD, collective=True)
        for c in configs:
            if c.name in native:
                models.set_native_rows(m, models.weight_fqn(kind, c.name), start[c.name])
            else:
                models.set_dynamic_rows(m, c.name, start[c.name], pg)
        pair.append(m)
    assert len(list(dynamic_modules(pair[0]))) == kernels
    what = f"VBE {names} weighted={weighted}"
    for step in range(STEPS):
        vbe, full = _batches(features, pg.rank(), step, weighted)
        out, ref = models.resolved(pair[0](vbe)), models.resolved(pair[1](full))
        for f in features:
            torch.testing.assert_close(out[f], ref[f], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {step} {f}: {m}")
        models.loss_of(out).backward()
        models.loss_of(ref).backward()
    for c in configs:
        if c.name in native:
            got, want = (models.native_rows(m, models.weight_fqn(kind, c.name), pg) for m in pair)
            assert not torch.allclose(got, start[c.name].double()), what  # it trained
        else:
            got, held = models.stored_rows(pair[0], c.name, torch.arange(KEYS), pg)
            want, _ = models.stored_rows(pair[1], c.name, torch.arange(KEYS), pg)
            assert bool((held >= 0).any()), what
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {c.name} rows: {m}")
    for m in pair:
        m.eval()
    vbe, full = _batches(features, pg.rank(), STEPS, weighted)
    out, ref = models.resolved(pair[0](vbe)), models.resolved(pair[1](full))
    torch.testing.assert_close(out.values(), ref.values(), msg=lambda m: f"{what} eval: {m}")


def _ranks(rank, world):
    pg = models.rank_groups()[0]
    sum_tables = models.ebc_configs(["a_table", "b_table"], dim=4, num_embeddings=KEYS)
    _vs_expanded(pg, sum_tables)
    _vs_expanded(pg, sum_tables, weighted=True)
    # MEAN and SUM tables are grouped apart: two kernels fill one VBE output.
    mean_table = models.ebc_configs(["c_table"], dim=8, num_embeddings=KEYS, pooling=torchrec.PoolingType.MEAN)
    _vs_expanded(pg, sum_tables + mean_table, kernels=2)
    # A native TABLE_WISE table beside them (its own sharding and output dist).
    native = models.ebc_configs(["native_table"], dim=4, num_embeddings=KEYS)
    _vs_expanded(pg, native + sum_tables, native=("native_table",))
    return True


def test_variable_batch_per_feature_matches_the_expanded_batch():
    assert run_ranks(_ranks, 2) == [True, True]
