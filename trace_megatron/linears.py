"""Routed-expert linear layers that compute on the rollout's FP4 execution path.

Weights: NVFP4 round-to-nearest with one global amax per expert weight (`trace_kernels.tensor_amax`,
max-reduced over expert-tensor-parallel shards), straight-through gradient: the codes the engine computes
from the same weights. Inputs: `site_quant.fake_quantize_site` with the rows the owning expert container
(`TraceSequentialMLP`) hands over just before the call (`pending_site`), consumed exactly once.

The GEMM's forward value is the engine's (`trace_kernels.grouped_mm.quantized_mm`: exact FP4 block
products in fp32, the fixed K order, both global scales in the epilogue), returned in fp32 like the
engine's grouped GEMM, so where the trainer holds the rollout's codes its expert outputs are the
engine's bit for bit (docs/engines.md), not a BF16 GEMM of dequantized operands that differs from it
in the last bits (which the next site's rounding turns into codeword flips). The gradient is the
straight-through one of the fake-quantized operands (x_fq @ W_fq^T). Exact only where the GEMM's K is
whole on this rank: a row-parallel linear_fc2 split over expert-TP ranks sums partial products across
ranks, which no single-rank K order reproduces; those GEMMs run Megatron's BF16 path and are counted
(`expert_gemm_bf16`, per layer and site).

Only `_forward_impl` (the GEMM call of Megatron's Column/RowParallelLinear) is replaced, so communication,
bias handling and sharded checkpoints stay Megatron's own.
"""

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from trace_kernels import TraceConfig, fake_quantize, tensor_amax
from trace_kernels.grouped_mm import quantized_mm

from .site_quant import SiteInput, fake_quantize_site


class _EngineGemm(torch.autograd.Function):
    """Forward: the engine's fp32 GEMM value (computed outside, from the codes). Backward: the
    straight-through gradient of x_fq @ W_fq^T (+ bias)."""

    @staticmethod
    def forward(ctx, x_fq, w_fq, bias, value):
        ctx.save_for_backward(x_fq, w_fq)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return value

    @staticmethod
    def backward(ctx, grad):
        x_fq, w_fq = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = (g.to(w_fq.dtype) @ w_fq).reshape(x_fq.shape).to(x_fq.dtype)
        grad_w = (g.transpose(0, 1).to(x_fq.dtype) @ x_fq.reshape(-1, x_fq.shape[-1])).to(w_fq.dtype)
        grad_b = g.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
        return grad_x, grad_w, grad_b, None


class _TraceExpertLinearMixin:
    trace_config: TraceConfig
    pending_site: SiteInput | None

    def _init_trace(self, trace_config: TraceConfig | None):
        self.trace_config = trace_config or TraceConfig()
        self.pending_site = None

    def _quantized_weight(self, weight: torch.Tensor):
        """(fake-quantized weight, its NVFP4Tensor or None when weights are not quantized)."""
        if not self.trace_config.quantize_expert_weights:
            return weight, None
        with torch.no_grad():
            amax = tensor_amax(weight)
            group = getattr(self, "tp_group", None)
            if group is not None and torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
        return fake_quantize(weight, global_amax=amax, return_quantized=True, block_scale=self.trace_config.block_scale)

    # Whether this layer's input rows are split over its tensor-parallel group (linear_fc2).
    _input_split_over_tp = False

    def _k_split(self) -> bool:
        group = getattr(self, "tp_group", None)
        return self._input_split_over_tp and group is not None and torch.distributed.get_world_size(group) > 1

    def _trace_forward_impl(self, parent_impl, input, weight, *args, **kwargs):
        site, self.pending_site = self.pending_site, None
        q_in = None
        if self.trace_config.quantize_expert_inputs:
            group = self.tp_group if self._input_split_over_tp else None
            input, q_in = fake_quantize_site(input, site, amax_group=group, config=self.trace_config, return_quantized=True)
        w_fq, q_w = self._quantized_weight(weight)
        if q_in is not None and q_w is not None and not self._k_split():
            bias = kwargs.get("bias")
            with torch.no_grad():
                value = quantized_mm(q_in, q_w, block_scale=self.trace_config.block_scale)
                if bias is not None:  # the engine's epilogue: a separate fp32 add
                    value = value + bias.to(torch.float32)
            return _EngineGemm.apply(input, w_fq, bias, value)
        if q_in is not None and q_w is not None and site is not None and site.batch is not None and not site.recompute:
            stats = site.batch.site_stats(site.layer, site.site)
            stats.expert_gemm_bf16 += input.shape[0] if input.dim() == 2 else input.reshape(-1, input.shape[-1]).shape[0]
        # The weight GEMM input is a fake-quantized copy, not the parameter: Megatron's fused wgrad
        # accumulation writes into `weight.main_grad`, which only the parameter has. Plain autograd
        # delivers the straight-through gradient to the parameter instead.
        kwargs["gradient_accumulation_fusion"] = False
        return parent_impl(input, w_fq, *args, **kwargs)


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
