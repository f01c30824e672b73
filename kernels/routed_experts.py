"""The routed-expert computation of a trace_fp4 rollout engine, shared by the vLLM and SGLang plugins.

One function, so both engines compute the same values from the same BF16 inputs (their codes can only
differ where their inputs do). Per MoE layer, for tokens x [T, H] routed to `topk_ids` [T, k] with
`topk_weights` [T, k]:
  1. fake-quantize x to NVFP4, one row per token                           -> site moe_fc1_in
  2. gate/up GEMM per routed slot; act(gate) * up in float32, cast to the model dtype
  3. fake-quantize that activation, one row per token and slot, UNSCALED by the routing weight
                                                                             -> site moe_fc2_in
  4. down GEMM per routed slot; routing weights applied after it and summed over slots in float32.
Step 3 quantizes before the routing weight on purpose: the engines apply the weight after the down
projection, and the trainer quantizes the same tensor (DESIGN.md section 3). That activation exists
only inside the expert computation, which is why the engines run this loop instead of their kernels.
"""

from typing import Callable

import torch
import torch.nn.functional as F

from .tensor import NVFP4Tensor

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# quantize(x, site) -> (dequantized x, captured NVFP4Tensor); the engine decides where captures go.
Quantizer = Callable[[torch.Tensor, str], tuple[torch.Tensor, NVFP4Tensor]]


def activation_fn(name: str):
    if name not in ACTIVATIONS:
        raise NotImplementedError(
            f"trace_fp4: MoE activation {name!r} is not supported (gated activations: {sorted(ACTIVATIONS)})"
        )
    return ACTIVATIONS[name]


def expert_gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`a @ w.T` for one expert, in a's dtype. Both operands hold dequantized NVFP4 values of the model
    dtype, so their products are exact in float32 and the sum accumulates in float32, as a BF16 GEMM
    does (float32 also because CPU BF16 matmuls of small shapes are slow). The seam for a native NVFP4
    GEMM on FP4 tensor-core GPUs, which would take codes and scales instead."""
    return F.linear(a.float(), w.float()).to(a.dtype)


def routed_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str,
    quantize: Quantizer | None,
) -> tuple[torch.Tensor, NVFP4Tensor | None, NVFP4Tensor | None]:
    """Returns (output [T, H] in x's dtype, fc1 capture [T, H] or None, fc2 capture [T, k, I] or None).

    `w13` [E, 2I, H] (gate rows, then up rows) and `w2` [E, H, I] are the weights the GEMMs use, already
    NVFP4-dequantized by the caller. `quantize=None` runs the experts without input quantization."""
    act = activation_fn(activation)
    T, H = x.shape
    k = topk_ids.shape[1]
    I = w2.shape[-1]
    dtype = x.dtype

    q1 = q2 = None
    x_in = x
    if quantize is not None:
        x_in, q1 = quantize(x, "moe_fc1_in")

    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    pair_token = order // k  # token of each (token, slot) pair in expert-sorted order

    h = x.new_empty((T * k, I))
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start : start + n]
        gu = expert_gemm(x_in[pair_token[start : start + n]], w13[e]).float()
        h[sel] = (act(gu[:, :I]) * gu[:, I:]).to(dtype)
        start += n

    h_in = h
    if quantize is not None:
        h_dq, q2 = quantize(h.view(T, k, I), "moe_fc2_in")
        h_in = h_dq.reshape(T * k, I)

    down = x.new_empty((T * k, H))
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start : start + n]
        down[sel] = expert_gemm(h_in[sel], w2[e])
        start += n

    out = (down.view(T, k, H).float() * topk_weights.view(T, k, 1).float()).sum(dim=1)
    return out.to(dtype), q1, q2
