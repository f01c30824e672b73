"""The audit blob a take writes (numpy path on host rows) equals the torch path's bytes and reads back,
for any number of audited rows, including none (a short record's site can audit no row)."""

import pytest
import torch

import trace_kernels
from trace_kernels.guides.sparse.audit import audit_blob, audit_parts, from_parts


@pytest.mark.parametrize("rows", [[], [0], [1, 4, 6]])
def test_numpy_blob_equals_torch_blob_and_reads_back(rows):
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    full = trace_kernels.quantize(x, trace_kernels.row_amax(x))
    r = torch.tensor(rows, dtype=torch.int64)
    blob = audit_parts(full, r)["audit"]
    assert torch.equal(blob, audit_blob(r, full.codes[r]))
    back_rows, back_codes = from_parts({"audit": blob}, (8,), 64, "test")
    assert back_rows.tolist() == rows
    assert torch.equal(back_codes, full.codes[r])
