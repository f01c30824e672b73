"""Reading a local Hugging Face MoE checkpoint: config validation and tensors.

Supported architectures: Qwen3-MoE / Qwen2-MoE here, and the families registered in `archs/` (each
reads its own config.json fields). Every refusal names the
directory and what is wrong with it, because a bad `--model` must fail before any engine starts.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from trace_kernels import BLOCK_SIZE, ModelShape, TraceConfig

from . import archs as archs_registry

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


def _int(cfg: dict, key: str, where: str, *, default=None, minimum: int = 1) -> int:
    """A positive (>= minimum) integer field of config.json; CheckpointError naming it otherwise."""
    if key not in cfg or cfg[key] is None:
        if default is not None:
            return default
        raise CheckpointError(f"{where}: config.json has no {key!r}")
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise CheckpointError(f"{where}: config.json {key}={v!r} must be an integer >= {minimum}")
    return v


def _number(cfg: dict, key: str, where: str, default: float) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
        raise CheckpointError(f"{where}: config.json {key}={v!r} must be a positive number")
    return float(v)


def read_config(model_dir) -> HFMoeConfig:
    """Read and fully check a checkpoint's config.json: every field the engines, the converter and the
    records need, with its type and the NVFP4 divisibility rules, so a bad --model fails here, before
    any engine starts, with one line naming the field."""
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"--model {d}: no such directory")
    path = d / "config.json"
    if not path.is_file():
        raise CheckpointError(f"--model {d}: no config.json (not a Hugging Face checkpoint)")
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(cfg).__name__}, expected an object of settings")
    where = f"--model {d}"
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{where}: config.json architectures={archs!r} must be a list of names")
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    fam = next((f for f in map(archs_registry.family, archs) if f is not None), None) if arch is None else None
    if fam is not None:
        quant = cfg.get("quantization_config")
        hf = fam.read_config(cfg, where)
        if quant is not None:
            _check_quantization_config(quant, hf.num_layers, where)
        return hf
    if arch is None:
        hint = " (a dense model: TRACE needs routed experts)" if not num_experts else ""
        raise CheckpointError(
            f"{where}: architecture {archs or 'unknown'} is not supported{hint}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES + archs_registry.supported())}"
        )
    if not num_experts:
        raise CheckpointError(f"{where}: {arch} config has no experts (num_experts missing or 0)")
    num_experts = _int(cfg, "num_experts" if cfg.get("num_experts") else "num_local_experts", where)
    n_layers = _int(cfg, "num_hidden_layers", where)
    dense = cfg.get("mlp_only_layers") or []
    step = cfg.get("decoder_sparse_step", 1)
    if dense or step != 1:
        raise CheckpointError(
            f"{where}: dense layers among the MoE layers (mlp_only_layers={dense}, "
            f"decoder_sparse_step={step}) are not supported yet"
        )
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{where}: config.json rope_parameters={rope!r} must be an object")
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if rope.get("rope_type", "default") != "default" or rope_theta is None:
        raise CheckpointError(f"{where}: only default RoPE is supported, got {rope or cfg.get('rope_scaling')}")
    qwen2 = arch == "Qwen2MoeForCausalLM"
    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv_heads = _int(cfg, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise CheckpointError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if "head_dim" not in cfg and hidden % heads:
        raise CheckpointError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} (and no head_dim)")
    head_dim = _int(cfg, "head_dim", where, default=hidden // heads)
    moe_inter = _int(cfg, "moe_intermediate_size", where)
    top_k = _int(cfg, "num_experts_per_tok", where)
    if top_k > num_experts:
        raise CheckpointError(f"{where}: num_experts_per_tok={top_k} exceeds the {num_experts} experts")
    for name, value in (("hidden_size", hidden), ("moe_intermediate_size", moe_inter), ("head_dim", head_dim)):
        if value % BLOCK_SIZE:
            raise CheckpointError(
                f"{where}: {name}={value} is not divisible by {BLOCK_SIZE} (NVFP4 quantizes blocks of "
                f"{BLOCK_SIZE} along it)"
            )
    shared = cfg.get("shared_expert_intermediate_size") if qwen2 else None
    if shared is not None:
        shared = _int(cfg, "shared_expert_intermediate_size", where, minimum=0)
    for key in ("norm_topk_prob", "tie_word_embeddings", "attention_bias", "qkv_bias"):
        if key in cfg and not isinstance(cfg[key], bool):
            raise CheckpointError(f"{where}: config.json {key}={cfg[key]!r} must be true or false")
    quant = cfg.get("quantization_config")
    if quant is not None:
        _check_quantization_config(quant, n_layers, where)
    return HFMoeConfig(
        architecture=arch,
        num_layers=n_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_int(cfg, "vocab_size", where),
        moe_intermediate_size=moe_inter,
        num_experts=num_experts,
        top_k=top_k,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", not qwen2)),
        rms_norm_eps=_number(cfg, "rms_norm_eps", where, 1e-6),
        rope_theta=_number({"rope_theta": rope_theta}, "rope_theta", where, 1.0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2-MoE always has Q/K/V biases (transformers 5 writes `qkv_bias`, older ones nothing).
        attention_bias=bool(cfg.get("qkv_bias", cfg.get("attention_bias", qwen2))),
        qk_norm=not qwen2,
        shared_expert_intermediate_size=shared,
    )


def check_files(model_dir) -> None:
    """What an engine needs besides config.json: weights and a tokenizer (checked before it starts)."""
    d = Path(model_dir)
    if not any(d.glob("*.safetensors")):
        raise CheckpointError(f"--model {d}: no *.safetensors weights")
    if not (d / "tokenizer.json").is_file() and not (d / "tokenizer_config.json").is_file():
        raise CheckpointError(f"--model {d}: no tokenizer (tokenizer.json or tokenizer_config.json)")


def _check_quantization_config(quant, num_layers: int, where: str) -> None:
    """A checkpoint that already carries a quantization_config: if it is trace_fp4's, it must be a valid
    TraceConfig for this model (the engines would refuse it only after loading)."""
    if not isinstance(quant, dict):
        raise CheckpointError(f"{where}: config.json quantization_config must be an object, got {quant!r:.60}")
    if quant.get("quant_method") != "trace_fp4":
        raise CheckpointError(
            f"{where}: the checkpoint is already quantized (quant_method={quant.get('quant_method')!r}); "
            "trace-fp4 align needs BF16 weights"
        )
    try:
        TraceConfig.from_dict(quant).check_layers(num_layers, where="the model")
    except ValueError as e:
        raise CheckpointError(f"{where}: config.json quantization_config: {e}") from None


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
