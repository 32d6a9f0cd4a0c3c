"""Two training forwards before their backwards (a module used twice in one
loss, or gradient accumulation): each backward updates its keys' current
rows, even when the second forward evicted or moved rows in between."""
import torch

from dynamicemb import DynamicEmbScoreStrategy
from emb_helpers import DEBUG_INIT, bags, debug_rows, make_module, stored, stored_keys

D, LR = 4, 0.5


def test_backward_after_eviction_updates_no_other_key(device):
    # One bucket of 16 slots at max capacity: the second forward's 16 new keys
    # evict key 5; its gradient must not land on the key now in its slot.
    m = make_module([D], max_capacity=16, initializer_args=DEBUG_INIT,
                    score_strategy=DynamicEmbScoreStrategy.STEP, module_kwargs=dict(learning_rate=LR), device=device)
    out_a = m(*bags([[5]], device))
    keys_b = list(range(100, 116))
    out_b = m(*bags([keys_b], device))
    assert stored_keys(m, 0) == set(keys_b)
    out_a.sum().backward()  # key 5 is gone: no update anywhere
    _, rows = stored(m, 0, keys_b)
    torch.testing.assert_close(rows[:, :D], debug_rows(keys_b, D), atol=0, rtol=0)
    out_b.sum().backward()
    torch.testing.assert_close(rows[:, :D] - LR, stored(m, 0, keys_b)[1][:, :D], atol=1e-6, rtol=0)


def test_backward_after_growth_equals_sequential_training(device):
    # The second forward doubles the table (rows move); with SGD and a loss
    # linear in the output, the updates commute, so the interleaved order
    # must end with the rows of forward-backward, forward-backward.
    def run(interleaved):
        m = make_module([D], max_capacity=1024, init_capacity=16, initializer_args=DEBUG_INIT,
                        module_kwargs=dict(learning_rate=LR), device=device)
        a, b = bags([[1, 2, 3], [2]], device), bags([list(range(2, 40)), [3, 3]], device)
        ga = torch.randn(2, D, generator=torch.Generator().manual_seed(0)).to(device)
        gb = torch.ones(2, D, device=device)
        if interleaved:
            out_a = m(*a)
            cap = m.storage.capacity(0)
            out_b = m(*b)
            assert m.storage.capacity(0) > cap  # the rows moved
            (out_a * ga).sum().backward()
            (out_b * gb).sum().backward()
        else:
            (m(*a) * ga).sum().backward()
            (m(*b) * gb).sum().backward()
        return stored(m, 0, list(range(1, 40)))

    found_i, rows_i = run(True)
    found_s, rows_s = run(False)
    assert bool(found_i.all()) and bool(found_s.all())
    torch.testing.assert_close(rows_i, rows_s, atol=1e-6, rtol=0)
