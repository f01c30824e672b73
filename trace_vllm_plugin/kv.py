"""FP4 KV cache for trace_fp4: K and V are NVFP4-quantized (with capture) on the cache-write path.

vLLM asks the quantization config for a method for every Attention layer and calls its
`create_weights(layer)` right after the layer built its backend impl. Ours switches that impl to a
subclass whose `do_kv_cache_update` quantizes K (after RoPE and the QK norm: this is the tensor the
model hands to Attention) and V with capture, one row per token and KV head (rows of head_dim), and
writes them to the cache. Prefill and decode both read K/V back from the cache, so every attention
read sees the quantized values.

Where the cache lives (`TRACE_FP4_KV_CACHE`, default `packed`):
- `packed` on CPU_ATTN: the cache holds the packed NVFP4 rows (codes, scales, amax; kv_packed.py), so
  the same `kv_cache_memory_bytes` holds ~3.4x the tokens (head_dim 128); reads dequantize the blocks
  a batch uses. Other backends have no packed path yet: they keep the dequantized cache below, and the
  fallback is logged and counted (`kv_cache_dequantized_fallback`).
- `dequantized`: the cache stays in the model dtype (kv_cache_dtype="auto") holding the dequantized
  values (the same bits attention sees in packed mode, 1.0x BF16 memory); kept to compare against.
Backends whose forward writes the cache itself (no separate `do_kv_cache_update`) are refused.
"""

import torch

import trace_kernels
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.models.utils import extract_layer_index

from trace_kernels.engine import kv_cache_mode

from .activations import quantize_input
from .kv_packed import packed_backend_class, packed_impl_class

logger = init_logger(__name__)

# Backends with a packed NVFP4 cache (kv_packed.py); the others keep the dequantized one.
PACKED_BACKENDS = ("CPU_ATTN",)


_TRACED_IMPLS: dict[type, type] = {}


def _do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
    idx, store = self._trace_fp4_layer_idx, self._trace_fp4_store
    store.count("kv_calls")
    store.count(f"kv_calls.layer{idx}")
    key, _ = quantize_input(store, key, idx, "k")
    value, _ = quantize_input(store, value, idx, "v")
    return self._trace_fp4_base.do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)


def traced_impl_class(base: type) -> type:
    """A subclass of the backend impl `base` that fake-quantizes K/V before its model-dtype cache write."""
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
        if str(layer.kv_cache_dtype).startswith("nvfp4"):
            # vLLM's own NVFP4 KV cache (SM100, FlashInfer trtllm-gen) quantizes with one calibrated
            # scale per tensor and the CUDA quantizer's rounding, and attends in FP8: not the codes a
            # record holds (per token and head amax, docs/architecture.md), so it cannot serve a
            # captured site.
            raise ValueError(
                f"trace_fp4: {self.layer_name}: kv_cache_dtype={layer.kv_cache_dtype!r} is vLLM's own NVFP4 KV "
                "cache, whose codes are not trace_fp4's (one per-tensor scale, another rounding, FP8 attention); "
                "use kv_cache_dtype='auto': trace_fp4 quantizes K/V itself (TRACE_FP4_KV_CACHE=packed|dequantized)"
            )
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
        if layer.attn_type != "decoder":
            raise NotImplementedError(f"trace_fp4: {self.layer_name}: {layer.attn_type} attention is not supported")
        store = self.quant_config.capture_store
        mode = kv_cache_mode()
        if mode == "packed" and backend.get_name() not in PACKED_BACKENDS:
            store.count("kv_cache_dequantized_fallback")
            logger.warning(
                "trace_fp4: %s: backend %s has no packed NVFP4 KV cache (only %s); the cache stores "
                "dequantized values in the model dtype (no memory saving)",
                self.layer_name, backend.get_name(), PACKED_BACKENDS,
            )
            mode = "dequantized"
        if mode == "packed":
            layer.attn_backend = packed_backend_class(backend)
            layer.impl.__class__ = packed_impl_class(type(layer.impl))
            layer.impl._trace_fp4_dtype = layer.kv_cache_torch_dtype
            layer.impl._trace_fp4_head_size_v = layer.head_size_v
            store.count("kv_cache_packed_layers")
        else:
            layer.impl.__class__ = traced_impl_class(type(layer.impl))
        layer.impl._trace_fp4_layer_idx = self.layer_idx
        layer.impl._trace_fp4_store = store

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # Keep vLLM's default k/v scales (1.0): the values written to (or dequantized into) the
        # model-dtype cache are the NVFP4 values themselves.
        return
