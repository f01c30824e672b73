"""The native packed KV cache (trace_kernels.cpu_native.kv): its write stores the bytes
trace_vllm_plugin.kv_packed.write_packed stores (padded slots -1 included), and its read gives the K / V
of kv_packed.dequantize_blocks bit for bit (bf16 and float32; NaN blocks; zero, tiny and huge amaxes)."""

import pytest
import torch

import trace_kernels as tk
from trace_kernels.cpu_native import kv
from trace_kernels.kv_layout import packed_row_bytes
from trace_vllm_plugin.kv_packed import dequantize_blocks, write_packed

H, D, BLOCK, BLOCKS = 2, 32, 16, 6


def _rows(T, seed):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(T, H, D, generator=g) * 5).to(torch.bfloat16)
    v = (torch.randn(T, H, D, generator=g) * torch.logspace(-3, 3, T)[:, None, None]).to(torch.bfloat16)
    k[1, 0, :16] = 0
    return k, v


def _page(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (BLOCKS, H, BLOCK, 2 * packed_row_bytes(D)), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("static_amax", [False, True])
def test_write_stores_write_packeds_bytes(static_amax, monkeypatch):
    k, v = _rows(9, 1)
    amax_k = torch.tensor([40.0]) if static_amax else tk.row_amax(k)
    qk, qv = tk.quantize(k, amax_k, backend="torch"), tk.quantize(v, tk.row_amax(v), backend="torch")
    slots = torch.tensor([3, 17, -1, 40, 95, -1, 0, 64])  # 8 of the 9 tokens; padded tokens at -1
    want, got = _page(), _page()
    write_packed(want, slots, qk, qv)
    kv.write_rows(got, slots, qk, qv)
    assert torch.equal(got, want)
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "native")  # and through the plugin's call site
    routed = _page()
    write_packed(routed, slots, qk, qv)
    assert torch.equal(routed, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_quantize_write_equals_quantize_then_write_packed(dtype):
    """kv.quantize_write (the plugin's one-call KV write): the same page bytes and capture codes as the
    torch quantize of K and V then write_packed; NaN / Inf values, a zero row, a static amax for V."""
    k, v = _rows(9, 2)
    k, v = k.to(dtype), v.to(dtype)
    k[2, 1, 3], k[4, 0, 20], v[5, 1, 0] = float("nan"), float("inf"), -float("inf")
    amax_k, amax_v = tk.row_amax(k), torch.full((9, H), 7.5)
    qk, qv = tk.quantize(k, amax_k, backend="torch"), tk.quantize(v, amax_v, backend="torch")
    slots = torch.tensor([3, 17, -1, 40, 95, -1, 0, 64])
    want, got = _page(), _page()
    write_packed(want, slots, qk, qv)
    (kc, ks), (vc, vs) = kv.quantize_write(got, slots, k, v, amax_k, amax_v)
    assert torch.equal(got, want)
    for a, b in ((kc, qk.codes), (ks, qk.scales), (vc, qv.codes), (vs, qv.scales)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_read_equals_dequantize_blocks(dtype):
    page = torch.zeros((BLOCKS, H, BLOCK, 2 * packed_row_bytes(D)), dtype=torch.uint8)
    k, v = _rows(BLOCKS * BLOCK, 2)
    amax = tk.row_amax(v)
    amax[5, 1], amax[6, 0], amax[7, 1] = 0.0, 1e-38, 3.3e38  # zero, tiny, huge global scales
    write_packed(page, torch.arange(BLOCKS * BLOCK), tk.quantize(k, tk.row_amax(k)), tk.quantize(v, amax))
    ids = torch.tensor([4, 0, 2])
    for p in (page, page.transpose(0, 1).contiguous().transpose(0, 1)):  # contiguous pages, and a strided view
        want = dequantize_blocks(p[ids], D, D, dtype)
        *got, slots = kv.dequantize_blocks(p, ids, D, D, dtype)
        assert torch.equal(slots, torch.arange(ids.shape[0] * BLOCK))
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                                      b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_nan_block_takes_torchs_cast():
    """A NaN block scale: the kernel reports the NaN and the cast is torch's (its NaN bits)."""
    page = torch.zeros((BLOCKS, H, BLOCK, 2 * packed_row_bytes(D)), dtype=torch.uint8)
    k, v = _rows(BLOCKS * BLOCK, 4)
    write_packed(page, torch.arange(BLOCKS * BLOCK), tk.quantize(k, tk.row_amax(k)), tk.quantize(v, tk.row_amax(v)))
    page[2, 1, 5, D // 2] = 0x7F  # a K row's first block scale: NaN
    ids = torch.tensor([2, 1])
    want = dequantize_blocks(page[ids], D, D, torch.bfloat16)
    got = kv.dequantize_blocks(page, ids, D, D, torch.bfloat16)[:2]
    assert torch.isnan(got[0]).any()
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_read_of_the_rows_requests_attend_to():
    """Requests of 20 and 40 tokens over blocks of 16 (the second's last block shared): only their rows are
    read, each the value the full read gives, with its scratch slot."""
    page = torch.zeros((BLOCKS, H, BLOCK, 2 * packed_row_bytes(D)), dtype=torch.uint8)
    k, v = _rows(BLOCKS * BLOCK, 5)
    write_packed(page, torch.arange(BLOCKS * BLOCK), tk.quantize(k, tk.row_amax(k)), tk.quantize(v, tk.row_amax(v)))
    remapped = torch.tensor([[0, 1, 0], [2, 3, 1]])  # scratch positions of each request's blocks
    valid = kv.valid_rows(remapped, torch.tensor([20, 40]), BLOCK, 4)
    assert valid.tolist() == [16, 8, 16, 16]  # block 1: 4 rows for request 0, 8 for request 1
    ids = torch.tensor([5, 1, 3, 0])
    kf, vf, _ = kv.dequantize_blocks(page, ids, D, D, torch.bfloat16)
    kp, vp, slots = kv.dequantize_blocks(page, ids, D, D, torch.bfloat16, valid=valid)
    assert slots.tolist() == list(range(0, 16)) + list(range(16, 24)) + list(range(32, 64))
    assert torch.equal(kp.view(torch.int16), kf[slots].view(torch.int16))
    assert torch.equal(vp.view(torch.int16), vf[slots].view(torch.int16))
