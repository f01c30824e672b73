"""Attention over the packed NVFP4 KV cache (`trace_kernels.kv_layout` rows in paged blocks).

    out = packed_decode_attention(q, kv_cache, block_table, seq_lens, scale)   # Triton: CUDA, or interpreted on a CPU
    k, v = dequantize_pages(kv_cache, block_ids, head_size, head_size_v, dtype)  # the blocks' values, model dtype

The K/V values attended to are bit for bit those of a model-dtype cache holding the dequantized rows (the
values the engines' packed caches stand for); `reference.packed_decode_attention` is the torch version.
"""

from .launch import dequantize_pages, packed_decode_attention

__all__ = ["dequantize_pages", "packed_decode_attention"]
