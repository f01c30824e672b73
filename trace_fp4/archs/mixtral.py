"""Mixtral (MixtralForCausalLM): the control. Every layer is MoE (softmax top-k, renormalised), no
shared expert, no biases, no QK norm; experts under `block_sparse_moe` as w1 (gate), w3 (up), w2 (down).
"""

from pathlib import Path

import torch

from ..hf_checkpoint import CheckpointError, HFMoeConfig, _int, _number
from ..hf_to_megatron import HFLayout, convert_moe_state_dict, moe_gpt_model, moe_transformer_config
from .config_fields import attention_fields, check_blocks, check_bools, checked_shape, rope_fields

ARCHITECTURE = "MixtralForCausalLM"
LAYOUT = HFLayout(moe="block_sparse_moe", experts=("w1", "w3", "w2"), shared_gate=None)


def build_tiny(out_dir, seed: int = 0, *, num_layers: int = 4, hidden_size: int = 128, intermediate_size: int = 32,
               num_experts: int = 8, top_k: int = 2, num_attention_heads: int = 4, num_kv_heads: int = 2,
               head_dim: int = 32, vocab_size: int = 384) -> Path:
    """A tiny random Mixtral (MixtralConfig + MixtralForCausalLM, bf16). head_dim 32 (vLLM's CPU
    attention needs a multiple of 32) = hidden / heads: SGLang 0.5.23's Mixtral ignores config.head_dim
    and uses hidden / heads, so the two must agree for it to run."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from .tiny_build import build_checkpoint

    params = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_attention_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        num_local_experts=num_experts, num_experts_per_tok=top_k, sliding_window=None,
        architectures=[ARCHITECTURE], dtype="bfloat16",
    )
    return build_checkpoint(out_dir, family="mixtral", config_class=MixtralConfig, model_class=MixtralForCausalLM,
                            params=params, seed=seed, initializer_range=1 / hidden_size**0.5)


def read_config(cfg: dict, where: str) -> HFMoeConfig:
    """Check a MixtralForCausalLM config.json; CheckpointError naming the field otherwise."""
    att = attention_fields(cfg, where)
    num_experts = _int(cfg, "num_local_experts", where)
    top_k = _int(cfg, "num_experts_per_tok", where)
    if top_k > num_experts:
        raise CheckpointError(f"{where}: num_experts_per_tok={top_k} exceeds the {num_experts} experts")
    # Mixtral's experts are `intermediate_size` wide (there is no separate moe_intermediate_size).
    inter = _int(cfg, "intermediate_size", where)
    if cfg.get("sliding_window") is not None:
        raise CheckpointError(f"{where}: sliding_window={cfg['sliding_window']} is not supported (Megatron parity)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act={cfg.get('hidden_act')!r}: Mixtral experts are SiLU-gated")
    check_bools(cfg, where, "tie_word_embeddings")
    rope_theta, partial = rope_fields(cfg, where)
    if partial != 1.0:
        raise CheckpointError(f"{where}: partial_rotary_factor={partial}: Mixtral rotates the whole head")
    check_blocks(where, hidden_size=att["hidden_size"], intermediate_size=inter, head_dim=att["head_dim"])
    hf = HFMoeConfig(
        architecture=ARCHITECTURE, num_layers=_int(cfg, "num_hidden_layers", where),
        vocab_size=_int(cfg, "vocab_size", where), moe_intermediate_size=inter, num_experts=num_experts,
        top_k=top_k, norm_topk_prob=True, rms_norm_eps=_number(cfg, "rms_norm_eps", where, 1e-5),
        rope_theta=rope_theta, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=False, qk_norm=False, shared_expert_intermediate_size=None, **att,
    )
    return checked_shape(cfg, hf, where)


# An HFMoeConfig with this family's routing and layer-pattern fields: the shared Megatron config and model.
transformer_config = moe_transformer_config
build_gpt_model = moe_gpt_model


def convert_state_dict(hf_state: dict[str, torch.Tensor], hf: HFMoeConfig, dtype=torch.float32) -> dict:
    return convert_moe_state_dict(hf_state, hf, dtype, LAYOUT)
