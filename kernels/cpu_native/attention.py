"""Native attention straight from the packed NVFP4 KV pages (the CPU twin of `trace_kernels.attention`'s
Triton decode kernel), for vLLM's CPU_ATTN packed cache (trace_vllm_plugin.kv_packed).

Why: the scratch read decodes every used block into a model-dtype scratch cache each layer call, has
vLLM's `cpu_attn_reshape_and_cache` re-lay it out, then runs vLLM's C++ kernel: three passes over the
whole context per layer per step (25% of the native engine's time). Here one kernel decodes each K/V
row of a request once per KV head, into a small float32 buffer, and attends from it.

What it computes, per request r (query tokens query_start_loc[r]..[r+1], seq_lens[r] tokens in the
cache, its new ones included), per query head (grouped-query: KV head h serves query heads h*G ..
h*G+G-1), per query token i of the request at position p = seq_len - n_query + i (causal: keys 0..p):
  - each K/V value decoded as the scratch holds it: e2m1(code) * (e4m3(scale) * g_dec) in float32
    (kv.dequantize_blocks_kernel's arithmetic), rounded to bf16 nearest-even when the model dtype is
    bf16 (to_bf16), kept float32 when it is float32;
  - scores: sum over d, in order, of q[d] * k[d] in float32 (q the model-dtype query, exact in float32),
    times scale (float32); softmax with the float32 max subtracted, np.exp in float32;
  - out[dv] = (sum over keys, in order, of p * v[dv]) / (sum of p), float32; the caller rounds it to the
    model dtype (torch's cast).
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

from ..kv_layout import packed_row_bytes
from . import as_numpy, njit
from .quantize import CALLS, NUMERATOR, global_dec, tables


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


@njit
def _attend(q, page, table, seq_lens, qsl, scale, D, DV, numerator, nib, sv, to_bf16, out, r, h, kt, vt, row, s,
            acc, fbuf, ibuf, tab):
    """Request r's query tokens, the query heads of KV head h: their outputs in `out` (the module docstring's
    arithmetic). kt f32 [D, >= L], vt f32 [>= L, DV], row, s, acc, fbuf, ibuf, tab: scratch buffers."""
    Hq = q.shape[1]
    H, block = page.shape[1], page.shape[2]
    G = Hq // H
    rk = D // 2 + D // 16 + 4
    zero = np.float32(0.0)
    L = seq_lens[r]
    q0 = qsl[r]
    nq = qsl[r + 1] - q0
    if nq <= 0 or L <= 0:
        return
    for t in range(L):
        prow = page[table[r, t // block], h, t % block]
        _decode_row(prow, 0, D, numerator, nib, sv, to_bf16, row, fbuf, ibuf, tab)
        for d in range(D):
            kt[d, t] = row[d]
        _decode_row(prow, rk, DV, numerator, nib, sv, to_bf16, vt[t], fbuf, ibuf, tab)
    for i in range(nq):
        last = L - nq + i + 1  # keys 0 .. last - 1 (causal)
        if last <= 0:  # a query before any key (cannot happen in vLLM): no keys, output 0
            for g in range(G):
                for d in range(DV):
                    out[q0 + i, h * G + g, d] = zero
            continue
        for g in range(G):
            hq = h * G + g
            for t in range(last):
                s[t] = zero
            for d in range(D):  # each score summed over d in order; the loop over keys vectorises
                qd = q[q0 + i, hq, d]
                for t in range(last):
                    s[t] += qd * kt[d, t]
            mx = np.float32(-np.inf)
            for t in range(last):
                s[t] = s[t] * scale
                if s[t] > mx:
                    mx = s[t]
            denom = zero
            for t in range(last):
                e = np.exp(s[t] - mx)
                s[t] = e
                denom += e
            for d in range(DV):
                acc[d] = zero
            for t in range(last):  # each output summed over the keys in order
                pt = s[t]
                for d in range(DV):
                    acc[d] += pt * vt[t, d]
            for d in range(DV):
                out[q0 + i, hq, d] = acc[d] / denom


@njit
def packed_attention_kernel(q, page, table, seq_lens, qsl, scale, D, DV, numerator, nib, sv, to_bf16, out):
    """q f32 [T, Hq, D]; page u8 [B, H, block, row_k + row_v]; table i64 [R, M]; seq_lens i64 [R];
    qsl i64 [R + 1] (query_start_loc); out f32 [T, Hq, DV]. Causal attention of each request's query
    tokens over its first seq_len cache rows, one (request, KV head) after the other."""
    max_len = 0
    for r in range(seq_lens.shape[0]):
        max_len = max(max_len, seq_lens[r])
    kt = np.empty((D, max_len), dtype=np.float32)  # K transposed: the score loop runs along the keys
    vt = np.empty((max_len, DV), dtype=np.float32)
    row, s, acc = np.empty(D, dtype=np.float32), np.empty(max_len, dtype=np.float32), np.empty(DV, dtype=np.float32)
    fbuf = np.empty(1, dtype=np.float32)
    tab = np.empty(16, dtype=np.float32)
    for r in range(seq_lens.shape[0]):
        for h in range(page.shape[1]):
            _attend(q, page, table, seq_lens, qsl, scale, D, DV, numerator, nib, sv, to_bf16, out, r, h, kt, vt, row,
                    s, acc, fbuf, fbuf.view(np.int32), tab)


@njit(parallel=True)
def packed_attention_kernel_parallel(q, page, table, seq_lens, qsl, scale, D, DV, numerator, nib, sv, to_bf16, out):
    """packed_attention_kernel with the (request, KV head) pairs spread over numba's threads: each pair's
    arithmetic is the serial kernel's, in the same order, on its own buffers, so the outputs are the same bits."""
    H = page.shape[1]
    for rh in numba.prange(seq_lens.shape[0] * H):
        r, h = rh // H, rh % H
        L = max(seq_lens[r], 1)
        fbuf = np.empty(1, dtype=np.float32)
        _attend(q, page, table, seq_lens, qsl, scale, D, DV, numerator, nib, sv, to_bf16, out, r, h,
                np.empty((D, L), dtype=np.float32), np.empty((L, DV), dtype=np.float32), np.empty(D, dtype=np.float32),
                np.empty(L, dtype=np.float32), np.empty(DV, dtype=np.float32), fbuf, fbuf.view(np.int32),
                np.empty(16, dtype=np.float32))


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


def packed_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, scale: float, head_size_v: int | None = None,
                     block_scale: str = "6", out: torch.Tensor | None = None, parallel: bool = False) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] (model dtype: bf16 or float32) over the packed cache uint8
    [blocks, H, block_size, row_k + row_v]: request r's query tokens are rows query_start_loc[r] ..
    query_start_loc[r + 1] - 1, the last ones of its seq_lens[r] tokens, whose blocks are block_table[r].
    Returns (or fills `out`, any [T, Hq * DV]-shaped view) [T, Hq, DV] in q's dtype. `parallel` (and numba
    running more than one thread, NUMBA_NUM_THREADS): the (request, KV head) pairs spread over numba's
    threads, the same bits as the serial kernel. Off by default, and the vLLM plugin does not ask for it:
    measured in the engine it halves the kernel's time but its idle OpenMP workers spin between calls,
    which on a small shared machine cost more than they save (docs/measurements.md).
    R requests need a block table of ceil(seq_len / block)
    columns each (vLLM's is always that wide; not checked per call)."""
    CALLS["kv_attention"] += 1
    T, Hq, D = q.shape
    DV = head_size_v or D
    B, H, block, width = kv_cache.shape
    if kv_cache.dtype != torch.uint8 or width != packed_row_bytes(D) + packed_row_bytes(DV):
        raise ValueError(f"packed KV pages {kv_cache.dtype} {tuple(kv_cache.shape)} do not hold head sizes {D} / {DV}")
    why = unsupported(q.dtype, block_scale, D, DV, Hq, H)
    if why is not None:
        raise ValueError(f"native packed attention: {why}")
    R = seq_lens.shape[0]
    if query_start_loc.shape[0] < R + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for {R} requests")
    nib, sv = tables()
    outf = torch.empty((T, Hq, DV), dtype=torch.float32)
    threaded = parallel and numba.get_num_threads() > 1 and R * H > 1
    kernel = packed_attention_kernel_parallel if threaded else packed_attention_kernel
    kernel(
        as_numpy(q.to(torch.float32)), as_numpy(kv_cache), as_numpy(block_table[:R].to(torch.int64)),
        as_numpy(seq_lens.to(torch.int64)), as_numpy(query_start_loc[: R + 1].to(torch.int64)),
        np.float32(scale), D, DV, NUMERATOR[block_scale], nib, sv, q.dtype == torch.bfloat16, outf.numpy(),
    )
    if out is None:
        return outf.to(q.dtype)
    out.view(T, Hq, DV).copy_(outf)
    return out
