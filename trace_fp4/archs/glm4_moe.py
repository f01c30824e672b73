"""GLM-4.5 (Glm4MoeForCausalLM): dense first layers, one ungated shared expert, sigmoid routing with a
score correction bias, partial rotary, Q/K/V biases, optional QK norm.

What each side does with it:
- records / ModelShape: the first `first_k_dense_replace` layers have a dense MLP and no routed experts:
  no routing ids, no moe_fc1_in / moe_fc2_in sites; every layer has standard K/V.
- engines: the shared expert and the dense MLPs are plain BF16 linears (vLLM runs the shared expert
  before the routed experts' quant method); routing (sigmoid + e_score_correction_bias, grouped top-k,
  renormalised) happens before it and is captured as the engine's expert ids; routed_scaling_factor is
  applied to the routed output by vLLM's MoE runner.
- Megatron: moe_layer_freq, sigmoid score function with expert bias, topk scaling factor, rotary_percent
  (see trace_fp4/hf_to_megatron.py).
"""

from pathlib import Path

import torch

from ..hf_checkpoint import CheckpointError, HFMoeConfig, _int, _number
from ..hf_to_megatron import HFLayout, convert_moe_state_dict, moe_gpt_model, moe_transformer_config
from .config_fields import attention_fields, check_blocks, check_bools, checked_shape, rope_fields

ARCHITECTURE = "Glm4MoeForCausalLM"
LAYOUT = HFLayout(shared="shared_experts", shared_gate=None, router_bias="gate.e_score_correction_bias")


def build_tiny(out_dir, seed: int = 0, *, num_layers: int = 4, first_k_dense_replace: int = 1, hidden_size: int = 64,
               intermediate_size: int = 128, moe_intermediate_size: int = 32, num_experts: int = 8, top_k: int = 2,
               num_attention_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32, vocab_size: int = 384,
               use_qk_norm: bool = True, n_group: int = 1, topk_group: int = 1,
               routed_scaling_factor: float = 2.5) -> Path:
    """A tiny random GLM-4.5 (Glm4MoeConfig + Glm4MoeForCausalLM, bf16) with GLM-4.5's own switches:
    attention_bias, partial_rotary_factor 0.5, one shared expert, norm_topk_prob, routed_scaling_factor
    2.5, and a random (non-zero) e_score_correction_bias so the bias really changes which experts win."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from .tiny_build import build_checkpoint

    params = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_attention_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=use_qk_norm,
        moe_intermediate_size=moe_intermediate_size, n_routed_experts=num_experts, num_experts_per_tok=top_k,
        n_shared_experts=1, first_k_dense_replace=first_k_dense_replace, norm_topk_prob=True,
        routed_scaling_factor=routed_scaling_factor, n_group=n_group, topk_group=topk_group,
        num_nextn_predict_layers=0, architectures=[ARCHITECTURE], dtype="bfloat16",
    )

    def after_init(model, gen):
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                # sigmoid scores of this model spread about +-0.1; a bias of that size reorders experts
                gate.e_score_correction_bias.copy_(torch.randn(num_experts, generator=gen) * 0.1)

    return build_checkpoint(out_dir, family="glm4_moe", config_class=Glm4MoeConfig, model_class=Glm4MoeForCausalLM,
                            params=params, seed=seed, initializer_range=1 / hidden_size**0.5, after_init=after_init)


def read_config(cfg: dict, where: str) -> HFMoeConfig:
    """Check a Glm4MoeForCausalLM config.json; CheckpointError naming the field otherwise."""
    att = attention_fields(cfg, where)
    n_layers = _int(cfg, "num_hidden_layers", where)
    num_experts = _int(cfg, "n_routed_experts", where)
    top_k = _int(cfg, "num_experts_per_tok", where)
    if top_k > num_experts:
        raise CheckpointError(f"{where}: num_experts_per_tok={top_k} exceeds the {num_experts} experts")
    first_dense = _int(cfg, "first_k_dense_replace", where, default=0, minimum=0)
    if first_dense >= n_layers:
        raise CheckpointError(f"{where}: first_k_dense_replace={first_dense} leaves no MoE layer of {n_layers}")
    moe_inter = _int(cfg, "moe_intermediate_size", where)
    dense_inter = _int(cfg, "intermediate_size", where) if first_dense else None
    n_shared = _int(cfg, "n_shared_experts", where, default=0, minimum=0)
    check_bools(cfg, where, "norm_topk_prob", "tie_word_embeddings", "attention_bias", "use_qk_norm")
    if not cfg.get("norm_topk_prob", True):
        # Megatron renormalises sigmoid top-k weights whenever top_k > 1; without it the trainer's
        # routing weights would differ from the engine's.
        raise CheckpointError(f"{where}: norm_topk_prob=false with sigmoid routing is not supported (Megatron renormalises)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act={cfg.get('hidden_act')!r}: GLM-4.5 experts are SiLU-gated")
    n_group = _int(cfg, "n_group", where, default=1)
    topk_group = _int(cfg, "topk_group", where, default=1)
    if num_experts % n_group or topk_group > n_group:
        raise CheckpointError(f"{where}: n_group={n_group} / topk_group={topk_group} do not fit {num_experts} experts")
    if n_group > 1 and top_k % topk_group:
        raise CheckpointError(f"{where}: num_experts_per_tok={top_k} is not a multiple of topk_group={topk_group}")
    if n_group > 1 and top_k // topk_group != 2:
        # HF and vLLM score a group by the sum of its top-2 experts, Megatron by its top (top_k / topk_group)
        raise CheckpointError(f"{where}: grouped routing needs num_experts_per_tok / topk_group = 2 for Megatron parity")
    rope_theta, partial = rope_fields(cfg, where)
    rot = att["head_dim"] * partial
    if rot != int(rot) or int(rot) % 2:
        raise CheckpointError(f"{where}: partial_rotary_factor={partial} of head_dim={att['head_dim']} is not an even width")
    check_blocks(where, hidden_size=att["hidden_size"], moe_intermediate_size=moe_inter, head_dim=att["head_dim"])
    hf = HFMoeConfig(
        architecture=ARCHITECTURE, num_layers=n_layers, vocab_size=_int(cfg, "vocab_size", where),
        moe_intermediate_size=moe_inter, num_experts=num_experts, top_k=top_k, norm_topk_prob=True,
        rms_norm_eps=_number(cfg, "rms_norm_eps", where, 1e-5), rope_theta=rope_theta,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=bool(cfg.get("use_qk_norm", False)),
        shared_expert_intermediate_size=moe_inter * n_shared if n_shared else None,
        dense_intermediate_size=dense_inter,  # moe_layers: from model_shape_from_hf (checked_shape)
        shared_expert_gate=False, score_function="sigmoid", expert_bias=True,
        routed_scaling_factor=_number(cfg, "routed_scaling_factor", where, 1.0),
        num_groups=n_group if n_group > 1 else None, group_topk=topk_group if n_group > 1 else None,
        rotary_percent=partial, router_fp32=True, **att,
    )
    return checked_shape(cfg, hf, where)


# An HFMoeConfig with this family's routing and layer-pattern fields: the shared Megatron config and model.
transformer_config = moe_transformer_config
build_gpt_model = moe_gpt_model


def convert_state_dict(hf_state: dict[str, torch.Tensor], hf: HFMoeConfig, dtype=torch.float32) -> dict:
    # Real GLM-4.5 checkpoints carry the multi-token-prediction layer(s) after the last decoder layer
    # (num_nextn_predict_layers); neither transformers' CausalLM nor vLLM's runs them, nor does the trainer.
    mtp = tuple(f"model.layers.{i}." for i in range(hf.num_layers, hf.num_layers + 8))
    state = {k: v for k, v in hf_state.items() if not k.startswith(mtp)}
    return convert_moe_state_dict(state, hf, dtype, LAYOUT)
