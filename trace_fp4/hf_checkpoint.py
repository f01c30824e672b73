"""Reading a local Hugging Face MoE checkpoint: config validation and tensors.

Supported architectures are the ones whose layout `hf_to_megatron` knows. Every refusal names the
directory and what is wrong with it, because a bad `--model` must fail before any engine starts.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from trace_kernels import ModelShape

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")


class CheckpointError(ValueError):
    """A --model directory that trace-fp4 cannot use."""


@dataclass(frozen=True)
class HFMoeConfig:
    """The fields of a Qwen3-MoE / Qwen2-MoE config.json that the conversion and the record need."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    shared_expert_intermediate_size: int | None

    def model_shape(self) -> ModelShape:
        return ModelShape(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )


def read_config(model_dir) -> HFMoeConfig:
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"--model {d}: no such directory")
    path = d / "config.json"
    if not path.is_file():
        raise CheckpointError(f"--model {d}: no config.json (not a Hugging Face checkpoint)")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if arch is None:
        hint = " (a dense model: TRACE needs routed experts)" if not num_experts else ""
        raise CheckpointError(
            f"--model {d}: architecture {archs or 'unknown'} is not supported{hint}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if not num_experts:
        raise CheckpointError(f"--model {d}: {arch} config has no experts (num_experts missing or 0)")
    n_layers = cfg["num_hidden_layers"]
    dense = cfg.get("mlp_only_layers") or []
    step = cfg.get("decoder_sparse_step", 1)
    if dense or step != 1:
        raise CheckpointError(
            f"--model {d}: dense layers among the MoE layers (mlp_only_layers={dense}, "
            f"decoder_sparse_step={step}) are not supported yet"
        )
    rope = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if rope.get("rope_type", "default") != "default" or rope_theta is None:
        raise CheckpointError(f"--model {d}: only default RoPE is supported, got {rope or cfg.get('rope_scaling')}")
    qwen2 = arch == "Qwen2MoeForCausalLM"
    heads = cfg["num_attention_heads"]
    return HFMoeConfig(
        architecture=arch,
        num_layers=n_layers,
        hidden_size=cfg["hidden_size"],
        num_attention_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        moe_intermediate_size=cfg["moe_intermediate_size"],
        num_experts=num_experts,
        top_k=cfg["num_experts_per_tok"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", not qwen2)),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2-MoE always has Q/K/V biases (transformers 5 writes `qkv_bias`, older ones nothing).
        attention_bias=bool(cfg.get("qkv_bias", cfg.get("attention_bias", qwen2))),
        qk_norm=not qwen2,
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") if qwen2 else None,
    )


def load_tensors(model_dir) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint."""
    from safetensors.torch import load_file

    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"--model {d}: no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out
