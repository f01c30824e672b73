"""Hugging Face MoE checkpoints -> Megatron-Core GPTModel (config and weights).

Qwen3-MoE / Qwen2-MoE here; the registered families (trace_fp4/archs/: GLM-4.5, Mixtral, ...) reuse
`transformer_config` / `convert_state_dict` with their own `HFLayout` of tensor names.

A small converter of our own (Megatron-Bridge needs Python 3.12 and Transformer Engine). The rules
that matter, each checked by the logits-parity test against transformers:
- Megatron fuses Q, K, V per KV group: that group's q heads, then its k head, then its v head.
- kv_channels = head_dim (Qwen3 heads are not hidden / num_heads wide).
- Expert linear_fc1 = cat(gate_proj, up_proj) along the output dimension.
- Qwen3-MoE renormalises the top-k probabilities (norm_topk_prob): softmax over the selected
  logits, i.e. moe_router_pre_softmax = not norm_topk_prob.
- Qwen2-MoE adds a sigmoid-gated shared expert and Q/K/V biases, and has no QK norm.
- Dense-MLP layers among the MoE layers (GLM-4.5's first_k_dense_replace) -> moe_layer_freq, a 0/1
  list; their MLP is Megatron's dense MLP (ffn_hidden_size = the dense intermediate size).
- Sigmoid routing with a score correction bias (GLM-4.5) -> moe_router_score_function="sigmoid",
  moe_router_enable_expert_bias (the bias picks the experts only; the weights are the unbiased sigmoid
  scores, renormalised: Megatron always renormalises sigmoid top-k), routed_scaling_factor ->
  moe_router_topk_scaling_factor, n_group / topk_group -> moe_router_num_groups / group_topk.
- Partial rotary (GLM-4.5's partial_rotary_factor) -> GPTModel(rotary_percent=...): both rotate the
  first rotary_percent * head_dim channels of each head with rotate-half pairs, the rest pass through.
"""

from dataclasses import dataclass

import torch

from .hf_checkpoint import CheckpointError, HFMoeConfig


def _family(hf, what: str):
    """The archs/ family module of a non-Qwen config, with `what` (a converter function) or a
    CheckpointError saying the trainer side is missing."""
    from . import archs

    fam = archs.family(hf.architecture)
    if fam is None:
        return None
    if getattr(hf, "trainer_missing", None) or not hasattr(fam, what):
        raise CheckpointError(
            f"{hf.architecture}: no Megatron-Core trainer on this machine ({hf.trainer_missing or f'no {what}'})"
        )
    return getattr(fam, what)


def transformer_config(hf: HFMoeConfig, *, params_dtype=torch.float32, **overrides):
    """A Megatron TransformerConfig equivalent to `hf` (routing replay on: the trainer replays)."""
    fam = _family(hf, "transformer_config")
    if fam is not None:
        return fam(hf, params_dtype=params_dtype, **overrides)
    return moe_transformer_config(hf, params_dtype=params_dtype, **overrides)


def moe_transformer_config(hf: HFMoeConfig, *, params_dtype=torch.float32, **overrides):
    """The TransformerConfig of any HFMoeConfig (Qwen, or a family of archs/ that fills its routing and
    layer-pattern fields): what the family modules call."""
    from .archs.megatron_config import megatron_config

    shared = hf.shared_expert_intermediate_size
    family = dict(
        num_layers=hf.num_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_kv_heads,
        kv_channels=hf.head_dim,
        ffn_hidden_size=hf.dense_intermediate_size or hf.moe_intermediate_size,
        num_moe_experts=hf.num_experts,
        moe_router_topk=hf.top_k,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_router_pre_softmax=not hf.norm_topk_prob,
        moe_router_score_function=hf.score_function,
        moe_router_enable_expert_bias=hf.expert_bias,
        moe_router_topk_scaling_factor=hf.routed_scaling_factor,
        moe_router_num_groups=hf.num_groups,
        moe_router_group_topk=hf.group_topk,
        moe_router_dtype="fp32" if hf.router_fp32 else None,
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=(shared is not None) if hf.shared_expert_gate is None else hf.shared_expert_gate,
        activation_func=torch.nn.functional.silu,
        layernorm_epsilon=hf.rms_norm_eps,
        qk_layernorm=hf.qk_norm,
        add_bias_linear=False,
        add_qkv_bias=hf.attention_bias,
    )
    if hf.moe_layers is not None:
        family["moe_layer_freq"] = [int(hf.has_moe(i)) for i in range(hf.num_layers)]
    return megatron_config(params_dtype=params_dtype, overrides=overrides, **family)


@dataclass(frozen=True)
class HFLayout:
    """Where a family keeps its MoE tensors under `model.layers.<i>.` (defaults: Qwen3-MoE / Qwen2-MoE)."""

    moe: str = "mlp"  # the MoE block
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per expert: gate, up, down
    shared: str = "shared_expert"
    shared_gate: str | None = "shared_expert_gate"  # None: an ungated shared expert
    router_bias: str | None = None  # the score correction bias under the MoE block


QWEN_LAYOUT = HFLayout()


def _fused_qkv(q, k, v, hf: HFMoeConfig) -> torch.Tensor:
    """[nq*D, ...], [nkv*D, ...], [nkv*D, ...] -> Megatron's per-group [(nq + 2 nkv) * D, ...]."""
    D, nkv = hf.head_dim, hf.num_kv_heads
    per_group = hf.num_attention_heads // nkv
    tail = q.shape[1:]
    q = q.reshape(nkv, per_group * D, *tail)
    k = k.reshape(nkv, D, *tail)
    v = v.reshape(nkv, D, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def convert_state_dict(hf_state: dict[str, torch.Tensor], hf: HFMoeConfig, dtype=torch.float32) -> dict:
    """HF tensor names -> Megatron GPTModel state dict (local spec, SequentialMLP experts)."""
    fam = _family(hf, "convert_state_dict")
    if fam is not None:
        return fam(hf_state, hf, dtype=dtype)
    return convert_moe_state_dict(hf_state, hf, dtype)


def convert_moe_state_dict(hf_state: dict[str, torch.Tensor], hf: HFMoeConfig, dtype=torch.float32,
                           layout: HFLayout = QWEN_LAYOUT) -> dict:
    """HF tensor names (where `layout` says) -> Megatron GPTModel state dict: what the families call."""
    src, take = tensor_taker(hf_state, dtype, hf.architecture)
    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight")}
    for i in range(hf.num_layers):
        h, m = f"model.layers.{i}", f"decoder.layers.{i}"
        a = f"{h}.self_attn"
        out[f"{m}.input_layernorm.weight"] = take(f"{h}.input_layernorm.weight")
        out[f"{m}.self_attention.linear_qkv.weight"] = _fused_qkv(
            take(f"{a}.q_proj.weight"), take(f"{a}.k_proj.weight"), take(f"{a}.v_proj.weight"), hf
        )
        if hf.attention_bias:
            out[f"{m}.self_attention.linear_qkv.bias"] = _fused_qkv(
                take(f"{a}.q_proj.bias"), take(f"{a}.k_proj.bias"), take(f"{a}.v_proj.bias"), hf
            )
        if hf.qk_norm:
            out[f"{m}.self_attention.q_layernorm.weight"] = take(f"{a}.q_norm.weight")
            out[f"{m}.self_attention.k_layernorm.weight"] = take(f"{a}.k_norm.weight")
        out[f"{m}.self_attention.linear_proj.weight"] = take(f"{a}.o_proj.weight")
        out[f"{m}.pre_mlp_layernorm.weight"] = take(f"{h}.post_attention_layernorm.weight")
        if not hf.has_moe(i):  # a dense-MLP layer: Megatron's MLP, BF16 on every path
            d = f"{h}.mlp"
            out[f"{m}.mlp.linear_fc1.weight"] = torch.cat([take(f"{d}.gate_proj.weight"), take(f"{d}.up_proj.weight")])
            out[f"{m}.mlp.linear_fc2.weight"] = take(f"{d}.down_proj.weight")
            continue
        b = f"{h}.{layout.moe}"
        out[f"{m}.mlp.router.weight"] = take(f"{b}.gate.weight")
        if layout.router_bias is not None:
            # Megatron keeps the expert bias in fp32 whatever the model dtype (it only ranks experts).
            out[f"{m}.mlp.router.expert_bias"] = take(f"{b}.{layout.router_bias}").float()
        gate, up, down = layout.experts
        for e in range(hf.num_experts):
            x = f"{b}.experts.{e}"
            me = f"{m}.mlp.experts.local_experts.{e}"
            out[f"{me}.linear_fc1.weight"] = torch.cat([take(f"{x}.{gate}.weight"), take(f"{x}.{up}.weight")])
            out[f"{me}.linear_fc2.weight"] = take(f"{x}.{down}.weight")
        if hf.shared_expert_intermediate_size is not None:
            s = f"{b}.{layout.shared}"
            out[f"{m}.mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                [take(f"{s}.gate_proj.weight"), take(f"{s}.up_proj.weight")]
            )
            out[f"{m}.mlp.shared_experts.linear_fc2.weight"] = take(f"{s}.down_proj.weight")
            if layout.shared_gate is not None:
                out[f"{m}.mlp.shared_experts.gate_weight"] = take(f"{b}.{layout.shared_gate}.weight")
    return finish_state_dict(out, src, take, tied=hf.tie_word_embeddings)


def tensor_taker(hf_state: dict, dtype, architecture: str):
    """(src, take) for a converter: `src` a copy of the checkpoint's tensors, `take(name)` pops one of
    them as `dtype` (a CheckpointError naming it when it is missing); what is left in `src` at the end is
    what no rule consumed (finish_state_dict refuses it)."""
    src = dict(hf_state)

    def take(name: str) -> torch.Tensor:
        try:
            return src.pop(name).to(dtype)
        except KeyError:
            raise CheckpointError(f"checkpoint has no tensor {name!r} (expected for {architecture})") from None

    return src, take


def finish_state_dict(out: dict, src: dict, take, *, tied: bool) -> dict:
    """The part every family's converter ends with: final norm, output layer (none when tied to the
    embedding), and a CheckpointError for any checkpoint tensor no rule consumed (`src` holds what is
    left, `take` pops from it)."""
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if tied:
        src.pop("lm_head.weight", None)
    else:
        out["output_layer.weight"] = take("lm_head.weight")
    if src:
        raise CheckpointError(f"checkpoint tensors the converter does not know: {sorted(src)[:5]}")
    return out


# Transformer Engine specs fuse the input norm into linear_qkv (and a dense layer's pre-MLP norm into
# its linear_fc1); the local spec keeps them separate.
_FUSED_NORMS = (
    (".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
    (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"),
)


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a converted state dict into `model`, adapting the input-norm name to the model's spec.
    Every parameter must be covered and every tensor used (`_extra_state` buffers aside)."""
    own = model.state_dict()
    adapted = {}
    for key, value in state.items():
        for plain, fused in _FUSED_NORMS:
            if key.endswith(plain) and key not in own and key[: -len(plain)] + fused in own:
                key = key[: -len(plain)] + fused
        adapted[key] = value
    missing, unexpected = model.load_state_dict(adapted, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"converted weights do not fit the Megatron model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def local_block_spec(hf, config):
    """The BF16 yardstick's decoder block spec: Megatron's local spec, or the family's where Megatron's
    local modules need a stand-in (DeepSeek-V3's MLA: trace_megatron.mla.MLADotProductAttention)."""
    from . import archs

    fam = archs.family(getattr(hf, "architecture", ""))
    if fam is not None and hasattr(fam, "local_block_spec"):
        return fam.local_block_spec(config)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")


def build_gpt_model(hf: HFMoeConfig, layer_spec, config, *, max_sequence_length: int = 4096, **stage):
    """A GPTModel shaped like `hf` with the given decoder spec (Megatron's local one or TRACE's);
    `stage`: pre_process / post_process of a pipeline stage."""
    fam = _family(hf, "build_gpt_model")
    if fam is not None:
        return fam(hf, layer_spec, config, max_sequence_length=max_sequence_length, **stage)
    return moe_gpt_model(hf, layer_spec, config, max_sequence_length=max_sequence_length, **stage)


def moe_gpt_model(hf: HFMoeConfig, layer_spec, config, *, max_sequence_length: int = 4096, **stage):
    """The GPTModel of any HFMoeConfig (RoPE with its rotary_percent): what the families call."""
    import warnings

    from megatron.core.models.gpt import GPTModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPTModel's deprecation notice in favour of HybridModel
        return GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=hf.vocab_size,
            max_sequence_length=max_sequence_length,
            position_embedding_type="rope",
            rotary_base=hf.rope_theta,
            rotary_percent=hf.rotary_percent,
            share_embeddings_and_output_weights=hf.tie_word_embeddings,
            **stage,
        )
