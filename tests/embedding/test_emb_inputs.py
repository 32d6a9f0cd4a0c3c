"""Edge-case batches (empty, empty bags, one bag) and bad inputs with clear errors."""
import pytest
import torch

from dynamicemb import DynamicEmbPoolingMode, EmbOptimType
from emb_helpers import DEBUG_INIT, bags, debug_rows, make_module, stored_keys

SUM, MEAN, NONE = DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.MEAN, DynamicEmbPoolingMode.NONE


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.ADAM], ids=lambda o: o.name)
@pytest.mark.parametrize("pooling", [SUM, MEAN, NONE], ids=lambda p: p.name)
def test_empty_batch(pooling, optimizer):
    m = make_module([4, 4], pooling=pooling, optimizer=optimizer)
    indices, offsets = torch.zeros(0, dtype=torch.int64), torch.zeros(2 * 3 + 1, dtype=torch.int64)
    out = m(indices, offsets)
    assert out.shape == ((0, 4) if pooling == NONE else (3, 8))
    assert torch.count_nonzero(out) == 0
    out.sum().backward()
    assert all(s["size"] == 0 for s in m.table_stats().values())


@pytest.mark.parametrize("pooling", [SUM, MEAN], ids=lambda p: p.name)
def test_empty_bags_pool_to_zero_and_get_no_update(pooling):
    m = make_module([3, 2], pooling=pooling, initializer_args=DEBUG_INIT, module_kwargs=dict(learning_rate=1.0))
    # Feature 0: bags [], [4, 6]; feature 1: bags [7], [].
    out = m(*bags([[], [4, 6], [7], []]))
    r = debug_rows([4, 6, 7], 3)
    pair = r[0] + r[1] if pooling == SUM else (r[0] + r[1]) / 2
    expected = torch.stack([torch.cat([torch.zeros(3), r[2, :2]]), torch.cat([pair, torch.zeros(2)])])
    torch.testing.assert_close(out.detach(), expected, atol=1e-6, rtol=0)
    out.sum().backward()
    m.eval()
    step = 1.0 if pooling == SUM else 0.5
    torch.testing.assert_close(m(*bags([[4], []]))[0, :3], debug_rows([4], 3)[0] - step, atol=1e-5, rtol=0)


def test_single_bag():
    m = make_module([5], pooling=MEAN, initializer_args=DEBUG_INIT)
    out = m(torch.tensor([1, 2, 2]), torch.tensor([0, 3]))
    torch.testing.assert_close(out.detach(), (debug_rows([1, 2, 2], 5).sum(0) / 3)[None], atol=1e-6, rtol=0)


def test_int32_inputs_equal_int64():
    m = make_module([4], initializer_args=DEBUG_INIT)
    idx, off = bags([[1, 2], [3, -4]])
    torch.testing.assert_close(m(idx.int(), off.int()), m(idx, off), atol=0, rtol=0)


@pytest.mark.parametrize("indices,offsets,psw,error,match", [
    ([1, 2, 3], [0, 2, 1, 3], None, RuntimeError, "offsets must be non-decreasing"),
    ([1, 2, 3], [0, 1, 2, 5], None, RuntimeError, "offsets end at 5 but there are 3 indices"),
    ([1, 2, 3], [1, 1, 2, 3], None, RuntimeError, "offsets must start at 0"),
    ([1, 2, 3], [0, 1, 3], None, RuntimeError, r"expected num_features \(3\) \* batch_size \+ 1"),
    ([1.0, 2.0, 3.0], [0, 1, 2, 3], None, TypeError, "indices must be an int64 or int32 tensor"),
    ([1, 2, 3], [0.0, 1.0, 2.0, 3.0], None, TypeError, "offsets must be an int64 or int32 tensor"),
    ([1, 2, 3], [0, 1, 2, 3], [1.0, 2.0], ValueError, r"per_sample_weights must be 1-D with one weight per index \(3\)"),
])
def test_bad_inputs_raise_clear_errors(indices, offsets, psw, error, match):
    m = make_module([4, 4, 4])
    before = m.table_stats()
    with pytest.raises(error, match=match):
        m(torch.tensor(indices), torch.tensor(offsets), None if psw is None else torch.tensor(psw))
    assert m.table_stats() == before  # nothing stored by a refused batch
    assert m.step == 0


def test_per_sample_weights_refused_with_none_pooling():
    """Refused before the step: nothing stored, no step counted (the kernel
    refused it after the insert)."""
    m = make_module([4], pooling=NONE)
    before = m.table_stats()
    with pytest.raises(ValueError, match=r"per_sample_weights are not supported with pooling NONE .*tables \['"):
        m(torch.tensor([1, 2]), torch.tensor([0, 2]), torch.ones(2))
    assert m.table_stats() == before and m.step == 0


def test_bad_feature_table_map_and_options():
    with pytest.raises(ValueError, match=r"feature 1 maps to table 3, outside \[0, 2\)"):
        make_module([4, 4], feature_table_map=[0, 3])
    with pytest.raises(ValueError, match="bucket_capacity must be a positive multiple of 16"):
        make_module([4], bucket_capacity=24)
    with pytest.raises(ValueError, match="is not supported by dynamicemb"):
        make_module([4], optimizer=EmbOptimType.LARS_SGD)  # (LAMB until issue 36 implemented it)


def test_training_false_table_refuses_backward():
    m = make_module([4], training=False)
    out = m(*bags([[1]]))
    assert stored_keys(m, 0) == {1}
    with pytest.raises(RuntimeError, match="training=False has no optimizer state"):
        out.sum().backward()
