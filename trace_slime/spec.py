"""`--spec trace_slime get_trace_spec`: the trace decoder-block spec for slime's model provider.

slime calls it as `get_trace_spec(args, config, vp_stage)` with the TransformerConfig it built from its
Megatron arguments, before it builds the GPTModel.
"""

from .settings import ROLLOUT_HOW, TraceSlimeError, check_args


def get_trace_spec(args, config, vp_stage=None):
    trace = check_args(args)  # every actor checks the whole command line where it builds its model
    if trace is None:  # pragma: no cover - check_args refuses a trainer-only TRACE already
        raise TraceSlimeError(f"--spec trace_slime get_trace_spec without TRACE: set {ROLLOUT_HOW}")
    import trace_megatron

    # The trace MoE layer replays each record's routes through Megatron-Core's routing-replay hook,
    # which the routers create only when this is set before the model is built.
    config.moe_enable_routing_replay = True
    return trace_megatron.get_gpt_decoder_block_with_trace_spec(
        config,
        use_transformer_engine=getattr(args, "transformer_impl", "local") == "transformer_engine",
        normalization=getattr(args, "normalization", None),
        qk_l2_norm=bool(getattr(args, "qk_l2_norm", False)),
        vp_stage=vp_stage,
        trace_config=trace.trace_config,
    )
