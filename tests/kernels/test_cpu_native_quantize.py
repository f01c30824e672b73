"""The native CPU backend's quantize and dequantize (trace_kernels.cpu_native.quantize, numba) give the torch
reference's bits on adversarial rows (E2M1 / E4M3 ties, zero / subnormal / saturated scales, signed zeros,
NaN / Inf blocks, NaN / Inf / zero / tiny / huge amaxes), through the public entry points with
backend="native" and with TRACE_FP4_CPU_BACKEND=native; what it does not cover runs torch, counted."""

import pytest
import torch

import trace_kernels as tk
from adversarial import bad_value_rows, cases
from trace_kernels import cpu_native, reference
from trace_kernels.cpu_native import quantize as native_quantize
from trace_kernels.kv_layout import pack_rows


def _random_rows():
    g = torch.Generator().manual_seed(11)
    return [(f"random_{R}x{K}", torch.randn(R, K, generator=g) * 10 ** float(torch.randn(1, generator=g)), None)
            for R, K in ((1, 16), (16, 64), (37, 128), (5, 2048))]


ALL = cases() + [bad_value_rows()] + _random_rows()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Floats as integers: a -0.0 / +0.0 or NaN payload difference shows."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()]) if t.is_floating_point() else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("name,x,amax", ALL, ids=[c[0] for c in ALL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_scale", ["6", "4over6"])
def test_quantize_and_fake_quantize_match_torch(name, x, amax, dtype, block_scale):
    x = x.to(dtype)
    if amax is None:
        amax = tk.row_amax(x)
    before = cpu_native.fallbacks()
    q0 = tk.quantize(x, amax, backend="torch", block_scale=block_scale)
    q1 = tk.quantize(x, amax, backend="native", block_scale=block_scale)
    assert _same(q0.codes, q1.codes) and _same(q0.scales, q1.scales), name
    d0, _ = tk.quantize_dequantize(x, global_amax=amax, backend="torch", block_scale=block_scale)
    d1, p1 = tk.quantize_dequantize(x, global_amax=amax, backend="native", block_scale=block_scale)
    assert _same(d0, d1) and _same(p1.codes, q0.codes), name
    assert cpu_native.fallbacks() == before  # nothing ran torch on the native path


def _same_but_nan_rows(a, b, amax) -> bool:
    """`_same` on every row whose amax is not NaN; NaN everywhere on the others. Why: torch's own NaN
    there depends on the row's position. `torch.minimum(g_enc, FLT_MAX)` (the contract's step 1) runs
    ATen's vector loop over chunks of 32 floats (AVX-512), where a NaN comes out as 0xFFFFFFFF, and its
    scalar loop over the tail, where the input's NaN passes through: the reference gives one row two
    NaN encodings by batch size, and no kernel can equal both."""
    ok = ~torch.isnan(amax)
    return _same(a[ok], b[ok]) and bool(torch.isnan(a[~ok]).all()) and bool(torch.isnan(b[~ok]).all())


@pytest.mark.parametrize("block_scale", ["6", "4over6"])
def test_dequantize_matches_torch_on_every_byte(block_scale):
    """Every code byte beside every scale byte (NaN scales 0x7F / 0xFF included) under amaxes of every kind."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(256).reshape(256, 256)  # K = 512
    scales = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 32).contiguous()
    amax = torch.tensor([2688.0, 448.0, 1e-30, 0.0, 3.3e38, 1.0, float("inf"), float("nan")]).repeat(32)
    q = tk.NVFP4Tensor(codes, scales, amax)
    for dtype in (torch.float32, torch.bfloat16):
        want = tk.dequantize(q, dtype, backend="torch", block_scale=block_scale)
        assert _same_but_nan_rows(tk.dequantize(q, dtype, backend="native", block_scale=block_scale), want, amax)
    want = reference.dequantize(codes, scales, amax, block_scale)
    assert _same_but_nan_rows(tk.dequantize(q, backend="native", block_scale=block_scale), want, amax)
    # rows in the scalar tail of torch's loop (fewer than 32): NaN amax rows included, every bit equal
    tail = tk.NVFP4Tensor(codes[:8], scales[248:].contiguous(), amax[:8])
    assert _same(tk.dequantize(tail, backend="native", block_scale=block_scale),
                 tk.dequantize(tail, backend="torch", block_scale=block_scale))


def test_env_routes_auto_to_native_and_packed_kv_rows_match(monkeypatch):
    """TRACE_FP4_CPU_BACKEND=native: "auto" takes the kernels; the packed KV write's rows are the same bytes."""
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(5, 2, 64, generator=g) * 7).to(torch.bfloat16)  # [tokens, kv heads, head_dim]
    k[1, 0, :16] = 0
    amax = tk.row_amax(k)
    want = pack_rows(tk.quantize(k, amax, backend="torch"))
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "native")
    before = cpu_native.fallbacks()
    assert torch.equal(pack_rows(tk.quantize(k, amax)), want)
    assert cpu_native.fallbacks() == before


def test_4over6_and_guided_rounding_run_their_kernels_uncounted():
    """4over6 quantization and guided rounding have kernels now: the reference's bits, nothing counted."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, generator=g)
    amax = tk.row_amax(x)
    before, calls = cpu_native.fallbacks(), native_quantize.CALLS["quantize_4over6"]
    q0 = tk.quantize(x, amax, backend="torch", block_scale="4over6")
    q1 = tk.quantize(x, amax, backend="native", block_scale="4over6")
    assert _same(q0.codes, q1.codes) and _same(q0.scales, q1.scales)
    guide = tk.quantize(x * 1.01, amax, backend="torch")
    assert _same(tk.quantize_guided(x, guide, backend="native").codes, tk.quantize_guided(x, guide, backend="torch").codes)
    assert cpu_native.fallbacks() == before
    assert native_quantize.CALLS["quantize_4over6"] == calls + 1


def test_4over6_takes_the_4_candidate_where_it_is_strictly_better():
    """Blocks built so each candidate wins (and one exact tie, which keeps 6): the kernel's choice is the
    reference's, and both choices occur (else the comparison above would not test the selection)."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    x[0, :16] = torch.tensor([4.0] + [1.0] * 15)  # on the 4-grid: the 4-candidate is exact
    x[1, :16] = torch.tensor([6.0, 5.0] + [0.5] * 14)
    x[2, :16] = 0.0  # both candidates exact (a tie): 6 kept
    amax = tk.row_amax(x)
    _, _, four = reference.quantize_with_choice(x, amax, "4over6")
    assert bool(four.any()) and bool((~four).any())
    q0 = tk.quantize(x, amax, backend="torch", block_scale="4over6")
    q1 = tk.quantize(x, amax, backend="native", block_scale="4over6")
    assert _same(q0.codes, q1.codes) and _same(q0.scales, q1.scales)
    # near-ties, one block per row (amax = block amax): blocks whose choice flips if the 16 squared errors
    # are summed left to right instead of the reference's pairwise tree (found by a search over 200,000
    # random blocks on the 1/8 grid), so the kernel's summation order is tested too
    near = torch.tensor([
        [2.5, -0.125, -2.25, -0.375, -0.375, -0.25, 0.25, 0.375, 0.625, -0.0, -0.75, -0.25, 1.0, -1.0, -0.75, -0.125],
        [-2.25, -1.875, 0.0, 0.625, -1.625, -1.625, 0.125, 2.875, -1.25, -1.25, -1.5, 2.125, -1.0, -1.875, 2.875, 1.25],
        [1.0, -5.0, -0.625, 3.125, -4.25, -2.375, 1.125, -1.75, -3.625, 0.625, 2.25, 0.375, -4.625, 1.625, -0.625, 2.625],
        [0.625, -0.25, -1.25, 0.125, -0.5, 0.5, -0.5, 0.75, 0.125, 0.0, 0.125, 0.0, -0.125, 0.375, 0.875, 0.125]])
    q0 = tk.quantize(near, tk.row_amax(near), backend="torch", block_scale="4over6")
    q1 = tk.quantize(near, tk.row_amax(near), backend="native", block_scale="4over6")
    assert _same(q0.codes, q1.codes) and _same(q0.scales, q1.scales)
