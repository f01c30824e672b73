"""exp16 (`trace_kernels.cpu_native.exp16`): the native attention's softmax exponentials in 16 lanes, a copy of
glibc's FMA expf. The kernel's outputs keep their bits only if every lane equals the scalar `expf` the kernel
called before (numba's np.exp on a float32: libm's expf), so that is checked on every float32 where the host's
expf is the one copied, and the IEEE-fixed values everywhere."""

import numba
import numpy as np
import pytest

from trace_kernels.cpu_native.exp16 import exp16_array, exp16_shifted, glibc_fma_expf_host

NOT_GLIBC_FMA = glibc_fma_expf_host()


@numba.njit(cache=False)
def _scalar_expf(x, y):
    for i in range(x.shape[0]):
        y[i] = np.exp(x[i])  # numba: libm's expf on each float32 (what the kernel called)


@numba.njit(cache=False)
def _exp16(x, y):
    for o in range(0, x.shape[0], 16):
        exp16_array(x, o, y)


@numba.njit(cache=False)
def _softmax_numerators(s, n, mx):
    for t0 in range(0, n, 16):
        exp16_shifted(s, t0, mx)


@numba.njit(cache=False)
def _fill(lo, x):
    xi = x.view(np.uint32)
    for i in range(xi.shape[0]):
        xi[i] = np.uint32(lo + i)


def _bits(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def _exp16_of(x):
    x = np.asarray(x, dtype=np.float32)
    pad = np.zeros(-(-x.shape[0] // 16) * 16, dtype=np.float32)
    pad[: x.shape[0]] = x
    y = np.empty_like(pad)
    _exp16(pad, y)
    return y[: x.shape[0]]


def _edge_inputs():
    """Every special branch and its neighbours: zeros, infinities, NaNs with payloads, subnormals, and each
    threshold of glibc's special path (88.0, the overflow and both underflow bounds) +- a few ulps."""
    bits = [0x0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA00001, 0x7FFFFFFF,
            0x1, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00800000, 0x3F800000, 0xBF800000, 0x7F7FFFFF, 0xFF7FFFFF]
    for c in (0x42B00000, 0xC2B00000, 0x42B17217, 0xC2CFF1B4, 0xC2CE8ECF, 0x42AFFFFF, 0x3F317218, 0x33800000):
        bits += [c + d for d in range(-4, 5)]
    return np.array(bits, dtype=np.uint32).view(np.float32)


def test_ieee_fixed_values_on_any_libm():
    """Values no correct expf can differ on: exp(+-0) = 1, exp(-inf) = +0, exp(inf) = inf, NaN stays NaN,
    past overflow inf, far below underflow +0; and the shifted form subtracts the max first, in float32."""
    x = np.array([0.0, -0.0, -np.inf, np.inf, np.nan, 89.0, 1e30, -104.5, -1e30, -np.float32(3e38)], np.float32)
    y = _exp16_of(x)
    assert _bits(y[:4]).tolist() == _bits([1.0, 1.0, 0.0, np.inf]).tolist()
    assert np.isnan(y[4])
    assert _bits(y[5:7]).tolist() == _bits([np.inf, np.inf]).tolist()
    assert _bits(y[7:]).tolist() == [0, 0, 0]
    s = np.array([3.0, 1.0, 3.0, -np.inf] + [0.5] * 12 + [9.0] * 16, np.float32)
    _softmax_numerators(s, 16, np.float32(3.0))
    assert s[0] == 1.0 and s[2] == 1.0 and s[3] == 0.0 and np.all(s[16:] == 9.0)  # lanes past n untouched
    assert 0 < s[1] < 1 and 0 < s[4] < s[1]


@pytest.mark.skipif(NOT_GLIBC_FMA is not None, reason=f"exp16 copies glibc's FMA expf: {NOT_GLIBC_FMA}")
def test_equals_the_scalar_expf_on_edges_and_random_floats():
    """Bit for bit against libm's expf: the special path's thresholds and a million random bit patterns."""
    rng = np.random.default_rng(0)
    x = np.concatenate((_edge_inputs(), rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint32).view(np.float32),
                        rng.uniform(-110, 90, size=1 << 18).astype(np.float32)))
    want = np.empty_like(x)
    _scalar_expf(x, want)
    got = _exp16_of(x)
    differ = np.nonzero(_bits(got) != _bits(want))[0]
    assert differ.size == 0, [(hex(int(_bits(x)[i])), hex(int(_bits(want)[i])), hex(int(_bits(got)[i]))) for i in differ[:8]]


@pytest.mark.skipif(NOT_GLIBC_FMA is not None, reason=f"exp16 copies glibc's FMA expf: {NOT_GLIBC_FMA}")
def test_equals_the_scalar_expf_on_every_float32():
    """All 2^32 inputs, in chunks of 2^24, against libm's expf (~40 s on one core): the proof that the kernel's
    softmax keeps its bits on this host."""
    chunk = 1 << 24
    x, want, got = (np.empty(chunk, np.float32) for _ in range(3))
    for lo in range(0, 1 << 32, chunk):
        _fill(lo, x)
        _scalar_expf(x, want)
        _exp16(x, got)
        if not np.array_equal(want.view(np.uint32), got.view(np.uint32)):
            i = int(np.nonzero(want.view(np.uint32) != got.view(np.uint32))[0][0])
            pytest.fail(f"expf({hex(lo + i)}): libm {hex(int(want.view(np.uint32)[i]))}, exp16 {hex(int(got.view(np.uint32)[i]))}")
