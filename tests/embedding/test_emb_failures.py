"""Keys that cannot be stored (API.md §3): counted, and per safe_check_mode
raised, warned or ignored; they read their initial value and get no update."""
import warnings

import pytest
import torch

from dynamicemb import DynamicEmbCheckMode, DynamicEmbPoolingMode, DynamicEmbScoreStrategy
from emb_helpers import DEBUG_INIT, bags, debug_rows, make_module, stored, stored_keys

D = 4
KEYS = list(range(100, 120))  # 20 distinct keys for one 16-slot bucket


def _tiny(mode, device, strategy=DynamicEmbScoreStrategy.TIMESTAMP):
    # max_capacity == init_capacity == bucket_capacity: one bucket, no growth.
    return make_module([D], pooling=DynamicEmbPoolingMode.NONE, max_capacity=16, init_capacity=16,
                       bucket_capacity=16, safe_check_mode=mode, score_strategy=strategy,
                       initializer_args=DEBUG_INIT,
                       module_kwargs=dict(learning_rate=1.0, table_names=["tiny"]), device=device)


def test_overfull_bucket_is_counted_and_warned(device):
    m = _tiny(DynamicEmbCheckMode.WARNING, device)
    with pytest.warns(RuntimeWarning, match=r"table 'tiny': 4 keys could not be stored"):
        out = m(*bags([KEYS], device))
    stats = m.table_stats()["tiny"]
    assert stats["failed"] == 4 and stats["size"] == 16
    # Keys are stored in input order: the last four failed.
    assert stored_keys(m, 0) == set(KEYS[:16])
    # Every output row (stored or failed) is the key's initial value.
    torch.testing.assert_close(out.detach().cpu(), debug_rows(KEYS, D), atol=0, rtol=0)
    out.sum().backward()  # lr 1, gradient ones: stored rows drop by 1
    _, rows = stored(m, 0, KEYS[:16])
    torch.testing.assert_close(rows[:, :D], debug_rows(KEYS[:16], D) - 1, atol=1e-5, rtol=0)
    # The failed keys kept no (updated) row: storing them now, by evicting
    # four older keys, gives their initial values.
    out = m(*bags([KEYS[16:]], device))
    torch.testing.assert_close(out.detach().cpu(), debug_rows(KEYS[16:], D), atol=0, rtol=0)
    assert m.table_stats()["tiny"]["evicted"] == 4

def test_error_mode_raises_naming_the_table(device):
    m = _tiny(DynamicEmbCheckMode.ERROR, device)
    with pytest.raises(RuntimeError, match=r"table 'tiny': 4 keys could not be stored"):
        m(*bags([KEYS], device))
    assert m.table_stats()["tiny"]["failed"] == 4


def test_ignore_mode_is_silent_but_counts(device):
    m = _tiny(DynamicEmbCheckMode.IGNORE, device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = m(*bags([KEYS], device))
    assert m.table_stats()["tiny"]["failed"] == 4
    torch.testing.assert_close(out.detach().cpu(), debug_rows(KEYS, D), atol=0, rtol=0)


def test_no_eviction_at_max_capacity_fails_new_keys(device):
    m = _tiny(DynamicEmbCheckMode.WARNING, device, DynamicEmbScoreStrategy.NO_EVICTION)
    m(*bags([KEYS[:16]], device)).sum().backward()
    with pytest.warns(RuntimeWarning, match="2 keys could not be stored"):
        out = m(*bags([KEYS[16:18] + KEYS[:2]], device))
    assert stored_keys(m, 0) == set(KEYS[:16])
    stats = m.table_stats()["tiny"]
    assert stats["failed"] == 2 and stats["evicted"] == 0
    expected = torch.cat([debug_rows(KEYS[16:18], D), debug_rows(KEYS[:2], D) - 1])
    torch.testing.assert_close(out.detach().cpu(), expected, atol=1e-5, rtol=0)
