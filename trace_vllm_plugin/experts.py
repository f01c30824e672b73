"""The routed-expert computation of the trace_fp4 MoE method, as one opaque custom op.

Per layer: quantize the hidden states entering gate/up (one row per token), run gate/up per routed
slot, quantize the activation entering down (one row per token and slot, *before* the routing weight,
so the trainer quantizes the same tensor), run down, then apply the routing weights and sum over
slots. Routing weights after down is how vLLM and the trainer's aligned path both compute it.

The expert GEMMs go through `expert_gemm`, the seam for a native FP4 GEMM: today it multiplies
dequantized (fake-quantized) operands in the model dtype, which is the only option on a CPU and the
reference on a GPU. Quantization itself always comes from `trace_kernels` (Triton on CUDA tensors).

Wrapped as `torch.ops.vllm.trace_fp4_moe_experts` so torch.compile treats it as one opaque call
(Dynamo cannot trace the capture side effects or the data-dependent per-expert loop).
"""

import torch
import torch.nn.functional as F

from .activations import quantize_input
from .capture import STORE

# layer_name -> RoutedExperts module; filled by the MoE method at weight creation.
LAYERS: dict[str, torch.nn.Module] = {}

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation_fn(name: str):
    if name not in _ACTIVATIONS:
        raise NotImplementedError(
            f"trace_fp4: MoE activation {name!r} is not supported (supported gated activations: "
            f"{sorted(_ACTIVATIONS)})"
        )
    return _ACTIVATIONS[name]


def expert_gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`a @ w.T` for one expert, returned in the model dtype: a [n, K] is the dequantized NVFP4 input
    in the model dtype, w [N, K] the dequantized NVFP4 weight (model-dtype values, held as float32).
    Products of model-dtype values are exact in float32 and the sum accumulates in float32, as a
    BF16 GEMM does; float32 only because CPU BF16 matmuls of these small shapes are slow.
    Seam for a native NVFP4 GEMM on FP4 tensor-core GPUs, which would take codes and scales."""
    return F.linear(a.to(w.dtype), w).to(a.dtype)


def moe_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_name: str
) -> torch.Tensor:
    layer = LAYERS[layer_name]
    method = layer.quant_method
    idx = method.layer_idx
    N, H = x.shape
    K = topk_ids.shape[1]
    dtype = x.dtype
    STORE.count("moe_calls")
    # No native FP4 GEMM yet: every call multiplies dequantized operands (see expert_gemm).
    STORE.count("fake_quant_expert_gemm_calls")
    STORE.count(f"moe_calls.layer{idx}")
    if STORE.capturing:
        # A copy: routers may reuse their output buffers across layers.
        STORE.put_routing(idx, topk_ids.to(torch.int16, copy=True))

    quant_inputs = method.config.quantize_expert_inputs
    if quant_inputs:
        x_in, _ = quantize_input(x, idx, "moe_fc1_in")
    else:
        x_in = x
    w13, w2 = method.gemm_weights(layer)
    I = w2.shape[-1]
    act = _ACTIVATIONS[method.activation]

    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    slot_tokens = order // K  # token of each sorted (token, slot) pair

    # gate/up per routed slot -> activation [N * K, I] in the model dtype (unscaled by routing).
    h = x.new_empty((N * K, I))
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start : start + n]
        gu = expert_gemm(x_in[slot_tokens[start : start + n]], w13[e]).float()
        h[sel] = (act(gu[:, :I]) * gu[:, I:]).to(dtype)
        start += n

    if quant_inputs:
        h_in, _ = quantize_input(h.view(N, K, I), idx, "moe_fc2_in")
        h_in = h_in.reshape(N * K, I)
    else:
        h_in = h

    down = x.new_empty((N * K, H))
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start : start + n]
        down[sel] = expert_gemm(h_in[sel], w2[e])
        start += n

    # Routing weights after the down projection, summed over slots in float32.
    out = (down.view(N, K, H).float() * topk_weights.view(N, K, 1).float()).sum(dim=1)
    return out.to(dtype)


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
