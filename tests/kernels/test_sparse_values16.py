"""The sparse decode's block values in registers (trace_kernels.cpu_native.values16, and decode16_row for
float32) give the scalar loop's bits they replace in sparse_decode: `(-mag if c & 8 else mag) * mult` with
mag = E2M1_GRID[c & 7], rounded to bf16 to nearest even on its int64 bits. Every code byte at every byte
position of a block, under multipliers of every exponent range (subnormal products, ties of the bf16
rounding, values that round up into the next binade and to inf, zero, inf and NaN multipliers)."""

import numba
import numpy as np

from trace_kernels.cpu_native.decode16 import decode16_row
from trace_kernels.cpu_native.sparse_decode import _GRID
from trace_kernels.cpu_native.values16 import values16_bf16


@numba.njit
def _scalar(codes, mults, out16, out32):
    for b in range(mults.shape[0]):
        for i in range(16):
            byte = np.int64(codes[b * 8 + i // 2])
            c = (byte >> 4) if i & 1 else (byte & 15)
            mag = _GRID[c & 7]
            v = (-mag if c & 8 else mag) * mults[b]
            u = np.int64(np.float32(v).view(np.int32)) & 0xFFFFFFFF
            out16[b * 16 + i] = np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)
            out32[b * 16 + i] = v


@numba.njit
def _vector(codes, mults, out16, out32):
    for b in range(mults.shape[0]):
        values16_bf16(out16, b * 16, codes, b * 8, mults[b])
        decode16_row(out32, b * 16, codes, b * 8, mults[b])


def test_every_code_byte_under_every_exponent_range():
    rng = np.random.default_rng(16)
    # multipliers: random mantissas at every exponent, ones whose products sit on bf16 ties (low 16 bits
    # 0x8000 of 1.5 * m etc.), the largest finite (products overflow), subnormals, 0, inf, NaN
    exps = np.arange(-149, 128)
    m = (rng.uniform(1, 2, exps.size) * np.float64(2.0) ** exps).astype(np.float32)
    ties = (np.arange(1, 200, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    special = np.array([0.0, -0.0, np.inf, np.nan, 3.4028235e38, 1e-45, 1.0, 0.5, 1 / 6], np.float32)
    mults = np.concatenate([m, ties, ties * np.float32(0.5), special]).astype(np.float32)
    blocks = []
    for k in range(32):  # each code byte at each of the 8 positions, under every multiplier
        codes = ((np.arange(8)[None, :] * 37 + np.arange(mults.size)[:, None] + 8 * k) % 256).astype(np.uint8)
        blocks.append(codes)
    for codes in blocks:
        codes = codes.reshape(-1)
        want16, got16 = np.empty(mults.size * 16, np.uint16), np.full(mults.size * 16, 0xABCD, np.uint16)
        want32, got32 = np.empty(mults.size * 16, np.float32), np.full(mults.size * 16, 7.0, np.float32)
        _scalar(codes, mults, want16, want32)
        _vector(codes, mults, got16, got32)
        assert np.array_equal(got16, want16)
        assert np.array_equal(got32.view(np.int32), want32.view(np.int32))
    # reached: bf16 ties that round up and down, -0.0, inf from rounding, NaN
    assert (want16 == 0x8000).any() and (want16 == 0x7F80).any() and ((want16 & 0x7FFF) > 0x7F80).any()
