"""The register decode of NVFP4 blocks (trace_kernels.cpu_native.decode16) gives the scalar decode's bits,
nib[code] * sv[scale] (quantize.tables(), the torch reference's tables): all 256 code bytes at each of the 8
byte positions of a block, against all 256 scale bytes (NaN 0x7F / 0xFF, subnormals, zero, both signs of
zero), in both layouts (the transposed tile the grouped GEMM's W decode writes, and the row its A decode
writes). Floats compared as their int32 bits (a -0.0 / +0.0 or NaN payload difference shows)."""

import numba
import numpy as np

from trace_kernels.cpu_native.decode16 import decode16_cols, decode16_row
from trace_kernels.cpu_native.quantize import tables


def _scalar(codes, scales):
    """codes u8 [R, 8], scales u8 [R] -> f32 [R, 16], the grouped GEMM's scalar loop."""
    nib, sv = tables()
    lo, hi = nib[codes & 0xF], nib[codes >> 4]
    vals = np.stack((lo, hi), axis=2).reshape(len(codes), 16)  # nibble 2k low, 2k + 1 high of byte k
    return vals * sv[scales][:, None]


@numba.njit
def _cols(codes, scales, sv, out):
    """out [16, R]: the transposed tiles of rows codes [R, 8] / scales [R, 1], 16 rows a call."""
    R = codes.shape[0]
    for n0 in range(0, R, 16):
        decode16_cols(out, n0, R, codes, n0 * 8, 8, scales, n0, 1, sv)


@numba.njit
def _rows(codes, scales, sv, out):
    for r in range(codes.shape[0]):
        decode16_row(out, r * 16, codes, r * 8, sv[scales[r, 0]])


def test_every_code_byte_against_every_scale_byte_in_both_layouts():
    nib, sv = tables()
    R = 256
    position = np.arange(8)
    codes = ((np.arange(R)[:, None] + 37 * position[None, :]) % 256).astype(np.uint8)  # each byte at each position
    assert all(len(set(codes[:, k])) == 256 for k in range(8))
    checked_nan = checked_neg_zero = 0
    for shift in range(256):  # every (code byte, scale byte) pair at every position
        scales = ((np.arange(R) + shift) % 256).astype(np.uint8)[:, None]
        want = _scalar(codes, scales[:, 0]).view(np.int32)
        t = np.full((16, R), np.nan, dtype=np.float32)
        _cols(codes, scales, sv, t)
        assert np.array_equal(t.T.view(np.int32), want)
        r = np.full((R, 16), np.nan, dtype=np.float32)
        _rows(codes, scales, sv, r.reshape(-1))
        assert np.array_equal(r.view(np.int32), want)
        checked_nan += int(np.isnan(want.view(np.float32)).sum())
        checked_neg_zero += int((want == np.int32(-2**31)).sum())
    assert checked_nan and checked_neg_zero  # the NaN scales and -0.0 products were among the cases


def test_tiles_inside_a_larger_layout_touch_only_their_own_elements():
    """A tile at an offset in a wider [K, N] scratch writes its 16 x 16 elements and nothing else (the
    grouped GEMM decodes several tiles of one expert side by side)."""
    nib, sv = tables()
    rng = np.random.default_rng(0)
    N, KB = 48, 3
    codes = rng.integers(0, 256, (N, KB * 8), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, (N, KB), dtype=np.uint8)
    out = np.full((KB * 16, N), 7.0, dtype=np.float32)

    @numba.njit
    def tile(out, codes, scales, sv, n0, b):
        N = out.shape[1]
        decode16_cols(out, b * 16 * N + n0, N, codes, n0 * codes.shape[1] + b * 8, codes.shape[1], scales,
                      n0 * scales.shape[1] + b, scales.shape[1], sv)

    tile(out, codes, scales, sv, 16, 1)
    want = np.full_like(out, 7.0)
    want[16:32, 16:32] = _scalar(codes[16:32, 8:16], scales[16:32, 1]).T
    assert np.array_equal(out.view(np.int32), want.view(np.int32))
