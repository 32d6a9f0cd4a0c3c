"""Eviction in a one-bucket table (capacity 16 = bucket_capacity): the victim
is the lowest-scored key (ties: lowest slot), and the reused slot starts with
the new key's initial value and fresh optimizer state."""
import math

import pytest
import torch

from dynamicemb import DynamicEmbScoreStrategy, EmbOptimType
from emb_helpers import DEBUG_INIT, bags, debug_rows, make_module, stored, stored_keys, stored_scores

LR, EPS, B1, B2 = 0.1, 1e-8, 0.9, 0.999
D = 4


def _module(optimizer, strategy, device):
    return make_module([D], optimizer=optimizer, max_capacity=16, bucket_capacity=16, score_strategy=strategy,
                       initializer_args=DEBUG_INIT,
                       module_kwargs=dict(learning_rate=LR, eps=EPS, beta1=B1, beta2=B2), device=device)


def _row_of(m, key):
    return int(m.storage.find(torch.tensor([key], device=m.device), torch.tensor([0], device=m.device))[0])


def _after_one_update(optimizer, init, step):
    """(value, state) of a fresh row after one update with an all-ones gradient."""
    if optimizer == EmbOptimType.EXACT_ADAGRAD:
        return init - LR / (1 + EPS), torch.ones(D)
    if optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        return init - LR / (1 + EPS), torch.ones(1)
    m1, m2 = 1 - B1, 1 - B2
    c1, c2 = 1 - B1 ** step, 1 - B2 ** step
    return init - LR * (m1 / c1) / (math.sqrt(m2 / c2) + EPS), torch.tensor([m1] * D + [m2] * D)


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                       EmbOptimType.ADAM], ids=lambda o: o.name)
def test_step_evicts_oldest_and_reused_slot_is_fresh(optimizer, device):
    m = _module(optimizer, DynamicEmbScoreStrategy.STEP, device)
    old, recent = list(range(8, 16)), list(range(8))
    for keys in (recent, old, recent):  # steps 1-3: `old` last seen at step 2
        m(*bags([keys], device)).sum().backward()
    assert m.table_stats()["t0"]["size"] == 16
    # Victims: the two lowest-scored (step 2) keys in the lowest slots.
    victims = sorted(old, key=lambda k: _row_of(m, k))[:2]
    victim_rows = sorted(_row_of(m, k) for k in victims)
    out = m(*bags([[100], [101]], device))
    assert stored_keys(m, 0) == (set(range(16)) - set(victims)) | {100, 101}
    assert sorted([_row_of(m, 100), _row_of(m, 101)]) == victim_rows
    assert m.table_stats()["t0"]["evicted"] == 2
    # Before the update: initial value and zero state (not the victim's).
    _, rows = stored(m, 0, [100, 101])
    torch.testing.assert_close(rows[:, :D], debug_rows([100, 101], D), atol=0, rtol=0)
    assert torch.count_nonzero(rows[:, D:]) == 0
    torch.testing.assert_close(out.detach().cpu(), debug_rows([100, 101], D), atol=0, rtol=0)
    out.sum().backward()
    _, rows = stored(m, 0, [100, 101])
    for i, key in enumerate([100, 101]):
        value, state = _after_one_update(optimizer, debug_rows([key], D)[0], m.optimizer_step)
        torch.testing.assert_close(rows[i, :D], value, atol=1e-6, rtol=0)
        torch.testing.assert_close(rows[i, D:], state, atol=1e-6, rtol=1e-6)
    assert stored_scores(m, 0)[100] == 4


def test_lfu_evicts_least_frequent(device):
    m = _module(EmbOptimType.EXACT_ROWWISE_ADAGRAD, DynamicEmbScoreStrategy.LFU, device)
    # Key k seen k % 4 + 1 times: 0, 4, 8, 12 are the least frequent.
    m(*bags([[k for k in range(16) for _ in range(k % 4 + 1)]], device)).sum().backward()
    rare = sorted([0, 4, 8, 12], key=lambda k: _row_of(m, k))
    m(*bags([[200, 200]], device)).sum().backward()  # count 2: still a new key, it evicts
    assert stored_keys(m, 0) == (set(range(16)) - {rare[0]}) | {200}
    assert stored_scores(m, 0)[200] == 2
    m(*bags([[201]], device)).sum().backward()  # count-1 keys left: rare[1:]
    assert stored_keys(m, 0) == (set(range(16)) - {rare[0], rare[1]}) | {200, 201}
    _, rows = stored(m, 0, [201])
    torch.testing.assert_close(rows[0, D:], torch.ones(1), atol=1e-6, rtol=0)  # one update from zero
    assert m.table_stats()["t0"]["evicted"] == 2


@pytest.mark.parametrize("strategy", [DynamicEmbScoreStrategy.STEP, DynamicEmbScoreStrategy.TIMESTAMP,
                                      DynamicEmbScoreStrategy.LFU], ids=lambda s: s.name)
def test_new_ids_never_evict_ids_of_the_same_batch(strategy, device):
    """A step's new id comes first in its batch and its bucket is full: it
    evicts the one stored key the batch does not name, not a stored key that
    follows it in the batch (which would come back as new, its trained row
    and state lost, and evict the next one in a cascade). Reference: the rows
    stored before the step."""
    m = _module(EmbOptimType.ADAM, strategy, device)
    m(*bags([list(range(16))], device)).sum().backward()  # the bucket full, every row trained
    batch = [100] + list(range(15))  # key 15 is the only stored key not named
    _, trained = stored(m, 0, batch[1:])
    out = m(*bags([[k] for k in batch], device))
    assert stored_keys(m, 0) == set(range(15)) | {100}
    assert m.table_stats()["t0"]["evicted"] == 1
    assert m.table_stats()["t0"]["inserted"] == 17  # 16, then 100
    torch.testing.assert_close(out.detach().cpu()[1:], trained[:, :D], atol=0, rtol=0)  # served their own rows
    torch.testing.assert_close(out.detach().cpu()[0], debug_rows([100], D)[0], atol=0, rtol=0)
    _, kept = stored(m, 0, batch[1:])
    torch.testing.assert_close(kept, trained, atol=0, rtol=0)  # state too, until the backward
