"""The table clock on the device under test: TIMESTAMP scores of a CUDA table
are GPU global-timer readings taken in stream order, so they lie between the
table clock read before and after the call, and the clock never goes back.
A dump stores them as ages against the same clock. Skipped without a GPU
(DYNAMICEMB_PARITY_DEVICE=cpu runs it on the CPU's monotonic clock)."""
import torch

from cuda_parity import DEV, PARITY_MARKS
from dynamicemb import DynamicEmbScoreStrategy as S
from dynamicemb import ScoredHashTable

pytestmark = PARITY_MARKS


def test_timestamp_scores_come_from_the_device_clock():
    t = ScoredHashTable(256, 16, (S.TIMESTAMP, S.LFU), device=DEV)
    readings = [t.now() for _ in range(5)]
    assert readings == sorted(readings)
    before = t.now()
    t.insert(torch.arange(50, device=DEV))
    t.lookup(torch.arange(25, device=DEV), update_score=True)
    after = t.now()
    (batch,) = list(t.export())
    stamps = t.slot_timestamps[batch.indices].cpu()
    assert bool(((stamps >= before) & (stamps <= after)).all())
    assert torch.equal(batch.scores.cpu().sort().values, torch.tensor([1] * 25 + [2] * 25))  # LFU counts


def test_the_clock_follows_the_device_timer_without_reading_it():
    """On CUDA now() reads the timer once and then advances by the host's
    monotonic clock (no wait for the device): it stays with the timer."""
    from dynamicemb._ops import ops
    t = ScoredHashTable(256, 16, S.TIMESTAMP, device=DEV)
    t.now()
    for _ in range(3):
        if DEV == "cuda":
            torch.cuda._sleep(10_000_000)  # the device busy: its timer runs on
        ours, timer = t.now(), int(ops.table_clock(t.slot_scores).item())
        assert abs(ours - timer) < 50_000_000  # within 50 ms
