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
does not depend on the other requests (batch invariant) nor on a thread count.

It is NOT bit-identical to the scratch path: vLLM's CPU kernel sums in its own (vectorised, tiled,
online-softmax) order, so outputs can differ in the last float32 bits and then by one bf16 ulp after
rounding. The values attended to are the same bits (the K/V records, made by the write, are untouched).
Tested against the torch reference (`trace_kernels.attention.reference.packed_attention`) within a
stated tolerance (tests/kernels/test_cpu_native_attention.py).
"""

import numpy as np
import torch

from ..kv_layout import packed_row_bytes
from . import as_numpy, njit
from .kv import _row_amax
from .quantize import CALLS, NUMERATOR, global_dec, tables


@njit
def _decode_row(page, b, h, t, base, n, numerator, nib, sv, to_bf16, dst, fbuf, ibuf, vals, vbits):
    """Packed row (block b, head h, token t, starting at byte `base`) of n values -> dst[:n] (values
    as the model-dtype scratch would hold them, in float32)."""
    nc = n // 2
    g_dec = global_dec(_row_amax(page, b, h, t, base + nc + n // 16, fbuf, ibuf), numerator)[1]
    for blk in range(n // 16):
        m = sv[page[b, h, t, base + nc + blk]] * g_dec
        for j in range(8):
            c = page[b, h, t, base + blk * 8 + j]
            vals[2 * j] = nib[c & 0xF] * m
            vals[2 * j + 1] = nib[c >> 4] * m
        if to_bf16:
            for i in range(16):  # round to bf16 on the bits, nearest-even (a NaN stays a NaN)
                x = np.int64(vbits[i]) & 0xFFFFFFFF
                if vals[i] == vals[i]:
                    vbits[i] = np.int32(np.uint32(((x + 0x7FFF + ((x >> 16) & 1)) >> 16) << 16))
        o = blk * 16
        for i in range(16):
            dst[o + i] = vals[i]


@njit
def packed_attention_kernel(q, page, table, seq_lens, qsl, scale, D, DV, numerator, nib, sv, to_bf16, out):
    """q f32 [T, Hq, D]; page u8 [B, H, block, row_k + row_v]; table i64 [R, M]; seq_lens i64 [R];
    qsl i64 [R + 1] (query_start_loc); out f32 [T, Hq, DV]. Causal attention of each request's query
    tokens over its first seq_len cache rows (see the module docstring for the arithmetic)."""
    R = seq_lens.shape[0]
    Hq = q.shape[1]
    H, block = page.shape[1], page.shape[2]
    G = Hq // H
    rk = D // 2 + D // 16 + 4
    max_len = 0
    for r in range(R):
        if seq_lens[r] > max_len:
            max_len = seq_lens[r]
    kt = np.empty((D, max_len), dtype=np.float32)  # K transposed: the score loop runs along the keys
    vt = np.empty((max_len, DV), dtype=np.float32)
    row = np.empty(max(D, DV), dtype=np.float32)
    s = np.empty(max_len, dtype=np.float32)
    acc = np.empty(DV, dtype=np.float32)
    fbuf = np.empty(1, dtype=np.float32)
    ibuf = fbuf.view(np.int32)
    vals = np.empty(16, dtype=np.float32)
    vbits = vals.view(np.int32)
    zero = np.float32(0.0)
    for r in range(R):
        L = seq_lens[r]
        q0 = qsl[r]
        nq = qsl[r + 1] - q0
        if nq <= 0 or L <= 0:
            continue
        for h in range(H):
            for t in range(L):
                b = table[r, t // block]
                p = t % block
                _decode_row(page, b, h, p, 0, D, numerator, nib, sv, to_bf16, row, fbuf, ibuf, vals, vbits)
                for d in range(D):
                    kt[d, t] = row[d]
                _decode_row(page, b, h, p, rk, DV, numerator, nib, sv, to_bf16, row, fbuf, ibuf, vals, vbits)
                for d in range(DV):
                    vt[t, d] = row[d]
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
                     block_scale: str = "6", out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] (model dtype: bf16 or float32) over the packed cache uint8
    [blocks, H, block_size, row_k + row_v]: request r's query tokens are rows query_start_loc[r] ..
    query_start_loc[r + 1] - 1, the last ones of its seq_lens[r] tokens, whose blocks are block_table[r].
    Returns (or fills `out`, any [T, Hq * DV]-shaped view) [T, Hq, DV] in q's dtype."""
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
    packed_attention_kernel(
        as_numpy(q.to(torch.float32)), as_numpy(kv_cache), as_numpy(block_table[:R].to(torch.int64)),
        as_numpy(seq_lens.to(torch.int64)), as_numpy(query_start_loc[: R + 1].to(torch.int64)),
        np.float32(scale), D, DV, NUMERATOR[block_scale], nib, sv, q.dtype == torch.bfloat16, outf.numpy(),
    )
    if out is None:
        return outf.to(q.dtype)
    out.view(T, Hq, DV).copy_(outf)
    return out
