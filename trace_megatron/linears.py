"""Routed-expert linear layers that compute on the rollout's FP4 execution path.

Weights: NVFP4 round-to-nearest with one global amax per expert weight (`trace_kernels.tensor_amax`,
max-reduced over expert-tensor-parallel shards), straight-through gradient: the codes the engine computes
from the same weights. Inputs: `site_quant.fake_quantize_site` with the rows the owning expert container
(`TraceSequentialMLP`) hands over just before the call (`pending_site`), consumed exactly once.

Only `_forward_impl` (the GEMM call of Megatron's Column/RowParallelLinear) is replaced, so communication,
bias handling and sharded checkpoints stay Megatron's own.
"""

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from trace_kernels import TraceConfig, fake_quantize, tensor_amax

from .site_quant import SiteInput, fake_quantize_site


class _TraceExpertLinearMixin:
    trace_config: TraceConfig
    pending_site: SiteInput | None

    def _init_trace(self, trace_config: TraceConfig | None):
        self.trace_config = trace_config or TraceConfig()
        self.pending_site = None

    def _quantized_weight(self, weight: torch.Tensor) -> torch.Tensor:
        if not self.trace_config.quantize_expert_weights:
            return weight
        with torch.no_grad():
            amax = tensor_amax(weight)
            group = getattr(self, "tp_group", None)
            if group is not None and torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
        return fake_quantize(weight, global_amax=amax)

    # Whether this layer's input rows are split over its tensor-parallel group (linear_fc2).
    _input_split_over_tp = False

    def _trace_forward_impl(self, parent_impl, input, weight, *args, **kwargs):
        site, self.pending_site = self.pending_site, None
        if self.trace_config.quantize_expert_inputs:
            group = self.tp_group if self._input_split_over_tp else None
            input = fake_quantize_site(input, site, amax_group=group, config=self.trace_config)
        # The weight GEMM input is a fake-quantized copy, not the parameter: Megatron's fused wgrad
        # accumulation writes into `weight.main_grad`, which only the parameter has. Plain autograd
        # delivers the straight-through gradient to the parameter instead.
        kwargs["gradient_accumulation_fusion"] = False
        return parent_impl(input, self._quantized_weight(weight), *args, **kwargs)


class TraceExpertColumnParallelLinear(_TraceExpertLinearMixin, ColumnParallelLinear):
    """linear_fc1 of a routed expert (input: the token's hidden state, site `moe_fc1_in`)."""

    def __init__(self, *args, trace_config: TraceConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_trace(trace_config)

    def _forward_impl(self, input, weight, *args, **kwargs):
        return self._trace_forward_impl(super()._forward_impl, input, weight, *args, **kwargs)


class TraceExpertRowParallelLinear(_TraceExpertLinearMixin, RowParallelLinear):
    """linear_fc2 of a routed expert (input: act(gate) * up before the routing probability,
    site `moe_fc2_in`). Its input is split over expert-TP ranks along the row."""

    _input_split_over_tp = True

    def __init__(self, *args, trace_config: TraceConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_trace(trace_config)

    def _forward_impl(self, input, weight, *args, **kwargs):
        return self._trace_forward_impl(super()._forward_impl, input, weight, *args, **kwargs)
