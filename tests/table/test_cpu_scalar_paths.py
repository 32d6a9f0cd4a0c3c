"""The CPU kernels' scalar rules where they also have vector paths (the
victims of a full bucket, the initial rows' Philox blocks): a CPU without
AVX2, or not x86, runs only those. DYNAMICEMB_CPU_VECTORS=0 makes this one
run them, and the tests that check these parts against the reference models
run again in a process started so."""
import os
import subprocess
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dynamicemb._ops import ops
from op_checks import generate_opcheck_tests, no_opcheck

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)


def _run(code_or_args, env_value):
    env = dict(os.environ, DYNAMICEMB_CPU_VECTORS=env_value)
    return subprocess.run([sys.executable, *code_or_args], env=env, capture_output=True, text=True,
                          timeout=900, cwd=TESTS)


@no_opcheck("starts a process; test_tracing_sees_the_flag opchecks the op")
def test_the_switch_turns_the_vector_paths_off():
    probe = ["-c", "import torch, dynamicemb; print(torch.ops.dynamicemb.cpu_vector_paths())"]
    assert _run(probe, "0").stdout.split() == ["False"]
    has_avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    assert ops.cpu_vector_paths() == has_avx2 or "DYNAMICEMB_CPU_VECTORS" in os.environ


def test_tracing_sees_the_flag():
    """Its fake kernel (what torch.compile and torch.export run) gives the
    real kernel's answer."""
    with FakeTensorMode():
        traced = ops.cpu_vector_paths()
    assert traced == ops.cpu_vector_paths()


@no_opcheck("its tests run in another process")
def test_scalar_paths_match_the_reference_models():
    r = _run(["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "not cuda",
              "table/test_table_rules.py",
              "table/test_table_model.py::test_many_keys_per_full_bucket_match_model",
              "embedding/test_emb_init.py"], "0")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


generate_opcheck_tests(sys.modules[__name__])
