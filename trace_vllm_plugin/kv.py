"""FP4 KV cache for trace_fp4: K and V are NVFP4-quantized (with capture) on the cache-write path.

vLLM asks the quantization config for a method for every Attention layer and calls its
`create_weights(layer)` right after the layer built its backend impl. Ours switches that impl to a
subclass whose `do_kv_cache_update` fake-quantizes K (after RoPE and the QK norm: this is the tensor
the model hands to Attention) and V, one row per token and KV head (rows of head_dim), before the
backend writes them to the cache. Prefill and decode both read K/V back from the cache, so every
attention read sees the quantized values.

The cache itself stays in the model dtype (kv_cache_dtype="auto") holding the dequantized values: the
CPU attention backend has no FP4 cache, and vLLM's `kv_cache_dtype="nvfp4"` is not implemented there.
Backends whose forward writes the cache itself (no separate `do_kv_cache_update`) are refused.
"""

import torch

import trace_kernels
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.models.utils import extract_layer_index

from .capture import STORE
from .activations import quantize_input

_TRACED_IMPLS: dict[type, type] = {}


def _do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
    idx = self._trace_fp4_layer_idx
    STORE.count("kv_calls")
    STORE.count(f"kv_calls.layer{idx}")
    key, _ = quantize_input(key, idx, "k")
    value, _ = quantize_input(value, idx, "v")
    return self._trace_fp4_base.do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)


def traced_impl_class(base: type) -> type:
    """A subclass of the backend impl `base` that quantizes K/V before the cache write."""
    if base not in _TRACED_IMPLS:
        _TRACED_IMPLS[base] = type(
            f"TraceFP4{base.__name__}",
            (base,),
            {"do_kv_cache_update": _do_kv_cache_update, "_trace_fp4_base": base},
        )
    return _TRACED_IMPLS[base]


class TraceFP4KVCacheMethod(BaseKVCacheMethod):
    def __init__(self, quant_config, layer_name: str):
        super().__init__(quant_config)
        self.layer_name = layer_name
        self.layer_idx = extract_layer_index(layer_name)

    def create_weights(self, layer: torch.nn.Module) -> None:
        # No k/v scale parameters: the scales are per token and head, computed at cache-write time.
        backend = layer.attn_backend
        if layer.kv_cache_dtype != "auto":
            raise ValueError(
                f"trace_fp4: {self.layer_name}: kv_cache_dtype={layer.kv_cache_dtype!r}; trace_fp4 "
                "quantizes K/V itself and needs kv_cache_dtype='auto'"
            )
        if backend.forward_includes_kv_cache_update or not hasattr(layer.impl, "do_kv_cache_update"):
            raise NotImplementedError(
                f"trace_fp4: attention backend {backend.get_name()} writes the KV cache inside its "
                "forward; trace_fp4 needs a backend with a separate do_kv_cache_update (CPU_ATTN, "
                "FLASH_ATTN, TRITON_ATTN, ...)"
            )
        if layer.head_size % trace_kernels.BLOCK_SIZE or layer.head_size_v % trace_kernels.BLOCK_SIZE:
            raise ValueError(
                f"trace_fp4: {self.layer_name}: head_dim={layer.head_size} is not divisible by "
                f"{trace_kernels.BLOCK_SIZE} (NVFP4 quantizes K/V rows of head_dim in blocks of 16)"
            )
        if layer.kv_sharing_target_layer_name is not None:
            raise NotImplementedError(f"trace_fp4: {self.layer_name}: cross-layer KV sharing is not supported")
        layer.impl.__class__ = traced_impl_class(type(layer.impl))
        layer.impl._trace_fp4_layer_idx = self.layer_idx

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # Keep vLLM's default k/v scales (1.0): the cache holds dequantized model-dtype values.
        return
