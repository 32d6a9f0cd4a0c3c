"""float16 / bfloat16 storage: forward, training and the output dtype, against
a float32 module fed the same batches (within the storage dtype's precision)."""
import pytest
import torch

from dynamicemb import DynamicEmbPoolingMode, EmbOptimType
from emb_helpers import make_module, random_batch, stored, stored_keys

FEATURE_TABLE = [0, 1]
NUM_KEYS = [40, 40]
# Absolute tolerance on pooled outputs of a few rows of magnitude ~0.15.
TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("output_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_storage_tracks_float32(dtype, output_dtype):
    kw = dict(pooling=DynamicEmbPoolingMode.MEAN, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
              feature_table_map=FEATURE_TABLE, num_embeddings=40)
    ref = make_module([8, 16], **kw, module_kwargs=dict(learning_rate=0.05))
    low = make_module([8, 16], embedding_dtype=dtype, **kw,
                      module_kwargs=dict(learning_rate=0.05, output_dtype=output_dtype))
    assert low.storage.weights()[0].dtype == dtype
    gen = torch.Generator().manual_seed(9)
    for _ in range(6):
        indices, offsets = random_batch(gen, FEATURE_TABLE, NUM_KEYS, batch=8, max_len=4)
        out_ref, out = ref(indices, offsets), low(indices, offsets)
        assert out.dtype == output_dtype
        torch.testing.assert_close(out.float(), out_ref, atol=TOL[dtype], rtol=0)
        probe = torch.randn(out.shape, generator=gen)
        (out_ref * probe).sum().backward()
        (out.float() * probe).sum().backward()
    for t, d in enumerate([8, 16]):
        keys = sorted(stored_keys(ref, t))
        _, rows_ref = stored(ref, t, keys)
        found, rows = stored(low, t, keys)
        assert bool(found.all())
        torch.testing.assert_close(rows[:, :d], rows_ref[:, :d], atol=TOL[dtype], rtol=0)
        torch.testing.assert_close(rows[:, d:], rows_ref[:, d:], atol=0, rtol=2e-2)  # rowwise state
    # Training moved the rows well beyond the tolerance: the match is not vacuous.
    keys = torch.tensor(sorted(stored_keys(ref, 0)))
    n = keys.numel()
    offsets = torch.cat([torch.arange(n + 1), torch.full((n,), n)])  # one bag per key; feature 1 empty
    initial = make_module([8, 16], **kw)(keys, offsets).detach()[:, :8]
    assert (stored(ref, 0, keys)[1][:, :8] - initial).abs().max() > 5 * TOL[dtype]

def test_mixed_storage_dtypes_refused():
    with pytest.raises(ValueError, match="share a storage dtype"):
        from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions
        BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=64, embedding_dtype=torch.float16),
                                       DynamicEmbTableOptions(dim=4, max_capacity=64)])
