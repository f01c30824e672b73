"""The packed NVFP4 KV row (trace_kernels.kv_layout) that both engines' packed caches store."""

import pytest
import torch

import trace_kernels
from trace_kernels.kv_layout import pack_rows, packed_row_bytes, unpack_rows


def test_row_bytes():
    assert packed_row_bytes(128) == 76 and packed_row_bytes(32) == 22 and packed_row_bytes(16) == 13
    with pytest.raises(ValueError, match="multiple of 16"):
        packed_row_bytes(40)


@pytest.mark.parametrize("head_dim", [16, 32, 128])
def test_round_trip_dequantizes_to_the_fake_quantized_values(head_dim):
    x = (torch.randn(7, 3, head_dim) * torch.logspace(-3, 3, 7)[:, None, None]).to(torch.bfloat16)
    x[0, 0, 0] = float("nan")  # a NaN amax travels through the packed row like any other
    xq, q = trace_kernels.quantize_dequantize(x)
    packed = pack_rows(q)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 3, packed_row_bytes(head_dim))
    u = unpack_rows(packed, head_dim)
    assert torch.equal(u.codes, q.codes) and torch.equal(u.scales, q.scales)
    assert torch.equal(u.global_amax.isnan(), q.global_amax.isnan())
    assert torch.equal(u.global_amax.nan_to_num(), q.global_amax.nan_to_num())
    got, want = u.dequantize(torch.bfloat16), xq
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_static_amax_is_stored_per_row():
    x = torch.randn(4, 2, 32)
    amax = torch.tensor([5.0])
    q = trace_kernels.quantize(x, amax)
    u = unpack_rows(pack_rows(q), 32)
    assert torch.equal(u.global_amax, torch.full((4, 2), 5.0))
    assert torch.equal(u.dequantize(), q.dequantize())


def test_wrong_width_is_refused():
    with pytest.raises(ValueError, match=r"uint8 \[\.\.\., 22\]"):
        unpack_rows(torch.zeros(3, 2, 21, dtype=torch.uint8), 32)
