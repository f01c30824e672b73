"""TraceMoELayer: Megatron's MoELayer that routes by the records and brings each token's guide rows to
the experts that process it (see token_rows.py for how rows follow the dispatcher)."""

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from trace_kernels import TraceConfig

from .binding import BatchBinding
from .experts import TraceSequentialMLP
from .router_replay import TraceRouterReplay
from .spec_fallbacks import SpecFallbacks
from .token_rows import PayloadSpec, build_payload, follow_dispatch


class TraceMoELayer(MoELayer):
    def __init__(self, *args, trace_config: TraceConfig | None = None, spec_fallbacks: SpecFallbacks | None = None,
                 **kwargs):
        _check_config(kwargs["config"] if "config" in kwargs else args[0])  # before Megatron builds anything
        super().__init__(*args, **kwargs)
        self.trace_config = trace_config or TraceConfig()
        self.spec_fallbacks = spec_fallbacks if spec_fallbacks is not None else SpecFallbacks()
        if getattr(self.router, "router_replay", None) is None:
            raise ValueError(
                "trace_megatron needs Megatron-Core's routing replay: set moe_enable_routing_replay=True in the "
                "TransformerConfig (the records' expert ids drive it)"
            )
        if not isinstance(self.experts, TraceSequentialMLP):
            raise TypeError(f"trace MoE layer built with experts {type(self.experts).__name__}, expected TraceSequentialMLP")
        self.router.router_replay = TraceRouterReplay(self.router.router_replay)
        self.experts.local_expert_indices = list(self.local_expert_indices)
        self.binding = BatchBinding(f"MoE layer {self.layer_number}")
        self._pending = None  # (batch, recompute, positions) between route() and preprocess()

    def set_layer_number(self, layer_number: int):
        """Megatron numbers the layer after building it: only now is it known whether this is a BF16
        boundary layer, whose experts then compute with unquantized weights and inputs, as the engines'."""
        super().set_layer_number(layer_number)
        layer_config = self.trace_config.for_layer(self.trace_layer)
        self.experts.trace_config = layer_config
        for expert in self.experts.local_experts:
            expert.linear_fc1.trace_config = expert.linear_fc2.trace_config = layer_config

    @property
    def trace_layer(self) -> int:
        return self.layer_number - 1  # Megatron numbers layers from 1 (PP offset included)

    def _local_positions(self, num_local_tokens: int, batch) -> torch.Tensor:
        tp = self.attn_tp_group
        tp_size = tp.size() if tp is not None else 1
        split = self.config.sequence_parallel and tp_size > 1
        total = num_local_tokens * (tp_size if split else 1)
        if total != batch.layout.num_positions:
            raise ValueError(
                f"trace_megatron: layer {self.trace_layer} sees {total} token positions, the guidance layout "
                f"describes {batch.layout.num_positions} (seq_len {batch.layout.seq_len} x batch {batch.layout.batch_size})"
            )
        start = tp.rank() * num_local_tokens if split else 0
        return torch.arange(start, start + num_local_tokens, device=batch.device)

    def route(self, hidden_states, padding_mask=None):
        batch, recompute = self.binding.resolve()
        positions = None
        if batch is not None:
            n = hidden_states.shape[0] * hidden_states.shape[1]
            positions = self._local_positions(n, batch)
            self.router.router_replay.trace_target = batch.routing_target(self.trace_layer, positions)
        self._pending = (batch, recompute, positions)
        return super().route(hidden_states, padding_mask)

    def preprocess(self, hidden_states, probs, routing_map):
        batch, recompute, positions = self._pending
        self._pending = None
        self._payload = None
        if batch is not None:
            ids = self.router.router_replay.last_topk_idx
            cfg = self.config
            spec = PayloadSpec(cfg.moe_router_topk, cfg.hidden_size, cfg.moe_ffn_hidden_size, batch.layer_guide_type(self.trace_layer))
            if not recompute:
                replay = self.router.router_replay
                batch.count_routing(self.trace_layer, replay.replayed_rows if batch.records is not None else 0, ids.shape[0])
            if batch.capture and not recompute:
                if self.ep_group.size() > 1 or (self.attn_tp_group is not None and self.attn_tp_group.size() > 1):
                    raise NotImplementedError(
                        "trace_megatron.capture runs with expert / tensor parallel size 1 (captured rows are "
                        "stored by this rank's token positions)"
                    )
                batch.capture_routing(self.trace_layer, positions, ids)
            self._payload = (batch, recompute, self.trace_layer, spec, build_payload(spec, batch, self.trace_layer, positions, ids))
        return super().preprocess(hidden_states, probs, routing_map)

    def postprocess(self, output, shared_expert_output):
        # The experts' outputs arrive in fp32 (summed over slots in fp32, as the engines do); cast once,
        # then add the shared experts in the model dtype, as the engines add them to the routed output.
        output = super().postprocess(output, None).to(self.config.params_dtype)
        return output if shared_expert_output is None else output + shared_expert_output

    def routed_experts_compute(self, hidden_states, probs):
        dispatched_input, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch_postprocess(hidden_states, probs)
        if self._payload is not None:
            batch, recompute, layer, spec, payload = self._payload
            rows = follow_dispatch(self.token_dispatcher, payload)
            if rows.shape[0] != dispatched_input.shape[0]:
                raise RuntimeError(
                    f"trace_megatron: {rows.shape[0]} payload rows followed the dispatcher, the experts got "
                    f"{dispatched_input.shape[0]} tokens"
                )
            self.experts.pending_rows = (batch, recompute, layer, spec, rows)
        self._payload = None
        self.experts.trace_layer = self.trace_layer  # for plain RTN without a batch (static amax needs it)
        expert_output, mlp_bias = self.experts(dispatched_input, tokens_per_expert, permuted_probs)
        output = self.token_dispatcher.combine_preprocess(expert_output)
        return output, mlp_bias


def _check_config(cfg) -> None:
    if cfg.moe_token_dispatcher_type not in ("allgather", "alltoall"):
        raise ValueError(
            f"trace_megatron supports the allgather and alltoall token dispatchers, not {cfg.moe_token_dispatcher_type!r}"
        )
    if cfg.moe_expert_capacity_factor is not None:
        raise ValueError("trace_megatron: token dropping (moe_expert_capacity_factor) is not supported")
    if getattr(cfg, "overlap_dispatch_backward_with_experts_wgrad", False):
        raise ValueError("trace_megatron: overlap_dispatch_backward_with_experts_wgrad is not supported")
