"""kv_row_write.quantize_write_per_row, the plugin's KV write for bf16 K / V with per-row amaxes: the page
bytes, codes, scales and amaxes (bits) of kv.quantize_write(compute_amax=True), with and without the rows
kept; K / V as strided views (V a slice of a fused qkv row, as vLLM hands it), NaN / Inf / zero rows,
padded slots, an int32 slot mapping, a scratch reused across shapes."""

import pytest
import torch

from trace_kernels import cpu_native
from trace_kernels.cpu_native import kv, kv_row_write
from trace_kernels.kv_layout import packed_row_bytes

H, D, DV = 2, 32, 48


def _kv(T, seed, nan):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, H * (D + D + DV), generator=g) * torch.logspace(-3, 3, T)[:, None]).to(torch.bfloat16)
    k = qkv[:, H * D: 2 * H * D].reshape(T, H, D).contiguous()
    v = qkv[:, 2 * H * D:].view(T, H, DV)  # strided: rows H * (2D + DV) apart
    assert T == 1 or not v.is_contiguous()
    k[0, 1] = 0
    if T > 3:
        k[1, 0] = -0.0
        v[2, 0, 5] = -float("inf")
        k[3, 1, 7] = float("inf")
    if nan:
        v[4, 1, 2] = float("nan")
    return k, v


def _page():
    return torch.randint(0, 256, (5, H, 16, packed_row_bytes(D) + packed_row_bytes(DV)),
                         generator=torch.Generator().manual_seed(9), dtype=torch.uint8)


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("nan", [False, True])
@pytest.mark.parametrize("T", [1, 7, 16])
def test_per_row_write_is_quantize_writes_bits(T, nan):
    k, v = _kv(T, T, nan and T > 4)
    slots = torch.tensor([3, 17, -1, 40, 79, -1, 0, 64, 5, 6, 7, 8, 9, 10, 11, 12][:T])
    want_page = _page()
    ka, va = torch.empty(T, H), torch.empty(T, H)
    (kc, ks), (vc, vs) = kv.quantize_write(want_page, slots, k, v, ka, va, compute_amax=True)
    want = ((kc, ks, ka), (vc, vs, va))
    for keep in (True, False):
        for sm in (slots, slots.to(torch.int32)):
            before = cpu_native.FALLBACKS["eager:kv_write_amax_nan"]
            page = _page()
            got = kv_row_write.quantize_write_per_row(page, sm, k, v, keep)
            assert cpu_native.FALLBACKS["eager:kv_write_amax_nan"] - before == int(nan and T > 4)
            assert torch.equal(page, want_page)
            if not keep:
                assert got is None
                continue
            for a_rows, b_rows in zip(got, want):
                for a, b in zip(a_rows, b_rows):
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def test_kept_rows_are_fresh_per_call():
    """put_owned keeps the rows without a copy: a later write must not change them."""
    k, v = _kv(7, 1, False)
    slots = torch.arange(7)
    first = kv_row_write.quantize_write_per_row(_page(), slots, k, v, True)
    kept = [t.clone() for rows in first for t in rows]
    kv_row_write.quantize_write_per_row(_page(), slots, k * 3, v * 3, True)
    kv_row_write.quantize_write_per_row(_page(), slots, k * 5, v * 5, False)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(kept, (t for rows in first for t in rows)))


def test_fewer_slots_than_rows_writes_the_first_tokens():
    k, v = _kv(9, 4, False)
    slots = torch.tensor([2, 30, 41])
    want, got = _page(), _page()
    kv.quantize_write(want, slots, k, v, torch.empty(9, H), torch.empty(9, H), compute_amax=True)
    kv_row_write.quantize_write_per_row(got, slots, k, v, False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("nan", [False, True])
def test_random_bf16_bit_patterns(nan):
    """Every kind of bf16 value (subnormals, huge, +-0, Inf; NaNs with their payloads when `nan`): the bits of
    kv.quantize_write(compute_amax=True) over rows whose amaxes span the whole range."""
    g = torch.Generator().manual_seed(11 + nan)
    T = 64
    k = torch.randint(-32768, 32768, (T, H, D), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    v = torch.randint(-32768, 32768, (T, H, DV), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    # narrow some rows' exponent range so that most blocks are finite and scales of every size occur
    for t in range(0, T, 2):
        shift = float(2.0 ** (t - 32))
        k[t] = torch.randn(H, D, generator=g).to(torch.bfloat16) * shift
        v[t] = torch.randn(H, DV, generator=g).to(torch.bfloat16) * shift
    if not nan:
        k = torch.where(torch.isnan(k), torch.zeros_like(k), k)
        v = torch.where(torch.isnan(v), torch.ones_like(v), v)
    slots = torch.randperm(80, generator=g)[:T]
    slots[::7] = -1
    want_page = _page()
    ka, va = torch.empty(T, H), torch.empty(T, H)
    (kc, ks), (vc, vs) = kv.quantize_write(want_page, slots, k, v, ka, va, compute_amax=True)
    page = _page()
    got = kv_row_write.quantize_write_per_row(page, slots, k, v, True)
    assert torch.equal(page, want_page)
    for a, b in zip((t for rows in got for t in rows), (kc, ks, ka, vc, vs, va)):
        assert torch.equal(_bits(a), _bits(b))


def test_any_strides_read_as_the_tensors_values():
    """K / V reach the kernel as address and strides (bf16_rows_at): a head-major K (transposed), a V whose
    elements are 2 apart, a K broadcast over tokens (stride 0) store kv.quantize_write's bytes."""
    g = torch.Generator().manual_seed(11)
    T = 6
    k_heads_major = torch.randn(H, T, D, generator=g).to(torch.bfloat16).transpose(0, 1)
    v_every_other = torch.randn(T, H, 2 * DV, generator=g).to(torch.bfloat16)[:, :, ::2]
    k_broadcast = torch.randn(1, H, D, generator=g).to(torch.bfloat16).expand(T, H, D)
    slots = torch.tensor([4, 9, 33, -1, 70, 12])
    for k, v in ((k_heads_major, v_every_other), (k_broadcast, v_every_other)):
        assert not k.is_contiguous() and not v.is_contiguous()
        want, got = _page(), _page()
        ka, va = torch.empty(T, H), torch.empty(T, H)
        (kc, ks), (vc, vs) = kv.quantize_write(want, slots, k, v, ka, va, compute_amax=True)
        rows = kv_row_write.quantize_write_per_row(got, slots, k, v, True)
        assert torch.equal(got, want)
        for a, b in zip((t for r in rows for t in r), (kc, ks, ka, vc, vs, va)):
            assert torch.equal(_bits(a), _bits(b))
