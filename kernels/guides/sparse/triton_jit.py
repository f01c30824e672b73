"""Triton source of the sparse guide's kernels: the encoder's payload bits and the decoder's syndromes
and flip-pattern search. Bit-identical with the torch reference (codec.py / fused_encode.py, parity.py,
search.py): syndromes are XORs of the same H columns; the search sums the same float32 costs in the
same order (candidate 0, 1, ...) and breaks ties the same way (the first pattern of the size-ordered
table, then the fewest flips).

Only source: `triton_launch` imports it compiled (CUDA tensors) and under the Triton interpreter (CPU
tensors).
"""

import triton
import triton.language as tl

INF = tl.constexpr(float("inf"))
NO_PATTERN = tl.constexpr(1 << 30)


# Reductions name Triton's own combine functions (tl.standard._sum_combine, _elementwise_min/_max):
# the interpreter runs exactly those as one numpy reduction and any other combine function element by
# element in Python (minutes for one search). tl.sum / tl.min themselves are @triton.jit functions bound
# to the mode triton was first imported in, so the interpreted copy of this module could not call them.
@triton.jit
def _sum(v, axis: tl.constexpr):
    return tl.reduce(v, axis, tl.standard._sum_combine)


@triton.jit
def _min(v, axis: tl.constexpr):
    return tl.reduce(v, axis, tl.standard._elementwise_min)


@triton.jit
def _max(v, axis: tl.constexpr):
    return tl.reduce(v, axis, tl.standard._elementwise_max)


@triton.jit
def _parity_counts(v, col, M_PAD: tl.constexpr):
    """[BLOCK, M_PAD]: per syndrome bit i, how many set bits of rows v [BLOCK, n] (0/1) lie under row i
    of H (columns `col` int64 [n]); their parities are the syndrome (parity.syndrome's matmul, exact)."""
    i = tl.arange(0, M_PAD).to(tl.int64)
    h = (col[:, None] >> i[None, :]) & 1
    return _sum(v.to(tl.int64)[:, :, None] * h[None, :, :], 1)


@triton.jit
def _from_counts(counts, M_PAD: tl.constexpr):
    i = tl.arange(0, M_PAD).to(tl.int64)
    return _sum((counts & 1) << i[None, :], 1)


@triton.jit
def _store_bits(out_ptr, base, value, n, rows_ok, PAD: tl.constexpr):
    """Bits 0..n-1 of int64 `value` [BLOCK_R] to out[base + i] (one uint8 0/1 per bit, LSB first)."""
    i = tl.arange(0, PAD)
    bits = (value[:, None] >> i[None, :].to(tl.int64)) & 1
    tl.store(out_ptr + base[:, None] + i[None, :], bits.to(tl.uint8), mask=rows_ok[:, None] & (i[None, :] < n))


@triton.jit
def _encode_bits_kernel(
    code_ptr, scale_ptr, key_ptr, ccol_ptr, scol_ptr, out_ptr,
    R, K, ROW_BITS, A_BITS, M_S, M_C,
    SEG: tl.constexpr, BPS: tl.constexpr, A_PAD: tl.constexpr, MS_PAD: tl.constexpr, MC_PAD: tl.constexpr,
    SCALE_RAW: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """One segment `s` (program axis 1) of BLOCK_R rows: its scale syndrome (or raw scale LSBs) and
    code syndrome as payload bits, at the row's bit offset; segment 0 also writes the amax coset bits.
    out: uint8 [R * ROW_BITS], one 0/1 per payload bit."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    s = tl.program_id(1)
    ok = r < R
    r64 = r.to(tl.int64)
    base = r64 * ROW_BITS + A_BITS + s * (M_S + M_C)
    # code syndrome: element 2h is the low nibble of byte h, 2h + 1 the high one; the mantissa bit is a
    # nibble's bit 0
    h = tl.arange(0, SEG // 2)
    c = tl.load(code_ptr + r64[:, None] * (K // 2) + s * (SEG // 2) + h[None, :], mask=ok[:, None], other=0).to(tl.int32)
    col_even = tl.load(ccol_ptr + 2 * h)
    col_odd = tl.load(ccol_ptr + 2 * h + 1)
    counts = _parity_counts(c & 1, col_even, MC_PAD) + _parity_counts((c >> 4) & 1, col_odd, MC_PAD)
    syn = _from_counts(counts, MC_PAD)
    _store_bits(out_ptr, base + M_S, syn, M_C, ok, MC_PAD)
    # scale syndrome over the LSBs of the segment's block scales
    b = tl.arange(0, MS_PAD)
    lsb = tl.load(scale_ptr + r64[:, None] * (K // 16) + s * BPS + b[None, :], mask=ok[:, None] & (b[None, :] < BPS),
                  other=0).to(tl.int32) & 1
    if SCALE_RAW:  # every LSB is sent
        tl.store(out_ptr + base[:, None] + b[None, :], lsb.to(tl.uint8), mask=ok[:, None] & (b[None, :] < M_S))
    else:
        scol = tl.load(scol_ptr + b, mask=b < BPS, other=0)
        ssyn = _from_counts(_parity_counts(lsb, scol, MS_PAD), MS_PAD)
        _store_bits(out_ptr, base, ssyn, M_S, ok, MS_PAD)
    if s == 0:
        key = tl.load(key_ptr + r, mask=ok, other=0)
        _store_bits(out_ptr, r64 * ROW_BITS, key, A_BITS, ok, A_PAD)


@triton.jit
def _syndrome_kernel(bits_ptr, col_ptr, out_ptr, N, n, N_PAD: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """int64 [N]: H @ bits over GF(2) for 0/1 rows bits [N, n] (any integer dtype)."""
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, N_PAD)
    ok = i < N
    v = tl.load(bits_ptr + i[:, None].to(tl.int64) * n + j[None, :], mask=ok[:, None] & (j[None, :] < n), other=0)
    col = tl.load(col_ptr + j, mask=j < n, other=0)
    syn = _from_counts(_parity_counts(v & 1, col, M_PAD), M_PAD)
    tl.store(out_ptr + i, syn, mask=ok)


@triton.jit
def _pick_cost(table, k, kr):
    """Column k of a [BLOCK_N, W_PAD] cost table."""
    return _min(tl.where(kr[None, :] == k, table, INF), 1)


@triton.jit
def _pick_index(table, k, kr):
    """Column k of a [BLOCK_N, W_PAD] index table (entries >= -1)."""
    return _max(tl.where(kr[None, :] == k, table, -1), 1)


@triton.jit
def _search_kernel(
    res_ptr, col_ptr, cost_ptr, bound_ptr, pmask_ptr, psize_ptr, out_idx_ptr, out_cost_ptr,
    N, P,
    C: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Per segment: the cheapest pattern (index into the size-ordered pattern table) of the staged search
    in search._search, given its C candidates' columns and costs (ascending cost) and the cost bounds
    (cumulative candidate costs). out_idx: -1 where no flip (syndrome agrees or unresolved);
    out_cost: the pattern's cost, 0 where the syndrome agrees, inf where unresolved."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = n < N
    n64 = n.to(tl.int64)
    res = tl.load(res_ptr + n, mask=ok, other=0)
    kr = tl.arange(0, W_PAD)
    best_c = tl.full((BLOCK_N, W_PAD), INF, tl.float32)  # per pattern size k: its cheapest, first index
    best_i = tl.full((BLOCK_N, W_PAD), -1, tl.int32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        pm = p < P
        pat = tl.load(pmask_ptr + p, mask=pm, other=0)
        size = tl.load(psize_ptr + p, mask=pm, other=0)  # 0 on padding: never a size searched
        syn = tl.full((BLOCK_N, BLOCK_P), 0, tl.int64)
        tot = tl.full((BLOCK_N, BLOCK_P), 0.0, tl.float32)
        for j in tl.static_range(C):
            sel = ((pat >> j) & 1)[None, :] == 1
            cj = tl.load(col_ptr + n64 * C + j, mask=ok, other=0)
            wj = tl.load(cost_ptr + n64 * C + j, mask=ok, other=0.0)
            syn = tl.where(sel, syn ^ cj[:, None], syn)
            tot = tl.where(sel, tot + wj[:, None], tot)
        tot = tl.where(syn == res[:, None], tot, INF)
        for k in tl.static_range(1, W + 1):
            tk = tl.where((size == k)[None, :], tot, INF)
            cmin = _min(tk, 1)
            cidx = _min(tl.where(tk == cmin[:, None], p[None, :], NO_PATTERN), 1)
            better = (cmin < _pick_cost(best_c, k, kr))[:, None] & (kr[None, :] == k)
            best_c = tl.where(better, cmin[:, None], best_c)
            best_i = tl.where(better, cidx[:, None], best_i)
    # the stages: up to 1 flip, 2 flips, ...; a segment leaves at the first stage whose best pattern
    # costs no more than its w + 1 cheapest candidates together, or at the last
    decided = res == 0
    out_c = tl.where(decided, 0.0, INF)
    out_i = tl.full((BLOCK_N,), -1, tl.int32)
    stage_c = tl.full((BLOCK_N,), INF, tl.float32)
    stage_i = tl.full((BLOCK_N,), -1, tl.int32)
    for w in tl.static_range(1, W + 1):
        wc = _pick_cost(best_c, w, kr)
        wi = _pick_index(best_i, w, kr)
        take = wc < stage_c  # ties keep the fewer flips (earlier in the table)
        stage_c = tl.where(take, wc, stage_c)
        stage_i = tl.where(take, wi, stage_i)
        found = stage_c < INF
        if w < W:
            bound = tl.load(bound_ptr + n64 * C + w, mask=ok, other=0.0)
            done = found & (stage_c <= bound)
        else:
            done = tl.full((BLOCK_N,), 1, tl.int1)
        now = done & ~decided
        out_c = tl.where(now, stage_c, out_c)
        out_i = tl.where(now & found, stage_i, out_i)
        decided = decided | done
    tl.store(out_idx_ptr + n, out_i, mask=ok)
    tl.store(out_cost_ptr + n, out_c, mask=ok)
