"""Guided rounding (docs/architecture.md), property-tested with hypothesis."""

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import nvfp4_oracle as oracle
import trace_kernels as tk

ROWS, K = 4, 64
values = hnp.arrays(
    np.float32, (ROWS, K), elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False)
)
noise = hnp.arrays(np.float32, (ROWS, K), elements=st.floats(-1.0, 1.0, width=32))
noise_scale = st.sampled_from([2.0**-9, 2.0**-7, 2.0**-5, 2.0**-3])


def _setup(x_np, n_np, scale):
    """Rollout value x_r and trainer value x_t = x_r (1 + scale * noise): a second engine's BF16 gap."""
    x_r = torch.from_numpy(x_np)
    x_t = x_r * (1 + scale * torch.from_numpy(n_np))
    rollout = tk.quantize(x_r, tk.row_amax(x_r))
    return x_r, x_t, rollout


def _neighbours(x_t, rollout):
    """Independent of the kernels: the signed-grid neighbours of x_t scaled by the rollout's scales."""
    _, y = oracle.rtn_with_scales(x_t, rollout.scales.numpy(), rollout.global_amax)
    grid = np.concatenate([-oracle.GRID[::-1], oracle.GRID[1:]])
    lo = grid[np.clip(np.searchsorted(grid, y, side="right") - 1, 0, len(grid) - 1)]
    hi = grid[np.clip(np.searchsorted(grid, y, side="left"), 0, len(grid) - 1)]
    return lo, hi


def _grid_values(q):
    return oracle.signed_value(oracle.unpack(q.codes))


@given(values, noise, noise_scale)
def test_full_guidance_never_increases_the_gap(x_np, n_np, scale):
    x_r, x_t, rollout = _setup(x_np, n_np, scale)
    target = _grid_values(rollout)
    guided = _grid_values(tk.quantize_guided(x_t, rollout))
    rtn_codes, _ = oracle.rtn_with_scales(x_t, rollout.scales.numpy(), rollout.global_amax)
    rtn = oracle.signed_value(rtn_codes)
    assert (np.abs(guided - target) <= np.abs(rtn - target)).all()


@given(values, noise, noise_scale)
def test_full_guidance_reproduces_every_neighbouring_code(x_np, n_np, scale):
    x_r, x_t, rollout = _setup(x_np, n_np, scale)
    target = _grid_values(rollout)
    lo, hi = _neighbours(x_t, rollout)
    adjacent = (target == lo) | (target == hi)
    guided = _grid_values(tk.quantize_guided(x_t, rollout))
    np.testing.assert_array_equal(guided[adjacent], target[adjacent])
    assert ((guided == lo) | (guided == hi)).all()  # never leaves the two neighbours


@given(values, noise, noise_scale)
def test_compact_guidance_reproduces_every_neighbouring_code(x_np, n_np, scale):
    x_r, x_t, rollout = _setup(x_np, n_np, scale)
    target = _grid_values(rollout)
    lo, hi = _neighbours(x_t, rollout)
    adjacent = (target == lo) | (target == hi)
    guided_q = tk.quantize_guided(x_t, tk.compact(rollout))
    guided = _grid_values(guided_q)
    np.testing.assert_array_equal(guided[adjacent], target[adjacent])
    assert torch.equal(guided_q.scales, rollout.scales)


@given(values)
def test_guidance_from_identical_values_is_identity(x_np):
    x = torch.from_numpy(x_np)
    q = tk.quantize(x, tk.row_amax(x))
    for guide in (q, tk.compact(q)):
        np.testing.assert_array_equal(_grid_values(tk.quantize_guided(x, guide)), _grid_values(q))


@given(values)
def test_no_guide_equals_quantize(x_np):
    x = torch.from_numpy(x_np)
    amax = tk.row_amax(x)
    a, b = tk.quantize(x, amax), tk.quantize_guided(x, None, global_amax=amax)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    out, _ = tk.quantize_dequantize(x)
    assert torch.equal(out, a.dequantize())


def test_guidance_removes_mismatches_that_rtn_makes():
    """Not vacuous: with BF16-level noise, RTN with its own scales disagrees somewhere, guidance not."""
    g = torch.Generator().manual_seed(0)
    x_r = torch.randn(256, 128, generator=g)
    x_t = x_r.to(torch.bfloat16).float() + x_r * 2**-9 * torch.randn(x_r.shape, generator=g)
    rollout = tk.quantize(x_r, tk.row_amax(x_r))
    own = tk.quantize(x_t, tk.row_amax(x_t))
    full = tk.quantize_guided(x_t, rollout)
    comp = tk.quantize_guided(x_t, tk.compact(rollout))
    target = _grid_values(rollout)
    rtn_mismatch = (_grid_values(own) != target).mean()
    assert rtn_mismatch > 1e-3
    assert (_grid_values(full) != target).mean() == 0
    assert (_grid_values(comp) != target).mean() == 0


def test_fake_quantize_is_straight_through():
    x = torch.randn(4, 32, requires_grad=True)
    rollout = tk.quantize(x.detach(), tk.row_amax(x.detach()))
    for guide in (None, rollout, tk.compact(rollout)):
        y, q = tk.fake_quantize(x, guide=guide, return_quantized=True)
        assert torch.equal(y.detach(), q.dequantize())
        (grad,) = torch.autograd.grad((y * torch.arange(32.0)).sum(), x)
        assert torch.equal(grad, torch.arange(32.0).expand(4, 32))


@given(values, noise, noise_scale)
def test_adjacent_agrees_with_an_independent_neighbour_search(x_np, n_np, scale):
    x_r, x_t, rollout = _setup(x_np, n_np, scale)
    target = _grid_values(rollout)
    lo, hi = _neighbours(x_t, rollout)
    expected = (target == lo) | (target == hi)
    np.testing.assert_array_equal(tk.adjacent(x_t, rollout).numpy(), expected)
    # and full guidance is exact exactly there
    guided = tk.codewords(tk.quantize_guided(x_t, rollout))
    assert torch.equal(guided[torch.from_numpy(expected)], tk.codewords(rollout)[torch.from_numpy(expected)])
