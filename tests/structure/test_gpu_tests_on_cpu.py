"""The CUDA parity tests (tests/cuda) skip without a GPU, so they could rot
unseen until a GPU session: run them here CPU against CPU
(DYNAMICEMB_PARITY_DEVICE=cpu, cuda_parity.py), which checks the tests
themselves (their inputs, the ops' signatures, their references)."""
import os
import re
import subprocess
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cuda_parity_tests_pass_cpu_against_cpu():
    env = {**os.environ, "DYNAMICEMB_PARITY_DEVICE": "cpu"}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(TESTS, "cuda")],
                         capture_output=True, text=True, env=env, timeout=600, cwd=os.path.dirname(TESTS))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    passed = re.search(r"(\d+) passed", res.stdout)
    assert passed and int(passed.group(1)) > 100, res.stdout[-2000:]
