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
import os
import shutil
import tempfile
from pathlib import Path

import torch

ARCHITECTURE = "GptOssForCausalLM"
STAMP = ".trace_fp4_tiny"
_FORMAT = 1


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
    projections (so the clamped SwiGLU's +-7 limit is reached by a few values, not all), non-zero
    biases and sinks (zero ones would not test that they are applied), a peaked LM head."""
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
            normal(p, 2 / math.sqrt(H))
        elif name.endswith("experts.down_proj"):
            normal(p, 1 / math.sqrt(I))
        elif name.endswith("experts.gate_up_proj_bias"):
            normal(p, 1.0)
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
    out = Path(out_dir)
    kwargs = tiny_config_kwargs(num_layers)
    stamp = json.dumps({"kwargs": kwargs, "seed": seed, "format": _FORMAT}, sort_keys=True)
    if (out / STAMP).exists() and (out / STAMP).read_text() == stamp:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write(tmp, kwargs, seed)
        (tmp / STAMP).write_text(stamp)
        if out.exists():
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.rename(tmp, out)
        except OSError:
            if not ((out / STAMP).exists() and (out / STAMP).read_text() == stamp):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
