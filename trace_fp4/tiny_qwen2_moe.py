"""A tiny random Qwen2-MoE with a gated shared expert (Qwen2MoeConfig + Qwen2MoeForCausalLM, bf16).

A second model family for the checks that must hold on a model the sparse rates were not tuned on
(issue 27): the shared expert runs in BF16 beside the routed experts, the attention has Q/K/V biases
and no QK norm. head_dim = hidden / heads = 32 (vLLM's Qwen2-MoE derives it so; its CPU attention needs
a multiple of 32). Trained like the trained tiny model with
`python -m trace_fp4.trained_tiny DIR family=qwen2_moe`.
"""

from pathlib import Path


def build_tiny_qwen2_moe(out_dir, seed: int = 0, *, num_layers: int = 4, hidden_size: int = 128,
                         moe_intermediate_size: int = 32, shared_expert_intermediate_size: int = 64,
                         num_experts: int = 8, top_k: int = 2, num_attention_heads: int = 4, num_kv_heads: int = 2,
                         vocab_size: int = 384) -> Path:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from .archs.tiny_build import build_checkpoint

    params = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_attention_heads, num_key_value_heads=num_kv_heads,
        hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        moe_intermediate_size=moe_intermediate_size, shared_expert_intermediate_size=shared_expert_intermediate_size,
        num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=False, decoder_sparse_step=1,
        architectures=["Qwen2MoeForCausalLM"], dtype="bfloat16",
    )
    return build_checkpoint(out_dir, family="qwen2_moe", config_class=Qwen2MoeConfig, model_class=Qwen2MoeForCausalLM,
                            params=params, seed=seed, initializer_range=1 / hidden_size**0.5)
