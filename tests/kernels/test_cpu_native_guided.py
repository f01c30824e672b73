"""The native guided rounding (trace_kernels.cpu_native.guided, numba) gives the torch reference's bits for
full and compact guides: on the adversarial rows (ties, zero blocks, subnormal / saturated scales, signed
zeros, NaN / Inf blocks and amaxes) with guides from nearby values, and on every scaled value beside every
target code and every scale byte (NaN bytes included) under amaxes of every kind; codes, scales and the
dequantized values, under both block scales, with nothing run by torch on the native path."""

import numpy as np
import pytest
import torch

import trace_kernels as tk
from adversarial import GRID, MIDPOINTS, bad_value_rows, cases
from trace_kernels import cpu_native, reference
from trace_kernels.cpu_native import guided


def _random_rows():
    g = torch.Generator().manual_seed(13)
    return [(f"random_{R}x{K}", torch.randn(R, K, generator=g) * 10 ** float(torch.randn(1, generator=g)), None)
            for R, K in ((1, 16), (37, 128), (5, 2048))]


ALL = cases() + [bad_value_rows()] + _random_rows()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()]) if t.is_floating_point() else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _same_but_nan_rows(a, b, amax) -> bool:
    """`_same` except on rows whose amax is NaN, which must be NaN on both sides: torch's NaN bits there
    depend on the row's position in a batch of more than 32 rows (docs/measurements.md, CPU native path)."""
    ok = ~torch.isnan(amax)
    return _same(a[ok], b[ok]) and bool(torch.isnan(a[~ok]).all()) and bool(torch.isnan(b[~ok]).all())


def _check(x, guide, block_scale="6", nan_rows_amax=None):
    """Native against torch through the public entry points: codes, scales, values in x's dtype."""
    before = cpu_native.fallbacks()
    q0 = tk.quantize_guided(x, guide, backend="torch", block_scale=block_scale)
    q1 = tk.quantize_guided(x, guide, backend="native", block_scale=block_scale)
    assert _same(q0.codes, q1.codes) and _same(q0.scales, q1.scales)
    d0, p0 = tk.quantize_dequantize(x, guide=guide, backend="torch", block_scale=block_scale)
    d1, p1 = tk.quantize_dequantize(x, guide=guide, backend="native", block_scale=block_scale)
    assert _same(p1.codes, q0.codes) and _same(p1.scales, q0.scales)
    if nan_rows_amax is None:
        assert _same(d0, d1)
    else:
        assert _same_but_nan_rows(d0.reshape(nan_rows_amax.numel(), -1), d1.reshape(nan_rows_amax.numel(), -1),
                                  nan_rows_amax)
    assert cpu_native.fallbacks() == before  # nothing ran torch on the native path
    return q0


@pytest.mark.parametrize("name,x,amax", ALL, ids=[c[0] for c in ALL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_guides_from_nearby_values_match_torch(name, x, amax, dtype):
    """The rollout rounded slightly different values (and, in a second guide, under a different amax):
    guided rounding then disagrees with the trainer's own RTN at some elements, which are the ones it moves."""
    x = x.to(dtype)
    if amax is None:
        amax = tk.row_amax(x)
    g = torch.Generator().manual_seed(len(name))
    near = x.float() * (1 + 0.03 * torch.randn(x.shape, generator=g))
    for rollout in (tk.quantize(near, amax, backend="torch"), tk.quantize(near, amax * 1.1, backend="torch")):
        for guide in (rollout, tk.compact(rollout)):
            q = _check(x, guide)
            own = tk.quantize(x, amax, backend="torch")
            if name.startswith("random") and x.numel() >= 1024:  # the guide moved some codes away from the trainer's own RTN
                assert not torch.equal(tk.codewords(q), tk.codewords(own))


def _every_value_code_scale(amax_row):
    """Rows r = 0..255 with guide scale byte r in every block; each row holds the values V (E2M1 grid
    points, midpoints, one ulp either side, signs, 0, -0, the clamp at 6 and beyond) times the scale, each
    beside every one of the 16 target codes (value i % 96 meets code (i // 96) % 16)."""
    v = np.array(MIDPOINTS + GRID[1:] + (7.0,), dtype=np.float32)
    v = np.concatenate([v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf))])
    v = np.concatenate([v, -v, [0.0, -0.0]]).astype(np.float32)
    v = np.pad(v, (0, 96 - v.size))
    n = 96 * 16
    vals = torch.from_numpy(np.tile(v, 16))
    code = (torch.arange(n) // 96) % 16
    sv = reference.decode_e4m3(torch.arange(256)).nan_to_num(nan=1.0)
    x = vals[None, :] * sv[:, None]  # y = x / s exactly where the scale is a power of two (amax 2688: g_dec 1)
    x[7, 5] = float("nan")  # bad blocks beside good ones in the same row
    x[200, 100] = -float("inf")
    codes = reference.pack_nibbles(code.expand(256, n))
    scales = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, n // 16).contiguous()
    return x, tk.NVFP4Tensor(codes, scales, amax_row)


@pytest.mark.parametrize("block_scale", ["6", "4over6"])
def test_every_value_beside_every_code_and_scale_byte(block_scale):
    for amax in (torch.tensor([2688.0]).expand(256).contiguous(),
                 torch.tensor([2688.0, 448.0, 1e-30, 0.0, 3.3e38, 1.0, float("inf"), float("nan")]).repeat(32)):
        x, full = _every_value_code_scale(amax)
        for guide in (full, tk.compact(full)):
            for dtype in (torch.float32, torch.bfloat16):
                _check(x.to(dtype), guide, block_scale, nan_rows_amax=amax)


def test_rows_in_torch_s_scalar_tail_with_nan_amax_match_every_bit():
    """Fewer than 32 rows: torch's NaN bits are the input's, as the kernel's, so even NaN-amax rows match."""
    amax = torch.tensor([2688.0, float("nan"), float("inf"), 0.0, 1e-38, 3.3e38, 448.0, 1.0])
    x, full = _every_value_code_scale(amax.repeat(32))
    x, full = x[100:108], tk.NVFP4Tensor(full.codes[100:108], full.scales[100:108], amax)
    for guide in (full, tk.compact(full)):
        _check(x, guide)


def test_env_routes_guided_rounding_to_the_kernel(monkeypatch):
    """TRACE_FP4_CPU_BACKEND=native: guided rounding by fake_quantize takes the kernel, uncounted as eager."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 5, 64, generator=g) * 4).to(torch.bfloat16)  # leading dims: [batch, tokens, K]
    rollout = tk.quantize(x.float() * 1.02, tk.row_amax(x), backend="torch")
    want = tk.quantize_dequantize(x, guide=tk.compact(rollout), backend="torch")[0]
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "native")
    before, calls = cpu_native.fallbacks(), dict(guided.CALLS)
    got = tk.fake_quantize(x, guide=tk.compact(rollout))
    assert _same(got, want)
    assert cpu_native.fallbacks() == before and "eager:quantize_guided" not in cpu_native.fallbacks()
    assert guided.CALLS["compact"] == calls.get("compact", 0) + 1


def test_a_guide_of_another_kind_is_refused():
    x = torch.zeros(1, 16)
    with pytest.raises(TypeError, match="full or compact guide"):
        guided.quantize_guided(x, torch.ones(1), object())
