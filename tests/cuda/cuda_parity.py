"""Shared by the CUDA parity tests: the device under test and bit-exact comparison.

The CPU kernels define the semantics; each parity test runs the same calls on
the CPU and on DYNAMICEMB_PARITY_DEVICE (default "cuda") and compares the
results bit for bit. Without a CUDA device the tests skip; with
DYNAMICEMB_PARITY_DEVICE=cpu they run CPU against CPU, which checks the tests
themselves on a machine without a GPU.

Only torch and dynamicemb are needed (no torchrec, no fbgemm_gpu).
"""
import os

import pytest
import torch

DEV = os.environ.get("DYNAMICEMB_PARITY_DEVICE", "cuda")

# The module-level `pytestmark` of every parity test file.
PARITY_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def bits(t):
    """A view that compares bit for bit (-0.0 != +0.0)."""
    t = t.contiguous()
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16)
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64}.get(t.dtype, t.dtype))


def same(a, b):
    """a and b (on any devices) hold the same dtype, shape and bits."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(bits(a.cpu()), bits(b.cpu()))
