"""The Megatron-Core TransformerConfig settings every family's trainer shares.

Each family's `transformer_config` passes only what its architecture decides (sizes, routing, attention,
activation, biases); what is here is the trainer's way of running any of them, the same for all:
- routing replay on, no load-balancing loss, alltoall dispatch: the trainer replays the rollout's
  expert choices instead of routing by itself (trace_megatron's routing replay);
- gated (GLU) MLPs, RMSNorm;
- no dropout, no fused bias-activation kernel (a CUDA fusion), CPU initialisation (the CPU runs here).
"""

import torch

_COMMON = dict(
    moe_router_load_balancing_type="none",
    moe_aux_loss_coeff=0.0,
    moe_token_dispatcher_type="alltoall",
    moe_enable_routing_replay=True,
    gated_linear_unit=True,
    normalization="RMSNorm",
    bias_activation_fusion=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    use_cpu_initialization=True,
)


def megatron_config(config_class=None, *, params_dtype=torch.float32, overrides: dict | None = None, **family):
    """`config_class` (default TransformerConfig) from the shared settings, the family's own `family`
    fields, then the caller's `overrides` (which may replace any of them). A family field that repeats
    a shared setting is a TypeError: the shared value is the one place it is decided."""
    if config_class is None:
        from megatron.core.transformer.transformer_config import TransformerConfig as config_class
    repeated = sorted(set(family) & set(_COMMON))
    if repeated:
        raise TypeError(f"megatron_config: {', '.join(repeated)} are shared settings; a family does not pass them")
    return config_class(**{**_COMMON, **family, "params_dtype": params_dtype, **(overrides or {})})
