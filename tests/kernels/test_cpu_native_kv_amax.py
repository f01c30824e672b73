"""kv.quantize_write(compute_amax=True), the plugin's per-row KV write: the amaxes it writes are
trace_kernels.row_amax's bits (a zero row, -0, Inf; a NaN row takes torch's amax) and the page and codes
are those of the write with torch's amaxes passed in."""

import torch

import trace_kernels as tk
from trace_kernels import cpu_native
from trace_kernels.cpu_native import kv
from trace_kernels.kv_layout import packed_row_bytes

H, D = 2, 32


def _write(k, v, slots, compute):
    page = torch.zeros((4, H, 16, 2 * packed_row_bytes(D)), dtype=torch.uint8)
    if compute:
        ka, va = torch.full(k.shape[:-1], 123.0), torch.full(v.shape[:-1], 123.0)  # overwritten
    else:
        ka, va = tk.row_amax(k), tk.row_amax(v)
    codes = kv.quantize_write(page, slots, k, v, ka, va, compute_amax=compute)
    return page, codes, ka, va


def test_in_kernel_amax_is_row_amaxs_bits():
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(7, H, D, generator=g) * 4).to(torch.bfloat16)
    v = torch.randn(7, H, D, generator=g).to(torch.bfloat16)
    k[1, 0] = 0
    k[1, 1] = -0.0
    v[3, 1, 5] = -float("inf")
    slots = torch.tensor([0, 5, 17, -1, 33, 40, 63])
    for nan in (False, True):
        if nan:
            k[4, 0, 9] = float("nan")
        before = cpu_native.FALLBACKS["eager:kv_write_amax_nan"]
        want, got = _write(k, v, slots, False), _write(k, v, slots, True)
        # the NaN row's amax came from torch: counted, once per write that met one
        assert cpu_native.FALLBACKS["eager:kv_write_amax_nan"] - before == int(nan)
        assert torch.equal(want[0], got[0])
        for a, b in zip(want[1], got[1]):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(want[2:], got[2:]):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        assert torch.isnan(got[2][4, 0]) == nan
