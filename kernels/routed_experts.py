"""The routed-expert computation of a trace_fp4 rollout engine, shared by the vLLM and SGLang plugins.

One function, so both engines compute the same values from the same inputs (their codes can only
differ where their inputs do). Per MoE layer, for tokens x [T, H] routed to `topk_ids` [T, k] with
`topk_weights` [T, k] and packed NVFP4 expert weights (`PackedExperts`, the only resident copy):
  1. sort the T * k (token, slot) pairs by expert (stable), offs = cumulative rows per expert
  2. fc1: `grouped_mm` of the tokens' rows, quantized on load (one row per token, site
     moe_fc1_in, captured by the GEMM itself), against w13 [E, 2I, H]    -> gate/up fp32 [M, 2I]
     (+ the expert's fc1 bias [2I] in fp32, when the model has expert biases: gpt-oss)
  3. gate/up rounded to the model dtype, the gated activation in float32 (`gated_activation`),
     cast to the model dtype
  4. fc2: `grouped_mm` of that activation, quantized on load (one row per token and slot, UNSCALED
     by the routing weight: site moe_fc2_in, captured by the GEMM), against w2 [E, H, I]
     (+ the expert's fc2 bias [H] in fp32)
  5. routing weights applied after the down projection (and after its bias), summed over slots in
     float32.
Gate/up layout: w13's rows are [gate; up] (gate rows 0..I-1, up rows I..2I-1) for every activation.
gpt-oss checkpoints interleave them (HF `gate_up_proj[..., 0::2]` is gate, `1::2` up); the engines'
loaders de-interleave the rows and the fc1 bias once, at load. Row order of w13 changes no FP4 code
(block scales run along H, the per-expert amax covers all rows), so this costs nothing.

Expert biases (gpt-oss, fp32 [E, 2I] and [E, H]): added in fp32 right after the scaled FP4 dot, before
the activation (fc1) and before the routing weight (fc2), where HF's `GptOssExperts` and vLLM's fused
MoE add them (`x @ W + b`, then the activation; `h @ W2 + b2`, then `* routing_weight`). They are not
quantized (they never enter an FP4 GEMM) and stay in the engine's parameter dtype. The captured
moe_fc2_in is the activation's output (after the bias and the clamp): exactly the rows fc2 consumes.
Step 4 quantizes before the routing weight on purpose: the engines apply the weight after the down
projection, and the trainer quantizes the same tensor.

Numerics of the GEMMs: `trace_kernels.grouped_mm` (exact block products, fixed K order, fp32 global
scales in the epilogue). `backend="triton"` on CUDA tensors is the fused kernel; "torch" is the
reference it equals bit for bit (the CPU path). The activation (step 3) is torch in both backends,
so the whole function is bit-identical across backends.

No host synchronisation on the Triton path (the expert counts stay on the device), so it can be
captured in a CUDA graph; the torch backend reads `offs` on the host.
"""

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from .api import row_amax
from .backend import resolve_backend
from .format import BLOCK_SIZE
from .grouped_mm import PackedExperts, grouped_mm
from .tensor import NVFP4Tensor

# gpt-oss's clamped SwiGLU ("swigluoai" in vLLM and SGLang; HF `GptOssExperts`): alpha and limit are
# the constants gpt-oss uses (HF: `self.alpha = 1.702`, `swiglu_limit` 7.0; vLLM's CPU and CUDA kernels
# hard-code both). The engine plugins refuse a checkpoint with another swiglu_limit.
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def swigluoai(gate: torch.Tensor, up: torch.Tensor, alpha: float = SWIGLUOAI_ALPHA, limit: float = SWIGLUOAI_LIMIT) -> torch.Tensor:
    """(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit): HF's
    `GptOssExperts` / vLLM's `SwigluOAIAndMul.forward_native` on de-interleaved halves (gate is
    clamped from above only, up on both sides; note the +1 on up)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


# name -> act(gate [.., I], up [.., I]) -> [.., I]: THE definition of each gated expert activation,
# used by both engine plugins and the trainer (trace_megatron), so all three compute the same function.
ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "silu": lambda gate, up: F.silu(gate) * up,
    "gelu": lambda gate, up: F.gelu(gate) * up,
    "gelu_tanh": lambda gate, up: F.gelu(gate, approximate="tanh") * up,
    "swigluoai": swigluoai,
}


def gated_activation(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """act(gate, up) for a gated MoE activation name (vLLM's `MoEActivation.value` spelling)."""
    if name not in ACTIVATIONS:
        raise NotImplementedError(
            f"trace_fp4: MoE activation {name!r} is not supported (gated activations: {sorted(ACTIVATIONS)})"
        )
    return ACTIVATIONS[name]


activation_fn = gated_activation  # the name the engine plugins import to validate an activation early


def deinterleave_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gpt-oss's interleaved gate/up (gate at even, up at odd positions of `dim`, as in HF's
    `gate_up_proj` [E, H, 2I] (dim -1) and `gate_up_proj_bias` [E, 2I]) -> [gate; up] halves."""
    return torch.cat((_every_other(t, dim, 0), _every_other(t, dim, 1)), dim=dim)


def _every_other(t: torch.Tensor, dim: int, start: int) -> torch.Tensor:
    idx = torch.arange(start, t.shape[dim], 2, device=t.device)
    return t.index_select(dim, idx)


def _bias(b: torch.Tensor | None, E: int, N: int, what: str) -> torch.Tensor | None:
    """An expert bias as the fp32 [E, N] the GEMM epilogue adds (exact from bf16 / fp16)."""
    if b is None:
        return None
    if tuple(b.shape) != (E, N):
        raise ValueError(f"{what} must have shape [{E}, {N}] (one row per expert), got {tuple(b.shape)}")
    return b.to(torch.float32).contiguous()


# amax(site, rows [R, K]) -> float32 [R]: the global amax of each row at a site, normally
# `lambda site, t: trace_kernels.site_amax(config, layer, site, t, saturated=counter)`, so the engines
# decide it (per row, or a calibrated static value, saturation counted) exactly as the trainer does.
SiteAmax = Callable[[str, torch.Tensor], torch.Tensor]


def _per_row_amax(site: str, rows: torch.Tensor) -> torch.Tensor:
    return row_amax(rows)


_per_row_amax.per_row = True  # the native backend computes this one inside its kernels (same bits)


def routed_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: PackedExperts,
    w2: PackedExperts,
    activation: str,
    *,
    capture: bool = False,
    amax: SiteAmax | None = _per_row_amax,
    backend: str = "auto",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, NVFP4Tensor | None, NVFP4Tensor | None]:
    """Returns (output [T, H] in x's dtype, fc1 capture [T, H] or None, fc2 capture [T, k, I] or None).

    `amax(site, rows)`: each row's global amax at `site` (default, or None: its own row amax, batch
    invariant; the native backend then computes it inside its kernels).
    `w13_bias` [E, 2I] ([gate; up] order) and `w2_bias` [E, H]: optional expert biases (gpt-oss)."""
    act = gated_activation(activation)
    if amax is None:
        amax = _per_row_amax
    T, H = x.shape
    k = topk_ids.shape[1]
    E, I = w2.codes.shape[0], w2.codes.shape[2] * 2  # w2.shape's values without building a torch.Size
    dtype, dev = x.dtype, x.device
    b13 = None if w13_bias is None else _bias(w13_bias, E, 2 * I, "w13_bias")
    b2 = None if w2_bias is None else _bias(w2_bias, E, H, "w2_bias")
    if backend != "torch" and dev.type == "cpu" and w13.block_scale == "6" and w2.block_scale == "6":
        if resolve_backend(backend, dev) == "native":  # the whole function in one or two numba calls
            return _native().routed_experts(x, topk_weights, topk_ids, w13, w2, activation, act, capture, amax, b13, b2)

    # ---- 1. expert-sorted (token, slot) pairs; counts stay on the device ------------------------
    flat_ids = topk_ids.reshape(-1).to(torch.int64)  # [M = T * k]
    order = torch.argsort(flat_ids, stable=True)  # [M] pair id of each sorted row
    counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    offs = torch.cumsum(counts, 0).to(torch.int32)  # [E]
    pair_token = order // k  # [M] token of each sorted row

    # ---- 2. fc1 (captures moe_fc1_in: one row per token, written by each token's slot-0 row) ----
    amax1 = amax("moe_fc1_in", x)  # [T]
    cap1 = q1 = None
    if capture:
        c1 = torch.empty((T, H // 2), dtype=torch.uint8, device=dev)
        s1 = torch.empty((T, H // BLOCK_SIZE), dtype=torch.uint8, device=dev)
        cap1 = (torch.where(order % k == 0, pair_token, -1), c1, s1)
        q1 = NVFP4Tensor(c1, s1, amax1)
    gu = grouped_mm(x, w13, offs, a_amax=amax1, a_rows=pair_token, capture=cap1, bias=b13, backend=backend)  # [M, 2I]

    # ---- 3. activation in float32 on the model-dtype gate/up, like the BF16 engines --------------
    gu = gu.to(dtype).float()
    h = act(gu[:, :I], gu[:, I:]).to(dtype)  # [M, I], sorted rows

    # ---- 4. fc2 (captures moe_fc2_in: one row per (token, slot), unscaled by the routing weight) --
    amax2 = amax("moe_fc2_in", h)  # [M]
    cap2 = q2 = None
    if capture:
        c2 = torch.empty((T * k, I // 2), dtype=torch.uint8, device=dev)
        s2 = torch.empty((T * k, I // BLOCK_SIZE), dtype=torch.uint8, device=dev)
        cap2 = (order, c2, s2)
        amax2_pairs = torch.empty_like(amax2).index_copy_(0, order, amax2).view(T, k)
        q2 = NVFP4Tensor(c2.view(T, k, I // 2), s2.view(T, k, I // BLOCK_SIZE), amax2_pairs)
    down = grouped_mm(h, w2, offs, a_amax=amax2, capture=cap2, bias=b2, backend=backend)  # [M, H] fp32

    # ---- 5. back to (token, slot) order; routing weights after the down projection --------------
    down = torch.empty_like(down).index_copy_(0, order, down).view(T, k, H)
    out = (down * topk_weights.view(T, k, 1).float()).sum(dim=1)
    return out.to(dtype), q1, q2


@functools.cache
def _native():
    """cpu_native.routed_experts, imported on first use (numba costs ~0.5 s to import) and then kept: an
    import statement per call costs ~1 us, per layer and step."""
    from .cpu_native import routed_experts as native

    return native


# quantize(x, site) -> (dequantized x, captured NVFP4Tensor or None), for the emulated path below.
Quantizer = Callable[[torch.Tensor, str], tuple[torch.Tensor, NVFP4Tensor | None]]


def routed_experts_emulated(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: PackedExperts | torch.Tensor,
    w2: PackedExperts | torch.Tensor,
    activation: str,
    quantize: Quantizer | None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, NVFP4Tensor | None, NVFP4Tensor | None]:
    """The ablation modes (`quantize_expert_weights` or `quantize_expert_inputs` off): a per-expert
    loop of float32 GEMMs. Packed weights are dequantized one expert at a time (no resident copy);
    BF16 tensors are used as they are. `quantize=None` leaves the inputs unquantized. Biases enter
    where `routed_experts` adds them (fp32, after each GEMM)."""
    act = gated_activation(activation)
    T, H = x.shape
    k = topk_ids.shape[1]
    E = w13.shape[0]
    I = w2.shape[-1]
    dtype = x.dtype
    b13, b2 = _bias(w13_bias, E, 2 * I, "w13_bias"), _bias(w2_bias, E, H, "w2_bias")

    def weight(w, e):
        return w.dequantize(e) if isinstance(w, PackedExperts) else w[e].float()

    q1 = q2 = None
    x_in = x
    if quantize is not None:
        x_in, q1 = quantize(x, "moe_fc1_in")
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=E).tolist()
    pair_token = order // k
    h = x.new_empty((T * k, I))
    start = 0
    for e, n in enumerate(counts):
        if n:
            sel = order[start : start + n]
            gu = F.linear(x_in[pair_token[start : start + n]].float(), weight(w13, e), None if b13 is None else b13[e])
            gu = gu.to(dtype).float()
            h[sel] = act(gu[:, :I], gu[:, I:]).to(dtype)
            start += n
    h_in = h
    if quantize is not None:
        h_dq, q2 = quantize(h.view(T, k, I), "moe_fc2_in")
        h_in = h_dq.reshape(T * k, I)
    down = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            sel = order[start : start + n]
            down[sel] = F.linear(h_in[sel].float(), weight(w2, e), None if b2 is None else b2[e])
            start += n
    out = (down.view(T, k, H) * topk_weights.view(T, k, 1).float()).sum(dim=1)
    return out.to(dtype), q1, q2
