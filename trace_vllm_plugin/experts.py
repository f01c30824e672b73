"""The routed-expert computation of the trace_fp4 MoE method, as one opaque custom op.

Per layer: quantize the hidden states entering gate/up (one row per token), run gate/up per routed
slot, quantize the activation entering down (one row per token and slot, *before* the routing weight,
so the trainer quantizes the same tensor), run down, then apply the routing weights and sum over
slots. Routing weights after down is how vLLM and the trainer's aligned path both compute it.

The computation itself is `trace_kernels.routed_experts` (shared with the SGLang plugin, so both
engines compute the same values): the NVFP4 grouped GEMM over the packed weights, which quantizes its
inputs on load and hands back the captured codes (Triton on CUDA tensors, the bit-identical torch
backend on the CPU).

Wrapped as `torch.ops.vllm.trace_fp4_moe_experts` so torch.compile treats it as one opaque call
(Dynamo cannot trace the capture side effects or the data-dependent per-expert loop). A custom op
takes tensors and strings only, so the layer is named: it is registered in its engine's static forward
context (the way vLLM's own layers are found by their ops), and its method carries the engine's
capture store.

CUDA graphs. On the packed path the op is graph-safe: no host synchronisation and no data-dependent
shape (the Triton grouped GEMM keeps the expert counts on the device; tests/kernels/test_no_host_sync.py
checks it), and the captured rows go to the store's static buffers (`CaptureStore.put`: copies into
fixed addresses, the mutation a replay repeats). The buffers are not operands of the op: nothing in
the compiled graph reads them (the runner reads them after the step), the way vLLM's attention op
writes the KV cache it finds through the forward context. The Python counters below count eager
calls only (a replay runs no Python).
"""

import torch

import trace_kernels
from trace_kernels.routed_experts import routed_experts, routed_experts_emulated

from .activations import quantize_input

_CONTEXT_SUFFIX = ".trace_fp4_experts"  # beside the name vLLM's own MoE runner is registered under


def register_layer(layer: torch.nn.Module) -> str:
    """Register `layer` (a RoutedExperts module, at model build) in its engine's static forward
    context; returns the name the custom op finds it by."""
    from vllm.config import get_current_vllm_config

    name = f"{layer.layer_name}{_CONTEXT_SUFFIX}"
    get_current_vllm_config().compilation_config.static_forward_context[name] = layer
    return name


def moe_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_name: str
) -> torch.Tensor:
    from vllm.forward_context import get_forward_context

    layer = get_forward_context().no_compile_layers[layer_name]
    method = layer.quant_method
    config = method.config
    idx = method.layer_idx
    store = method.store
    store.count("moe_calls")
    store.count(f"moe_calls.layer{idx}")
    if store.capturing:
        # Copied into the layer's static routing buffer (routers may reuse their output buffers).
        store.put_routing(idx, topk_ids)
    if method.ep_size > 1:
        # Expert parallel: this rank runs only the (token, slot) pairs of its own experts; the others
        # count nothing here (weight 0) and the engine's all-reduce adds the other ranks' outputs. The
        # record takes each pair's fc2 row from the rank that owns its expert (rank_parts).
        local = layer.expert_map[topk_ids.long()]
        mine = local >= 0
        topk_ids = torch.where(mine, local, 0).to(topk_ids.dtype)
        topk_weights = torch.where(mine, topk_weights, torch.zeros_like(topk_weights))
    w13, w2 = method.gemm_weights(layer)
    b13, b2 = method.expert_biases(layer)  # gpt-oss; None otherwise
    if config.quantize_expert_weights and config.quantize_expert_inputs:
        # The NVFP4 grouped GEMM: Triton on CUDA tensors, its bit-identical torch backend on the CPU.
        store.count("nvfp4_grouped_gemm_calls")
        wants = store.wants(idx)
        # Per-token amax (batch invariant) unless the config calibrated a static one: the decision
        # SGLang and the trainer make too (trace_kernels.site_amax); values above a static amax are counted.
        def amax(site, rows):
            a = trace_kernels.site_amax(config, idx, site, rows, saturated=store.saturation)
            if site == "moe_fc2_in" and method.tp_size > 1 and config.activation_scale != "static":
                # Tensor parallel: each rank holds a slice of the row; its amax spans all of them.
                from .tensor_parallel import all_reduce_row_amax

                a = all_reduce_row_amax(a)
            return a

        with torch.profiler.record_function("trace_fp4.routed_experts"):  # shows in bench --profile
            out, q1, q2 = routed_experts(
                x, topk_weights, topk_ids, w13, w2, method.activation, capture=wants, amax=amax, w13_bias=b13, w2_bias=b2,
                backend=store.kernel_backend,
            )
        if wants:
            store.put(idx, "moe_fc1_in", q1)
            store.put(idx, "moe_fc2_in", q2)
        return out
    # Ablation modes: a per-expert float32 loop (counted: it is not the FP4 execution path).
    store.count("emulated_expert_gemm_calls")
    quantize = None
    if config.quantize_expert_inputs:
        quantize = lambda t, site: quantize_input(store, t, idx, site)  # noqa: E731  (captures into store)
    out, _, _ = routed_experts_emulated(x, topk_weights, topk_ids, w13, w2, method.activation, quantize, b13, b2)
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
