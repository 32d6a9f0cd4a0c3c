"""The `row_parts` fixture: every test of this directory runs twice, with
every table's rows whole and with them split in two parts (a hybrid table,
dynamicemb/table_rows.py: the first third of max_capacity in the head, the
rest in the tail, as global_hbm_for_values would put them), so that its
assertions also hold through the kernels' addressing rule
(csrc/embedding/row_parts.h). Tables that set global_hbm_for_values, and
cached ones, keep their own rule. A module that tests the kernels' list of
row tensors itself, or makes its own splits, sets ROWS_WHOLE = True."""
import pytest

from dynamicemb import DynamicEmbTableOptions

_hbm_rows = DynamicEmbTableOptions.hbm_rows


def _first_third(self, row_bytes):
    if self.caching or self.global_hbm_for_values:
        return _hbm_rows(self, row_bytes)
    return self.max_capacity // 3


@pytest.fixture(autouse=True)
def row_parts(request, monkeypatch):
    mode = getattr(request, "param", "whole")
    if mode == "split":
        monkeypatch.setattr(DynamicEmbTableOptions, "hbm_rows", _first_third)
    return mode


def pytest_generate_tests(metafunc):
    if "row_parts" in metafunc.fixturenames and not getattr(metafunc.module, "ROWS_WHOLE", False):
        metafunc.parametrize("row_parts", ["whole", "split"], indirect=True)
