"""Native attention straight from the packed NVFP4 KV pages (the CPU twin of `trace_kernels.attention`'s
Triton decode kernel), for vLLM's CPU_ATTN packed cache (trace_vllm_plugin.kv_packed).

Why: the scratch read decodes every used block into a model-dtype scratch cache each layer call, has
vLLM's `cpu_attn_reshape_and_cache` re-lay it out, then runs vLLM's C++ kernel: three passes over the
whole context per layer per step (25% of the native engine's time). Here one kernel decodes each K/V
row of a request once per KV head, into float32 buffers, and attends from them.

How the decode is fast (_decode_all): all of the call's rows (every request, every KV head) at once:
their scales (as E4M3 values) and amax laid out along the rows, then loops along the rows that vectorise: g_dec and
each block's two table values as bits; then every value's bits by integer selects and adds on 16 lanes
from a block's 8 code bytes (vec16._build16), K transposed ([d, row]: 16 rows' blocks transposed in
registers) and V along the rows ([row, d], as the output loop reads it). ~0.3 ns a value where a per-row, per-block table with per-value lookups (_decode_row, kept for
the rows outside its fast range) took ~1 ns.

What it computes, per request r (query tokens query_start_loc[r]..[r+1], seq_lens[r] tokens in the
cache, its new ones included), per query head (grouped-query: KV head h serves query heads h*G ..
h*G+G-1), per query token i of the request at position p = seq_len - n_query + i (causal: keys 0..p):
  - each K/V value decoded as the scratch holds it: e2m1(code) * (e4m3(scale) * g_dec) in float32
    (kv.dequantize_blocks_kernel's arithmetic), rounded to bf16 nearest-even when the model dtype is
    bf16 (to_bf16), kept float32 when it is float32;
  - scores: sum over d, in order, of q[d] * k[d] in float32 (q the model-dtype query, exact in float32),
    times scale (float32); softmax with the float32 max subtracted, expf in float32 (exp16:
    glibc's FMA expf in 16 lanes, the bits of the scalar libm call it replaced, on a glibc x86-64 host with FMA);
  - out[dv] = (sum over keys, in order, of p * v[dv]) / (sum of p), float32, then rounded to the model dtype
    as torch's cast does: bf16 nearest-even on the bits, written in place into the result (checked against
    torch's cast on every non-NaN float32; a call with a NaN result is cast by torch itself, packed_attention).
Every output element's arithmetic runs in a fixed order, whatever the batch holds: a request's result
does not depend on the other requests (batch invariant) nor on a thread count. On request (`parallel=True`)
and with more than one numba thread the (request, KV head) pairs run in parallel (`numba.prange`, each pair
on its own buffers, the serial kernel's arithmetic, the same bits). In vLLM's CPU worker torch runs its
ops on its own OpenMP threads (OMP_NUM_THREADS; 1 in the benches) and numba's pool works only inside this
call while torch waits, so they never compute at once; but numba's OpenMP workers spin after each call,
and the engine is slower for it on a shared 2-core machine (docs/measurements.md), so the plugin runs the
serial kernel.

It is NOT bit-identical to the scratch path: vLLM's CPU kernel sums in its own (vectorised, tiled,
online-softmax) order, so outputs can differ in the last float32 bits and then by one bf16 ulp after
rounding. The values attended to are the same bits (the K/V records, made by the write, are untouched).
Tested against the torch reference (`trace_kernels.attention.reference.packed_attention`) within a
stated tolerance (tests/kernels/test_cpu_native_attention.py).
"""

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import carray
from numba.core import types
from numba.extending import intrinsic, overload

from ..kv_layout import packed_row_bytes
from . import as_numpy, njit
from .quantize import CALLS, NUMERATOR, global_dec, tables
from .exp16 import exp16_shifted
from .pointers import uint16_pointer
from .vec16 import (build_cols16, build_row16, max16, scores16x1, scores16x4, wsum16x1, wsum16x1_total, wsum16x2,
                    wsum16x2_total, wsum16x4, wsum16x4_total)


@njit
def _bf16(x, fbuf, ibuf):
    """float32 x rounded to bf16 on its bits, nearest-even (torch's cast of a non-NaN value); NaN kept."""
    if x != x:
        return x
    fbuf[0] = x
    b = np.int64(ibuf[0]) & 0xFFFFFFFF
    ibuf[0] = np.int32(np.uint32(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16))
    return fbuf[0]


# |m| within these bounds: every product nib * m (|nib| in 0.5 .. 6) and its bf16 rounding are normal
# float32 numbers, so scaling by a power of two is exact and commutes with the rounding.
_M_LO = np.float32(2.0**-124)
_M_HI = np.float32(2.0**120)


@njit
def _decode_row(prow, base, n, numerator, nib, sv, to_bf16, dst, fbuf, ibuf, tab):
    """Packed row bytes `prow` (its K or V part starting at byte `base`) of n values -> dst[:n], the values
    a model-dtype scratch holds: e2m1(code) * m, m = e4m3(scale) * g_dec, float32, then (to_bf16) rounded
    to bf16. Per 16-value block a 16-entry table of those values is built and the codes look it up: the
    E2M1 magnitudes are {0.5, 1, 2, 4} x {1, 1.5} and 0, so (m in the normal range, _M_LO .. _M_HI) two
    products and roundings give them all, bf16(2^k * x) = 2^k * bf16(x) exactly for normal numbers.
    Outside that range (or a NaN scale) each entry is computed alone, product then rounding."""
    nc = n // 2
    a = base + nc + n // 16
    ibuf[0] = np.int32(np.int64(prow[a]) | (np.int64(prow[a + 1]) << 8) | (np.int64(prow[a + 2]) << 16)
                       | (np.int64(prow[a + 3]) << 24))
    g_dec = global_dec(fbuf[0], numerator)[1]
    half = np.float32(0.5)
    two = np.float32(2.0)
    four = np.float32(4.0)
    for blk in range(n // 16):
        m = sv[prow[base + nc + blk]] * g_dec
        if m >= _M_LO and m <= _M_HI:
            r1 = m
            r15 = nib[3] * m  # 1.5 * m
            if to_bf16:
                r1 = _bf16(r1, fbuf, ibuf)
                r15 = _bf16(r15, fbuf, ibuf)
            tab[0] = np.float32(0.0)
            tab[1] = half * r1
            tab[2] = r1
            tab[3] = r15
            tab[4] = two * r1
            tab[5] = two * r15
            tab[6] = four * r1
            tab[7] = four * r15
            for i in range(8):
                tab[8 + i] = -tab[i]
        else:
            for i in range(16):
                v = nib[i] * m
                tab[i] = _bf16(v, fbuf, ibuf) if to_bf16 else v
        o = blk * 16
        cb = base + blk * 8
        for j in range(8):
            c = prow[cb + j]
            dst[o + 2 * j] = tab[c & 0xF]
            dst[o + 2 * j + 1] = tab[c >> 4]


@intrinsic
def _f32_bits(typingctx, x):
    """The bits of float32 x as a uint32 (a register bitcast: no store and reload through memory)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, b):
    """The float32 whose bits are uint32 b."""
    if b != types.uint32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


def _as_f32(x):
    """A query element as float32: float32 as it is, a bf16's bits (uint16) widened exactly."""
    raise NotImplementedError("numba only")


@overload(_as_f32, inline="always")
def _as_f32_impl(x):
    if x == types.float32:
        return lambda x: x
    if x == types.uint16:
        return lambda x: _bits_f32(_U(_U(x) << _U(16)))
    return None


def _to_out(x, out):
    """float32 result x as `out` holds it: float32 as it is; for a uint16 (bf16 bits) `out`, x rounded to bf16
    nearest-even on its bits (torch's float -> bf16 cast of a non-NaN value; a NaN is the caller's: see
    packed_attention)."""
    raise NotImplementedError("numba only")


@overload(_to_out, inline="always")
def _to_out_impl(x, out):
    if out.dtype == types.float32:
        return lambda x, out: x
    if out.dtype == types.uint16:
        def to_bits(x, out):
            b = _f32_bits(x)
            return np.uint16(_U(_U(b + _U(0x7FFF) + (_U(b >> _U(16)) & _U(1))) >> _U(16)))
        return to_bits
    return None


_U = np.uint32  # the bit-building loops run in uint32 lanes (numba widens plain ints to int64: half the lanes)
_U64 = np.uint64


@njit
def _gather_scales(pf, off, part, N, nc, nb, sv, scalev, amax):
    """The K or V parts' (first byte `part`) block scales and amax of rows i < N at byte offsets off[i] of the flat
    page pf (nc code bytes, nb scale bytes, the float32 amax) laid out along the rows: scalev [nb, >= N] the E4M3
    value of each scale byte (sv[byte], float32), amax [>= N] (uint32 bits). Why the value and not the byte: the
    table lookup is a gather, which kept _block_bits' loops scalar (~9.5 us a part on attn7's decode shape); here,
    in a loop that reads scattered bytes anyway, it costs ~0.5 us. The code bytes are read from the page itself by
    the 16-lane builds (vec16)."""
    for i in range(N):
        o = _U64(off[i] + part)
        for j in range(nb):
            scalev[j, i] = sv[pf[o + _U64(nc + j)]]
        a = o + _U64(nc + nb)
        amax[i] = _U(_U(pf[a]) | (_U(pf[a + _U64(1)]) << _U(8)) | (_U(pf[a + _U64(2)]) << _U(16))
                     | (_U(pf[a + _U64(3)]) << _U(24)))


@njit
def _row_bits(N, scale_row, gdec, nib3, to_bf16, b1r, b15r, fast):
    """One block of rows i < N: b1r[i], b15r[i] the bits of r1 = m, r15 = 1.5 m (m = scale_row[i] * gdec[i]), each
    rounded to bf16 when to_bf16; fast[i] cleared when m is outside _M_LO .. _M_HI (or NaN). One-dimensional
    contiguous rows and no table lookup: the loop vectorises (16 lanes)."""
    for i in range(N):
        m = scale_row[i] * gdec[i]
        b1 = _f32_bits(m)
        b15 = _f32_bits(nib3 * m)
        if to_bf16:  # _bf16 on the bits (m, 1.5 m positive finite where used: no NaN, no carry out of 32 bits)
            b1 = _U(_U(b1 + _U(0x7FFF) + (_U(b1 >> _U(16)) & _U(1))) >> _U(16)) << _U(16)
            b15 = _U(_U(b15 + _U(0x7FFF) + (_U(b15 >> _U(16)) & _U(1))) >> _U(16)) << _U(16)
        b1r[i] = b1
        b15r[i] = b15
        fast[i] &= np.uint8((m >= _M_LO) & (m <= _M_HI))


@njit
def _block_bits(N, nb, amax, scalev, numerator, nib3, to_bf16, gdec, bits, fast):
    """Per row i < N and block: the bits of r1 and r15 of _decode_row's fast-path table (its arithmetic:
    g_dec = global_dec(amax), m = e4m3(scale) * g_dec, r1 = m, r15 = 1.5 m, each rounded to bf16 when to_bf16)
    into bits [2 blk, i], [2 blk + 1, i]; fast[i] = 0 when a block's m is outside _M_LO .. _M_HI (or NaN):
    that row part then takes _decode_row. scalev: the scales' E4M3 values (_gather_scales). Loops along the rows
    (they vectorise): gdec [>= N] scratch."""
    af = amax.view(np.float32)
    for i in range(N):
        gdec[i] = global_dec(af[i], numerator)[1]
        fast[i] = 1
    for blk in range(nb):
        _row_bits(N, scalev[blk], gdec, nib3, to_bf16, bits[2 * blk], bits[2 * blk + 1], fast)


@njit
def _slow_rows(page_rows, off, fast, N, n, part, numerator, nib, sv, to_bf16, row, fbuf, tab, dst, along_rows):
    """The rows with a block outside the fast range (fast[i] == 0) by _decode_row, into dst [n, >= N] or, along_rows,
    [>= N, n]: the same values the fast path would have written there."""
    W = page_rows.shape[1]
    for i in range(N):
        if fast[i] == 0:
            _decode_row(page_rows[off[i] // W], part, n, numerator, nib, sv, to_bf16, row, fbuf, fbuf.view(np.int32),
                        tab)
            for d in range(n):
                if along_rows:
                    dst[i, d] = row[d]
                else:
                    dst[d, i] = row[d]


@njit
def _decode_part(pf, off, N, n, part, numerator, nib, sv, to_bf16, dst, bufs, page_rows):
    """One part (K or V: `part` its first byte in a row) of rows i < N (flat-page byte offset off[i]) decoded,
    _decode_row's values bit for bit, transposed: dst [n, >= N + 16] (its columns N .. N + 15 zeroed). Why not
    _decode_row per row: its per-block table (two roundings through memory, 16 stores) and per-value lookups cost
    ~1 ns a value. Here the scales (E4M3 values) and amax are laid out along the rows, each block's r1 / r15 bits computed
    in loops along the rows (_block_bits), then each block of 16 rows built in 16-lane registers from the page's
    code bytes and transposed there (vec16.build_cols16). Rows with a block outside the fast
    range take _decode_row (page_rows: pf as rows)."""
    scalev, amax, gdec, bits, fast, row, fbuf, tab = bufs
    nb = n // 16
    _gather_scales(pf, off, part, N, n // 2, nb, sv, scalev, amax)
    _block_bits(N, nb, amax, scalev, numerator, nib[3], to_bf16, gdec, bits, fast)
    dstu = dst.view(np.uint32)
    kstride = dst.shape[1]
    for blk in range(nb):
        b1r, b15r = bits[2 * blk], bits[2 * blk + 1]
        for i0 in range(0, N, 16):  # the last group's rows past N repeat row N - 1 into the padding columns
            build_cols16(dstu, kstride, 16 * blk, i0, pf, off, part + 8 * blk, b1r, b15r, N)
    dst[:, N:] = np.float32(0.0)  # the score loop reads 16 columns past the rows (scores dropped): zero, not garbage
    _slow_rows(page_rows, off, fast, N, n, part, numerator, nib, sv, to_bf16, row, fbuf, tab, dst, False)


@njit
def _decode_part_rows(pf, off, N, n, part, numerator, nib, sv, to_bf16, dst, bufs, page_rows):
    """_decode_part's values, bit for bit, laid out along the rows: dst [>= N, n] (V, which the output loop reads a
    row at a time: no transpose back per (request, KV head), ~22 us a decode call). The codes are read straight
    from the page, 8 bytes a block, and built in 16 lanes (vec16.build_row16)."""
    scalev, amax, gdec, bits, fast, row, fbuf, tab = bufs
    nb = n // 16
    _gather_scales(pf, off, part, N, n // 2, nb, sv, scalev, amax)
    _block_bits(N, nb, amax, scalev, numerator, nib[3], to_bf16, gdec, bits, fast)
    dstu = dst.view(np.uint32)
    for i in range(N):
        o = off[i] + part
        for blk in range(nb):
            build_row16(dstu, i * n + 16 * blk, pf, o + 8 * blk, bits[2 * blk, i], bits[2 * blk + 1, i])
    _slow_rows(page_rows, off, fast, N, n, part, numerator, nib, sv, to_bf16, row, fbuf, tab, dst, True)


@njit
def _decode_all(page, table, seq_lens, qsl, D, DV, numerator, nib, sv, to_bf16):
    """Every request's first seq_len cache rows of every KV head decoded (none for a request without query
    tokens: as before, its block table row is never read) (_decode_row's values, bit for bit), K
    into kt [D, N + 16] transposed (16 zero columns past the rows) and V into v [N, DV] along the rows; the rows
    of (request r, KV head h) are K's columns / V's rows start[r * H + h] onward. All of the call's rows at once: the loops along them are long enough to vectorise well."""
    B, H, block, W = page.shape
    R = seq_lens.shape[0]
    start = np.empty(R * H + 1, dtype=np.int64)
    start[0] = 0
    for r in range(R):
        for h in range(H):
            start[r * H + h + 1] = start[r * H + h] + (max(seq_lens[r], 0) if qsl[r + 1] > qsl[r] else 0)
    N = start[R * H]
    off = np.empty(N, dtype=np.int64)
    for r in range(R):
        for h in range(H):
            c0 = start[r * H + h]
            L = start[r * H + h + 1] - c0
            for b in range((L + block - 1) // block):  # block by block: no integer division per row (~7 us a call)
                o = (table[r, b] * H + h) * block * W
                t0 = b * block
                for t in range(min(block, L - t0)):
                    off[c0 + t0 + t] = o + t * W
    n = max(D, DV)
    bufs = (np.empty((n // 16, N), dtype=np.float32), np.empty(N, dtype=np.uint32), np.empty(N, dtype=np.float32),
            np.empty((n // 8, N), dtype=np.uint32), np.empty(N, dtype=np.uint8), np.empty(n, dtype=np.float32),
            np.empty(1, dtype=np.float32), np.empty(16, dtype=np.float32))
    pf = page.reshape(B * H * block * W)
    page_rows = page.reshape(B * H * block, W)
    kt = np.empty((D, N + 16), dtype=np.float32)  # 16 columns past the rows: the score loop's last 16 keys
    v = np.empty((N, DV), dtype=np.float32)
    _decode_part(pf, off, N, D, 0, numerator, nib, sv, to_bf16, kt, bufs, page_rows)
    _decode_part_rows(pf, off, N, DV, D // 2 + D // 16 + 4, numerator, nib, sv, to_bf16, v, bufs, page_rows)
    return kt, v, start


@njit
def _attend(q, qsl, L, scale, D, DV, out, r, h, H, kt, c0, v, s, acc, qf):
    """Request r's query tokens, the query heads of KV head h: their outputs in `out` (the module docstring's
    arithmetic), from its L decoded rows: K kt[:, c0 + t], V v[c0 + t, :] (_decode_all). s [>= L + 16], acc [DV],
    qf [D]: scratch. The score and output sums run in 16-lane vectors held in registers (vec16: each lane the
    scalar loop's multiply then add, in order): the scores 16 keys at a time (the last keys' block reads kt's
    columns past the pair's rows, whose scores are never used), the output 16 head-dim values at a time; the softmax's
    exponentials 16 keys at a time (exp16; the lanes past the last key are computed and never read)."""
    Hq = q.shape[1]
    G = Hq // H
    zero = np.float32(0.0)
    q0 = qsl[r]
    nq = qsl[r + 1] - q0
    nan = 0
    if nq <= 0 or L <= 0:
        return nan
    kstride = kt.shape[1]
    for i in range(nq):
        last = L - nq + i + 1  # keys 0 .. last - 1 (causal)
        if last <= 0:  # a query before any key (cannot happen in vLLM): no keys, output 0
            for g in range(G):
                for d in range(DV):
                    out[q0 + i, h * G + g, d] = _to_out(zero, out)
            continue
        n16 = (last + 15) // 16
        for g in range(G):
            hq = h * G + g
            for d in range(D):
                qf[d] = _as_f32(q[q0 + i, hq, d])
            c = 0
            while c + 4 <= n16:  # s[t] = (sum over d, in order from 0, of q[d] * k[d, t]) * scale
                scores16x4(s, 16 * c, qf, kt, c0 + 16 * c, kstride, D, scale)
                c += 4
            while c < n16:
                scores16x1(s, 16 * c, qf, kt, c0 + 16 * c, kstride, D, scale)
                c += 1
            mx = max16(s, last)  # the scalar max's value, 16 keys at a time
            for t0 in range(0, last, 16):  # s[t] = expf(s[t] - mx), 16 keys at a time (exp16: libm's bits)
                exp16_shifted(s, t0, mx)
            # acc[d] = sum over keys, in order from 0, of p[t] * v[t, d]; the first wsum call also returns the
            # denominator, sum over keys in order from 0 of p[t] (its own loop before: a chain of dependent adds)
            if DV >= 64:
                denom = wsum16x4_total(acc, s, last, v, c0 * DV, DV)
                d0 = 64
            elif DV >= 32:
                denom = wsum16x2_total(acc, s, last, v, c0 * DV, DV)
                d0 = 32
            else:
                denom = wsum16x1_total(acc, s, last, v, c0 * DV, DV)
                d0 = 16
            while d0 + 64 <= DV:
                wsum16x4(acc[d0:], s, last, v, c0 * DV + d0, DV)
                d0 += 64
            while d0 + 32 <= DV:
                wsum16x2(acc[d0:], s, last, v, c0 * DV + d0, DV)
                d0 += 32
            while d0 < DV:
                wsum16x1(acc[d0:], s, last, v, c0 * DV + d0, DV)
                d0 += 16
            for d in range(DV):
                x = acc[d] / denom
                nan += x != x
                out[q0 + i, hq, d] = _to_out(x, out)
    return nan


@njit
def packed_attention_kernel(q, page, table, seq_lens, qsl, scale, D, DV, numerator, nib, sv, to_bf16, out):
    """q f32 [T, Hq, D]; page u8 [B, H, block, row_k + row_v]; table [R, M], seq_lens [R], qsl [R + 1]
    (query_start_loc): int32 or int64; out f32 [T, Hq, DV]. Causal attention of each request's query
    tokens over its first seq_len cache rows, one (request, KV head) after the other."""
    H = page.shape[1]
    kt, v, start = _decode_all(page, table, seq_lens, qsl, D, DV, numerator, nib, sv, to_bf16)
    max_len = 0
    for r in range(seq_lens.shape[0]):
        max_len = max(max_len, seq_lens[r])
    s = np.empty(max_len + 16, dtype=np.float32)
    acc, qf = np.empty(DV, dtype=np.float32), np.empty(D, dtype=np.float32)
    nan = 0
    for r in range(seq_lens.shape[0]):
        for h in range(H):
            nan += _attend(q, qsl, seq_lens[r], scale, D, DV, out, r, h, H, kt, start[r * H + h], v, s, acc, qf)
    return nan


@njit(parallel=True)
def packed_attention_kernel_parallel(q, page, table, seq_lens, qsl, scale, D, DV, numerator, nib, sv, to_bf16, out):
    """packed_attention_kernel with the (request, KV head) pairs' attention spread over numba's threads (the
    decode before it serial): each pair's arithmetic is the serial kernel's, in the same order, on its own
    buffers, so the outputs are the same bits."""
    H = page.shape[1]
    kt, v, start = _decode_all(page, table, seq_lens, qsl, D, DV, numerator, nib, sv, to_bf16)
    nan = 0
    for rh in numba.prange(seq_lens.shape[0] * H):
        r, h = rh // H, rh % H
        L = max(seq_lens[r], 1)
        nan += _attend(q, qsl, seq_lens[r], scale, D, DV, out, r, h, H, kt, start[rh], v,
                       np.empty(L + 16, dtype=np.float32), np.empty(DV, dtype=np.float32), np.empty(D, dtype=np.float32))
    return nan


def unsupported(dtype: torch.dtype, block_scale: str, head_size: int, head_size_v: int, num_heads: int,
                num_kv_heads: int) -> str | None:
    """Why a layer's shape or config is outside this kernel (the caller then runs the scratch path, counted),
    or None. Per-layer features (sliding window, ALiBi, soft-cap, sinks) are the caller's check
    (kv_packed.decode_kernel_unsupported)."""
    if dtype not in (torch.bfloat16, torch.float32):
        return f"model dtype {dtype} (the kernel rounds K/V to bf16 or keeps float32)"
    if block_scale not in NUMERATOR:
        return f"block scale {block_scale!r}"
    if head_size % 16 or head_size_v % 16:
        return f"head sizes {head_size} / {head_size_v} (NVFP4 rows of 16-value blocks)"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads over {num_kv_heads} KV heads"
    return None


def _index_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of an integer index tensor as the kernel reads it: vLLM's int32 (and int64) ones as they are
    (the kernel is compiled for either; a .to(int64) per tensor per call cost ~2 us each), others as int64."""
    if _is_view(t):
        return t.numpy()
    return as_numpy(t.to(torch.int64))


def index_views(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor):
    """(table, seq_lens, query_start_loc, views): the index tensors as the kernel reads them, whole (the kernel
    reads rows r < len(seq_lens) of the table and entries r <= len(seq_lens) of query_start_loc, so no slice:
    a `[:R]` per tensor and call cost ~1.3 us), and whether all three are views of the tensors' memory (then a
    caller may keep them while it keeps the tensors: they read the values as they are at each call)."""
    arrays = (_index_array(block_table), _index_array(seq_lens), _index_array(query_start_loc))
    return (*arrays, all(_is_view(t) for t in (block_table, seq_lens, query_start_loc)))


def _is_view(t: torch.Tensor) -> bool:
    """Whether _index_array hands back a view of t's memory (not a converted copy)."""
    return t.dtype in (torch.int32, torch.int64) and t.device.type == "cpu" and t.is_contiguous()


def _check_pages(kv_cache: torch.Tensor, dtype: torch.dtype, block_scale: str, D: int, DV: int, Hq: int) -> int:
    """The packed cache's KV head count, after the checks every call path makes: uint8 pages whose rows hold the
    K and V head sizes, and a query dtype, block scale and head shape the kernel supports (ValueError naming it)."""
    B, H, block, width = kv_cache.shape
    if kv_cache.dtype != torch.uint8 or width != packed_row_bytes(D) + packed_row_bytes(DV):
        raise ValueError(f"packed KV pages {kv_cache.dtype} {tuple(kv_cache.shape)} do not hold head sizes {D} / {DV}")
    why = unsupported(dtype, block_scale, D, DV, Hq, H)
    if why is not None:
        raise ValueError(f"native packed attention: {why}")
    return H


def packed_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, scale: float, head_size_v: int | None = None,
                     block_scale: str = "6", out: torch.Tensor | None = None, parallel: bool = False,
                     held: tuple | None = None) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] (model dtype: bf16 or float32) over the packed cache uint8
    [blocks, H, block_size, row_k + row_v]: request r's query tokens are rows query_start_loc[r] ..
    query_start_loc[r + 1] - 1, the last ones of its seq_lens[r] tokens, whose blocks are block_table[r].
    Returns (or fills `out`, any [T, Hq * DV]-shaped view; a contiguous bf16 or float32 one is written in place)
    [T, Hq, DV] in q's dtype. `parallel` (and numba
    running more than one thread, NUMBA_NUM_THREADS): the (request, KV head) pairs spread over numba's
    threads, the same bits as the serial kernel. Off by default, and the vLLM plugin does not ask for it:
    measured in the engine it halves the kernel's time but its idle OpenMP workers spin between calls,
    which on a small shared machine cost more than they save (docs/measurements.md).
    R requests need a block table of ceil(seq_len / block)
    columns each (vLLM's is always that wide; not checked per call). `held`: the numpy views
    (page, table, seq_lens, query_start_loc) of kv_cache and the three index tensors as index_views makes
    them, which the engine's caller keeps across calls (kv_packed: ~8 us a layer call); None makes them here."""
    CALLS["kv_attention"] += 1
    T, Hq, D = q.shape
    DV = head_size_v or D
    H = _check_pages(kv_cache, q.dtype, block_scale, D, DV, Hq)
    R = seq_lens.shape[0]
    if query_start_loc.shape[0] < R + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for {R} requests")
    nib, sv = tables()
    threaded = parallel and numba.get_num_threads() > 1 and R * H > 1
    kernel = packed_attention_kernel_parallel if threaded else packed_attention_kernel
    res = torch.empty((T, Hq, DV), dtype=q.dtype) if out is None else out.view(T, Hq, DV)
    page, table, lens, qsl = (as_numpy(kv_cache), *index_views(block_table, seq_lens, query_start_loc)[:3]) \
        if held is None else held
    args = (as_numpy(q), page, table, lens, qsl, np.float32(scale), D, DV, NUMERATOR[block_scale], nib, sv,
            q.dtype == torch.bfloat16)
    # The query read as it is (bf16 bits or float32) and the result written in place as `out` holds it (bf16 bits
    # or float32): no float32 copy of q, no float32 result and cast (~5 us a decode call).
    direct = res.dtype in (torch.bfloat16, torch.float32) and res.is_contiguous()
    nan = kernel(*args, as_numpy(res)) if direct else 0
    if not direct or (nan and res.dtype == torch.bfloat16):
        # The kernel's bf16 rounding is torch's cast for every value but NaN, whose bits differ between torch's
        # vectorised and scalar loops (so with the layout): a call with a NaN result (only NaN inputs make one),
        # or a result tensor the kernel does not write, is computed into float32 and cast by torch, as before;
        # counted, as the second kernel run it is.
        CALLS["kv_attention_cast_by_torch"] += 1
        outf = torch.empty((T, Hq, DV), dtype=torch.float32)
        kernel(*args, outf.numpy())
        res.copy_(outf)
    return res if out is None else out



@njit
def packed_attention_bf16_at(q_address, out_address, T, Hq, page, table, seq_lens, qsl, scale, D, DV, numerator, nib,
                             sv):
    """packed_attention_kernel with a bf16 query and result given as the addresses of C-contiguous tensors (the
    caller holds them for the call): q [T, Hq, D] and out [T, Hq, DV] read and written as their bf16 bits (uint16),
    as packed_attention hands them over as numpy views. The same kernel on the same values, without the two views
    (`as_numpy` of q and of the result, ~2.4 us each a call)."""
    q = carray(uint16_pointer(q_address), (T, Hq, D))
    out = carray(uint16_pointer(out_address), (T, Hq, DV))
    return packed_attention_kernel(q, page, table, seq_lens, qsl, scale, D, DV, numerator, nib, sv, True, out)


def layer_consts(kv_cache: torch.Tensor, num_heads: int, head_size: int, head_size_v: int, block_scale: str,
                 scale: float) -> tuple:
    """packed_attention's checks of a layer's fixed inputs (the cache's dtype and row width, the shape and config),
    done once, and the kernel's fixed arguments for its bf16 calls: what packed_attention_bf16 takes. vLLM binds a
    layer one cache tensor, one shape and one scale for the engine's life (kv_packed holds this per cache address)."""
    D, DV = head_size, head_size_v
    _check_pages(kv_cache, torch.bfloat16, block_scale, D, DV, num_heads)
    nib, sv = tables()
    return num_heads, D, DV, {(num_heads * DV,), (num_heads, DV)}, np.float32(scale), NUMERATOR[block_scale], nib, sv


def packed_attention_bf16(q: torch.Tensor, out: torch.Tensor, T: int, held: tuple, consts: tuple):
    """packed_attention(q[:T], ..., out=out[:T], held=held) for the engine's usual call, or None where that call
    must take packed_attention itself: a bf16 query [>= T, Hq, D] and result ([>= T, Hq * DV] or [>= T, Hq, DV]),
    both C-contiguous, their first T rows used in place (no slices). `consts`: layer_consts of the layer (its
    checks done there once); `held`: the (page, table, seq_lens, query_start_loc) views packed_attention takes.
    The same kernel on the same values and the same NaN rule (a call with a NaN result is computed into float32
    and cast by torch, counted), without the per-call views, slices and checks (~15 us of Python a call)."""
    Hq, D, DV, out_tails, scale, numerator, nib, sv = consts
    qs = q.shape
    if not (q.dtype == torch.bfloat16 and out.dtype == torch.bfloat16 and len(qs) == 3 and qs[0] >= T and qs[1] == Hq
            and qs[2] == D and out.shape[0] >= T and out.shape[1:] in out_tails and q.is_contiguous()
            and out.is_contiguous()):
        return None
    CALLS["kv_attention"] += 1
    page, table, lens, qsl = held
    if packed_attention_bf16_at(q.data_ptr(), out.data_ptr(), T, Hq, page, table, lens, qsl, scale, D, DV, numerator,
                                nib, sv):
        CALLS["kv_attention_cast_by_torch"] += 1  # as packed_attention: the kernel's second run, float32, torch's cast
        outf = torch.empty((T, Hq, DV), dtype=torch.float32)
        packed_attention_kernel(as_numpy(q[:T]), page, table, lens, qsl, scale, D, DV, numerator, nib, sv, True,
                                outf.numpy())
        out[:T].view(T, Hq, DV).copy_(outf)
    return out
