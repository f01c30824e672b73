"""NVFP4 KV cache of trace_fp4 (DESIGN.md section 3; not SGLang's power-of-two `fp4_mx_block16` recipe).

Each K and V row (one token, one KV head: `head_dim` values) is quantized once, with its own global
amax (per token and head, batch invariant), in `quantize_kv_rows`, the one place K/V are quantized:

1. Around `RadixAttention.forward` (SGLang 0.5.23): K here is after RoPE and after the QK norm. The
   backend receives the fake-quantized K/V instead of the BF16 ones, because SGLang's GPU backends
   (flashinfer, triton, fa3) attend prefill tokens to the K/V passed in, not to the cache; the
   NVFP4 data is kept for the cache write of the same layer.
2. Around `MHATokenToKVPool.set_kv_buffer`, the one place K/V enter the cache: the codes are captured
   at the rows' KV slots, and the cache stores the packed NVFP4 rows (kv_pool.py, the default) or,
   with `TRACE_FP4_KV_CACHE=dequantized`, the dequantized values in the model dtype (1.0x BF16 memory,
   the same values every read sees). A write whose K is not the tensor step 1 handed to the backend
   is quantized there, counted as `kv_quantized_at_write`.
"""

import os

import torch

import trace_kernels

from . import counters
from .runtime import RUNTIME

KV_CACHE_ENV = "TRACE_FP4_KV_CACHE"
KV_CACHE_MODES = ("packed", "dequantized")


def kv_cache_mode() -> str:
    mode = os.environ.get(KV_CACHE_ENV, "packed")
    if mode not in KV_CACHE_MODES:
        raise ValueError(f"trace_fp4: {KV_CACHE_ENV}={mode!r}; expected one of {KV_CACHE_MODES}")
    return mode


def quantize_kv_rows(x: torch.Tensor, num_kv_heads: int, head_dim: int, layer_id: int, site: str):
    """x [T, num_kv_heads * head_dim] or [T, num_kv_heads, head_dim] -> (dequantized like x, NVFP4Tensor)."""
    rows = x.reshape(x.shape[0], num_kv_heads, head_dim)
    # per token and head unless the config calibrated a static amax (the decision every engine shares)
    amax = trace_kernels.site_amax(RUNTIME.trace, layer_id, site, rows, saturated=counters.SATURATION)
    xq, q = trace_kernels.quantize_dequantize(rows, global_amax=amax)
    return xq.reshape(x.shape), q


def _active() -> bool:
    trace = RUNTIME.trace
    return trace is not None and trace.quantize_kv


def attention_forward_hook(original, layer, q, k, v, forward_batch, *args, **kwargs):
    if not _active() or k is None or v is None or "k_rope" in kwargs:
        return original(layer, q, k, v, forward_batch, *args, **kwargs)
    shape = RUNTIME.shape
    layer_id = int(layer.layer_id)
    kq, qk = quantize_kv_rows(k, shape.num_kv_heads, shape.head_dim, layer_id, "k")
    vq, qv = quantize_kv_rows(v, shape.num_kv_heads, shape.head_dim, layer_id, "v")
    counters.count(f"kv_quantized_for_attention.layer{layer_id}")
    RUNTIME.stash_kv(layer_id, kq, vq, qk, qv)
    try:
        return original(layer, q, kq, vq, forward_batch, *args, **kwargs)
    finally:
        RUNTIME.stash_kv(layer_id, None)


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


def set_kv_buffer_hook(original, pool, layer, loc_info, cache_k, cache_v, *args, **kwargs):
    if not _active() or layer is None:
        return original(pool, layer, loc_info, cache_k, cache_v, *args, **kwargs)
    if kwargs.get("layer_id_override") is not None or len(args) > 2:
        raise NotImplementedError("trace_fp4: KV writes with layer_id_override are not supported")
    if kwargs.get("dcp_kv_mask") is not None:
        raise NotImplementedError("trace_fp4: KV writes with dcp_kv_mask (decode context parallel) are not supported")
    from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

    loc, _, _ = unwrap_write_loc(loc_info)
    shape = RUNTIME.shape
    layer_id = int(layer.layer_id)
    stash = RUNTIME.stashed_kv(layer_id)
    if stash is not None and _same_rows(cache_k, stash[0]) and _same_rows(cache_v, stash[1]):
        kq, vq, qk, qv = stash
        kq, vq = cache_k, cache_v  # the tensors the backend got (already the dequantized values)
    else:
        counters.count("kv_quantized_at_write")
        kq, qk = quantize_kv_rows(cache_k, shape.num_kv_heads, shape.head_dim, layer_id, "k")
        vq, qv = quantize_kv_rows(cache_v, shape.num_kv_heads, shape.head_dim, layer_id, "v")
    counters.count("kv_writes")
    counters.count(f"kv_writes.layer{layer_id}")
    RUNTIME.capture_kv(layer_id, loc, qk, qv)
    if getattr(pool, "trace_fp4_packed", False):
        pool.write_rows(layer_id, loc, qk, qv)
        return None
    return original(pool, layer, loc_info, kq, vq, *args, **kwargs)
