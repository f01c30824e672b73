"""FP4 KV cache for MLA attention (DeepSeek-V2/V3, Kimi K2): the latent kv_c is NVFP4 with capture.

What MLA caches and reads (vLLM 0.32.0, `MLAAttention.forward` and the CPU backend `CPUMLAImpl`):
- The cache row of a token is 576 wide: `kv_c_normed` (kv_lora_rank 512, after `kv_a_layernorm`) then
  `k_pe` (qk_rope_head_dim 64, after RoPE), one row per token (num_kv_heads = 1).
- Decode (`forward_mqa`) reads both parts back from the cache. Prefill (`forward_mha`) does NOT: it
  up-projects the fresh `kv_c_normed` / `k_pe` tensors it was handed (on the CPU chunked prefill and
  prefix caching are off for MLA, so no prefill ever reads cached context).
So quantizing inside `do_kv_cache_update` (as kv.py does for standard attention, where prefill reads
the cache) would leave prefill attending to BF16 latents and decode to FP4 ones. Instead the layer's
`forward` quantizes `kv_c_normed` once, before both the cache write and the attention: every read,
prefill or decode, sees the same NVFP4 values, and the cache holds exactly those values.

The FP4 site is `kv_latent` = kv_c_normed, one row of kv_lora_rank per token (ModelShape
kv_kind="mla"): it is the part of the cache that carries the keys and values of every head (they
are `kv_b_proj(kv_c)`), 512 of the 576 cached values per token. `k_pe` stays in the model dtype: it is
the RoPE'd positional key shared by all heads (64 values), a small part of the cache, and the
trainer's k_pe comes out of Megatron's own RoPE, which differs from the engine's in the last bits, so
FP4 codes there would mostly record RoPE noise rather than information; keeping it BF16 is also what
DeepSeek's own FP8 KV format (fp8_ds_mla) does (the rope part unquantized).

Cache: dequantized (model dtype, 1.0x BF16 memory). The CPU decode kernel
(`mla_decode_kvcache_cpu`) reads the 576-wide model-dtype cache directly, so a packed NVFP4 latent
cache would need its own decode kernel; `TRACE_FP4_KV_CACHE=packed` (the default) therefore falls
back to the dequantized cache for MLA layers, logged and counted (`kv_cache_dequantized_fallback`).
"""

import torch

import trace_kernels
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.models.utils import extract_layer_index

from .activations import quantize_input
from trace_kernels.engine import kv_cache_mode

logger = init_logger(__name__)

SITE = "kv_latent"
_TRACED: dict[type, type] = {}


def _forward(self, q, kv_c_normed, k_pe, *args, **kwargs):
    idx, store = self._trace_fp4_layer_idx, self._trace_fp4_store
    store.count("kv_calls")
    store.count(f"kv_calls.layer{idx}")
    # Rows [T, 1, kv_lora_rank]: one row per token and (the one) latent head, as the record holds them.
    T, L = kv_c_normed.shape[0], kv_c_normed.shape[-1]
    xq, _ = quantize_input(store, kv_c_normed.reshape(T, 1, L), idx, SITE)
    return self._trace_fp4_base.forward(self, q, xq.reshape(kv_c_normed.shape), k_pe, *args, **kwargs)


def traced_mla_class(base: type) -> type:
    """A subclass of the MLAAttention class `base` whose forward fake-quantizes kv_c_normed with capture."""
    if base not in _TRACED:
        _TRACED[base] = type(f"TraceFP4{base.__name__}", (base,), {"forward": _forward, "_trace_fp4_base": base})
    return _TRACED[base]


class TraceFP4MLAKVCacheMethod(BaseKVCacheMethod):
    def __init__(self, quant_config, layer_name: str):
        super().__init__(quant_config)
        self.layer_name = layer_name
        self.layer_idx = extract_layer_index(layer_name)

    def create_weights(self, layer: torch.nn.Module) -> None:
        # Called from MLAAttention.__init__ before its impl exists: only the layer's class is switched
        # here (its forward is looked up at call time). No k/v scale parameters (per-token scales).
        from .kv import refuse_vllm_nvfp4_kv

        refuse_vllm_nvfp4_kv(self.layer_name, layer.kv_cache_dtype)
        if layer.kv_cache_dtype != "auto":
            raise ValueError(
                f"trace_fp4: {self.layer_name}: kv_cache_dtype={layer.kv_cache_dtype!r}; trace_fp4 "
                "quantizes the MLA latent itself and needs kv_cache_dtype='auto'"
            )
        if layer.kv_lora_rank % trace_kernels.BLOCK_SIZE:
            raise ValueError(
                f"trace_fp4: {self.layer_name}: kv_lora_rank={layer.kv_lora_rank} is not divisible by "
                f"{trace_kernels.BLOCK_SIZE} (NVFP4 quantizes the latent in blocks of 16)"
            )
        if getattr(layer, "indexer", None) is not None or getattr(layer.impl if hasattr(layer, "impl") else None, "is_sparse", False):
            raise NotImplementedError(f"trace_fp4: {self.layer_name}: sparse MLA (DeepSeek-V3.2 indexer) is not supported")
        store = self.quant_config.capture_store
        if kv_cache_mode() == "packed":
            store.count("kv_cache_dequantized_fallback")
            logger.warning(
                "trace_fp4: %s: MLA has no packed NVFP4 latent cache (the CPU decode kernel reads the "
                "model-dtype cache); the cache stores the dequantized kv_c (no memory saving)",
                self.layer_name,
            )
        layer.__class__ = traced_mla_class(type(layer))
        layer._trace_fp4_layer_idx = self.layer_idx
        layer._trace_fp4_store = store
        store.count("kv_mla_layers")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return
