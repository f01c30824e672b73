"""NVFP4 KV cache of trace_fp4 (docs/architecture.md; not SGLang's power-of-two `fp4_mx_block16` recipe).

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

Both hooks find the engine's state on the object they receive (the attention layer, the KV pool; hung
there by capture_setup.init_capture).
"""

import torch

import trace_kernels

from .state import state_of


def quantize_kv_rows(state, x: torch.Tensor, layer_id: int, site: str):
    """x [T, num_kv_heads * head_dim] or [T, num_kv_heads, head_dim] -> (dequantized like x, NVFP4Tensor)."""
    # -1: the KV heads this rank holds (all of them at TP=1; num_kv_heads / tp_size under TP)
    rows = x.reshape(x.shape[0], -1, state.shape.head_dim)
    # per token and head unless the config calibrated a static amax (the decision every engine shares)
    amax = trace_kernels.site_amax(state.trace, layer_id, site, rows, saturated=state.counters.saturation)
    xq, q = trace_kernels.quantize_dequantize(rows, global_amax=amax, block_scale=state.trace.block_scale)
    return xq.reshape(x.shape), q


def _kv_state(obj):
    """The engine state when trace_fp4 quantizes this engine's KV, else None."""
    state = state_of(obj)
    return state if state is not None and state.trace.quantize_kv else None


def _bf16_layer(state, layer) -> bool:
    """A BF16 boundary layer (TraceConfig.bf16_layers): its K/V are not quantized."""
    return state.trace.is_bf16_layer(int(layer.layer_id))


def attention_forward_hook(original, layer, q, k, v, forward_batch, *args, **kwargs):
    state = _kv_state(layer)
    if state is None or k is None or v is None or "k_rope" in kwargs or _bf16_layer(state, layer):
        return original(layer, q, k, v, forward_batch, *args, **kwargs)
    layer_id = int(layer.layer_id)
    kq, qk = quantize_kv_rows(state, k, layer_id, "k")
    vq, qv = quantize_kv_rows(state, v, layer_id, "v")
    state.counters.count(f"kv_quantized_for_attention.layer{layer_id}")
    state.stash_kv(layer_id, kq, vq, qk, qv)
    try:
        return original(layer, q, kq, vq, forward_batch, *args, **kwargs)
    finally:
        state.stash_kv(layer_id, None)


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


def set_kv_buffer_hook(original, pool, layer, loc_info, cache_k, cache_v, *args, **kwargs):
    state = _kv_state(pool)
    if state is None or layer is None or _bf16_layer(state, layer):
        return original(pool, layer, loc_info, cache_k, cache_v, *args, **kwargs)
    if kwargs.get("layer_id_override") is not None or len(args) > 2:
        raise NotImplementedError("trace_fp4: KV writes with layer_id_override are not supported")
    if kwargs.get("dcp_kv_mask") is not None:
        raise NotImplementedError("trace_fp4: KV writes with dcp_kv_mask (decode context parallel) are not supported")
    from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

    loc, _, _ = unwrap_write_loc(loc_info)
    layer_id = int(layer.layer_id)
    stash = state.stashed_kv(layer_id)
    if stash is not None and _same_rows(cache_k, stash[0]) and _same_rows(cache_v, stash[1]):
        kq, vq, qk, qv = stash
        kq, vq = cache_k, cache_v  # the tensors the backend got (already the dequantized values)
    else:
        state.counters.count("kv_quantized_at_write")
        kq, qk = quantize_kv_rows(state, cache_k, layer_id, "k")
        vq, qv = quantize_kv_rows(state, cache_v, layer_id, "v")
    state.counters.count("kv_writes")
    state.counters.count(f"kv_writes.layer{layer_id}")
    state.capture_kv(layer_id, loc, qk, qv)
    if getattr(pool, "trace_fp4_packed", False):
        pool.write_rows(layer_id, loc, qk, qv)
        return None
    return original(pool, layer, loc_info, kq, vq, *args, **kwargs)
