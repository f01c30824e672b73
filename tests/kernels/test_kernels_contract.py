"""The torch reference against an independent oracle of the NVFP4 contract (docs/architecture.md)."""

import numpy as np
import pytest
import torch

import nvfp4_oracle as oracle
import trace_kernels as tk
from adversarial import cases
from trace_kernels import reference


def _check_against_oracle(x: torch.Tensor, amax: torch.Tensor):
    q = tk.quantize(x, amax, backend="torch")
    rows_amax = amax.expand(x.shape[0]) if amax.numel() == 1 else amax
    codes, scales = oracle.quantize(x, rows_amax.contiguous())
    np.testing.assert_array_equal(q.scales.numpy().astype(np.int64), scales)
    np.testing.assert_array_equal(oracle.unpack(q.codes), codes)


@pytest.mark.parametrize("name,x,amax", cases(), ids=[c[0] for c in cases()])
def test_reference_matches_oracle_on_adversarial_data(name, x, amax):
    _check_against_oracle(x, amax)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dist", ["normal", "uniform", "lognormal", "outliers"])
@pytest.mark.parametrize("amax_mode", ["per_row", "per_tensor"])
def test_reference_matches_oracle_on_random_data(dtype, dist, amax_mode):
    g = torch.Generator().manual_seed(hash((str(dtype), dist, amax_mode)) % 2**31)
    x = torch.randn(32, 128, generator=g)
    if dist == "uniform":
        x = torch.rand(32, 128, generator=g) * 8 - 4
    elif dist == "lognormal":
        x = torch.exp(x * 3) * torch.sign(torch.randn(32, 128, generator=g))
    elif dist == "outliers":
        x[torch.rand(32, 128, generator=g) < 0.01] *= 300
    x = x.to(dtype)
    amax = tk.row_amax(x) if amax_mode == "per_row" else tk.tensor_amax(x)
    _check_against_oracle(x, amax)


def test_grid_values_reproduce_exactly():
    """Hand-checkable: with global amax 2688 and block amax 6 every grid value maps to itself."""
    grid = torch.tensor([6.0, 4, 3, 2, 1.5, 1, 0.5, 0, -0.5, -1, -1.5, -2, -3, -4, -6, 6])
    q = tk.quantize(grid[None], torch.tensor([2688.0]))
    assert q.scales.tolist() == [[0x38]]  # E4M3 1.0: exponent 7 (bias 7), mantissa 0
    assert torch.equal(q.dequantize()[0], grid)
    assert q.codes[0, 0].item() == (0x6 << 4) | 0x7  # 6 -> index 7 (low nibble), 4 -> index 6 (high)


def test_e4m3_rounding_is_exact_for_every_byte_and_midpoint():
    """Every E4M3 value and every midpoint between neighbours, against torch's float8 cast."""
    values = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (values[:-1] + values[1:]) / 2  # exact in float32
    s = torch.cat([values, mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, mids + 1)])
    s = s.clamp(max=448.0)
    byte, value = reference.round_to_e4m3(s)
    expected = s.to(torch.float8_e4m3fn)
    assert torch.equal(byte.to(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(value, expected.float())
    assert torch.equal(reference.decode_e4m3(byte), expected.float())


def test_nan_and_inf_poison_only_their_block():
    """Documented behaviour: a block holding NaN or +-Inf gets the E4M3 NaN scale byte (0x7F) and
    zero codes, so it dequantizes to NaN; the other blocks are untouched."""
    x = torch.randn(3, 64)
    clean = tk.quantize(x, torch.tensor([10.0]))
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    x[2, 17] = float("-inf")
    q = tk.quantize(x, torch.tensor([10.0]))
    bad = torch.zeros(3, 4, dtype=torch.bool)
    bad[0, 0] = bad[1, 2] = bad[2, 1] = True
    assert torch.equal(q.scales[bad], torch.full((3,), 0x7F, dtype=torch.uint8))
    assert torch.equal(q.scales[~bad], clean.scales[~bad])
    deq = q.dequantize().reshape(3, 4, 16)
    assert deq[bad].isnan().all() and not deq[~bad].isnan().any()


def test_non_finite_global_amax_poisons_its_row():
    x = torch.randn(2, 32)
    q = tk.quantize(x, torch.tensor([float("inf"), 3.0]))
    assert (q.scales[0] == 0x7F).all() and (q.scales[1] != 0x7F).all()


def test_all_zero_row_with_zero_amax_is_zero():
    x = torch.zeros(2, 32)
    q = tk.quantize(x, tk.row_amax(x))
    assert not q.codes.any() and not q.scales.any()
    assert torch.equal(q.dequantize(), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_matches_oracle_values(dtype):
    x = (torch.randn(8, 64) * 5).to(dtype)
    amax = tk.row_amax(x)
    q = tk.quantize(x, amax)
    codes, scales = oracle.quantize(x, amax)
    _, g_dec = oracle.global_scales(amax.numpy())
    s_val = torch.from_numpy(scales.astype(np.uint8)).view(torch.float8_e4m3fn).float().numpy()
    expected = oracle.signed_value(codes).reshape(8, 4, 16) * (s_val * g_dec[:, None])[..., None]
    np.testing.assert_array_equal(q.dequantize().numpy(), expected.reshape(8, 64).astype(np.float32))
    assert q.dequantize(dtype).dtype == dtype
