"""BF16 boundary layers in vLLM: TraceConfig(bf16_layers=[0, 3]) keeps those layers' experts (weights
and inputs) and K/V unquantized; their records hold no site rows; the weights digest covers the NVFP4
layers only. One engine start."""

import pytest
import torch

import trace_kernels as tk
import trace_vllm_plugin as tvp
from trace_kernels.grouped_mm import PackedExperts
from trace_kernels.weight_digest import layer_digest
from vllm_helpers import FULL_ALL, PROMPTS, checkpoint_expert_codes, expert_residency, greedy, make_llm, shutdown, tiny_moe

BF16 = (0, 3)


@pytest.fixture(scope="module")
def run():
    model = tiny_moe()
    llm = make_llm(model, quant_config={**FULL_ALL, "bf16_layers": list(BF16)})
    try:
        outs = llm.generate(PROMPTS, greedy(4))
        records = tvp.get_records(llm, outs)
        residency = llm.apply_model(expert_residency)[0]
        kv_methods = llm.apply_model(lambda m: [type(getattr(layer.self_attn.attn, "quant_method", None)).__name__ for layer in m.model.layers])[0]
    finally:
        shutdown(llm)
    return model, records, residency, kv_methods


def test_records_hold_rows_only_for_the_fp4_layers(run):
    _, records, _, _ = run
    for rec in records:
        assert rec.modes == (None, "full", "full", None)
        assert rec.config.bf16_layers == BF16
        with_rows = {int(n.split(".")[1]) for n in rec.tensors if n.split(".")[2] in tk.ALL_SITES}
        assert with_rows == {1, 2}
        assert rec.routed_experts(0).shape == (rec.num_tokens, 2)  # routing of every MoE layer is kept


def test_bf16_layers_hold_bf16_experts_and_no_fp4_kv_method(run):
    _, _, residency, kv_methods = run
    for layer in BF16:
        assert residency[layer]["w13_weight"][0] == torch.bfloat16 and residency[layer]["w13_weight"][1] > 0
        assert not any(name.startswith("trace_w13") for name in residency[layer])
        assert kv_methods[layer] != "TraceFP4KVCacheMethod"
    for layer in (1, 2):
        assert residency[layer]["trace_w13.codes"][0] == torch.uint8
        assert kv_methods[layer] == "TraceFP4KVCacheMethod"


def test_the_weights_digest_covers_the_nvfp4_layers(run):
    model, records, _, _ = run
    want = checkpoint_expert_codes(model / "model.safetensors")
    packed = {layer: layer_digest(*(PackedExperts(w[f"{n}_codes"], w[f"{n}_scales"], w[f"{n}_amax"]) for n in ("w13", "w2")))
              for layer, w in want.items() if layer not in BF16}
    assert {r.identity.weights_digest for r in records} == {tk.weights_digest(packed)}
