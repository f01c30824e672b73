"""Native NVFP4 grouped GEMM (default block scale): `grouped_mm.reference.grouped_mm` as two kernel calls.

The reference's steps, the same float32 operations in the same order where order matters:
  1. A rows quantized with the contract (quantize.quantize_kernel, global amax per source row); their
     codes / scales copied to the capture rows `dest[m]` of the sorted rows that have one.
  2. Operands decoded without global scales: e2m1(code) * e4m3(scale) (exact; NaN scale -> NaN).
  3. One partial per 16-element K block: the sum of its 16 products. Exact in any order (the reference
     docstring: at most 20 significant bits), so the kernel sums them in whatever order vectorises
     (across the N outputs, products in j order).
  4. acc = 0; acc = acc + p[kb] for kb = 0, 1, ... (the one fixed K order; acc starts at +0 as
     torch.zeros does, so an all -0 partial still gives +0).
  5. out = acc * (g_dec_a[row] * g_dec_w[expert]); then + bias[expert] as a separate fp32 add.
Each expert's W is decoded inside the call into a [K, N] scratch (transposed, so step 3 runs along N)
and dropped: no resident dequantized weight, as in the reference. Step 2 runs in 16-lane registers
(decode16.py: 16 x 16 tiles of W, A a block at a time), with the scalar loop's bits.

Threads: the experts are split over numba threads (prange), as many as torch uses
(cpu_native.parallel_launch). An expert's rows, and so every output element, are one thread's work in
the order above, so the bits do not depend on the thread count. At the engine's decode shapes the
weight decode is a large part of the work (about 0.6 us per expert with decode16, 1.3 us before, against
0.3 us per row), which is why the split is over experts, not rows.
"""

import numpy as np
import torch
from numba import prange

from . import njit, parallel_launch
from .decode16 import decode16_cols, decode16_row
from .quantize import CALLS, NUMERATOR, global_dec, np_view, quantize_kernel, tables

F32 = np.float32


@njit(parallel=True)
def grouped_mm_kernel(a_codes, a_scales, a_amax, src, dest, cap_codes, cap_scales, w_codes, w_scales, w_amax, offs,
                      bias, has_bias, numerator, nib, sv, out):
    """a_codes u8 [Ra, K/2], a_scales u8 [Ra, K/16], a_amax f32 [Ra]; src i64 [M] (source row of each
    sorted row); dest i64 [M] capture row (-1: none; empty: no capture) into cap_codes / cap_scales;
    w_codes u8 [E, N, K/2], w_scales u8 [E, N, K/16], w_amax f32 [E]; offs i32 [E] cumulative;
    bias f32 [E, N] (read when has_bias) -> out f32 [M, N]."""
    M = out.shape[0]
    E = w_codes.shape[0]
    a_val, g_dec_a = copy_and_decode_a(a_codes, a_scales, a_amax, src, dest, cap_codes, cap_scales, M, numerator, sv)
    if M == 0:
        return
    for e in prange(E):  # experts on the threads: each output row is one thread's, in the fixed order
        start = offs[e - 1] if e > 0 else 0
        stop = offs[e]
        if stop <= start:  # no rows for this expert
            continue
        expert_rows(a_val, g_dec_a, src, w_codes, w_scales, w_amax, e, start, stop, bias, has_bias, numerator, nib,
                    sv, out)


@njit
def grouped_mm_serial(a_codes, a_scales, a_amax, src, dest, cap_codes, cap_scales, w_codes, w_scales, w_amax, offs,
                      bias, has_bias, numerator, nib, sv, out):
    """grouped_mm_kernel on the calling thread alone, for a launch whose numba thread count is 1 (the CPU
    engine's): the same steps in the same order, so the same bits, without the parallel region's launch (a
    prange loop goes through numba's threading layer even for one thread: its scheduling and the OpenMP
    region on every call, twice a MoE layer call)."""
    M = out.shape[0]
    E = w_codes.shape[0]
    a_val, g_dec_a = copy_and_decode_a(a_codes, a_scales, a_amax, src, dest, cap_codes, cap_scales, M, numerator, sv)
    if M == 0:
        return
    for e in range(E):
        start = offs[e - 1] if e > 0 else 0
        stop = offs[e]
        if stop <= start:
            continue
        expert_rows(a_val, g_dec_a, src, w_codes, w_scales, w_amax, e, start, stop, bias, has_bias, numerator, nib,
                    sv, out)


@njit
def copy_and_decode_a(a_codes, a_scales, a_amax, src, dest, cap_codes, cap_scales, M, numerator, sv):
    """Steps 1-2 for A, shared by both grouped kernels: the capture rows copied, then (M > 0) every source row
    decoded once (rows are gathered per expert) -> (a_val f32 [Ra, K], g_dec_a f32 [Ra]); empty when M is 0."""
    KH = a_codes.shape[1]
    K = KH * 2
    KB = K // 16
    for m in range(dest.shape[0]):
        d = dest[m]
        if d >= 0:
            s = src[m]
            for i in range(KH):
                cap_codes[d, i] = a_codes[s, i]
            for i in range(KB):
                cap_scales[d, i] = a_scales[s, i]
    Ra = a_codes.shape[0] if M > 0 else 0
    a_val = np.empty((Ra, K), dtype=np.float32)
    g_dec_a = np.empty(Ra, dtype=np.float32)
    for r in range(Ra):
        g_dec_a[r] = global_dec(a_amax[r], numerator)[1]
        for b in range(KB):  # nib[code] * sv[scale] per element, in registers (decode16: the same bits)
            decode16_row(a_val, r * K + b * 16, a_codes, r * KH + b * 8, sv[a_scales[r, b]])
    return a_val, g_dec_a


@njit
def expert_rows(a_val, g_dec_a, src, w_codes, w_scales, w_amax, e, start, stop, bias, has_bias, numerator, nib, sv,
                out):
    """Steps 2-5 for the sorted rows start..stop of expert e (its W decoded into a private scratch)."""
    N = out.shape[1]
    K = a_val.shape[1]
    KB = K // 16
    w_t = np.empty((K, N), dtype=np.float32)
    acc = np.empty(N, dtype=np.float32)
    g_dec_w = global_dec(w_amax[e], numerator)[1]
    N16 = N - N % 16
    KH = K // 2
    for n0 in range(0, N16, 16):  # step 2 for this expert's W, transposed: 16 rows x 16 elements a tile
        for b in range(KB):  # in registers (decode16: nib[code] * sv[scale], the same bits as the loop below)
            decode16_cols(w_t, b * 16 * N + n0, N, w_codes, (e * N + n0) * KH + b * 8, KH, w_scales,
                          (e * N + n0) * KB + b, KB, sv)
    for n in range(N16, N):  # the rows past the last full tile
        for b in range(KB):
            sw = sv[w_scales[e, n, b]]
            for j in range(8):
                c = w_codes[e, n, b * 8 + j]
                w_t[b * 16 + 2 * j, n] = nib[c & 0xF] * sw
                w_t[b * 16 + 2 * j + 1, n] = nib[c >> 4] * sw
    for m in range(start, stop):
        r = src[m]
        for n in range(N):
            acc[n] = F32(0.0)
        for b in range(KB):
            # Step 3 per output n as a scalar sum over j in order (the same adds as a p[n] row updated per
            # j): with j's trip count the constant 16 the j loop unrolls, so the n loop is the innermost
            # one and vectorises with the partials in registers, not a p row stored and reloaded per j.
            a = a_val[r, b * 16:b * 16 + 16]
            wb = w_t[b * 16:b * 16 + 16]
            for n in range(N):
                p = F32(0.0)
                for j in range(16):
                    p = p + a[j] * wb[j, n]
                acc[n] = acc[n] + p
        g = g_dec_a[r] * g_dec_w
        for n in range(N):
            out[m, n] = acc[n] * g
        if has_bias:
            for n in range(N):
                out[m, n] = out[m, n] + bias[e, n]


def grouped_mm(a, a_amax, a_rows, w_codes, w_scales, w_amax, offs, capture, bias=None) -> torch.Tensor:
    """`grouped_mm.reference.grouped_mm` with the default block scale (validated inputs, CPU tensors)."""
    CALLS["grouped_mm"] += 1
    Ra, K = a.shape
    E, N = w_codes.shape[0], w_codes.shape[1]
    M = a_rows.shape[0] if a_rows is not None else Ra
    nib, sv = tables()
    numerator = NUMERATOR["6"]
    a_codes = np.empty((Ra, K // 2), dtype=np.uint8)
    a_scales = np.empty((Ra, K // 16), dtype=np.uint8)
    a_amax = np_view(a_amax)
    quantize_kernel(np_view(a.to(torch.float32)), a_amax, numerator, a_codes, a_scales,
                    np.empty((0, 0), dtype=np.float32), False, nib, sv)
    src = np_view(a_rows) if a_rows is not None else np.arange(M, dtype=np.int64)
    if capture is not None:
        dest, cap_codes, cap_scales = capture  # the buffers are contiguous (checked): written in place
        dest = np_view(dest)
        cap_codes = cap_codes.view(-1, K // 2).numpy()
        cap_scales = cap_scales.view(-1, K // 16).numpy()
    else:
        dest, cap_codes, cap_scales = _NO_CAPTURE
    out = np.empty((M, N), dtype=np.float32)
    bias_np = np_view(bias) if bias is not None else _NO_BIAS
    with parallel_launch():
        grouped_mm_kernel(a_codes, a_scales, a_amax, src, dest, cap_codes, cap_scales, np_view(w_codes),
                          np_view(w_scales), np_view(w_amax), np_view(offs), bias_np, bias is not None,
                          numerator, nib, sv, out)
    return torch.from_numpy(out)


_NO_CAPTURE = (np.empty(0, dtype=np.int64), np.empty((0, 0), dtype=np.uint8), np.empty((0, 0), dtype=np.uint8))
_NO_BIAS = np.empty((0, 0), dtype=np.float32)
