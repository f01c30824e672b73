"""Resident NVFP4 expert weights: the only copy of a routed-expert projection an engine keeps.

`PackedExperts` holds, for W [E, N, K]: codes uint8 [E, N, K/2], scales uint8 [E, N, K/16] (E4M3
bytes) and one fp32 global amax per expert [E] (4.5 bits per parameter plus 4 bytes per expert).
Weight loading and RL weight sync write into these tensors expert by expert
(`quantize_expert_`): round-to-nearest with the expert's own tensor amax, the convention of the
trainer (`trace_megatron.linears`) and of a fresh engine load. In place, so tensor addresses stay
fixed (CUDA graphs keep pointing at the live weights).
"""

from dataclasses import dataclass

import torch

from ..api import quantize, tensor_amax
from ..format import BLOCK_SIZE, check_block_scale
from ..tensor import NVFP4Tensor


@dataclass(frozen=True)
class PackedExperts:
    codes: torch.Tensor  # uint8 [E, N, K/2]
    scales: torch.Tensor  # uint8 [E, N, K/16]
    amax: torch.Tensor  # fp32 [E]
    block_scale: str = "6"  # the block-scale rule of the codes (TraceConfig.block_scale); sets g_dec too

    def __post_init__(self):
        check_block_scale(self.block_scale)

    @classmethod
    def empty(cls, num_experts: int, n: int, k: int, device=None, block_scale: str = "6") -> "PackedExperts":
        if k % BLOCK_SIZE:
            raise ValueError(f"expert weight K={k} is not divisible by {BLOCK_SIZE}")
        return cls(
            torch.zeros((num_experts, n, k // 2), dtype=torch.uint8, device=device),
            torch.zeros((num_experts, n, k // BLOCK_SIZE), dtype=torch.uint8, device=device),
            torch.zeros((num_experts,), dtype=torch.float32, device=device),
            block_scale,
        )

    @property
    def shape(self) -> torch.Size:
        """[E, N, K] of the weight this packs."""
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 2))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.amax))

    def expert(self, e: int) -> NVFP4Tensor:
        """Expert e as an NVFP4Tensor [N, K] (views, per-tensor amax)."""
        return NVFP4Tensor(self.codes[e], self.scales[e], self.amax[e : e + 1])

    def dequantize(self, e: int, dtype=torch.float32) -> torch.Tensor:
        """One expert's dequantized weight [N, K] (transient: for emulated paths and tests)."""
        return self.expert(e).dequantize(dtype, block_scale=self.block_scale)

    @torch.no_grad()
    def quantize_expert_(self, e: int, w: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        """Requantize expert e in place from its full-precision weight w [N, K]. `amax`: the expert's
        global amax when `w` is one tensor-parallel shard of it (default: w's own amax)."""
        if tuple(w.shape) != tuple(self.shape[1:]):
            raise ValueError(f"expert weight has shape {tuple(w.shape)}, the packed tensor expects {tuple(self.shape[1:])}")
        w = w.to(self.codes.device)
        amax = tensor_amax(w) if amax is None else amax.to(device=w.device, dtype=torch.float32).reshape(1)
        q = quantize(w, amax, block_scale=self.block_scale)
        self.codes[e].copy_(q.codes)
        self.scales[e].copy_(q.scales)
        self.amax[e : e + 1].copy_(amax)


class ExpertWeightStream:
    """Takes full-precision expert weights as an engine's weight loader hands them over, one
    projection of one expert at a time, and requantizes them into the resident `PackedExperts`.

    Shards: "w1" (gate [I, H]), "w3" (up [I, H]), "w2" (down [H, I]). The per-expert amax of w13
    covers gate and up together, so the first half to arrive is held (a copy: loaders may reuse their
    buffers) until its partner comes; at most one half per expert in flight, none between updates.
    `check_complete()` raises if a half is still waiting (a weight update must send both).

    Tensor parallel (`tp_rank`, `tp_size`): the loader hands over the checkpoint's full projections
    and this rank keeps its slice of the intermediate dimension (rows of gate and of up, columns of
    down), quantized with the amax of the WHOLE expert. Block scales run along K and the slices are
    whole blocks, so each rank's codes are exactly its slice of a single-rank engine's codes.
    """

    def __init__(self, w13: PackedExperts, w2: PackedExperts, where: str, tp_rank: int = 0, tp_size: int = 1):
        self.w13, self.w2, self.where = w13, w2, where
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        self.max_pending_bytes = 0

    def _rows(self, n: int) -> slice:
        return slice(self.tp_rank * n, (self.tp_rank + 1) * n)

    def load(self, shard_id: str, expert: int, weight: torch.Tensor) -> None:
        if shard_id == "w2":
            if self.tp_size == 1:
                self.w2.quantize_expert_(expert, weight)
                return
            local = self.w2.shape[2]
            if tuple(weight.shape) != (self.w2.shape[1], local * self.tp_size):
                raise ValueError(
                    f"{self.where}: expert {expert} w2 has shape {tuple(weight.shape)}, expected the full "
                    f"{(self.w2.shape[1], local * self.tp_size)} (tensor parallel {self.tp_size})"
                )
            self.w2.quantize_expert_(expert, weight[:, self._rows(local)], amax=tensor_amax(weight))
            return
        if shard_id not in ("w1", "w3"):
            raise ValueError(f"{self.where}: unknown expert shard {shard_id!r} (expected w1, w3 or w2)")
        half = self.w13.shape[1] // 2 * self.tp_size
        if tuple(weight.shape) != (half, self.w13.shape[2]):
            raise ValueError(
                f"{self.where}: expert {expert} {shard_id} has shape {tuple(weight.shape)}, expected {(half, self.w13.shape[2])}"
            )
        halves = self.pending.setdefault(expert, {})
        halves[shard_id] = weight.detach().to(self.w13.codes.device, copy=True)
        self.max_pending_bytes = max(
            self.max_pending_bytes, sum(t.numel() * t.element_size() for h in self.pending.values() for t in h.values())
        )
        if len(halves) == 2:
            del self.pending[expert]
            if self.tp_size == 1:
                self.w13.quantize_expert_(expert, torch.cat((halves["w1"], halves["w3"])))
                return
            rows = self._rows(self.w13.shape[1] // 2)
            amax = torch.maximum(tensor_amax(halves["w1"]), tensor_amax(halves["w3"]))
            self.w13.quantize_expert_(expert, torch.cat((halves["w1"][rows], halves["w3"][rows])), amax=amax)

    def check_complete(self) -> None:
        if self.pending:
            waiting = {e: sorted({"w1", "w3"} - set(h)) for e, h in sorted(self.pending.items())}
            raise ValueError(
                f"{self.where}: gate/up weights incomplete: expert -> missing half {waiting}. The NVFP4 global "
                "amax of an expert covers gate and up together, so an update must send both halves"
            )


def resident_bytes(module: torch.nn.Module, skip: tuple[str, ...] = ()) -> tuple[int, int]:
    """(bytes of every tensor with storage that a routed-expert module holds: parameters, buffers and
    tensor / PackedExperts attributes; bytes the same expert weights take in BF16). Meta tensors
    (the placeholder parameters of the packed layout) hold nothing."""
    seen: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        if not t.is_meta:
            seen[id(t)] = t.numel() * t.element_size()

    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if name not in skip:
            add(t)
    bf16 = 0
    for v in vars(module).values():
        if isinstance(v, torch.Tensor):
            add(v)
        elif isinstance(v, PackedExperts):
            for t in (v.codes, v.scales, v.amax):
                add(t)
            bf16 += 2 * v.shape.numel()
    if bf16 == 0:  # BF16 layout (ablation): the weights themselves
        bf16 = sum(2 * getattr(module, n).numel() for n in ("w13_weight", "w2_weight") if hasattr(module, n))
    return sum(seen.values()), bf16


def install_packed_experts(layer, num_experts: int, intermediate: int, hidden: int, params_dtype, *, where: str,
                           attrs: dict, set_weight_attrs, weight_loader, tp_rank: int = 0,
                           tp_size: int = 1, block_scale: str = "6") -> ExpertWeightStream:
    """Give an engine's MoE `layer` its resident packed weights and the parameters its loaders write to.

    `layer.trace_w13` [E, 2I, H] and `layer.trace_w2` [E, H, I] are the only copy. `w13_weight` /
    `w2_weight` are meta-device placeholders (no storage) named and shaped as the engine expects, so its
    checkpoint and weight-sync paths find them; their `weight_loader` (the engine's signature) feeds the
    returned stream, which requantizes each expert as it arrives. `set_weight_attrs` is the engine's
    own (vLLM and SGLang each have one)."""
    E, I, H = num_experts, intermediate, hidden
    layer.trace_w13 = PackedExperts.empty(E, 2 * I, H, block_scale=block_scale)  # default device: the engine's load device
    layer.trace_w2 = PackedExperts.empty(E, H, I, block_scale=block_scale)
    for name, shape in (("w13_weight", (E, 2 * I, H)), ("w2_weight", (E, H, I))):
        param = torch.nn.Parameter(torch.empty(shape, dtype=params_dtype, device="meta"), requires_grad=False)
        layer.register_parameter(name, param)
        set_weight_attrs(param, attrs)
        param.weight_loader = weight_loader
    return ExpertWeightStream(layer.trace_w13, layer.trace_w2, where, tp_rank, tp_size)
