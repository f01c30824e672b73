"""Which KV cache may serve a captured K/V site on vLLM's GPU attention backends. vLLM's own NVFP4 KV
cache (kv_cache_dtype 'nvfp4', SM100 FlashInfer trtllm-gen) quantizes with one calibrated scale per
tensor and the CUDA quantizer's rounding and attends in FP8, so its codes are not the ones a record
holds: the trace_fp4 KV method refuses it, naming why. (The CPU build cannot start an engine with that
dtype, so the method is called on a layer stand-in with the attributes it reads.)"""

from types import SimpleNamespace

import pytest

from trace_vllm_plugin.kv import TraceFP4KVCacheMethod


@pytest.mark.parametrize("dtype", ["nvfp4", "nvfp4_4over6"])
def test_vllms_own_nvfp4_kv_cache_cannot_serve_a_captured_site(dtype):
    method = TraceFP4KVCacheMethod(SimpleNamespace(capture_store=None), "model.layers.0.self_attn.attn")
    layer = SimpleNamespace(attn_backend=None, kv_cache_dtype=dtype)
    with pytest.raises(ValueError, match=r"vLLM's own NVFP4 KV cache, whose codes are not trace_fp4's"):
        method.create_weights(layer)
