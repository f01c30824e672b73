"""The routed-expert computation of a trace_fp4 rollout engine, shared by the vLLM and SGLang plugins.

One function, so both engines compute the same values from the same inputs (their codes can only
differ where their inputs do). Per MoE layer, for tokens x [T, H] routed to `topk_ids` [T, k] with
`topk_weights` [T, k] and packed NVFP4 expert weights (`PackedExperts`, the only resident copy):
  1. sort the T * k (token, slot) pairs by expert (stable), offs = cumulative rows per expert
  2. fc1: `grouped_mm` of the tokens' rows, quantized on load (one row per token, site
     moe_fc1_in, captured by the GEMM itself), against w13 [E, 2I, H]    -> gate/up fp32 [M, 2I]
  3. gate/up rounded to the model dtype, act(gate) * up in float32, cast to the model dtype
  4. fc2: `grouped_mm` of that activation, quantized on load (one row per token and slot, UNSCALED
     by the routing weight: site moe_fc2_in, captured by the GEMM), against w2 [E, H, I]
  5. routing weights applied after the down projection, summed over slots in float32.
Step 4 quantizes before the routing weight on purpose: the engines apply the weight after the down
projection, and the trainer quantizes the same tensor (DESIGN.md section 3).

Numerics of the GEMMs: `trace_kernels.grouped_mm` (exact block products, fixed K order, fp32 global
scales in the epilogue). `backend="triton"` on CUDA tensors is the fused kernel; "torch" is the
reference it equals bit for bit (the CPU path). The activation (step 3) is torch in both backends,
so the whole function is bit-identical across backends.

No host synchronisation on the Triton path (the expert counts stay on the device), so it can be
captured in a CUDA graph; the torch backend reads `offs` on the host.
"""

from typing import Callable

import torch
import torch.nn.functional as F

from .api import row_amax
from .format import BLOCK_SIZE
from .grouped_mm import PackedExperts, grouped_mm
from .tensor import NVFP4Tensor

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation_fn(name: str):
    if name not in ACTIVATIONS:
        raise NotImplementedError(
            f"trace_fp4: MoE activation {name!r} is not supported (gated activations: {sorted(ACTIVATIONS)})"
        )
    return ACTIVATIONS[name]


# amax(site, rows [R, K]) -> float32 [R]: the global amax of each row at a site, normally
# `lambda site, t: trace_kernels.site_amax(config, layer, site, t, saturated=counter)`, so the engines
# decide it (per row, or a calibrated static value, saturation counted) exactly as the trainer does.
SiteAmax = Callable[[str, torch.Tensor], torch.Tensor]


def _per_row_amax(site: str, rows: torch.Tensor) -> torch.Tensor:
    return row_amax(rows)


def routed_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: PackedExperts,
    w2: PackedExperts,
    activation: str,
    *,
    capture: bool = False,
    amax: SiteAmax = _per_row_amax,
    backend: str = "auto",
) -> tuple[torch.Tensor, NVFP4Tensor | None, NVFP4Tensor | None]:
    """Returns (output [T, H] in x's dtype, fc1 capture [T, H] or None, fc2 capture [T, k, I] or None).

    `amax(site, rows)`: each row's global amax at `site` (default: its own row amax, batch invariant)."""
    act = activation_fn(activation)
    T, H = x.shape
    k = topk_ids.shape[1]
    E, I = w2.shape[0], w2.shape[2]
    dtype, dev = x.dtype, x.device

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
    gu = grouped_mm(x, w13, offs, a_amax=amax1, a_rows=pair_token, capture=cap1, backend=backend)  # [M, 2I]

    # ---- 3. activation in float32 on the model-dtype gate/up, like the BF16 engines --------------
    gu = gu.to(dtype).float()
    h = (act(gu[:, :I]) * gu[:, I:]).to(dtype)  # [M, I], sorted rows

    # ---- 4. fc2 (captures moe_fc2_in: one row per (token, slot), unscaled by the routing weight) --
    amax2 = amax("moe_fc2_in", h)  # [M]
    cap2 = q2 = None
    if capture:
        c2 = torch.empty((T * k, I // 2), dtype=torch.uint8, device=dev)
        s2 = torch.empty((T * k, I // BLOCK_SIZE), dtype=torch.uint8, device=dev)
        cap2 = (order, c2, s2)
        amax2_pairs = torch.empty_like(amax2).index_copy_(0, order, amax2).view(T, k)
        q2 = NVFP4Tensor(c2.view(T, k, I // 2), s2.view(T, k, I // BLOCK_SIZE), amax2_pairs)
    down = grouped_mm(h, w2, offs, a_amax=amax2, capture=cap2, backend=backend)  # [M, H] fp32

    # ---- 5. back to (token, slot) order; routing weights after the down projection --------------
    down = torch.empty_like(down).index_copy_(0, order, down).view(T, k, H)
    out = (down * topk_weights.view(T, k, 1).float()).sum(dim=1)
    return out.to(dtype), q1, q2


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
) -> tuple[torch.Tensor, NVFP4Tensor | None, NVFP4Tensor | None]:
    """The ablation modes (`quantize_expert_weights` or `quantize_expert_inputs` off): a per-expert
    loop of float32 GEMMs. Packed weights are dequantized one expert at a time (no resident copy);
    BF16 tensors are used as they are. `quantize=None` leaves the inputs unquantized."""
    act = activation_fn(activation)
    T, H = x.shape
    k = topk_ids.shape[1]
    E = w13.shape[0]
    I = w2.shape[-1]
    dtype = x.dtype

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
            gu = F.linear(x_in[pair_token[start : start + n]].float(), weight(w13, e)).to(dtype).float()
            h[sel] = (act(gu[:, :I]) * gu[:, I:]).to(dtype)
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
            down[sel] = F.linear(h_in[sel].float(), weight(w2, e))
            start += n
    out = (down.view(T, k, H) * topk_weights.view(T, k, 1).float()).sum(dim=1)
    return out.to(dtype), q1, q2
