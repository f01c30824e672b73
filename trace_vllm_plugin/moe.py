"""TraceFP4MoEMethod: the FusedMoE quant method of trace_fp4 (routed experts only).

Weights: the checkpoint's BF16 expert weights stay the master copy in `w13_weight` / `w2_weight`
(vLLM's weight loader and an RL trainer's weight sync write there). `process_weights_after_loading`
quantizes them to NVFP4 round-to-nearest with one global amax per expert and per projection
(`trace_kernels.tensor_amax` of that expert's fused gate/up weight [2I, H], and of its down weight
[H, I]) and keeps the NVFP4 data (`layer.trace_w13`, `layer.trace_w2`). It runs again after every
weight update, always from the master copy, so re-running it is idempotent.

The forward is `experts.moe_experts` behind a custom op (see experts.py).
"""

import torch

import trace_kernels
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.models.utils import extract_layer_index

from trace_kernels.routed_experts import activation_fn
from trace_kernels.weight_digest import layer_digest

from . import experts
from .capture import STORE

logger = init_logger(__name__)


def _quantize_experts(w: torch.Tensor) -> trace_kernels.NVFP4Tensor:
    """NVFP4 RTN of expert weights [E, N, K] with one global amax per expert."""
    amax = torch.cat([trace_kernels.tensor_amax(w[e]) for e in range(w.shape[0])])
    return trace_kernels.quantize(w, amax[:, None].expand(w.shape[:-1]).contiguous())


class TraceFP4MoEMethod(FusedMoEMethodBase):
    def __init__(self, moe, config, layer_name: str):
        super().__init__(moe)
        self.config = config
        self.layer_name = layer_name
        self.layer_idx = extract_layer_index(layer_name)
        self.activation = moe.activation.value
        activation_fn(self.activation)  # clear error now for unsupported activations
        if not moe.activation.is_gated:
            raise NotImplementedError(f"trace_fp4: non-gated MoE activation {self.activation!r}")
        if moe.has_bias:
            raise NotImplementedError(f"trace_fp4: {layer_name}: expert biases are not supported")
        if moe.moe_parallel_config.tp_size > 1 or moe.moe_parallel_config.ep_size > 1:
            raise NotImplementedError(
                f"trace_fp4: {layer_name}: tensor/expert parallel MoE is not supported yet (records "
                "would be split across ranks); run with tensor_parallel_size=1"
            )
        self.weights_version = 0

    # ---- weights -------------------------------------------------------------------------------
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra):
        for name, size in (("hidden_size", hidden_size), ("moe_intermediate_size", intermediate_size_per_partition)):
            if size % trace_kernels.BLOCK_SIZE:
                raise ValueError(
                    f"trace_fp4: {self.layer_name}: {name}={size} is not divisible by "
                    f"{trace_kernels.BLOCK_SIZE} (NVFP4 quantizes blocks of 16 along the GEMM K dimension)"
                )
        if getattr(layer, "apply_router_weight_on_input", False):
            raise NotImplementedError(
                f"trace_fp4: {self.layer_name}: apply_router_weight_on_input models are not supported "
                "(the routing weight must be applied after the down projection)"
            )
        # The same BF16 parameters (and weight loaders) as vLLM's unquantized MoE method.
        UnquantizedFusedMoEMethod.create_weights(
            self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra
        )
        # Unique per module instance: two engines in one process must not share a registry entry.
        self.op_layer_name = f"{layer.layer_name}@{id(layer):x}"
        experts.LAYERS[self.op_layer_name] = layer

    def process_weights_after_loading(self, layer) -> None:
        """Quantize the master BF16 weights (at load and after every weight update)."""
        dtype = layer.w13_weight.dtype
        if self.config.quantize_expert_weights:
            with torch.no_grad():
                layer.trace_w13 = _quantize_experts(layer.w13_weight.data)
                layer.trace_w2 = _quantize_experts(layer.w2_weight.data)
                # Fake-quant GEMM operands (the native FP4 GEMM would use trace_w13/trace_w2 directly).
                layer.trace_w13_deq = layer.trace_w13.dequantize(dtype)
                layer.trace_w2_deq = layer.trace_w2.dequantize(dtype)
                layer.trace_w13_gemm = layer.trace_w13_deq.float()
                layer.trace_w2_gemm = layer.trace_w2_deq.float()
        else:
            layer.trace_w13_gemm = layer.w13_weight.data.float()
            layer.trace_w2_gemm = layer.w2_weight.data.float()
        if layer.w13_weight.is_cuda and self.weights_version == 0:
            logger.warning_once(
                "trace_fp4: no native NVFP4 GEMM yet; expert GEMMs multiply dequantized operands "
                "(counted as fake_quant_expert_gemm_calls)"
            )
        self.weights_version += 1
        # The records' weights identity: version counter and the digest both engines compute.
        digest = layer_digest(layer.trace_w13, layer.trace_w2) if self.config.quantize_expert_weights else None
        STORE.weights_updated(self.layer_idx, digest, self.weights_version)
        STORE.count("expert_weight_quantizations")

    def gemm_weights(self, layer):
        return layer.trace_w13_gemm, layer.trace_w2_gemm

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig | None:
        return FusedMoEQuantConfig.make()

    # ---- forward -------------------------------------------------------------------------------
    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        # Shared experts (if any) are run by vLLM's MoE runner before this call, outside the FP4 path.
        return torch.ops.vllm.trace_fp4_moe_experts(x, topk_weights, topk_ids, self.op_layer_name)
