"""trace_fp4 in real vLLM (CPU) on GLM-4.5 and Mixtral: records carry routing and moe sites only for the
routed-expert layers, K/V for every layer, and hold exactly the codes trace_kernels recomputes from the
engine's own inputs; dense MLPs and the shared expert stay BF16; routing is what vLLM chose (GLM-4.5:
sigmoid scores + e_score_correction_bias, renormalised, routed_scaling_factor on the output)."""

import pytest
import torch

import trace_kernels
import trace_vllm_plugin as tvp
from trace_fp4.archs import glm4_moe, mixtral
from vllm_helpers import FULL_ALL, MODELS_DIR, fc2_inputs, greedy, make_llm, same_values, shutdown

LONG = " ".join(["The lazy dog jumps over the quick brown fox, and the fox runs away."] * 3)
# family -> (builder, the MoE block's attribute on a decoder layer, routed-expert layers of the tiny model)
FAMILIES = {
    "glm4_moe": (glm4_moe.build_tiny, "mlp", [1, 2, 3]),
    "mixtral": (mixtral.build_tiny, "block_sparse_moe", [0, 1, 2, 3]),
}


def _moe_block(layer, attr):
    block = getattr(layer, attr)
    return block if hasattr(block, "experts") else None


def _probe(model, attr):
    """Per forward call: every MoE block's input, and every attention layer's K / V."""
    probes = {"x": {}, "k": {}, "v": {}}
    handles = []
    for i, layer in enumerate(model.model.layers):
        block = _moe_block(layer, attr)
        if block is not None:
            handles.append(block.experts.register_forward_pre_hook(
                lambda m, a, kw, i=i: probes["x"].setdefault(i, []).append(kw.get("hidden_states", a[0] if a else None).detach().clone()),
                with_kwargs=True))

        def attn_hook(mod, args, kwargs, i=i):
            _, k, v = args[:3]
            probes["k"].setdefault(i, []).append(k.detach().reshape(k.shape[0], -1, mod.head_size).clone())
            probes["v"].setdefault(i, []).append(v.detach().reshape(v.shape[0], -1, mod.head_size).clone())

        handles.append(layer.self_attn.attn.register_forward_pre_hook(attn_hook, with_kwargs=True))
    model._glm_probes = (probes, handles)


def _take(model, attr):
    probes, handles = model._glm_probes
    for h in handles:
        h.remove()
    del model._glm_probes
    out = {"probes": probes, "weights": {}, "gate": {}, "bf16_modules": {}}
    for i, layer in enumerate(model.model.layers):
        block = _moe_block(layer, attr)
        if block is None:  # a dense layer: vLLM's own BF16 MLP
            out["bf16_modules"][f"layer{i}.mlp"] = [
                (type(m.quant_method).__name__, m.weight.dtype) for m in layer.mlp.modules() if hasattr(m, "quant_method")
            ]
            continue
        re = block.experts.routed_experts
        out["weights"][i] = {f"{n}_{f}": getattr(getattr(re, f"trace_{n}"), f).detach().clone()
                             for n in ("w13", "w2") for f in ("codes", "scales", "amax")}
        bias = getattr(block.gate, "e_score_correction_bias", None)
        out["gate"][i] = {"bias": None if bias is None else bias.detach().float().clone(),
                          "logits": [_gate(block.gate, x) for x in probes["x"][i]]}
        shared = getattr(block, "shared_experts", None)
        if shared is not None:
            out["bf16_modules"][f"layer{i}.shared_experts"] = [
                (type(m.quant_method).__name__, m.weight.dtype) for m in shared.modules() if hasattr(m, "quant_method")
            ]
    return out


def _gate(gate, x):
    out = gate(x)
    return (out[0] if isinstance(out, tuple) else out).detach().float().clone()


@pytest.fixture(scope="module", params=list(FAMILIES))
def run(request):
    name = request.param
    build, attr, moe_layers = FAMILIES[name]
    model_dir = build(MODELS_DIR / f"tiny_{name}")
    llm = make_llm(model_dir, quant_config=FULL_ALL, max_num_batched_tokens=32)
    try:
        llm.apply_model(lambda m: _probe(m, attr))
        out = llm.generate([LONG], greedy(5))[0]
        seen = llm.apply_model(lambda m: _take(m, attr))[0]
        record = tvp.get_record(llm, out)
        stats = tvp.stats(llm)["counters"]
    finally:
        shutdown(llm)
    return name, moe_layers, out, record, seen, stats


def test_record_shape_is_per_layer(run):
    name, moe_layers, out, record, _, stats = run
    shape = record.shape
    assert shape.moe_layer_list() == moe_layers and shape.kv_layer_list() == [0, 1, 2, 3]
    assert record.num_tokens == len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
    for layer in range(4):
        assert (stats.get(f"moe_calls.layer{layer}", 0) > 0) == (layer in moe_layers), (layer, stats)
        assert stats[f"kv_calls.layer{layer}"] > 0
        if layer not in moe_layers:
            with pytest.raises(trace_kernels.RecordError):
                record.routed_experts(layer)
            with pytest.raises(trace_kernels.RecordError):
                record.site(layer, "moe_fc1_in")
    assert stats["expert_weight_quantizations"] == len(moe_layers)


def test_dense_mlp_and_shared_expert_stay_bf16(run):
    name, _, _, _, seen, _ = run
    mods = seen["bf16_modules"]
    if name == "glm4_moe":
        assert set(mods) == {"layer0.mlp"} | {f"layer{i}.shared_experts" for i in (1, 2, 3)}
    else:
        assert mods == {}
    for key, linears in mods.items():
        assert linears and all(m == "UnquantizedLinearMethod" and d == torch.bfloat16 for m, d in linears), (key, linears)


def test_codes_equal_a_trace_kernels_recomputation(run):
    name, moe_layers, _, record, seen, _ = run
    probes, weights = seen["probes"], seen["weights"]
    T = record.num_tokens
    for layer in range(4):
        for site in ("k", "v"):
            data = torch.cat(probes[site][layer])
            assert data.shape[0] == T
            expect = trace_kernels.quantize(data, trace_kernels.row_amax(data))
            assert same_values(expect, record.site(layer, site)), (layer, site)
        if layer not in moe_layers:
            assert layer not in probes["x"]
            continue
        xs = probes["x"][layer]
        x = torch.cat(xs)
        expect = trace_kernels.quantize(x, trace_kernels.row_amax(x))
        assert same_values(expect, record.site(layer, "moe_fc1_in")), (layer, "moe_fc1_in")
        expect = fc2_inputs(xs, record.routed_experts(layer), weights[layer])
        assert same_values(expect, record.site(layer, "moe_fc2_in")), (layer, "moe_fc2_in")


def test_routing_is_what_the_engine_chose(run):
    """GLM-4.5: the recorded experts are a top-k of sigmoid(logits) + e_score_correction_bias (the bias
    ranks, n_group=1); Mixtral: a top-k of the logits. Equal-score ties may go either way, so compare
    the scores of the recorded experts with the k best scores."""
    name, moe_layers, _, record, seen, _ = run
    for layer in moe_layers:
        g = seen["gate"][layer]
        logits = torch.cat(g["logits"])
        score = torch.sigmoid(logits) + g["bias"] if name == "glm4_moe" else logits
        ids = record.routed_experts(layer).long()
        best = score.topk(ids.shape[1], dim=-1).values
        got = score.gather(-1, ids).sort(-1, descending=True).values
        assert torch.equal(best, got), layer
        if name == "glm4_moe":
            # the bias is load-bearing: without it the top-k differs for some tokens
            plain = torch.sigmoid(logits).topk(ids.shape[1], dim=-1).indices.sort(-1).values
            assert not torch.equal(plain, ids.sort(-1).values), layer
