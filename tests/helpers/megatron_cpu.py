"""Real Megatron-Core on a CPU for the tests: a tiny Qwen3-MoE-shaped GPTModel and its batches.

The CUDA-to-CPU redirections come from `trace_fp4.megatron_cpu` (the align job's CPU mode); nothing of
this is in trace_megatron.
"""

import warnings

import torch

# The CPU redirections live with the align job, which runs Megatron-Core on a CPU too; the tests use
# the same ones.
from trace_fp4.megatron_cpu import causal_mask, free_port, init_parallel  # noqa: F401
from trace_fp4.megatron_cpu import install as install_cpu_shim  # noqa: F401

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|absl).*")


# ---- a tiny Qwen3-MoE-shaped GPTModel ---------------------------------------------------------------
VOCAB = 128
MAX_SEQ = 64


def tiny_config(*, dispatcher: str = "alltoall", num_layers: int = 2, recompute: bool = False, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=num_layers, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
        ffn_hidden_size=128, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        qk_layernorm=True, add_bias_linear=False, bias_activation_fusion=False,
        moe_token_dispatcher_type=dispatcher, moe_enable_routing_replay=True, moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.05,
    )
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def tiny_model(config, *, trace: bool = True, trace_config=None, seed: int = 0, **gpt_kwargs):
    """GPTModel from the trace block spec (or Megatron's local spec with trace=False)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    import trace_megatron

    torch.manual_seed(seed)
    if trace:
        spec = trace_megatron.get_gpt_decoder_block_with_trace_spec(config, normalization="RMSNorm", trace_config=trace_config)
    else:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=MAX_SEQ,
            position_embedding_type="rope", **gpt_kwargs,
        )
    return model


def padded_batch(lengths, seq_len: int, seed: int = 0):
    """input_ids [B, seq_len] (right-padded with 0), position ids, mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), seq_len), generator=g)
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
    pos = torch.arange(seq_len)[None].expand(len(lengths), seq_len)
    return ids, pos, causal_mask(seq_len)


def load_full_state(model, full_state: dict, ep_rank: int = 0, ep_size: int = 1) -> None:
    """Load a single-process state dict into a model whose experts are split over `ep_size` ranks."""
    import re

    state = {}
    for key, value in full_state.items():
        m = re.match(r"(.*\.local_experts\.)(\d+)(\..*)", key)
        if m:
            e = int(m.group(2))
            n_local = model.config.num_moe_experts // ep_size
            if e // n_local != ep_rank:
                continue
            key = f"{m.group(1)}{e % n_local}{m.group(3)}"
        state[key] = value
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)


def allow_torch_norm_with_sequence_parallel() -> None:
    """Megatron's torch norms refuse sequence parallelism because they do not all-reduce their weight
    gradients over the TP group (Apex / TE norms do). Forward they are exact, so forward-only tests may
    build them with sequence_parallel on."""
    import copy

    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__
    if getattr(original, "_sp_allowed", False):
        return

    def __new__(cls, config, *args, **kwargs):
        config = copy.copy(config)
        config.sequence_parallel = False
        return original(cls, config, *args, **kwargs)

    __new__._sp_allowed = True
    torch_norm.WrappedTorchNorm.__new__ = __new__
