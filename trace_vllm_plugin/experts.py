"""The routed-expert computation of the trace_fp4 MoE method, as one opaque custom op.

Per layer: quantize the hidden states entering gate/up (one row per token), run gate/up per routed
slot, quantize the activation entering down (one row per token and slot, *before* the routing weight,
so the trainer quantizes the same tensor), run down, then apply the routing weights and sum over
slots. Routing weights after down is how vLLM and the trainer's aligned path both compute it.

The computation itself is `trace_kernels.routed_experts` (shared with the SGLang plugin, so both
engines compute the same values); its `expert_gemm` is the seam for a native FP4 GEMM. Quantization
always comes from `trace_kernels` (Triton on CUDA tensors).

Wrapped as `torch.ops.vllm.trace_fp4_moe_experts` so torch.compile treats it as one opaque call
(Dynamo cannot trace the capture side effects or the data-dependent per-expert loop).
"""

import torch

from trace_kernels.routed_experts import routed_experts

from .activations import quantize_input
from .capture import STORE

# layer_name -> RoutedExperts module; filled by the MoE method at weight creation.
LAYERS: dict[str, torch.nn.Module] = {}


def moe_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_name: str
) -> torch.Tensor:
    layer = LAYERS[layer_name]
    method = layer.quant_method
    idx = method.layer_idx
    STORE.count("moe_calls")
    # No native FP4 GEMM yet: every call multiplies dequantized operands (trace_kernels' expert_gemm).
    STORE.count("fake_quant_expert_gemm_calls")
    STORE.count(f"moe_calls.layer{idx}")
    if STORE.capturing:
        # A copy: routers may reuse their output buffers across layers.
        STORE.put_routing(idx, topk_ids.to(torch.int16, copy=True))
    quantize = None
    if method.config.quantize_expert_inputs:
        quantize = lambda t, site: quantize_input(t, idx, site)  # noqa: E731  (captures into STORE)
    w13, w2 = method.gemm_weights(layer)
    out, _, _ = routed_experts(x, topk_weights, topk_ids, w13, w2, method.activation, quantize)
    return out


def _moe_experts_fake(x, topk_weights, topk_ids, layer_name):
    return torch.empty_like(x)


def _register_op() -> None:
    from vllm.utils.torch_utils import direct_register_custom_op

    try:
        torch.ops.vllm.trace_fp4_moe_experts  # noqa: B018  (already registered in this process)
        return
    except (AttributeError, RuntimeError):
        pass
    direct_register_custom_op(
        op_name="trace_fp4_moe_experts",
        op_func=moe_experts,
        fake_impl=_moe_experts_fake,
    )


_register_op()
