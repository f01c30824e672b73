"""NVFP4 KV cache of trace_fp4 (DESIGN.md section 3; not SGLang's power-of-two `fp4_mx_block16` recipe).

Installed around `MHATokenToKVPool.set_kv_buffer` (SGLang 0.5.23), the one place where K and V enter the
cache: K there is after RoPE and after the QK norm, exactly what later tokens attend to. Each K and V row
(one token, one KV head: `head_dim` values) is quantized with its own global amax (per token and head,
batch invariant); the codes are captured at the row's KV slot, and the cache stores the dequantized
values, which every attention read sees (SGLang's torch-native CPU attention reads the whole sequence,
the current tokens included, back from the cache). On a CPU this is bit-for-bit what an NVFP4 cache with
dequantize-on-read gives; it does not save memory (see README: limits).
"""

import torch

import trace_kernels

from . import counters
from .runtime import RUNTIME


def quantize_kv_rows(x: torch.Tensor, num_kv_heads: int, head_dim: int, layer_id: int = 0, site: str = "k"):
    """x [T, num_kv_heads * head_dim] or [T, num_kv_heads, head_dim] -> (dequantized like x, NVFP4Tensor)."""
    rows = x.reshape(x.shape[0], num_kv_heads, head_dim)
    # per token and head unless the config calibrated a static amax (the decision every engine shares)
    amax = trace_kernels.site_amax(RUNTIME.trace, layer_id, site, rows, saturated=counters.SATURATION)
    xq, q = trace_kernels.quantize_dequantize(rows, global_amax=amax)
    return xq.reshape(x.shape), q


def set_kv_buffer_hook(original, pool, layer, loc_info, cache_k, cache_v, *args, **kwargs):
    trace = RUNTIME.trace
    if trace is None or not trace.quantize_kv or layer is None:
        return original(pool, layer, loc_info, cache_k, cache_v, *args, **kwargs)
    if kwargs.get("layer_id_override") is not None:
        raise NotImplementedError("trace_fp4: KV writes with layer_id_override are not supported")
    from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

    loc, _, _ = unwrap_write_loc(loc_info)
    shape = RUNTIME.shape
    layer_id = int(layer.layer_id)
    kq, qk = quantize_kv_rows(cache_k, shape.num_kv_heads, shape.head_dim, layer_id, "k")
    vq, qv = quantize_kv_rows(cache_v, shape.num_kv_heads, shape.head_dim, layer_id, "v")
    counters.count("kv_writes")
    counters.count(f"kv_writes.layer{layer_id}")
    RUNTIME.capture_kv(layer_id, loc, qk, qv)
    return original(pool, layer, loc_info, kq, vq, *args, **kwargs)
