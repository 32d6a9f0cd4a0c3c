"""The parity tests need only torch and dynamicemb: the package and both
parity modules import with torchrec and fbgemm_gpu blocked (runs everywhere)."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = r"""
import sys
for blocked in ("torchrec", "fbgemm_gpu"):
    sys.modules[blocked] = None  # any import of them raises ImportError
sys.path.insert(0, sys.argv[1])
import dynamicemb
import test_cuda_parity_embedding
import test_cuda_parity_table
from dynamicemb import ScoredHashTable, BatchedDynamicEmbeddingTables, EmbOptimType
print("ok")
"""


def test_parity_tests_import_without_torchrec_and_fbgemm():
    r = subprocess.run([sys.executable, "-c", SCRIPT, HERE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
