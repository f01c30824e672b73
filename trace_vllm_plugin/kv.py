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
  a batch uses (or, with TRACE_FP4_KV_DECODE_ATTENTION=triton, decode batches read the packed pages
  through trace_kernels' Triton kernel; on the native CPU path every batch attends from the packed
  pages with trace_kernels.cpu_native.attention). TRITON_ATTN keeps a packed cache with that Triton decode read
  only (the kernel checked on an H200; not yet inside vLLM on a GPU). Other backends, and TRITON_ATTN without it, keep the dequantized cache
  below; the fallback is logged and counted (`kv_cache_dequantized_fallback`).
- `dequantized`: the cache stays in the model dtype (kv_cache_dtype="auto") holding the dequantized
  values (the same bits attention sees in packed mode, 1.0x BF16 memory); kept to compare against.
Backends whose forward writes the cache itself (no separate `do_kv_cache_update`) are refused.
"""

import torch

import trace_kernels
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.models.utils import extract_layer_index

from trace_kernels import envs
from trace_kernels.engine import kv_cache_mode

from .activations import quantize_input
from .kv_packed import (decode_kernel_unsupported, native_attention_unsupported, packed_backend_class,
                        packed_impl_class)

logger = init_logger(__name__)

# Backends with a packed NVFP4 cache (kv_packed.py); the others keep the dequantized one. The GPU ones
# only with the Triton decode read (TRACE_FP4_KV_DECODE_ATTENTION=triton): their full decode CUDA graphs
# cannot run the scratch read.
PACKED_BACKENDS = ("CPU_ATTN",)
GPU_PACKED_BACKENDS = ("TRITON_ATTN",)


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


def _no_packed_cache(backend: str, decode: str, unsupported: str | None) -> str | None:
    """Why a layer on `backend` cannot keep the packed cache (it falls back to the dequantized one), or None."""
    if backend in PACKED_BACKENDS:
        return None
    if backend not in GPU_PACKED_BACKENDS:
        return f"backend {backend} has no packed NVFP4 KV cache (only {PACKED_BACKENDS + GPU_PACKED_BACKENDS})"
    if decode != "triton":
        return (f"backend {backend} keeps a packed NVFP4 KV cache only with TRACE_FP4_KV_DECODE_ATTENTION=triton "
                "(its decode CUDA graphs cannot run the scratch read)")
    if unsupported is not None:
        return f"the Triton decode attention over packed pages does not support {unsupported}"
    return None


def refuse_vllm_nvfp4_kv(layer_name: str, kv_cache_dtype) -> None:
    """vLLM's own NVFP4 KV cache (kv_cache_dtype 'nvfp4', 'nvfp4_4over6', 'nvfp4_ds_mla'; FlashInfer on
    SM100, vLLM PR #40177) cannot serve a captured site: it does not compute trace_fp4's contract.
    What decides it, in vLLM 0.32 (docs/engines.md, "vLLM's own NVFP4 KV cache"):
    - its global scale is one per layer and tensor: FlashInfer's `do_kv_cache_update` hands the cache
      write `layer._k_scale` / `layer._v_scale` (v1/attention/backends/flashinfer.py), a calibrated
      checkpoint value or 1.0 (model_executor/layers/quantization/kv_cache.py; NVFP4 is not a
      per-token-head mode, v1/kv_cache_interface.py). A record's K/V rows use each token and KV head's
      own amax, so the block scales, and with them the codes, differ;
    - the block scales come from the CUDA quantizer (reciprocal approximations; about 1e-3 of block
      scales differ from the contract's at E4M3 ties), and 'nvfp4_4over6' picks max/4 or max/6 per block;
    - attention reads it with an FP8 query and writes FP8 output (trtllm-gen), not the model dtype the
      trainer attends in."""
    if not str(kv_cache_dtype).startswith("nvfp4"):
        return
    raise ValueError(
        f"trace_fp4: {layer_name}: kv_cache_dtype={kv_cache_dtype!r} is vLLM's own NVFP4 KV cache, which does "
        "not compute the codes a TRACE record holds: it scales K/V by one calibrated k_scale/v_scale per layer "
        "(a record's rows use each token and KV head's own amax), rounds with the CUDA quantizer"
        f"{' and picks max/4 or max/6 scales' if kv_cache_dtype == 'nvfp4_4over6' else ''}, and attends with an "
        "FP8 query and FP8 output; so it cannot serve a captured site. Use kv_cache_dtype='auto': trace_fp4 "
        "quantizes K/V itself (TRACE_FP4_KV_CACHE=packed|dequantized)"
    )


class TraceFP4KVCacheMethod(BaseKVCacheMethod):
    def __init__(self, quant_config, layer_name: str):
        super().__init__(quant_config)
        self.layer_name = layer_name
        self.layer_idx = extract_layer_index(layer_name)

    def create_weights(self, layer: torch.nn.Module) -> None:
        # No k/v scale parameters: the scales are per token and head, computed at cache-write time.
        backend = layer.attn_backend
        refuse_vllm_nvfp4_kv(self.layer_name, layer.kv_cache_dtype)
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
        decode = envs.TRACE_FP4_KV_DECODE_ATTENTION
        block_scale = self.quant_config.trace_config.block_scale
        if decode == "triton" and block_scale != "6":
            raise NotImplementedError(
                f"trace_fp4: {self.layer_name}: TRACE_FP4_KV_DECODE_ATTENTION=triton reads NVFP4 pages with the "
                f"default block scale only; block_scale={block_scale!r} needs the scratch path (unset it)"
            )
        from vllm.config import get_current_vllm_config

        block_size = get_current_vllm_config().cache_config.block_size
        unsupported = decode_kernel_unsupported(layer.impl, layer.head_size_v, block_size)
        why = _no_packed_cache(backend.get_name(), decode, unsupported) if mode == "packed" else None
        if why is not None:
            store.count("kv_cache_dequantized_fallback")
            logger.warning(
                "trace_fp4: %s: %s; the cache stores dequantized values in the model dtype (no memory saving)",
                self.layer_name, why,
            )
            mode = "dequantized"
        if mode == "packed":
            layer.attn_backend = packed_backend_class(backend)
            layer.impl.__class__ = packed_impl_class(type(layer.impl))
            layer.impl._trace_fp4_dtype = layer.kv_cache_torch_dtype
            layer.impl._trace_fp4_head_size_v = layer.head_size_v
            layer.impl._trace_fp4_decode_kernel = decode == "triton" and unsupported is None
            layer.impl._trace_fp4_block_scale = block_scale
            layer.impl._trace_fp4_attention = decode  # auto / native: kv_packed._forward's native read
            layer.impl._trace_fp4_native_why = native_attention_unsupported(
                layer.impl, layer.kv_cache_torch_dtype, layer.head_size_v, block_scale)
            if decode == "triton" and unsupported is not None:
                logger.warning("trace_fp4: %s: %s: decode reads through the scratch, not the Triton kernel",
                               self.layer_name, unsupported)
                store.count("kv_decode_attention_scratch_layers")
            store.count("kv_cache_packed_layers")
        else:
            layer.impl.__class__ = traced_impl_class(type(layer.impl))
        layer.impl._trace_fp4_layer_idx = self.layer_idx
        layer.impl._trace_fp4_store = store

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # Keep vLLM's default k/v scales (1.0): the values written to (or dequantized into) the
        # model-dtype cache are the NVFP4 values themselves.
        return
