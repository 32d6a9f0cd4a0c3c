"""Every op of the dynamicemb library has a fake kernel (dynamicemb/_ops.py) and
is opchecked by a generated twin of some op test (tests/op_checks.py).

test_every_op_is_opchecked runs last (conftest.py): in a whole run the twins
have opchecked every op by then; in a partial run it runs the twins of the op
test modules in a child pytest and reads which ops they checked."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._library.simple_registry import singleton

import dynamicemb._ops  # noqa: F401  (registers the ops and their fake kernels)
import op_checks

TESTS = Path(__file__).resolve().parent


def _all_library_ops():
    prefix = op_checks.NAMESPACE + "::"
    return sorted(n[len(prefix):] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix))


def _traceable(name: str) -> bool:
    """An op with a str result (rules(): the build's constants, read at
    import) cannot be traced at all: it needs no fake kernel, and opcheck
    cannot compare its result."""
    return [str(r.type) for r in getattr(torch.ops.dynamicemb, name).default._schema.returns] != ["str"]


def _library_ops():
    return [n for n in _all_library_ops() if _traceable(n)]


def test_the_library_holds_the_ops_of_ops_cpp():
    source = (TESTS.parent / "csrc" / "ops.cpp").read_text()
    assert sorted(re.findall(r'm\.def\(\s*"(\w+)\(', source)) == _all_library_ops()
    assert [n for n in _all_library_ops() if not _traceable(n)] == ["rules"]


def test_every_op_has_a_fake_kernel():
    missing = [n for n in _library_ops() if singleton.find(f"{op_checks.NAMESPACE}::{n}").fake_impl.kernel is None]
    assert not missing, f"ops without a fake kernel (register one in dynamicemb/_ops.py): {missing}"


def _op_test_modules():
    """The test modules that generate opcheck twins."""
    return sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                  if p.name != Path(__file__).name and "generate_opcheck_tests(" in p.read_text())


@pytest.mark.last
def test_every_op_is_opchecked(tmp_path):
    missing = set(_library_ops()) - set(op_checks.CHECKED)
    if missing:  # the twins did not all run in this session: run them
        log = tmp_path / "opchecked"
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", op_checks.PREFIX,
                            *_op_test_modules()], cwd=TESTS, capture_output=True, text=True, timeout=900,
                           env=dict(os.environ, **{op_checks.LOG_ENV: str(log)}))
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        missing -= set(log.read_text().split()) if log.exists() else set()
    assert not missing, (f"ops that no generated opcheck covers: {sorted(missing)}; call each in a test of a "
                         f"module that applies op_checks.generate_opcheck_tests")
