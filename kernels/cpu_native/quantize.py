"""Native RTN quantize and dequantize, under both block scales ("6": quantize_kernel, which the grouped GEMM,
routed experts and KV write call too; "4over6": quantize_4over6_kernel).

The contract's steps (trace_kernels.reference, and `grouped_mm.reference.quantize_rows` /
`dequantize_rows`, its fewer-op forms) as one loop nest per call, float32 throughout, the same IEEE
operations in the same order:
  1. g_enc = min(numerator / amax, FLT_MAX), 1 where 0; g_dec = 1 / g_enc      (per row)
  2. s = clamp(amax_b * (g_enc * fp32(1/6)), max 448), rounded to E4M3 by the bit trick (normal) or
     half-to-even on s * 512 (subnormal)                                       (per block)
  3. y = clamp(x * min(1 / (s * g_dec), FLT_MAX), -6, 6); E2M1 index by the midpoints, ties to even
  4. a block with a NaN / Inf (or a row with a non-finite amax) gets codes 0 and scale byte 0x7F
4over6 (reference.select_4over6): step 2 also for s4 = clamp(s6 * 1.5), steps 3-4 for both candidates,
and each candidate's error sum (v * (s * g_dec) - x)^2 over the block in the reference's pairwise tree
order; the 4-candidate where its error is strictly lower. Exact for the same reasons: float32 ops one at
a time, no FMA (fastmath off), the same summation order (tests include near-tie blocks whose choice
flips under a left-to-right sum).
Dequantized values: e2m1(code) * (e4m3(scale) * g_dec), the byte tables of grouped_mm.reference.
`min` / `clamp` are written as comparisons so a NaN passes through as torch.minimum / clamp pass it.

The cast of the dequantized float32 values to a model dtype stays a torch `.to` (its NaN encoding is
torch's own; a hand-written bf16 rounding would have to copy it case by case).
"""

from collections import Counter

import numpy as np
import torch

from . import as_numpy, njit

CALLS: Counter = Counter()  # native piece -> calls (shows which pieces a run took natively; tests read it)


def np_view(t: torch.Tensor):
    """`as_numpy` for a CPU tensor that is not bf16, in one call when it is contiguous (the wrappers below
    run per layer call, where as_numpy's checks cost as much as a small kernel)."""
    return t.numpy() if t.is_contiguous() else t.contiguous().numpy()

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
SIXTH = F32(1.0 / 6.0)  # the contract's fp32(1/6)
E4M3_MAX = F32(448.0)
MIN_NORMAL = F32(2.0**-6)
SUB_STEP = F32(2.0**-9)
NUMERATOR = {"6": F32(448.0 * 6.0), "4over6": F32(256.0 * 6.0)}


def tables():
    """(signed E2M1 value of each nibble [16], E4M3 value of each byte [256] with NaN at 0x7F / 0xFF):
    the torch reference's own tables, so both read the same float32 values."""
    global _TABLES
    if _TABLES is None:
        from ..grouped_mm.reference import tables as torch_tables

        pairs, scale_values = torch_tables(torch.device("cpu"))
        _TABLES = (pairs[:16, 0].numpy().copy(), scale_values.numpy().copy())
    return _TABLES


_TABLES = None


@njit
def global_dec(amax, numerator):
    """Step 1 for one row: g_enc, g_dec (NaN amax -> NaN, as torch)."""
    g = numerator / amax
    if g > FLT_MAX:
        g = FLT_MAX
    if g == F32(0.0):
        g = F32(1.0)
    return g, F32(1.0) / g


@njit
def row_amax_kernel(a, out):
    """out[r] = max |a[r, :]| (torch's `x.abs().amax(-1)` bits (the routed experts' and the KV write's per-row site amax) for rows without NaN: +0.0 for a zero row,
    as abs makes every zero +0). Returns False at the first NaN (out then incomplete)."""
    R, K = a.shape
    for r in range(R):
        m = F32(0.0)
        for j in range(K):
            v = abs(a[r, j])
            if v != v:
                return False
            if v > m:
                m = v
        out[r] = m
    return True


@njit
def block_amax(x, r, base):
    """(the largest |value| of the 16 values of row r from `base`, whether one of them is not finite)."""
    bad = False
    amax_b = F32(0.0)
    for j in range(16):
        v = x[r, base + j]
        if not np.isfinite(v):
            bad = True
        a = abs(v)
        if a > amax_b:
            amax_b = a
    return amax_b, bad


@njit
def write_bad_block(codes, scales, out, r, b, want_out, m, nib):
    """The contract's non-finite block: codes 0, scale byte 0x7F (NaN), and with `want_out` the values
    code 0 dequantizes to under that scale (`m`: NaN scale value x the row's decode scale)."""
    base = b * 16
    for j in range(8):
        codes[r, base // 2 + j] = 0
    scales[r, b] = 0x7F
    if want_out:
        for j in range(16):
            out[r, base + j] = nib[0] * m


@njit
def quantize_kernel(x, amax, numerator, codes, scales, out, want_out, nib, sv):
    """x f32 [R, K], amax f32 [R] -> codes u8 [R, K/2], scales u8 [R, K/16]; with `want_out` also the
    dequantized values into out f32 [R, K]."""
    R, K = x.shape
    NB = K // 16
    fbuf = np.empty(1, dtype=np.float32)
    ibuf = fbuf.view(np.int32)
    y = np.empty(16, dtype=np.float32)
    for r in range(R):
        g_enc, g_dec = global_dec(amax[r], numerator)
        row_bad = not np.isfinite(amax[r])
        g6 = g_enc * SIXTH
        for b in range(NB):
            base = b * 16
            amax_b, bad = block_amax(x, r, base)
            if bad or row_bad:
                write_bad_block(codes, scales, out, r, b, want_out, sv[0x7F] * g_dec, nib)
                continue
            byte, enc = block_scale_enc(amax_b, g6, g_dec, fbuf, ibuf, sv)
            scales[r, b] = byte
            for j in range(16):
                t = x[r, base + j] * enc
                if t < F32(-6.0):
                    t = F32(-6.0)
                elif t > F32(6.0):
                    t = F32(6.0)
                y[j] = t
            m = sv[byte] * g_dec
            for j in range(0, 16, 2):
                c0 = e2m1_code(y[j])
                c1 = e2m1_code(y[j + 1])
                codes[r, (base + j) // 2] = c0 | (c1 << 4)
                if want_out:
                    out[r, base + j] = nib[c0] * m
                    out[r, base + j + 1] = nib[c1] * m


FOUR_OVER_SIX = F32(1.5)  # format.FOUR_OVER_SIX_EXPANSION: the 4-candidate's unrounded scale is s6 * 1.5


@njit
def _clamp_scale(s):
    """reference._clamp_scale for s >= 0 or NaN: min(s, FLT_MAX), clamp at 448, NaN -> 0."""
    if s > FLT_MAX:
        s = FLT_MAX
    if s > E4M3_MAX:
        s = E4M3_MAX
    if s != s:
        s = F32(0.0)
    return s


@njit
def _candidate(x, r, base, s_value, g_dec, nib, codes16, e):
    """One 4over6 candidate of block (r, base): its signed E2M1 codes into codes16 [16] and its error
    sum_i (v_i * (s * g_dec) - x_i)^2 in reference.block_sq_error's order (the products, then the
    differences, squares, and the pairwise tree: (0+1), (2+3), ... then pairs of those)."""
    enc = F32(1.0) / (s_value * g_dec)
    if enc > FLT_MAX:
        enc = FLT_MAX
    m = s_value * g_dec
    for j in range(16):
        v = x[r, base + j]
        t = v * enc
        if t < F32(-6.0):
            t = F32(-6.0)
        elif t > F32(6.0):
            t = F32(6.0)
        c = e2m1_code(t)
        codes16[j] = c
        d = nib[c] * m - v
        e[j] = d * d
    n = 16
    while n > 1:
        n //= 2
        for j in range(n):
            e[j] = e[2 * j] + e[2 * j + 1]
    return e[0]


@njit
def quantize_4over6_kernel(x, amax, numerator, codes, scales, out, want_out, nib, sv):
    """`quantize_kernel` under the 4over6 block scale (reference.select_4over6): per block both candidate
    scales (s6 and s4 = clamp(s6 * 1.5)), each rounded to E4M3 and quantizing the block; the 4-candidate
    where its error is strictly lower (a tie or a NaN keeps 6). `numerator` must be NUMERATOR["4over6"]."""
    R, K = x.shape
    NB = K // 16
    fbuf = np.empty(1, dtype=np.float32)
    ibuf = fbuf.view(np.int32)
    c6 = np.empty(16, dtype=np.int64)
    c4 = np.empty(16, dtype=np.int64)
    e = np.empty(16, dtype=np.float32)
    for r in range(R):
        g_enc, g_dec = global_dec(amax[r], numerator)
        row_bad = not np.isfinite(amax[r])
        g6 = g_enc * SIXTH
        for b in range(NB):
            base = b * 16
            amax_b, bad = block_amax(x, r, base)
            if bad or row_bad:
                write_bad_block(codes, scales, out, r, b, want_out, sv[0x7F] * g_dec, nib)
                continue
            s6 = _clamp_scale(amax_b * g6)
            fbuf[0] = s6
            byte6, value6 = round_e4m3(s6, np.int64(ibuf[0]), sv)
            s4 = _clamp_scale(s6 * FOUR_OVER_SIX)
            fbuf[0] = s4
            byte4, value4 = round_e4m3(s4, np.int64(ibuf[0]), sv)
            err6 = _candidate(x, r, base, value6, g_dec, nib, c6, e)
            err4 = _candidate(x, r, base, value4, g_dec, nib, c4, e)
            four = err4 < err6
            byte = byte4 if four else byte6
            cs = c4 if four else c6
            scales[r, b] = byte
            m = sv[byte] * g_dec
            for j in range(0, 16, 2):
                codes[r, (base + j) // 2] = cs[j] | (cs[j + 1] << 4)
                if want_out:
                    out[r, base + j] = nib[cs[j]] * m
                    out[r, base + j + 1] = nib[cs[j + 1]] * m


@njit
def block_scale_enc(amax_b, g6, g_dec, fbuf, ibuf, sv):
    """Steps 2 and 3 of the contract for one block of amax amax_b: (its E4M3 scale byte, the encode factor
    1 / (scale * g_dec), clamped to FLT_MAX). fbuf / ibuf: a float32 scratch and its int32 view."""
    s = _clamp_scale(amax_b * g6)  # step 2: the unrounded scale, clamped (NaN -> 0), then E4M3
    fbuf[0] = s
    byte, s_value = round_e4m3(s, np.int64(ibuf[0]), sv)
    # step 3
    enc = F32(1.0) / (s_value * g_dec)
    if enc > FLT_MAX:
        enc = FLT_MAX
    return byte, enc


@njit
def round_e4m3(s, bits, sv):
    """Step 2's E4M3 rounding of one scale `s` in [0, 448] (not NaN) whose float32 bit pattern is `bits`:
    (byte, its value). A normal scale rounds its bit pattern to 3 mantissa bits, ties to even (the
    rounded float32 is exactly sv[byte]); a subnormal one rounds s * 512 half to even."""
    if s >= MIN_NORMAL:
        rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~np.int64(0xFFFFF)
        byte = ((((rounded >> 23) & 0xFF) - 120) << 3) | ((rounded >> 20) & 0x7)
        return byte, sv[byte]
    v = s * F32(512.0)
    f = np.int64(v)  # v >= 0: truncation is the floor
    d = v - F32(f)
    if d > F32(0.5) or (d == F32(0.5) and (f & 1) == 1):
        f += 1
    return f, F32(f) * SUB_STEP


@njit
def e2m1_code(t):
    """Step 4: the signed E2M1 code of t in [-6, 6] (ties to the even mantissa)."""
    a = abs(t)
    i = 0
    if a > F32(0.25):
        i += 1
    if a >= F32(0.75):
        i += 1
    if a > F32(1.25):
        i += 1
    if a >= F32(1.75):
        i += 1
    if a > F32(2.5):
        i += 1
    if a >= F32(3.5):
        i += 1
    if a > F32(5.0):
        i += 1
    if t < F32(0.0):
        i |= 8
    return i


@njit
def dequantize_kernel(codes, scales, amax, numerator, nib, sv, out):
    """codes u8 [R, K/2], scales u8 [R, K/16], amax f32 [R] -> out f32 [R, K] = e2m1 * (e4m3 * g_dec)."""
    R = codes.shape[0]
    NB = scales.shape[1]
    for r in range(R):
        g_dec = global_dec(amax[r], numerator)[1]
        for b in range(NB):
            m = sv[scales[r, b]] * g_dec
            for j in range(8):
                c = codes[r, b * 8 + j]
                out[r, b * 16 + 2 * j] = nib[c & 0xF] * m
                out[r, b * 16 + 2 * j + 1] = nib[c >> 4] * m


def quantize(x2: torch.Tensor, amax: torch.Tensor, out_dtype=None, block_scale: str = "6"):
    """RTN rows: x2 [R, K] (float32 / bf16 / fp16), amax f32 [R] -> (codes u8 [R, K/2], scales u8
    [R, K/16], dequantized values in out_dtype or None), under the block scale rule `block_scale`."""
    CALLS["quantize" if block_scale == "6" else f"quantize_{block_scale}"] += 1
    R, K = x2.shape
    xf = x2.to(torch.float32).contiguous()  # exact for bf16 / fp16
    codes = np.empty((R, K // 2), dtype=np.uint8)
    scales = np.empty((R, K // 16), dtype=np.uint8)
    out = np.empty((R, K) if out_dtype is not None else (0, 0), dtype=np.float32)
    nib, sv = tables()
    kernel = quantize_kernel if block_scale == "6" else quantize_4over6_kernel
    kernel(xf.numpy(), np_view(amax), NUMERATOR[block_scale], codes, scales, out, out_dtype is not None, nib, sv)
    codes, scales = torch.from_numpy(codes), torch.from_numpy(scales)
    if out_dtype is None:
        return codes, scales, None
    return codes, scales, torch.from_numpy(out).to(out_dtype)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, block_scale: str = "6") -> torch.Tensor:
    """f32 [R, K] from codes u8 [R, K/2], scales u8 [R, K/16], amax f32 [R] (either block scale: the
    rule only sets the global scale's numerator)."""
    CALLS["dequantize"] += 1
    R = codes.shape[0]
    out = torch.empty((R, codes.shape[1] * 2), dtype=torch.float32)
    nib, sv = tables()
    dequantize_kernel(np_view(codes), np_view(scales), np_view(amax), NUMERATOR[block_scale], nib, sv, out.numpy())
    return out
