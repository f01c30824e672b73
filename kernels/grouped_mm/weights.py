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
from ..format import BLOCK_SIZE
from ..tensor import NVFP4Tensor


@dataclass(frozen=True)
class PackedExperts:
    codes: torch.Tensor  # uint8 [E, N, K/2]
    scales: torch.Tensor  # uint8 [E, N, K/16]
    amax: torch.Tensor  # fp32 [E]

    @classmethod
    def empty(cls, num_experts: int, n: int, k: int, device=None) -> "PackedExperts":
        if k % BLOCK_SIZE:
            raise ValueError(f"expert weight K={k} is not divisible by {BLOCK_SIZE}")
        return cls(
            torch.zeros((num_experts, n, k // 2), dtype=torch.uint8, device=device),
            torch.zeros((num_experts, n, k // BLOCK_SIZE), dtype=torch.uint8, device=device),
            torch.zeros((num_experts,), dtype=torch.float32, device=device),
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
        return self.expert(e).dequantize(dtype)

    @torch.no_grad()
    def quantize_expert_(self, e: int, w: torch.Tensor) -> None:
        """Requantize expert e in place from its full-precision weight w [N, K]."""
        if tuple(w.shape) != tuple(self.shape[1:]):
            raise ValueError(f"expert weight has shape {tuple(w.shape)}, the packed tensor expects {tuple(self.shape[1:])}")
        w = w.to(self.codes.device)
        amax = tensor_amax(w)
        q = quantize(w, amax)
        self.codes[e].copy_(q.codes)
        self.scales[e].copy_(q.scales)
        self.amax[e : e + 1].copy_(amax)
