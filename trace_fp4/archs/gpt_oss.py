"""gpt-oss (GptOssForCausalLM) support: the tiny checkpoint the tests build, and what is specific to it.

What gpt-oss has that the Qwen3-MoE path did not (and where each is handled):
  - expert biases (HF `gate_up_proj_bias` [E, 2I], `down_proj_bias` [E, H]) and the clamped SwiGLU
    ("swigluoai": alpha 1.702, limit 7.0, `(up + 1) * gate * sigmoid(alpha * gate)`): one definition in
    `trace_kernels.routed_experts` (biases added in fp32 after the scaled FP4 dot, before the
    activation / the routing weight; the biases themselves are not quantized);
  - interleaved gate/up columns in HF's `gate_up_proj` [E, H, 2I] (gate at even, up at odd
    positions): de-interleaved to [gate; up] rows once, at load (`deinterleave_gate_up`);
  - attention sinks (one learned logit per head) and a sliding window on every other layer
    (`layer_types`): attention internals the KV quantization does not touch (only the cached K/V
    values are FP4);
  - a router with a bias, softmax over the top-k logits: routing happens in the engine before the
    expert computation and is recorded / replayed as ids like any other.

`build_tiny(out_dir, seed)` writes a random checkpoint with transformers' own `GptOssConfig` /
`GptOssForCausalLM` (save_pretrained, bf16 safetensors) and the shared offline tokenizer. Sizes:
hidden, intermediate and head_dim multiples of 16 (NVFP4 blocks), head_dim a multiple of 32 (vLLM's
CPU attention), a sliding window of 8 tokens so the tests' prompts cross it.
"""

import json
import math
from pathlib import Path

import torch

from ..tiny_model import build_atomically

ARCHITECTURE = "GptOssForCausalLM"

_FORMAT = 2


def tiny_config_kwargs(num_layers: int = 4) -> dict:
    return dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=32,  # per expert (gpt-oss has no separate moe_intermediate_size)
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        max_position_embeddings=2048,
        rope_parameters={
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 64, "rope_theta": 150000.0,  # 64 * 32 = max_position_embeddings
        },
        rms_norm_eps=1e-5,
        swiglu_limit=7.0,
        attention_bias=True,
        tie_word_embeddings=False,
    )


def _randomize(model, seed: int) -> None:
    """Random weights with the scales of a trained model's activations: std 1/sqrt(fan_in) for the
    projections, non-zero biases and sinks (zero ones would not test that they are applied), a
    peaked LM head. (Larger expert weights make this random model chaotic: FP4 noise then moves
    log-probs by half their size. The clamp at +-7 is exercised by tests/kernels/test_grouped_mm.py.)"""
    g = torch.Generator().manual_seed(seed)

    def normal(t, std):
        with torch.no_grad():
            t.copy_(torch.randn(t.shape, generator=g) * std)

    H = model.config.hidden_size
    I = model.config.intermediate_size
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight") or "layernorm" in name:
            with torch.no_grad():
                p.fill_(1.0)
        elif name.endswith("embed_tokens.weight"):
            normal(p, 1.0)
        elif name.endswith("lm_head.weight"):
            normal(p, 3 / math.sqrt(H))
        elif name.endswith("sinks"):
            normal(p, 1.0)
        elif name.endswith("experts.gate_up_proj"):
            normal(p, 1 / math.sqrt(H))
        elif name.endswith("experts.down_proj"):
            normal(p, 1 / math.sqrt(I))
        elif name.endswith("experts.gate_up_proj_bias"):
            normal(p, 0.5)
        elif name.endswith("bias"):
            normal(p, 0.1)
        else:  # attention q/k/v/o, router weight
            normal(p, 1 / math.sqrt(p.shape[-1]))


def _write(out: Path, kwargs: dict, seed: int) -> None:
    from transformers import GptOssConfig, GptOssForCausalLM

    from ..tiny_model import _write_tokenizer

    eos_id = _write_tokenizer(out, kwargs["vocab_size"])
    config = GptOssConfig(**kwargs, architectures=[ARCHITECTURE], eos_token_id=eos_id, pad_token_id=eos_id,
                          bos_token_id=None, dtype="bfloat16")
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config)
    _randomize(model, seed)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}, indent=2)
    )


def build_tiny(out_dir, seed: int = 0, num_layers: int = 4) -> Path:
    """Write (or reuse, by a stamp of the arguments) a tiny random gpt-oss checkpoint; returns its path.
    Built in a private temporary directory and moved into place (concurrent builders are safe)."""
    kwargs = tiny_config_kwargs(num_layers)
    stamp = json.dumps({"kwargs": kwargs, "seed": seed, "format": _FORMAT}, sort_keys=True)
    return build_atomically(out_dir, stamp, lambda tmp: _write(tmp, kwargs, seed))


# ---- config.json check (the archs registry's read_config) ----------------------------------------------
_INT_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "num_local_experts", "num_experts_per_tok", "vocab_size", "sliding_window")


def read_config(cfg: dict, where: str = "model"):
    """The checked gpt-oss config.json (`archs.ArchConfig`); CheckpointError naming the field otherwise."""
    from ..hf_checkpoint import CheckpointError
    from . import ArchConfig

    for key in _INT_FIELDS:
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CheckpointError(f"{where}: config.json {key}={v!r} must be an integer >= 1 (gpt-oss)")
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") == "mxfp4":
        raise CheckpointError(
            f"{where}: an MXFP4 gpt-oss checkpoint (quantization_config.quant_method='mxfp4'); trace_fp4 "
            "requantizes BF16 expert weights: dequantize it to BF16 first"
        )
    from trace_kernels.routed_experts import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

    if float(cfg.get("swiglu_limit", SWIGLUOAI_LIMIT)) != SWIGLUOAI_LIMIT or float(cfg.get("swiglu_alpha", SWIGLUOAI_ALPHA)) != SWIGLUOAI_ALPHA:
        raise CheckpointError(
            f"{where}: gpt-oss swiglu_limit={cfg.get('swiglu_limit')} / swiglu_alpha={cfg.get('swiglu_alpha')}; "
            f"the engines support {SWIGLUOAI_LIMIT} / {SWIGLUOAI_ALPHA} only"
        )
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", "yarn") != "yarn":
        raise CheckpointError(f"{where}: gpt-oss rope_type={rope.get('rope_type')!r}; the converter supports 'yarn'")
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is not None and (len(types) != n or set(types) - {"sliding_attention", "full_attention"}):
        raise CheckpointError(
            f"{where}: config.json layer_types must list {n} entries of 'sliding_attention' / 'full_attention', got {types!r}"
        )
    if cfg.get("tie_word_embeddings"):
        raise CheckpointError(f"{where}: gpt-oss with tie_word_embeddings=true is not supported by the converter")
    return ArchConfig(architecture=ARCHITECTURE, num_layers=n, vocab_size=cfg["vocab_size"], raw=cfg, where=where)


# ---- Megatron-Core (0.19.2, local spec) --------------------------------------------------------------
# gpt-oss in Megatron's own terms:
#   clamped SwiGLU      gated_linear_unit, activation_func=quick_gelu (x * sigmoid(1.702 x)),
#                       activation_func_clamp_value=7 (gate clamped from above, up on both sides),
#                       glu_linear_offset=1 (the "+1" on up); bias_activation_fusion off
#   expert / all biases add_bias_linear=True (qkv, o_proj, router logits, expert fc1 / fc2); Megatron
#                       scales the fc2 bias by the routing probability, like HF (and TraceSequentialMLP
#                       applies probability after fc2 + bias)
#   sinks               softmax_type="learnable": `core_attention.softmax_offset` [heads] = HF `sinks`
#   sliding window      window_size=(sliding_window - 1, 0) on the layers whose layer_types entry is
#                       "sliding_attention" (window_attn_skip_freq as a 0/1 list); HF's window of W
#                       keys includes the query's own position
#   router              softmax over the top-k logits (moe_router_pre_softmax=False), logits bias
#   rope                YaRN (position_embedding_type="yarn", the yarn_* config attributes)


def _get(cfg, key, default=None):
    """A config.json field of `cfg`: a dict, an `archs.ArchConfig` (its `raw` dict) or a GptOssConfig."""
    raw = getattr(cfg, "raw", None)
    if isinstance(raw, dict):
        cfg = raw
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def layer_is_sliding(cfg) -> list[int]:
    n = _get(cfg, "num_hidden_layers")
    types = _get(cfg, "layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return [1 if t == "sliding_attention" else 0 for t in types]


def transformer_config(hf_cfg, *, params_dtype=torch.float32, **overrides):
    """A Megatron TransformerConfig equivalent to gpt-oss config `hf_cfg` (dict or GptOssConfig)."""
    from megatron.core.activations import quick_gelu

    from trace_fp4_patches.megatron_sliding_window import install_sliding_window_softmax

    from .megatron_config import megatron_config

    install_sliding_window_softmax()  # the window on any device, packed-sample masks kept
    cfg = hf_cfg
    limit = float(_get(cfg, "swiglu_limit", 7.0))
    rope = _get(cfg, "rope_parameters") or {}
    if rope.get("rope_type", "yarn") != "yarn":
        raise ValueError(f"gpt-oss: rope_type {rope.get('rope_type')!r}; the converter supports yarn")
    I = _get(cfg, "intermediate_size")
    config = megatron_config(
        params_dtype=params_dtype,
        overrides=overrides,
        num_layers=_get(cfg, "num_hidden_layers"),
        hidden_size=_get(cfg, "hidden_size"),
        num_attention_heads=_get(cfg, "num_attention_heads"),
        num_query_groups=_get(cfg, "num_key_value_heads"),
        kv_channels=_get(cfg, "head_dim"),
        ffn_hidden_size=I,
        num_moe_experts=_get(cfg, "num_local_experts"),
        moe_router_topk=_get(cfg, "num_experts_per_tok"),
        moe_ffn_hidden_size=I,
        moe_router_pre_softmax=False,
        moe_router_score_function="softmax",
        activation_func=quick_gelu,
        activation_func_clamp_value=limit,
        glu_linear_offset=1.0,
        add_bias_linear=True,
        add_qkv_bias=True,
        softmax_type="learnable",
        window_size=(int(_get(cfg, "sliding_window")) - 1, 0),
        window_attn_skip_freq=layer_is_sliding(cfg),
        layernorm_epsilon=_get(cfg, "rms_norm_eps", 1e-5),
        qk_layernorm=False,
        masked_softmax_fusion=False,
    )
    # YaRN parameters GPTModel reads by getattr (TransformerConfig has no fields for them).
    config.yarn_rotary_scaling_factor = float(rope.get("factor", 32.0))
    config.yarn_original_max_position_embeddings = int(rope.get("original_max_position_embeddings", 4096))
    config.yarn_beta_fast = float(rope.get("beta_fast", 32.0))
    config.yarn_beta_slow = float(rope.get("beta_slow", 1.0))
    config.yarn_mscale = 1.0
    config.yarn_mscale_all_dim = 0.0
    config.yarn_correction_range_round_to_int = bool(rope.get("truncate", True))
    return config


def _fused_qkv(q, k, v, cfg) -> torch.Tensor:
    """Megatron's per-KV-group [q heads of the group, k head, v head] layout."""
    D, nkv = _get(cfg, "head_dim"), _get(cfg, "num_key_value_heads")
    per_group = _get(cfg, "num_attention_heads") // nkv
    tail = q.shape[1:]
    return torch.cat([q.reshape(nkv, per_group * D, *tail), k.reshape(nkv, D, *tail), v.reshape(nkv, D, *tail)], dim=1).reshape(-1, *tail)


def convert_state_dict(hf_state: dict, hf_cfg, dtype=torch.float32) -> dict:
    """HF gpt-oss tensors -> Megatron GPTModel state dict (local spec, SequentialMLP experts).
    Expert fc1 rows are de-interleaved to [gate; up] (Megatron's GLU chunks halves), like the engines'."""
    from trace_kernels.routed_experts import deinterleave_gate_up

    from ..hf_checkpoint import CheckpointError
    from ..hf_to_megatron import tensor_taker

    src, take = tensor_taker(hf_state, dtype, ARCHITECTURE)
    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight")}
    for i in range(_get(hf_cfg, "num_hidden_layers")):
        h, m, a = f"model.layers.{i}", f"decoder.layers.{i}", f"model.layers.{i}.self_attn"
        out[f"{m}.input_layernorm.weight"] = take(f"{h}.input_layernorm.weight")
        for kind in ("weight", "bias"):
            out[f"{m}.self_attention.linear_qkv.{kind}"] = _fused_qkv(
                take(f"{a}.q_proj.{kind}"), take(f"{a}.k_proj.{kind}"), take(f"{a}.v_proj.{kind}"), hf_cfg
            )
            out[f"{m}.self_attention.linear_proj.{kind}"] = take(f"{a}.o_proj.{kind}")
            out[f"{m}.mlp.router.{kind}"] = take(f"{h}.mlp.router.{kind}")
        out[f"{m}.self_attention.core_attention.softmax_offset"] = take(f"{a}.sinks")
        out[f"{m}.pre_mlp_layernorm.weight"] = take(f"{h}.post_attention_layernorm.weight")
        gate_up, gate_up_b = take(f"{h}.mlp.experts.gate_up_proj"), take(f"{h}.mlp.experts.gate_up_proj_bias")
        down, down_b = take(f"{h}.mlp.experts.down_proj"), take(f"{h}.mlp.experts.down_proj_bias")
        for e in range(gate_up.shape[0]):
            me = f"{m}.mlp.experts.local_experts.{e}"
            out[f"{me}.linear_fc1.weight"] = deinterleave_gate_up(gate_up[e], -1).t().contiguous()  # [2I, H]
            out[f"{me}.linear_fc1.bias"] = deinterleave_gate_up(gate_up_b[e], -1)
            out[f"{me}.linear_fc2.weight"] = down[e].t().contiguous()  # [H, I]
            out[f"{me}.linear_fc2.bias"] = down_b[e]
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    out["output_layer.weight"] = take("lm_head.weight")
    if src:
        raise CheckpointError(f"gpt-oss checkpoint tensors the converter does not know: {sorted(src)[:5]}")
    return out


def build_gpt_model(hf_cfg, layer_spec, config, *, max_sequence_length: int = 4096):
    """A GPTModel shaped like gpt-oss config `hf_cfg` (YaRN rope) with the given decoder spec."""
    import warnings

    from megatron.core.models.gpt import GPTModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(
            config=config, transformer_layer_spec=layer_spec, vocab_size=_get(hf_cfg, "vocab_size"),
            max_sequence_length=max_sequence_length, position_embedding_type="yarn",
            rotary_base=float((_get(hf_cfg, "rope_parameters") or {}).get("rope_theta", 150000.0)),
            share_embeddings_and_output_weights=bool(_get(hf_cfg, "tie_word_embeddings", False)),
        )
