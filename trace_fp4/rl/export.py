"""Megatron-Core GPTModel weights -> Hugging Face Qwen3-MoE names (the inverse of hf_to_megatron).

Used two ways: the routed experts after every RL step (the weight sync to the engine), and the whole
model once after the supervised initialisation (a checkpoint the engine loads). Round trip
`convert_state_dict(to_hf(x)) == x` is tested.
"""

import torch

from ..hf_checkpoint import HFMoeConfig

_EXPERT = ".mlp.experts.local_experts."


def _split_qkv(w: torch.Tensor, hf: HFMoeConfig):
    D, nkv = hf.head_dim, hf.num_kv_heads
    per_group = hf.num_attention_heads // nkv
    g = w.reshape(nkv, (per_group + 2) * D, *w.shape[1:])
    q = g[:, : per_group * D].reshape(-1, *w.shape[1:])
    k = g[:, per_group * D : (per_group + 1) * D].reshape(-1, *w.shape[1:])
    v = g[:, (per_group + 1) * D :].reshape(-1, *w.shape[1:])
    return q, k, v


def expert_to_hf(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """decoder.layers.L.mlp.experts.local_experts.E.linear_fc{1,2}.weight -> gate/up/down_proj."""
    layer = int(name.split(".")[2])
    expert = int(name.split(_EXPERT)[1].split(".")[0])
    prefix = f"model.layers.{layer}.mlp.experts.{expert}"
    if name.endswith("linear_fc1.weight"):
        gate, up = tensor.chunk(2, dim=0)
        return {f"{prefix}.gate_proj.weight": gate.contiguous(), f"{prefix}.up_proj.weight": up.contiguous()}
    if name.endswith("linear_fc2.weight"):
        return {f"{prefix}.down_proj.weight": tensor.contiguous()}
    raise ValueError(f"not a routed-expert weight: {name}")


def experts_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        if _EXPERT in name:
            out.update(expert_to_hf(name, t))
    return out


def to_hf(state: dict[str, torch.Tensor], hf: HFMoeConfig) -> dict[str, torch.Tensor]:
    """A whole Megatron state dict (local spec, no shared experts, no QKV bias) -> HF tensors."""
    if hf.shared_expert_intermediate_size is not None or hf.attention_bias:
        raise ValueError("export supports Qwen3-MoE without shared experts or QKV biases (the tiny model)")
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"]}
    for i in range(hf.num_layers):
        m, h = f"decoder.layers.{i}", f"model.layers.{i}"
        a = f"{h}.self_attn"
        norm = state.get(f"{m}.input_layernorm.weight", state.get(f"{m}.self_attention.linear_qkv.layer_norm_weight"))
        out[f"{h}.input_layernorm.weight"] = norm
        q, k, v = _split_qkv(state[f"{m}.self_attention.linear_qkv.weight"], hf)
        out.update({f"{a}.q_proj.weight": q.contiguous(), f"{a}.k_proj.weight": k.contiguous(), f"{a}.v_proj.weight": v.contiguous()})
        if hf.qk_norm:
            out[f"{a}.q_norm.weight"] = state[f"{m}.self_attention.q_layernorm.weight"]
            out[f"{a}.k_norm.weight"] = state[f"{m}.self_attention.k_layernorm.weight"]
        out[f"{a}.o_proj.weight"] = state[f"{m}.self_attention.linear_proj.weight"]
        out[f"{h}.post_attention_layernorm.weight"] = state[f"{m}.pre_mlp_layernorm.weight"]
        out[f"{h}.mlp.gate.weight"] = state[f"{m}.mlp.router.weight"]
    out.update(experts_to_hf(state))
    out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    if not hf.tie_word_embeddings:
        out["lm_head.weight"] = state["output_layer.weight"]
    return out
