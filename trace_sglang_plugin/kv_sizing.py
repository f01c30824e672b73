"""Bytes per token that SGLang 0.5.23 sizes its KV pool with, for the packed NVFP4 pool (kv_pool.py).

SGLang divides its KV memory budget by a per-token cell size computed before the pool exists
(`DefaultPoolConfigurator._compute_cell_size`); around it, a trace_fp4 model with the packed pool
costs `kv_heads * (row_k + row_v)` bytes per token and layer instead of `kv_heads * (hd + vhd) * 2`,
so the same budget admits ~3.4x the tokens (head_dim 128). Reported in the counters
(`kv_pool_cell_bytes_model_dtype`, `kv_pool_cell_bytes_packed`).
"""

import torch

from trace_kernels.engine import kv_cache_mode
from trace_kernels.kv_layout import packed_row_bytes

from .state import model_counters


def _trace_config_of(model_config):
    """The model's TraceConfig if it is a trace_fp4 model, else None."""
    from trace_kernels import TraceConfig
    from trace_kernels.config import QUANT_METHOD

    cfg = getattr(model_config.hf_config, "quantization_config", None)
    if isinstance(cfg, dict) and cfg.get("quant_method") == QUANT_METHOD:
        from .config import TraceFp4SGLangConfig

        return TraceFp4SGLangConfig.from_config(cfg).trace
    if getattr(model_config, "quantization", None) == QUANT_METHOD:
        return TraceConfig()
    return None


def packed_cell_size_hook(original, configurator, kvc, num_layers):
    """Around `DefaultPoolConfigurator._compute_cell_size`: SGLang sizes its token pool by bytes per
    token; with the packed pool a token costs `kv_heads * (row_k + row_v)` bytes per layer, so the same
    memory budget holds more tokens."""
    size = original(configurator, kvc, num_layers)
    mc = kvc.model_config
    trace = _trace_config_of(mc)
    if trace is None or not trace.quantize_kv or kv_cache_mode() != "packed" or kvc.use_mla_backend:
        return size
    hd, vhd = int(mc.head_dim), int(mc.v_head_dim)
    dense_token_layer_head = (hd + vhd) * torch._utils._element_size(kvc.kv_cache_dtype)
    if size <= 0 or size % dense_token_layer_head:
        # Not the plain MHA formula (extra per-token state): keep SGLang's figure, say so.
        model_counters(mc).count("kv_pool_cell_size_not_packed")
        return size
    packed = size // dense_token_layer_head * (packed_row_bytes(hd) + packed_row_bytes(vhd))
    counters = model_counters(mc)  # the engine's state adopts them once it exists
    counters.count("kv_pool_cell_bytes_model_dtype", size)
    counters.count("kv_pool_cell_bytes_packed", packed)
    return packed
