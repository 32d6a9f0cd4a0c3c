"""Fixtures of the table tests."""
import pytest
import torch


@pytest.fixture
def threads():
    """At least 2 intra-op threads, so that big batches take the kernels'
    parallel paths (the insert: buckets in parallel, keys of one bucket in
    input order) instead of the serial ones."""
    old = torch.get_num_threads()
    torch.set_num_threads(max(2, old))
    yield
    torch.set_num_threads(old)
