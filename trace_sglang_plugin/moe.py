"""TraceFp4MoEMethod: SGLang's FusedMoE quant method for trace_fp4 (routed experts only; SGLang 0.5.23).

Weights: the checkpoint's BF16 expert weights stay the master copy in `w13_weight` / `w2_weight`, the
parameters SGLang's loader and weight-update paths write to (`update_weights_from_tensor`,
`update_weights_from_distributed`, ...). `process_weights_after_loading` (run at load and by
`end_weight_update` after every update) quantizes them to NVFP4 round-to-nearest with one global amax
per expert and projection (`trace_kernels.tensor_amax` of the expert's fused gate/up weight [2I, H] and
of its down weight [H, I]; the same convention as the vLLM plugin and the trainer), always from the
master copy, so it is idempotent and partial updates are re-quantized correctly.
`restore_weights_before_loading` has nothing to undo: the masters are never repacked.

Forward: `trace_kernels.routed_experts` (NVFP4 inputs of both expert GEMMs, with capture). On CPU the
GEMMs multiply dequantized operands in the model dtype.
"""

import torch
from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

import trace_kernels

from trace_kernels.routed_experts import activation_fn, routed_experts

from . import counters
from .weight_digest import layer_digest
from .runtime import RUNTIME


def _quantize_experts(w: torch.Tensor) -> trace_kernels.NVFP4Tensor:
    """NVFP4 RTN of expert weights [E, N, K] with one global amax per expert."""
    amax = torch.cat([trace_kernels.tensor_amax(w[e]) for e in range(w.shape[0])])
    return trace_kernels.quantize(w, amax[:, None].expand(w.shape[:-1]).contiguous())


class TraceFp4MoEMethod(UnquantizedFusedMoEMethod):
    def __init__(self, trace, prefix: str):
        super().__init__(use_triton_kernels=False)
        self.trace = trace
        self.prefix = prefix
        self.layer_id: int | None = None

    # ---- weights -------------------------------------------------------------------------------
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra):
        for name, size in (("hidden_size", hidden_size), ("moe_intermediate_size", intermediate_size_per_partition)):
            if size % trace_kernels.BLOCK_SIZE:
                raise ValueError(
                    f"trace_fp4: {self.prefix}: {name}={size} is not divisible by {trace_kernels.BLOCK_SIZE} "
                    "(NVFP4 quantizes blocks of 16 along the GEMM K dimension)"
                )
        if extra.get("with_bias"):
            raise NotImplementedError(f"trace_fp4: {self.prefix}: expert biases are not supported")
        if getattr(layer, "moe_tp_size", 1) > 1 or getattr(layer, "moe_ep_size", 1) > 1:
            raise NotImplementedError(
                f"trace_fp4: {self.prefix}: tensor/expert parallel MoE is not supported yet (a record would "
                "be split across ranks); run with tp_size=1"
            )
        self.layer_id = int(layer.layer_id)
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra)
        RUNTIME.register_moe_layer(self.layer_id)

    def create_moe_runner(self, layer, moe_runner_config):
        cfg = moe_runner_config
        if not cfg.is_gated:
            raise NotImplementedError(f"trace_fp4: {self.prefix}: non-gated MoE activations are not supported")
        activation_fn(cfg.activation)  # clear error now for an unsupported activation
        if cfg.apply_router_weight_on_input:
            raise NotImplementedError(
                f"trace_fp4: {self.prefix}: apply_router_weight_on_input models are not supported (the routing "
                "weight must be applied after the down projection, as the trainer does)"
            )
        if getattr(cfg, "num_fused_shared_experts", 0):
            raise NotImplementedError(f"trace_fp4: {self.prefix}: fused shared experts are not supported")
        self.moe_runner_config = cfg
        # No SGLang runner: `apply` runs its own expert loop (get_moe_runner_backend() -> None means
        # "a direct kernel consuming standard TopK with local ids").
        self.runner = None
        self._aiter_runner = None

    def get_moe_runner_backend(self, layer):
        return None

    def process_weights_after_loading(self, layer) -> None:
        """Quantize the master BF16 weights (at load, and at the end of every weight update)."""
        dtype = layer.w13_weight.dtype
        if self.trace.quantize_expert_weights:
            with torch.no_grad():
                layer.trace_w13 = _quantize_experts(layer.w13_weight.data)
                layer.trace_w2 = _quantize_experts(layer.w2_weight.data)
                layer.trace_w13_deq = trace_kernels.dequantize(layer.trace_w13, dtype)
                layer.trace_w2_deq = trace_kernels.dequantize(layer.trace_w2, dtype)
            RUNTIME.weight_digests[self.layer_id] = layer_digest(layer.trace_w13, layer.trace_w2)
        RUNTIME.weight_versions[self.layer_id] = RUNTIME.weight_versions.get(self.layer_id, 0) + 1
        counters.count("expert_weight_quantizations")

    def restore_weights_before_loading(self, layer) -> None:
        # The BF16 masters were never repacked, so fresh weights load into them as they are.
        counters.count("expert_weight_restores")

    # ---- forward -------------------------------------------------------------------------------
    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        x = dispatch_output.hidden_states
        topk_weights, topk_ids, _ = dispatch_output.topk_output
        idx = self.layer_id
        counters.count("moe_calls")
        counters.count(f"moe_calls.layer{idx}")
        if self.trace.quantize_expert_weights:
            w13, w2 = layer.trace_w13_deq, layer.trace_w2_deq
        else:
            w13, w2 = layer.w13_weight, layer.w2_weight
        quantize = None
        if self.trace.quantize_expert_inputs:
            # per-token amax (batch invariant) unless the config calibrated a static one
            quantize = lambda t, site: trace_kernels.quantize_dequantize(  # noqa: E731
                t, global_amax=self.trace.activation_amax(idx, site, t.device)
            )
        out, q1, q2 = routed_experts(
            x, topk_weights, topk_ids, w13, w2, self.moe_runner_config.activation, quantize
        )
        RUNTIME.capture_moe(idx, topk_ids, q1, q2)
        return StandardCombineInput(hidden_states=out)
