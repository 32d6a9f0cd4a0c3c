"""A user's admission counters for the tests: the counts in a Python dict
(loops are fine in a test), without and with the checkpoint methods."""
import torch

from dynamicemb import Counter


class DictCounter(Counter):
    """Trains; has no export / load, so it cannot be checkpointed."""

    def __init__(self):
        self.counts = {}

    def add(self, keys, counts):
        out = []
        for k, c in zip(keys.tolist(), counts.tolist()):
            self.counts[k] = self.counts.get(k, 0) + c
            out.append(self.counts[k])
        return torch.tensor(out, dtype=torch.int64, device=keys.device)

    def erase(self, keys):
        for k in keys.tolist():
            self.counts.pop(k, None)


class SavedDictCounter(DictCounter):
    """The same, with the two checkpoint methods."""

    def export(self, batch_size=1 << 16):
        items = sorted(self.counts.items())
        for i in range(0, len(items), batch_size):
            part = items[i:i + batch_size]
            yield torch.tensor([k for k, _ in part]), torch.tensor([c for _, c in part])

    def load(self, keys, counts):
        self.counts = dict(zip(keys.tolist(), counts.tolist()))
