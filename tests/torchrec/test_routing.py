"""Routing keys to ranks: dynamicemb.routing.owners against a pure-Python
reference of every dist_type, route_keys against fbgemm's
block_bucketize_sparse_features for native (block) features, and where a
2-rank model actually stores each key after a training step; the ops under
torch.compile and torch.export, and opchecked by the generated twin of every
test (tests/op_checks.py)."""
import random
import sys

import pytest
import torch

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import models
from dynamicemb.routing import DIST_TYPES, ROUTE_BLOCK, owners, route_param, route_rule
from dynamicemb._ops import ops
from multiprocess import run_ranks
from op_checks import generate_opcheck_tests, no_opcheck
from table.reference import fmix64  # the table's Python model: the same hash rule

MASK = (1 << 64) - 1
EDGE_KEYS = [0, 1, -1, 2, 7, 1000, -1000, 2**31, 2**62 + 5, 2**63 - 1, -(2**63), -(2**63) + 1]


def reference_owner(key: int, dist_type: str, world: int, num_embeddings: int) -> int:
    if dist_type == "hash_roundrobin":
        return fmix64(key) % world
    if dist_type == "roundrobin":
        return key % world  # Python's % is the non-negative remainder
    block = -(-num_embeddings // world)
    return (key % num_embeddings) // block


def _keys(n=2000, seed=0):
    rng = random.Random(seed)
    return EDGE_KEYS + [rng.randrange(-(2**63), 2**63) for _ in range(n)] + list(range(-50, 300))


@pytest.mark.parametrize("dist_type", sorted(DIST_TYPES))
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_owners_match_reference(dist_type, world):
    keys = _keys()
    num_embeddings = 1001
    got = owners(torch.tensor(keys), dist_type, world, num_embeddings).tolist()
    assert got == [reference_owner(k, dist_type, world, num_embeddings) for k in keys]


def _route_reference(lengths, values, weights, rules, params, world):
    """route_keys' layout: [rank][feature][bag], input order kept in a bag;
    block features get fbgemm's local index, dynamic features keep keys."""
    F = len(rules)
    B = len(lengths) // F
    out = [[[] for _ in range(F * B)] for _ in range(world)]
    pos = 0
    for j, n in enumerate(lengths):
        f = j // B
        for i in range(pos, pos + n):
            k = values[i]
            if rules[f] == ROUTE_BLOCK:
                u, bs = k & MASK, params[f]
                r, local = (u // bs, u % bs) if u < bs * world else (u % world, u // world)
                k = local - (1 << 64) if local >= 1 << 63 else local
            else:
                dist_type = {v: n for n, v in DIST_TYPES.items()}[rules[f]]
                r = reference_owner(k, dist_type, world, params[f])
            out[r][j].append((k, weights[i], i))
        pos += n
    flat = [x for rank in out for bag in rank for x in bag]
    permute = [0] * len(values)
    for p, (_, _, i) in enumerate(flat):
        permute[i] = p
    return ([len(bag) for rank in out for bag in rank], [k for k, _, _ in flat], [w for _, w, _ in flat], permute)


def _random_kjt(F, B, seed, key_range):
    rng = random.Random(seed)
    lengths = [rng.randrange(4) for _ in range(F * B)]
    values = [rng.randrange(*key_range) for _ in range(sum(lengths))]
    weights = [rng.random() for _ in values]
    return lengths, values, weights


@pytest.mark.parametrize("world", [1, 2, 3])
def test_route_keys_block_matches_fbgemm(world):
    """Native row-wise features: same lengths, local indices, weights and
    unbucketize permutation as fbgemm's block bucketization."""
    F, B = 3, 5
    block_sizes = [7, 4, 100]  # keys past block * world (and negative ones) go round-robin
    lengths, values, weights = _random_kjt(F, B, seed=world, key_range=(-20, 40))
    L, V, W = torch.tensor(lengths), torch.tensor(values), torch.tensor(weights)
    ours = ops.route_keys(L, V, W, [ROUTE_BLOCK] * F, block_sizes, world)
    fb_len, fb_val, fb_w, _, fb_perm = torch.ops.fbgemm.block_bucketize_sparse_features(
        L, V, False, True, torch.tensor(block_sizes), world, W)
    assert ours[0].tolist() == fb_len.tolist()
    assert ours[1].tolist() == fb_val.tolist()
    assert ours[2].tolist() == fb_w.tolist()
    assert ours[3].tolist() == fb_perm.tolist()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_route_keys_mixed_rules(world):
    """A sharding mixing native and dynamic features: each feature by its rule."""
    F, B = 4, 3
    rules = [ROUTE_BLOCK, route_rule("hash_roundrobin"), route_rule("roundrobin"), route_rule("continuous")]
    params = [10, route_param("hash_roundrobin", 50), route_param("roundrobin", 50), route_param("continuous", 50)]
    lengths, values, weights = _random_kjt(F, B, seed=10 + world, key_range=(-60, 120))
    got = ops.route_keys(torch.tensor(lengths), torch.tensor(values), torch.tensor(weights), rules, params, world)
    want = _route_reference(lengths, values, weights, rules, params, world)
    assert [t.tolist() for t in got] == [want[0], want[1], torch.tensor(want[2]).tolist(), want[3]]


@pytest.mark.parametrize("world", [2, 3])
def test_route_keys_large_batch_with_threads(world):
    """A batch of ~40K values on 2 threads: several chunks of bags route in
    parallel, and the layout still equals the one-by-one reference."""
    F, B = 4, 4000
    rules = [ROUTE_BLOCK, route_rule("hash_roundrobin"), route_rule("roundrobin"), route_rule("continuous")]
    params = [5000, route_param("hash_roundrobin", 1 << 20), route_param("roundrobin", 1 << 20),
              route_param("continuous", 1 << 20)]
    rng = random.Random(world)
    lengths = [rng.randrange(6) for _ in range(F * B)]
    values = [rng.randrange(-(1 << 20), 1 << 22) for _ in range(sum(lengths))]
    weights = [rng.random() for _ in values]
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = ops.route_keys(torch.tensor(lengths), torch.tensor(values), torch.tensor(weights), rules, params, world)
    finally:
        torch.set_num_threads(old)
    want = _route_reference(lengths, values, weights, rules, params, world)
    assert [t.tolist() for t in got] == [want[0], want[1], torch.tensor(want[2]).tolist(), want[3]]


# ---- where a 2-rank model stores keys ----------------------------------------------------

NUM_EMBEDDINGS = 1000
DIST_TABLES = {"hash_table": "hash_roundrobin", "rr_table": "roundrobin", "cont_table": "continuous"}
KEYS = list(range(-40, 40)) + list(range(990, 1010)) + [2**40 + 3, -(2**50)]
STRIDED = list(range(0, 400, 2))  # a stride of the world size: roundrobin would put all on rank 0


def _placement(rank, world):
    configs = models.ebc_configs(list(DIST_TABLES) + ["strided_table"], dim=4, num_embeddings=NUM_EMBEDDINGS)
    constraints = {}
    for table, dist_type in list(DIST_TABLES.items()) + [("strided_table", "hash_roundrobin")]:
        constraints.update(models.dynamic_constraints([table], dist_type=dist_type))
    pg = models.rank_groups()[0]
    model = models.build("ebc", configs, pg, constraints, models.SGD)
    # Each rank feeds its half of the keys, one bag per key (empty bags pad
    # the shorter features to one batch size).
    batch = {t.replace("table", "feature"): [[k] for k in KEYS[rank::world]] for t in DIST_TABLES}
    batch["strided_feature"] = [[k] for k in STRIDED[rank::world]]
    size = max(len(bags) for bags in batch.values())
    batch = {f: bags + [[]] * (size - len(bags)) for f, bags in batch.items()}
    models.loss_of(models.resolved(model(models.kjt(batch)))).backward()
    placed = {}
    for table, keys in list(zip(DIST_TABLES, [KEYS] * 3)) + [("strided_table", STRIDED)]:
        placed[table] = models.stored_rows(model, table, torch.tensor(keys), pg)[1].tolist()
    return placed


@no_opcheck("its ops run in the spawned ranks")
def test_keys_stored_on_their_owner_rank():
    placed, _ = run_ranks(_placement, 2)
    for table, dist_type in DIST_TABLES.items():
        assert placed[table] == [reference_owner(k, dist_type, 2, NUM_EMBEDDINGS) for k in KEYS], table
    strided = placed["strided_table"]
    assert strided == [reference_owner(k, "hash_roundrobin", 2, NUM_EMBEDDINGS) for k in STRIDED]
    share = strided.count(0) / len(strided)
    assert 0.35 <= share <= 0.65, f"hash_roundrobin put {share:.0%} of strided keys on rank 0"


def test_route_ops_compile_and_export_with_dynamic_shapes():
    """Both ops trace (their fake kernels): torch.compile(fullgraph) and
    torch.export, dynamic in the bag and value counts, equal eager."""
    rules = [ROUTE_BLOCK, route_rule("hash_roundrobin"), route_rule("continuous")]
    params = [10, 1, 50]

    class Route(torch.nn.Module):
        def forward(self, lengths, values, weights):
            routed = ops.route_keys(lengths, values, weights, rules, params, 3)
            return routed + (owners(values, "continuous", 3, 50),)

    def batch(B, seed):
        lengths, values, weights = _random_kjt(len(rules), B, seed, key_range=(-60, 120))
        return torch.tensor(lengths), torch.tensor(values), torch.tensor(weights)

    f = Route()
    batches = [batch(4, 0), batch(7, 1)]
    expected = [f(*b) for b in batches]
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    # lengths: F * B (B >= 2: export specializes 0 and 1); values: any count.
    bags, n = 3 * torch.export.Dim("b", min=2), torch.export.Dim("n", min=2)
    exported = torch.export.export(f, batches[0], dynamic_shapes=({0: bags}, {0: n}, {0: n})).module()
    for b, want in zip(batches, expected):
        for run in (compiled, exported):
            for got, w in zip(run(*b), want):
                assert torch.equal(got, w)


def test_route_ops_refuse_bad_input():
    """Both routing ops check their arguments (shared host checks, route_checks.h)
    before any key is routed: a bad rule parameter would otherwise divide by zero."""
    lengths, values = torch.tensor([1, 1]), torch.tensor([5, 6])
    cases = [
        (lambda: ops.route_keys(lengths, values.to(torch.int32), None, [ROUTE_BLOCK], [4], 2), "int64"),
        (lambda: ops.route_keys(lengths, values, None, [ROUTE_BLOCK], [0], 2), "feature 0: bad routing rule"),
        (lambda: ops.route_keys(lengths, values, None, [ROUTE_BLOCK, ROUTE_BLOCK], [4], 2), "one rule and param"),
        (lambda: ops.route_keys(lengths, values, None, [ROUTE_BLOCK], [4], 0), "world size"),
        (lambda: ops.route_keys(lengths, values, torch.ones(3), [ROUTE_BLOCK], [4], 2), "weights"),
        (lambda: ops.route_keys(torch.tensor([2, 1]), values, None, [ROUTE_BLOCK], [4], 2), "lengths sum to 3"),
        (lambda: ops.route_owners(values, ROUTE_BLOCK, 0, 2), "bad routing rule"),
        (lambda: ops.route_owners(values.view(2, 1), ROUTE_BLOCK, 4, 2), "1-D int64"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


generate_opcheck_tests(sys.modules[__name__])
