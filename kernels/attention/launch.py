"""Launchers of the packed-KV attention kernels (source in `triton_jit.py`).

CUDA tensors run the compiled kernels; CPU tensors run the same source under the Triton interpreter
(imported the way `trace_kernels.grouped_mm.launch` does it, with the helpers' interpreted copy in
place). Nothing here reads a device value on the host, so a decode launch can be captured in a CUDA
graph.
"""

from pathlib import Path

import torch
import triton

from .. import triton_kernels
from ..kv_layout import packed_row_bytes

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


_kernels = triton_kernels.kernel_source("trace_kernels.attention", Path(__file__).with_name("triton_jit.py"))


def _check_cache(kv_cache: torch.Tensor, head_size: int, head_size_v: int) -> int:
    """The cache's layout checked; returns the bytes of a K row (where the V row starts)."""
    row_k, row_v = packed_row_bytes(head_size), packed_row_bytes(head_size_v)
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[-1] != row_k + row_v:
        raise ValueError(
            f"packed KV cache must be uint8 [blocks, kv_heads, block_size, {row_k + row_v}] for head sizes "
            f"{head_size}/{head_size_v}, got {kv_cache.dtype} {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("packed KV cache rows must be contiguous bytes")
    for name, n in (("head_size", head_size), ("head_size_v", head_size_v), ("block_size", kv_cache.shape[2])):
        if n & (n - 1):
            raise ValueError(f"{name}={n}: the packed-KV attention kernels need a power of two")
    return row_k


def _dtype_code(dtype: torch.dtype) -> int:
    if dtype not in _DTYPES:
        raise ValueError(f"model dtype {dtype}: the packed-KV attention supports {sorted(map(str, _DTYPES))}")
    return _DTYPES[dtype]


def packed_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, head_size_v: int | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention, one query token per sequence, over the packed NVFP4 cache.

    q [N, Hq, D] in the model dtype; kv_cache uint8 [blocks, H, block_size, row_k + row_v];
    block_table int [>= N, max_blocks] (row i: sequence i's blocks); seq_lens int [>= N] (tokens of
    sequence i in the cache, its own included; >= 1). Hq must be a multiple of H (query heads of KV
    head h: h * Hq / H ...). Returns (or fills `out`) [N, Hq, DV] in q's dtype."""
    N, Hq, D = q.shape
    H = kv_cache.shape[1]
    DV = head_size_v or D
    row_k = _check_cache(kv_cache, D, DV)
    if Hq % H:
        raise ValueError(f"{Hq} query heads do not group over {H} KV heads")
    dtype = _dtype_code(q.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty((N, Hq, DV), dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    G = Hq // H
    target = out.view(torch.int16) if q.dtype == torch.bfloat16 else out
    _kernels(q)._packed_decode_attention_kernel[(N, H)](
        q, kv_cache, block_table, seq_lens, target,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        float(scale),
        G=G, G_PAD=triton.next_power_of_2(G), D=D, DV=DV, ROW_K=row_k,
        BLOCK=kv_cache.shape[2], DTYPE=dtype,
    )
    return out


def dequantize_pages(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, head_size: int, head_size_v: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `block_ids` [U] of the packed cache -> (K [U * block_size, H, D], V [.., DV]) in `dtype`,
    token-major: the values `trace_vllm_plugin.kv_packed.dequantize_blocks` gives, bit for bit."""
    row_k = _check_cache(kv_cache, head_size, head_size_v)
    U, H, block = block_ids.shape[0], kv_cache.shape[1], kv_cache.shape[2]
    code = _dtype_code(dtype)
    k = torch.empty((U * block, H, head_size), dtype=dtype, device=kv_cache.device)
    v = torch.empty((U * block, H, head_size_v), dtype=dtype, device=kv_cache.device)
    if U == 0:
        return k, v
    as_store = (lambda t: t.view(torch.int16)) if dtype == torch.bfloat16 else (lambda t: t)  # noqa: E731
    _kernels(kv_cache)._dequantize_pages_kernel[(U, H)](
        kv_cache, block_ids.contiguous(), as_store(k), as_store(v),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        H=H, D=head_size, DV=head_size_v, ROW_K=row_k, BLOCK=block, DTYPE=code,
    )
    return k, v
