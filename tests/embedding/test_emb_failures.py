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
    # On CUDA the warning may come after the step, by table_stats() at the latest.
    with pytest.warns(RuntimeWarning, match=r"table 'tiny': 4 keys could not be stored at step 1"):
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

def test_failure_counts_that_land_later_warn_naming_their_step(monkeypatch):
    """A CUDA step does not wait for its failure counts: they are counted and
    warned when their copy lands (here: not before table_stats), naming the
    step they happened in. Modelled on the CPU by holding every copy back."""
    from dynamicemb.batched_dynamicemb_tables import BatchedDynamicEmbeddingTables
    from dynamicemb.host_copy import HostCopy
    monkeypatch.setattr(BatchedDynamicEmbeddingTables, "_defers_counts", lambda self, failed: True)
    held = [True]
    monkeypatch.setattr(HostCopy, "landed", lambda self: not held[0])
    m = _tiny(DynamicEmbCheckMode.WARNING, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(*bags([KEYS], "cpu"))  # step 1: 4 keys fail
        m(*bags([KEYS[:16]], "cpu"))  # step 2: all stored
    assert m.failed.tolist() == [0]
    held[0] = False
    with pytest.warns(RuntimeWarning, match=r"table 'tiny': 4 keys could not be stored at step 1") as w:
        m(*bags([KEYS[:16]], "cpu"))  # step 3 drains the landed counts
    assert len(w) == 1 and w[0].filename == __file__  # at the module's caller
    assert m.failed.tolist() == [4]
    held[0] = True
    m(*bags([KEYS[16:] + [500, 501, 502, 503, 504]], "cpu"))  # step 4: evicts; its own failures none
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert m.table_stats()["tiny"]["failed"] == 4  # table_stats waits for every count
    assert m.failed.tolist() == [4] and m._counts_in_flight == []


def test_error_mode_raises_naming_the_table(device):
    m = _tiny(DynamicEmbCheckMode.ERROR, device)
    with pytest.raises(RuntimeError, match=r"table 'tiny': 4 keys could not be stored") as err:
        m(*bags([KEYS], device))
    # It says what the raising step left: its other keys stored (not that the failed ones read their initial value).
    assert "the step's other keys are stored" in str(err.value) and "initial value" not in str(err.value)
    s = m.table_stats()["tiny"]
    assert s["failed"] == 4 and s["size"] == len(KEYS) - 4


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
        stats = m.table_stats()["tiny"]  # on CUDA the warning may come after the step, by table_stats
    assert stored_keys(m, 0) == set(KEYS[:16])
    assert stats["failed"] == 2 and stats["evicted"] == 0
    expected = torch.cat([debug_rows(KEYS[16:18], D), debug_rows(KEYS[:2], D) - 1])
    torch.testing.assert_close(out.detach().cpu(), expected, atol=1e-5, rtol=0)


def test_every_failing_table_of_a_step_is_reported():
    """Tables of one module (a sharded collection's) may differ in check
    mode: in a step where a WARNING table and two ERROR tables fail, the
    error names all three, each with its count (a warning first would be
    the error itself under -W error)."""
    from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions
    modes = {"warned": DynamicEmbCheckMode.WARNING, "strict": DynamicEmbCheckMode.ERROR,
             "stricter": DynamicEmbCheckMode.ERROR}
    m = BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=D, max_capacity=16, init_capacity=16, bucket_capacity=16, safe_check_mode=mode,
                                initializer_args=DEBUG_INIT) for mode in modes.values()],
        table_names=list(modes), pooling_mode=DynamicEmbPoolingMode.NONE)
    per_table = [KEYS, KEYS[:18], KEYS[:19]]  # 4, 2 and 3 keys over the one 16-slot bucket
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match=r"table 'strict': 2 keys could not be stored at step 1.*; "
                                               r"table 'stricter': 3 keys could not be stored at step 1.*; "
                                               r"table 'warned': 4 keys could not be stored at step 1"):
            m(*bags(per_table, "cpu"))
    assert {n: s["failed"] for n, s in m.table_stats().items()} == {"warned": 4, "strict": 2, "stricter": 3}


def test_each_steps_warning_is_shown_and_not_kept():
    """Every step with failed keys warns (its text has the step and count);
    none of those texts stays in the caller's __warningregistry__, where
    warnings.warn keeps each distinct one: a long run failing keys every
    step grew it by an entry a step."""
    m = _tiny(DynamicEmbCheckMode.WARNING, "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(5):
            m(*bags([KEYS], "cpu"))
    assert [str(w.message).split(" (bucket")[0] for w in caught if "could not be stored" in str(w.message)] == \
        [f"dynamicemb: table 'tiny': 4 keys could not be stored at step {s}" for s in range(1, 6)]
    assert all(w.filename == __file__ for w in caught)
    assert not [k for k in globals().get("__warningregistry__", {}) if "could not be stored" in str(k)]


def test_a_step_warning_from_a_shallow_stack_is_attributed_not_raised():
    """The module's forward called directly from a script's top level: the
    warning's stack level reaches past the top of the stack, where
    warnings.warn says sys:1 (warn_step raised 'call stack is not deep
    enough' after the step had stored its keys)."""
    import os
    import subprocess
    import sys
    code = "\n".join([
        "import sys, warnings",
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})",
        "from test_emb_failures import _tiny, KEYS",
        "from emb_helpers import bags",
        "from dynamicemb import DynamicEmbCheckMode",
        "m = _tiny(DynamicEmbCheckMode.WARNING, 'cpu')",
        "with warnings.catch_warnings(record=True) as w:",
        "    warnings.simplefilter('always')",
        "    m.forward(*bags([KEYS], 'cpu'))",
        "print([(x.filename, str(x.message)[:62]) for x in w])"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "('sys', \"dynamicemb: table 'tiny': 4 keys could not be stored at step 1\")" in out.stdout, out.stdout
