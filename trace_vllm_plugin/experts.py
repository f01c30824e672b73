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
checks it), and the captured rows go to static buffers at fixed addresses (copies, the mutation a
replay repeats). The op declares those buffers: they are its operands, listed in `mutates_args`
(routed ids, each site's codes / scales / amax, the layer's stamp block; the step counter is read
only), made at model build (`StepBuffers.allocate_moe_layer`) and written only through the operands,
so torch.compile sees every write it makes (inductor calls the op on the buffers themselves, no copies).
Where Dynamo sees the op: on vLLM-CPU (and TPU) the MoE runner calls its forward directly, so this op is
in the compiled graph. On CUDA the runner wraps the whole MoE layer in vLLM's own opaque
`vllm.moe_forward` op (declared `mutates_args=["hidden_states"]` only), which calls this op eagerly
inside it: the compiler never sees our op there, and the buffers are written the way vLLM's own
routed-experts capturer writes its static buffer from inside that op (`RoutedExpertsCapturer.capture`,
undeclared), which a CUDA graph replays all the same. The ablation paths write through the same
operands. The Python counters below count eager calls only (a replay runs no Python).
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


# The op's capture operands after `layer_name`, as `StepBuffers.allocate_moe_layer` returns them; all
# but the step counter are written by the op.
CAPTURE_OPERANDS = ("routing_ids", "fc1_codes", "fc1_scales", "fc1_amax", "fc2_codes", "fc2_scales",
                    "fc2_amax", "stamps", "step")
MUTATED_OPERANDS = list(CAPTURE_OPERANDS[:-1])


def moe_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_name: str,
    routing_ids: torch.Tensor, fc1_codes: torch.Tensor, fc1_scales: torch.Tensor, fc1_amax: torch.Tensor,
    fc2_codes: torch.Tensor, fc2_scales: torch.Tensor, fc2_amax: torch.Tensor, stamps: torch.Tensor,
    step: torch.Tensor,
) -> torch.Tensor:
    """The custom op's body (what a compiled graph calls): the layer found by its name, then layer_experts."""
    from vllm.forward_context import get_forward_context

    layer = get_forward_context().no_compile_layers[layer_name]
    operands = (routing_ids, fc1_codes, fc1_scales, fc1_amax, fc2_codes, fc2_scales, fc2_amax, stamps, step)
    return layer_experts(layer, x, topk_weights, topk_ids, operands)


def layer_experts(layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, operands: tuple) -> torch.Tensor:
    """The routed experts of `layer` writing its captures through `operands` (CAPTURE_OPERANDS' order). The
    method's eager `apply` calls this directly (TraceFP4MoEMethod.apply: the op's dispatch cost a few us a
    layer call); a compiled graph reaches it through the custom op, which declares the operands it writes."""
    method = layer.quant_method
    config = method.config
    idx = method.layer_idx
    store = method.store
    into, calls_key = _capture_targets(method, operands)
    store.count("moe_calls")
    store.count(calls_key)
    # On the native CPU engine's host-rows path the MoE kernel writes the routing ids into the step's rows
    # itself (routed_experts.engine_call's ids_into: put_routing's int16 cast, ~10 us of Python a layer call
    # in the engine saved); `ids_pending` until then, and put_routing runs wherever the kernel did not write
    # them, before any other capture write of this call (the order every other path keeps).
    ids_pending = False
    if store.capturing:
        if method.ep_size == 1 and store.routing_by_kernel(idx):
            ids_pending = True
        else:
            # Copied into the layer's static routing buffer (routers may reuse their output buffers).
            store.put_routing(idx, topk_ids, into["routing"])
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
        native = method.__dict__.get("_trace_fp4_native_moe")
        if native is None:
            native = _native_moe(method, store, w13, w2)
        if native and x.is_cpu and native.engine_case(x, topk_weights, topk_ids, method.activation, None, b13, b2):
            # The native CPU engine's usual call (what routed_experts below would pick: cpu_native.routed_experts'
            # one-kernel case), called without the dispatch layers in between (~25 us a call in the engine).
            # On the native CPU engine the captures are written straight into the step's host arena rows
            # (capture.py: host_moe_rows), else into fresh tensors kept by put_owned.
            rows = (store.host_moe_rows(idx, x.shape[0], x.shape[1], topk_ids.shape[1], w2.codes.shape[2] * 2,
                                        ids_pending) if wants else None)
            ids_rows = None
            if ids_pending:
                if rows is not None:
                    rows, ids_rows = rows[:6], rows[6]
                if ids_rows is None:  # no arena rows for them: the store's own write, first as always
                    store.put_routing(idx, topk_ids, into["routing"])
                    ids_pending = False
            if torch.autograd.profiler._is_profiler_enabled:
                with torch.profiler.record_function("trace_fp4.routed_experts"):  # shows in bench --profile
                    done = native.engine_call(x, topk_weights, topk_ids, w13, w2, wants, rows, ids_rows)
            else:
                done = native.engine_call(x, topk_weights, topk_ids, w13, w2, wants, rows, ids_rows)
            if done is not None:
                out, q1, q2 = done
                if rows is not None:
                    store.host_wrote(idx, "moe_fc1_in", "moe_fc2_in", ids_rows is not None)
                elif wants:  # this call's own tensors: the step keeps them without a copy (CaptureStore.put_owned)
                    store.put_owned(idx, "moe_fc1_in", q1, into["moe_fc1_in"])
                    store.put_owned(idx, "moe_fc2_in", q2, into["moe_fc2_in"])
                return out
        if ids_pending:  # not the kernel's call (or one it refused): the routing write before the general path's
            store.put_routing(idx, topk_ids, into["routing"])
            ids_pending = False
        # Per-token amax (batch invariant) unless the config calibrated a static one: the decision
        # SGLang and the trainer make too (trace_kernels.site_amax); values above a static amax are counted.
        def amax(site, rows):
            a = trace_kernels.site_amax(config, idx, site, rows, saturated=store.saturation)
            if site == "moe_fc2_in" and method.tp_size > 1 and config.activation_scale != "static":
                # Tensor parallel: each rank holds a slice of the row; its amax spans all of them.
                from .tensor_parallel import all_reduce_row_amax

                a = all_reduce_row_amax(a)
            return a

        if config.activation_scale != "static" and method.tp_size == 1:
            amax = None  # per row at both sites: the native backend computes it inside its kernels
        def call():
            return routed_experts(
                x, topk_weights, topk_ids, w13, w2, method.activation, capture=wants, amax=amax, w13_bias=b13, w2_bias=b2,
                backend=store.kernel_backend,
            )
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function("trace_fp4.routed_experts"):  # shows in bench --profile
                out, q1, q2 = call()
        else:  # its enter / exit ops cost a few us per layer call even with no profiler running
            out, q1, q2 = call()
        if wants:
            # q1 / q2 are this call's own tensors (routed_experts allocates its captures per call): on the
            # native CPU engine the step keeps them without a copy (CaptureStore.put_owned).
            store.put_owned(idx, "moe_fc1_in", q1, into["moe_fc1_in"])
            store.put_owned(idx, "moe_fc2_in", q2, into["moe_fc2_in"])
        return out
    if ids_pending:
        store.put_routing(idx, topk_ids, into["routing"])
    # Ablation modes: a per-expert float32 loop (counted: it is not the FP4 execution path).
    store.count("emulated_expert_gemm_calls")
    quantize = None
    if config.quantize_expert_inputs:
        quantize = lambda t, site: quantize_input(store, t, idx, site, into.get(site))  # noqa: E731  (captures into the operands)
    out, _, _ = routed_experts_emulated(x, topk_weights, topk_ids, w13, w2, method.activation, quantize, b13, b2)
    return out


def _capture_targets(method, operands: tuple) -> tuple:
    """(into, the layer's call-count key): where each key's rows go, the operands themselves, never buffers
    looked up elsewhere (placeholders, with nothing to index, when the engine captures nothing; `into` is
    {} then). Made once per layer and operand set and kept on the method: the three stamp views, the dict
    and the key's f-string cost ~2-3 us a layer call in the engine. Kept while the operands are the same
    tensor objects (the static buffers made at model build; a caller handing other tensors, as a test with
    fresh ones does, gets targets made from those)."""
    held = method.__dict__.get("_trace_fp4_capture_targets")
    if held is not None and (held[0] is operands or all(a is b for a, b in zip(held[0], operands))):
        return held[1]
    routing_ids, fc1_codes, fc1_scales, fc1_amax, fc2_codes, fc2_scales, fc2_amax, stamps, step = operands
    into = {}
    if method.store.capturing:
        into = {
            "routing": ((routing_ids,), stamps[0], step),
            "moe_fc1_in": ((fc1_codes, fc1_scales, fc1_amax), stamps[1], step),
            "moe_fc2_in": ((fc2_codes, fc2_scales, fc2_amax), stamps[2], step),
        }
    targets = (into, f"moe_calls.layer{method.layer_idx}")
    method.__dict__["_trace_fp4_capture_targets"] = (operands, targets)
    return targets


def _native_moe(method, store, w13, w2):
    """trace_kernels.cpu_native.routed_experts where this layer's calls take its one-kernel engine case
    whenever the call's own tensors allow it (cpu_native.routed_experts.engine_case, checked per call), else
    False. Decided at the layer's first call, as routed_experts would decide per call: the backend resolves to
    "native" on the CPU (TRACE_FP4_CPU_BACKEND, read once here as the KV write does: kv_packed._native_write),
    packed weights with the default block scale, and the per-row amax at both sites (no static activation
    scale, one tensor-parallel rank)."""
    from trace_kernels.backend import resolve_backend
    from trace_kernels.grouped_mm import PackedExperts

    native = False
    config = method.config
    if (isinstance(w13, PackedExperts) and isinstance(w2, PackedExperts) and w13.codes.is_cpu
            and w13.block_scale == "6" and w2.block_scale == "6"
            and config.activation_scale != "static" and method.tp_size == 1
            and resolve_backend(store.kernel_backend, w13.codes.device) == "native"):
        from trace_kernels.cpu_native import routed_experts as native
    method.__dict__["_trace_fp4_native_moe"] = native
    return native


def _moe_experts_fake(x, topk_weights, topk_ids, layer_name, *capture):
    return torch.empty_like(x)


def capture_operands(store, layer_idx: int, hidden: int, intermediate: int, top_k: int) -> tuple:
    """The op's capture operands for one layer, made at model build on the default (load) device:
    the store's static buffers when it captures, 0-row placeholders otherwise."""
    device = torch.empty(0).device
    if store.capturing:
        return store.buffers.allocate_moe_layer(layer_idx, hidden, intermediate, top_k, store.wants(layer_idx), device)
    # Distinct tensors: an op's mutable operands may not alias each other.
    return tuple(torch.empty(0, device=device) for _ in CAPTURE_OPERANDS)


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
        mutates_args=MUTATED_OPERANDS,
    )


_register_op()
