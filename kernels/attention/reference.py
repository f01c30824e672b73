"""Torch reference of decode attention over the packed NVFP4 KV cache: decode the blocks a sequence
uses to the model dtype (`kv_layout.unpack_rows(...).dequantize(dtype)`, what a model-dtype cache of the
dequantized rows holds), then softmax(q k^T * scale) v in float32, rounded to the model dtype."""

import torch

from ..kv_layout import packed_row_bytes, unpack_rows


def sequence_kv(kv_cache, blocks, seq_len: int, head_size: int, head_size_v: int, dtype):
    """(K [seq_len, H, D], V [seq_len, H, DV]) of one sequence, in `dtype`, from its block ids."""
    row_k = packed_row_bytes(head_size)
    pages = kv_cache[blocks.to(torch.int64)]  # [nb, H, block, row_k + row_v]
    nb, H, block = pages.shape[:3]
    k = unpack_rows(pages[..., :row_k], head_size).dequantize(dtype)
    v = unpack_rows(pages[..., row_k:], head_size_v).dequantize(dtype)
    k = k.permute(0, 2, 1, 3).reshape(nb * block, H, head_size)[:seq_len]
    v = v.permute(0, 2, 1, 3).reshape(nb * block, H, head_size_v)[:seq_len]
    return k, v


def packed_decode_attention(q, kv_cache, block_table, seq_lens, scale: float, head_size_v: int | None = None):
    """Same arguments and result as `launch.packed_decode_attention` (to within float32 summation order)."""
    N, Hq, D = q.shape
    DV = head_size_v or D
    H = kv_cache.shape[1]
    block = kv_cache.shape[2]
    out = torch.empty((N, Hq, DV), dtype=q.dtype, device=q.device)
    for i in range(N):
        n = int(seq_lens[i])
        blocks = block_table[i, : (n + block - 1) // block]
        k, v = sequence_kv(kv_cache, blocks, n, D, DV, q.dtype)
        k = k.float().repeat_interleave(Hq // H, dim=1)  # [n, Hq, D]
        v = v.float().repeat_interleave(Hq // H, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        p = torch.softmax(s, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", p, v).to(q.dtype)
    return out


def packed_attention(q, kv_cache, block_table, seq_lens, query_start_loc, scale: float, head_size_v: int | None = None):
    """Causal attention over the packed cache for a mixed batch (vLLM's varlen layout): request i's query
    tokens are q[query_start_loc[i]:query_start_loc[i + 1]], the last ones of its seq_lens[i] cache
    tokens; query token j of n attends to keys 0 .. seq_len - n + j. Same values as `packed_decode_attention`
    on a batch of single-token decodes. Returns [T, Hq, DV] in q's dtype (rows past the last request: 0)."""
    T, Hq, D = q.shape
    DV = head_size_v or D
    H = kv_cache.shape[1]
    block = kv_cache.shape[2]
    out = torch.zeros((T, Hq, DV), dtype=q.dtype, device=q.device)
    for i in range(seq_lens.shape[0]):
        n = int(seq_lens[i])
        q0, q1 = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if q1 == q0 or n == 0:
            continue
        k, v = sequence_kv(kv_cache, block_table[i, : (n + block - 1) // block], n, D, DV, q.dtype)
        k = k.float().repeat_interleave(Hq // H, dim=1)  # [n, Hq, D]
        v = v.float().repeat_interleave(Hq // H, dim=1)
        s = torch.einsum("qhd,nhd->hqn", q[q0:q1].float(), k) * scale  # [Hq, nq, n]
        pos = n - (q1 - q0) + torch.arange(q1 - q0)
        s = s.masked_fill(torch.arange(n)[None, :] > pos[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[q0:q1] = torch.einsum("hqn,nhd->qhd", p, v).to(q.dtype)
    return out
