"""InferenceEmbeddingTable against a dict model of the tables (reference.py):
pooling SUM, MEAN (both divisors), weighted SUM and NONE, several tables of
mixed dims, missing keys, empty bags and batches, every value precision
(exact for float32, within the rounding of the stored rows otherwise); the
KeyedJaggedTensor interface; clear errors on bad input."""
import pytest
import torch
import torchrec

from dynamicemb.inference import FrozenTable, InferenceEmbeddingTable, dequantize_rows_int8, quantize_rows_int8
from dict_tables import DictTables

DIMS = {"t0": 8, "t1": 12, "t2": 3}


def _tables(seed=0, n=300):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, dim) in enumerate(DIMS.items()):
        # Keys anywhere in int64, negative and extreme ones included.
        keys = torch.randint(-2**62, 2**62, (n,), generator=g).unique()
        keys[:2] = torch.tensor([-1, torch.iinfo(torch.int64).min])
        out[name] = (keys, torch.randn(keys.numel(), dim, generator=g))
    return out


def _frozen(raw, features=None):
    return [FrozenTable(n, k, v, (features or {}).get(n, [f"{n}_f"])) for n, (k, v) in raw.items()]


def _batch(raw, feature_tables, B, seed, max_len=4):
    """TBE-layout ids: stored keys and missing ones, some bags empty."""
    g = torch.Generator().manual_seed(seed)
    values, offsets = [], [0]
    for t in feature_tables:
        keys = raw[t][0]
        for _ in range(B):
            L = int(torch.randint(0, max_len + 1, (1,), generator=g))
            for _ in range(L):
                if bool(torch.rand(1, generator=g) < 0.8):
                    values.append(int(keys[torch.randint(0, keys.numel(), (1,), generator=g)]))
                else:
                    values.append(int(torch.randint(0, 2**40, (1,), generator=g)))
            offsets.append(len(values))
    return torch.tensor(values, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)


def _stored(raw, dtype):
    """The rows as the module stores them (rounded to its precision)."""
    if dtype == "int8":
        return {n: (k, dequantize_rows_int8(quantize_rows_int8(v))) for n, (k, v) in raw.items()}
    return {n: (k, v.to(getattr(torch, dtype)).to(torch.float32)) for n, (k, v) in raw.items()}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_matches_dict_model(dtype, pooling, weighted):
    raw = _tables()
    m = InferenceEmbeddingTable(_frozen(raw), pooling=pooling, dtype=dtype, is_weighted=weighted,
                                mean_divisor="length")
    ref = DictTables(_stored(raw, dtype))
    feats = list(DIMS)
    for B, seed in ((5, 1), (1, 2), (0, 3)):
        values, offsets = _batch(raw, feats, B, seed)
        w = (1 + (values % 7).to(torch.float32) / 4) if weighted else None
        got = m(values, offsets, w)
        want = ref.pooled(feats, values, offsets, pooling, w)
        assert got.shape == want.shape
        if dtype == "float32" and not weighted and pooling == "SUM":
            # The stored rows exactly; float32 sums in input order.
            exact = DictTables(raw).pooled(feats, values, offsets).to(torch.float32)
            torch.testing.assert_close(got, exact, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(got.to(torch.float64), want, rtol=1e-5, atol=1e-5)


def test_int8_rows_within_the_quantisation_bound():
    """Each element of an int8 row is within half a step of its row's range."""
    raw = _tables()
    for keys, values in raw.values():
        back = dequantize_rows_int8(quantize_rows_int8(values))
        step = (values.max(1).values - values.min(1).values) / 255
        assert bool(((back - values).abs() <= step.unsqueeze(1) / 2 + 1e-6).all())


def test_mixed_mean_and_torchrec_divisor():
    raw = _tables()
    feats = list(DIMS)
    values, offsets = _batch(raw, feats, 6, 7)
    w = 0.5 + (values % 3).to(torch.float32)
    ref = DictTables(raw)
    m = InferenceEmbeddingTable(_frozen(raw), pooling=["SUM", "MEAN", "SUM"], is_weighted=True)
    got = m(values, offsets, w).to(torch.float64)
    B = 6
    for f, (t, pooling) in enumerate(zip(feats, ["SUM", "MEAN", "SUM"])):
        sub = torch.cat([torch.zeros(1, dtype=torch.int64),
                         offsets[f * B + 1:(f + 1) * B + 1] - offsets[f * B]])
        lo, hi = int(offsets[f * B]), int(offsets[(f + 1) * B])
        want = ref.pooled([t], values[lo:hi], sub, pooling, w[lo:hi], mean_divisor="torchrec_rw")
        c0 = sum(DIMS[x] for x in feats[:f])
        torch.testing.assert_close(got[:, c0:c0 + DIMS[t]], want, rtol=1e-5, atol=1e-5)


def test_sequence_and_kjt_interfaces():
    raw = {n: (k, v[:, :3]) for n, (k, v) in _tables().items()}
    m = InferenceEmbeddingTable(_frozen(raw, {"t0": ["a", "b"], "t1": ["c"], "t2": ["d"]}), pooling="NONE")
    ref = DictTables(raw)
    feats = {"a": "t0", "b": "t0", "c": "t1", "d": "t2"}
    values, offsets = _batch(raw, list(feats.values()), 3, 11)
    lengths = offsets.diff()
    # The KJT's features in another order, with one the module does not know.
    order = ["d", "x", "b", "a", "c"]
    per_feature = {f: (values[offsets[i * 3]:offsets[(i + 1) * 3]], lengths[i * 3:(i + 1) * 3])
                   for i, f in enumerate(feats)}
    per_feature["x"] = (torch.tensor([1, 2, 3]), torch.tensor([1, 0, 2]))
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        order, torch.cat([per_feature[f][0] for f in order]), torch.cat([per_feature[f][1] for f in order]))
    out = m(kjt)
    assert sorted(out) == sorted(feats)
    for f, t in feats.items():
        ids, lens = per_feature[f]
        assert torch.equal(out[f].lengths(), lens)
        want = ref.sequence([t] * ids.numel(), ids) if ids.numel() else torch.zeros(0, 3, dtype=torch.float64)
        torch.testing.assert_close(out[f].values().to(torch.float64), want, rtol=0, atol=0)
    # TBE layout: one row per id, features in the module's order.
    flat = m(values, offsets)
    torch.testing.assert_close(flat.to(torch.float64), ref.sequence(
        [t for i, t in enumerate(feats.values()) for _ in range(int(offsets[(i + 1) * 3] - offsets[i * 3]))], values))


def test_kjt_pooled_output_is_a_keyed_tensor():
    raw = _tables()
    m = InferenceEmbeddingTable(_frozen(raw))
    values, offsets = _batch(raw, list(DIMS), 4, 5)
    kjt = torchrec.KeyedJaggedTensor.from_offsets_sync([f"{t}_f" for t in DIMS], values, offsets)
    kt = m(kjt)
    assert kt.keys() == [f"{t}_f" for t in DIMS] and kt.length_per_key() == list(DIMS.values())
    assert torch.equal(kt.values(), m(values, offsets))


def test_bad_inputs_name_the_problem():
    raw = _tables()
    m = InferenceEmbeddingTable(_frozen(raw))
    values, offsets = _batch(raw, list(DIMS), 2, 1)
    with pytest.raises(TypeError, match="int64 or int32"):
        m(values.to(torch.float32), offsets)
    with pytest.raises(KeyError, match="no feature \\['t2_f'\\]"):
        m(torchrec.KeyedJaggedTensor.from_lengths_sync(["t0_f", "t1_f"], torch.tensor([1, 2]),
                                                       torch.tensor([1, 0, 1, 0])))
    with pytest.raises(ValueError, match="feature 't1_f' has a negative length"):
        m(torchrec.KeyedJaggedTensor(keys=["t0_f", "t1_f", "t2_f"], values=torch.tensor([1, 2]),
                                     lengths=torch.tensor([1, 2, -1, 0, 0, 0])))
    bad = offsets.clone()
    bad[-1] += 1
    with pytest.raises(RuntimeError, match="offsets end at"):
        m(values, bad)
    with pytest.raises(ValueError, match="key .* is given twice"):
        InferenceEmbeddingTable([FrozenTable("dup", torch.tensor([3, 3]), torch.zeros(2, 4), ["f"])])
    with pytest.raises(ValueError, match="unknown value precision"):
        InferenceEmbeddingTable(_frozen(raw), dtype="int4")


def test_packing_keeps_every_key_and_reads_near_its_load_factor():
    g = torch.Generator().manual_seed(3)
    keys = torch.randint(-2**63, 2**63 - 1, (50_000,), generator=g).unique()
    values = torch.arange(keys.numel(), dtype=torch.float32).unsqueeze(1).repeat(1, 2)
    m = InferenceEmbeddingTable([FrozenTable("big", keys, values, ["f"])])
    assert m.num_keys() == {"big": keys.numel()}
    assert keys.numel() / m.slot_keys.numel() > 0.5
    got = m(keys, torch.arange(keys.numel() + 1))
    assert torch.equal(got, values)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_integer_ids_and_non_finite_weights_refused(bad):
    raw = _tables()
    m = InferenceEmbeddingTable(_frozen(raw), is_weighted=True)
    values = torch.tensor([int(raw["t0"][0][0]), 7, int(raw["t2"][0][1])])
    lengths = torch.tensor([1, 0, 0, 1, 1, 0])  # B = 2; t1_f bag 1 holds index 1
    kjt = torchrec.KeyedJaggedTensor(keys=["t2_f", "t1_f", "t0_f"], values=values.to(torch.float64),
                                     lengths=torch.tensor([1, 0, 0, 1, 1, 0]))
    with pytest.raises(TypeError, match=r"ids of features \['t2_f', 't1_f', 't0_f'\] must be int64 or int32, "
                                        r"got torch.float64"):
        m(kjt)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    with pytest.raises(TypeError, match=r"got torch.float32 and torch.int64 \(features \['t0_f', 't1_f', 't2_f'\]\)"):
        m(values.to(torch.float32), offsets)
    w = torch.tensor([1.0, bad, 0.5])
    with pytest.raises(ValueError, match=rf"per-sample weight 1 \(feature 't1_f', bag 1\) is {bad}"):
        m(values, offsets, w)
    # Through a KJT in another feature order: the weights follow their ids.
    kjt = torchrec.KeyedJaggedTensor(keys=["t1_f", "t0_f", "t2_f"], values=values[[1, 0, 2]],
                                     lengths=torch.tensor([0, 1, 1, 0, 1, 0]), weights=w[[1, 0, 2]])
    with pytest.raises(ValueError, match=rf"per-sample weight 1 \(feature 't1_f', bag 1\) is {bad}"):
        m(kjt)
