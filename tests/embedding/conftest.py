"""The `row_parts` fixture: a test module that asks for it
(`pytestmark = pytest.mark.usefixtures("row_parts")`) runs twice, with every
table's rows whole and with them split in two parts (a hybrid table,
dynamicemb/table_rows.py: the first third of max_capacity in the head, the
rest in the tail, as global_hbm_for_values would put them), so that its
assertions also hold through the kernels' addressing rule
(csrc/embedding/row_parts.h). Tables that set global_hbm_for_values, and
cached ones, keep their own rule."""
import pytest

from dynamicemb import DynamicEmbTableOptions

_hbm_rows = DynamicEmbTableOptions.hbm_rows


def _first_third(self, row_bytes):
    if self.caching or self.global_hbm_for_values:
        return _hbm_rows(self, row_bytes)
    return self.max_capacity // 3


@pytest.fixture(params=["whole", "split"])
def row_parts(request, monkeypatch):
    if request.param == "split":
        monkeypatch.setattr(DynamicEmbTableOptions, "hbm_rows", _first_third)
    return request.param
