"""The `device` fixture: a test that takes it runs on the CPU and, where a
CUDA device exists, again on CUDA (marked gpu; skipped without one). The CPU
kernels define the semantics, so the same assertions hold on both."""
import pytest
import torch

DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
]


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> str:
    return request.param


def pytest_collection_modifyitems(items):
    # Tests marked `last` read what the others recorded; the sort is stable.
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)
