"""The 16-lane RTN block pieces of the sparse decode (trace_kernels.cpu_native.rtn16) give the scalar code's
bits: a block's largest |value| as quantize.block_amax's loop takes it, and the packed E2M1 codes of
value * enc clamped to [-6, 6] as quantize.e2m1_code computes each, on ties at every threshold (both
signs), signed zeros, subnormals, saturation (|value * enc| > 6, and overflow to inf) and random blocks.
Floats compared as int32 bits, codes as bytes. Then the decode's RTN rows equal torch reference quantize's
bytes under each row's own amax (the whole _rtn_row, its block scales included)."""

import numba
import numpy as np
import torch

from trace_kernels.cpu_native.quantize import e2m1_code
from trace_kernels.cpu_native.rtn16 import absmax16, rtn_codes16


@numba.njit
def _scalar(x, enc, amax_out, codes_out):
    """The scalar loops rtn16 replaces (sparse_decode._rtn_row before it), per 16-value block of x."""
    for b in range(x.shape[0] // 16):
        m = np.float32(0.0)
        for j in range(16):
            a = abs(x[b * 16 + j])
            if a > m:
                m = a
        amax_out[b] = m
        for j in range(0, 16, 2):
            t0 = x[b * 16 + j] * enc[b]
            if t0 < np.float32(-6.0):
                t0 = np.float32(-6.0)
            elif t0 > np.float32(6.0):
                t0 = np.float32(6.0)
            t1 = x[b * 16 + j + 1] * enc[b]
            if t1 < np.float32(-6.0):
                t1 = np.float32(-6.0)
            elif t1 > np.float32(6.0):
                t1 = np.float32(6.0)
            codes_out[b * 8 + j // 2] = np.uint8(e2m1_code(t0) | (e2m1_code(t1) << 4))


@numba.njit
def _vector(x, enc, amax_out, codes_out):
    for b in range(x.shape[0] // 16):
        amax_out[b] = absmax16(x, b * 16)
        rtn_codes16(codes_out, b * 8, x, b * 16, enc[b])


def _blocks(rng, n):
    """n blocks of 16 float32 values and an encode factor each, mixing the cases the two could disagree on."""
    thresholds = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    special = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-39, -3e-39, 3.4e38, -3.4e38, 7.0, -6.5], np.float32)
    x = np.empty((n, 16), np.float32)
    enc = np.empty(n, np.float32)
    for i in range(n):
        kind = i % 5
        p2 = np.float32(2.0) ** np.float32(rng.integers(-30, 30))
        if kind == 0:  # exact ties: thresholds and grid points times a power of two, enc its inverse
            x[i] = rng.choice(np.concatenate([thresholds, grid]), 16) * rng.choice([-1, 1], 16) * p2
            enc[i] = np.float32(1.0) / p2
        elif kind == 1:  # one ulp either side of the ties
            t = rng.choice(thresholds, 16) * p2
            x[i] = np.nextafter(t, rng.choice([-np.inf, np.inf], 16).astype(np.float32)) * rng.choice([-1, 1], 16)
            enc[i] = np.float32(1.0) / p2
        elif kind == 2:  # zeros, subnormals, huge values (saturation, inf products)
            x[i] = rng.choice(special, 16)
            enc[i] = rng.choice(np.array([1.0, 3.4e38, 1e-30, 6.0], np.float32))
        elif kind == 3:  # all zeros of either sign
            x[i] = rng.choice(np.array([0.0, -0.0], np.float32), 16)
            enc[i] = np.float32(1.0)
        else:
            x[i] = (rng.standard_normal(16) * np.exp(3 * rng.standard_normal())).astype(np.float32)
            enc[i] = np.float32(6.0) / max(np.abs(x[i]).max(), np.float32(1e-30)) * np.float32(rng.uniform(0.5, 1.5))
    return x.reshape(-1), enc


def test_block_max_and_codes_equal_the_scalar_loops():
    rng = np.random.default_rng(10)
    x, enc = _blocks(rng, 5000)
    n = enc.shape[0]
    want_m, got_m = np.empty(n, np.float32), np.full(n, np.nan, np.float32)
    want_c, got_c = np.empty(n * 8, np.uint8), np.full(n * 8, 0xAB, np.uint8)
    _scalar(x, enc, want_m, want_c)
    _vector(x, enc, got_m, got_c)
    assert np.array_equal(got_m.view(np.int32), want_m.view(np.int32))
    assert np.array_equal(got_c, want_c)
    # the cases were reached: every code nibble 0..15, ties, saturation, zero blocks
    nibbles = np.concatenate([want_c & 0xF, want_c >> 4])
    assert set(nibbles.tolist()) == set(range(16))
    assert (want_m == 0).sum() >= 1000 and np.isinf(x * np.repeat(enc, 16)).any()


def test_the_decodes_rtn_rows_equal_quantize_under_the_row_amax():
    """decoder.decode's RTN rows (the native kernel's _rtn_row with these pieces, its block scales included)
    equal torch's quantize of the same rows under their own amax, on rows of tie, one-ulp and random blocks
    (test_cpu_native_sparse_decode.py covers zero, tiny and large rows)."""
    import trace_kernels as tk
    from trace_kernels.guides import sparse as sg
    from trace_kernels.guides.sparse import decoder

    rng = np.random.default_rng(11)
    x = np.concatenate([_blocks(rng, 64 * 8)[0].reshape(-1, 16)[[i for i in range(64 * 8) if i % 5 in (0, 1, 4)]]])
    x = torch.from_numpy(x[: (len(x) // 8) * 8].reshape(-1, 128)).to(torch.float32)
    q = tk.quantize(x, tk.row_amax(x))
    rtn, report = [], sg.DecodeReport()
    decoder.decode_dequantized(sg.encode(q, "moe_fc1_in"), x, report, backend="native", rtn_out=rtn)
    (r,) = rtn
    assert x.shape[0] >= 30
    assert torch.equal(r.codes, q.codes) and torch.equal(r.scales, q.scales)
    assert torch.equal(r.global_amax.view(torch.int32), q.global_amax.view(torch.int32))
