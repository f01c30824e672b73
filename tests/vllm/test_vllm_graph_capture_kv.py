"""Which KV cache may serve a captured K/V site on vLLM's GPU attention backends. vLLM's own NVFP4 KV
cache (kv_cache_dtype 'nvfp4' / 'nvfp4_4over6' / 'nvfp4_ds_mla', FlashInfer on SM100) scales K/V by one
calibrated k_scale/v_scale per layer, rounds with the CUDA quantizer and attends with an FP8 query and
output, so its codes are not the ones a record holds (per token and KV head amax): both trace_fp4 KV
methods (attention and MLA) refuse it, saying why. (The CPU build cannot start an engine with that dtype,
so the methods are called on a layer stand-in with the attributes they read.)"""

from types import SimpleNamespace

import pytest

from trace_vllm_plugin.kv import TraceFP4KVCacheMethod
from trace_vllm_plugin.kv_mla import TraceFP4MLAKVCacheMethod


@pytest.mark.parametrize("method", [TraceFP4KVCacheMethod, TraceFP4MLAKVCacheMethod])
@pytest.mark.parametrize("dtype", ["nvfp4", "nvfp4_4over6", "nvfp4_ds_mla"])
def test_vllms_own_nvfp4_kv_cache_cannot_serve_a_captured_site(method, dtype):
    m = method(SimpleNamespace(capture_store=None), "model.layers.0.self_attn.attn")
    layer = SimpleNamespace(attn_backend=None, kv_cache_dtype=dtype)
    with pytest.raises(ValueError) as err:
        m.create_weights(layer)
    msg = str(err.value)
    assert f"kv_cache_dtype={dtype!r} is vLLM's own NVFP4 KV cache" in msg
    # Why, in the message: the per-layer scale against a record's per-row amax, the FP8 attention.
    assert "one calibrated k_scale/v_scale per layer" in msg and "each token and KV head's own amax" in msg
    assert "FP8 query and FP8 output" in msg and "cannot serve a captured site" in msg
    assert ("max/4 or max/6" in msg) == (dtype == "nvfp4_4over6")


def test_which_backends_keep_a_packed_cache_and_why_not():
    from trace_vllm_plugin.kv import _no_packed_cache

    assert _no_packed_cache("CPU_ATTN", "scratch", None) is None and _no_packed_cache("CPU_ATTN", "triton", "ALiBi") is None
    assert _no_packed_cache("TRITON_ATTN", "triton", None) is None
    assert "only with TRACE_FP4_KV_DECODE_ATTENTION=triton" in _no_packed_cache("TRITON_ATTN", "scratch", None)
    assert "does not support sliding window" in _no_packed_cache("TRITON_ATTN", "triton", "sliding window (7, 0)")
    assert "has no packed NVFP4 KV cache" in _no_packed_cache("FLASH_ATTN", "triton", None)


def test_the_decode_kernel_names_what_it_does_not_support():
    from trace_vllm_plugin.kv_packed import decode_kernel_unsupported

    plain = dict(sliding_window=(-1, -1), alibi_slopes=None, logits_soft_cap=0, sinks=None)
    assert decode_kernel_unsupported(SimpleNamespace(**plain)) is None
    assert decode_kernel_unsupported(SimpleNamespace(**{**plain, "sliding_window": -1})) is None  # CPU_ATTN's "none"
    assert decode_kernel_unsupported(SimpleNamespace(**{**plain, "sliding_window": (127, 0)})) == "sliding window (127, 0)"
    assert decode_kernel_unsupported(SimpleNamespace(**{**plain, "logits_soft_cap": 30.0})) == "logits soft-cap 30.0"
    assert decode_kernel_unsupported(SimpleNamespace(**{**plain, "sinks": object()})) == "attention sinks"
    assert decode_kernel_unsupported(SimpleNamespace(**plain, head_size=96)).startswith("head_size 96")
    assert decode_kernel_unsupported(SimpleNamespace(**plain, head_size=128), 128, 48).startswith("block_size 48")
    assert decode_kernel_unsupported(SimpleNamespace(**plain, head_size=128), 128, 32) is None


def test_a_packed_backend_caps_its_cuda_graphs_at_single_token_decode():
    """The scratch read (mixed and prefill batches) has a data-dependent block set, so only decode
    batches (the Triton read) may be captured whole; a backend that never had graphs keeps none."""
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    from trace_vllm_plugin.kv_packed import packed_backend_class

    triton = packed_backend_class(TritonAttentionBackend).get_builder_cls()
    assert issubclass(triton, TritonAttentionBackend.get_builder_cls())
    assert TritonAttentionBackend.get_builder_cls().get_cudagraph_support(None, None) == AttentionCGSupport.ALWAYS
    assert triton.get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    cpu = packed_backend_class(CPUAttentionBackend).get_builder_cls()
    assert cpu.get_cudagraph_support(None, None) == CPUAttentionBackend.get_builder_cls().get_cudagraph_support(None, None)
