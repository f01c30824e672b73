"""The code stage's 16-lane block pass (trace_kernels.cpu_native.own_codes16) gives the scalar loop's bits
it replaced in sparse_decode._hypothesis: per value the trainer's own mantissa bit, the grid neighbours and
sign (nbr) and |y| or inf on the grid (cost), for y = x * enc clamped to [-6, 6]; on E2M1 grid points, the
rounding ties between them, one ulp either side of both, signed zeros, subnormals, saturation (products
past 6 and overflowing to inf) and random blocks. Floats compared as int32 bits."""

import numba
import numpy as np

from trace_kernels.cpu_native.own_codes16 import own_codes16
from trace_kernels.cpu_native.quantize import e2m1_code
from trace_kernels.cpu_native.sparse_decode import _GRID, _INF


@numba.njit
def _scalar(x, enc, bits, nbr, cost):
    """sparse_decode._hypothesis's code loop as it was (scalar), per 16-value block of x."""
    for b in range(enc.shape[0]):
        for i in range(16):
            t = b * 16 + i
            y = x[t] * enc[b]
            if y < np.float32(-6.0):
                y = np.float32(-6.0)
            elif y > np.float32(6.0):
                y = np.float32(6.0)
            a = abs(y)
            bits[t] = e2m1_code(y) & 1
            k = (int(a >= np.float32(0.5)) + int(a >= np.float32(1.0)) + int(a >= np.float32(1.5))
                 + int(a >= np.float32(2.0)) + int(a >= np.float32(3.0)) + int(a >= np.float32(4.0))
                 + int(a >= np.float32(6.0)))
            neg = 64 if y < 0 else 0
            if _GRID[k] == a:
                cost[t] = _INF
                nbr[t] = k | (k << 3) | neg
            else:
                nbr[t] = k | (min(k + 1, 7) << 3) | neg
                cost[t] = a


@numba.njit
def _vector(x, enc, bits, nbr, cost):
    for b in range(enc.shape[0]):
        own_codes16(bits, nbr, cost, b * 16, x, enc[b])


def _blocks(rng, n):
    pts = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7], np.float32)
    special = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-39, 3.4e38, -3.4e38, 6.5, -6.0, 6.0], np.float32)
    x = np.empty((n, 16), np.float32)
    enc = np.empty(n, np.float32)
    for i in range(n):
        kind = i % 4
        p2 = np.float32(2.0) ** np.float32(rng.integers(-30, 30))
        if kind == 0:  # grid points and ties exactly, both signs
            x[i] = rng.choice(pts, 16) * rng.choice([-1, 1], 16) * p2
            enc[i] = np.float32(1.0) / p2
        elif kind == 1:  # one ulp either side
            t = rng.choice(pts, 16) * p2
            x[i] = np.nextafter(t, rng.choice([-np.inf, np.inf], 16).astype(np.float32)) * rng.choice([-1, 1], 16)
            enc[i] = np.float32(1.0) / p2
        elif kind == 2:
            x[i] = rng.choice(special, 16)
            enc[i] = rng.choice(np.array([1.0, 3.4028235e38, 1e-30, 6.0], np.float32))
        else:
            x[i] = (rng.standard_normal(16) * np.exp(3 * rng.standard_normal())).astype(np.float32)
            enc[i] = np.float32(6.0) / max(np.abs(x[i]).max(), np.float32(1e-30)) * np.float32(rng.uniform(0.5, 1.5))
    return x.reshape(-1), enc


def test_bits_neighbours_and_costs_equal_the_scalar_loop():
    x, enc = _blocks(np.random.default_rng(12), 6000)
    n = x.shape[0]
    want = (np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.float32))
    got = (np.full(n, -1, np.int64), np.full(n, -1, np.int64), np.full(n, np.nan, np.float32))
    _scalar(x, enc, *want)
    _vector(x, enc, *got)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert np.array_equal(got[2].view(np.int32), want[2].view(np.int32))
    # reached: every grid floor with and without sign, on and off the grid, both mantissa bits
    assert set((want[1] & 7).tolist()) == set(range(8)) and set((want[1] & 64).tolist()) == {0, 64}
    assert np.isinf(want[2]).sum() > 1000 and (~np.isinf(want[2])).sum() > 1000 and set(want[0].tolist()) == {0, 1}
