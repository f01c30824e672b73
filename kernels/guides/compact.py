"""The compact encoding: one mantissa bit per element plus the rollout's scales and amax.

Neighbours on the signed E2M1 grid differ in their mantissa bit, so with the rollout's scales the bit
tells guided rounding which of its two neighbours the rollout took.
"""

from dataclasses import dataclass

import torch

from .. import reference
from ..format import BLOCK_SIZE
from .base import Guide


@dataclass(frozen=True)
class CompactGuide(Guide):
    """Compact guidance rows.

    mbits:       uint8 `[..., K // 8]`, element 8i + j in bit j
    scales:      uint8 `[..., K // 16]`
    global_amax: float32, one element or `[...]`
    """

    mbits: torch.Tensor
    scales: torch.Tensor
    global_amax: torch.Tensor

    encoding = "compact"
    serves = ("compact", "sparse", None)

    def fields(self):
        return self.mbits, self.scales, self.global_amax

    def unpacked_bits(self) -> torch.Tensor:
        """int32 `[..., K]` of 0/1."""
        shifts = torch.arange(8, dtype=torch.uint8, device=self.mbits.device)
        bits = (self.mbits[..., None] >> shifts) & 1
        return bits.reshape(*self.mbits.shape[:-1], -1).to(torch.int32)

    def __getitem__(self, index) -> "CompactGuide":
        amax = self.global_amax if self.global_amax.numel() == 1 else self.global_amax[index]
        return CompactGuide(self.mbits[index], self.scales[index], amax)

    def nbytes(self) -> int:
        return self.mbits.numel() + self.scales.numel() + 4 * self.global_amax.numel()

    @classmethod
    def row_fields(cls, K: int):
        return ((K // 8,), torch.uint8), ((K // BLOCK_SIZE,), torch.uint8), ((), torch.float32)

    @classmethod
    def record_layout(cls, lead: tuple, K: int):
        return {
            "mbits": ((*lead, K // 8), torch.uint8),
            "scales": ((*lead, K // BLOCK_SIZE), torch.uint8),
            "amax": (tuple(lead), torch.float32),
        }

    def record_parts(self):
        return {"mbits": self.mbits, "scales": self.scales, "amax": self.global_amax}

    @classmethod
    def from_record_parts(cls, parts, lead, K):
        return cls(parts["mbits"], parts["scales"], parts["amax"])

    @classmethod
    def encode(cls, rows, site):
        return rows if isinstance(rows, cls) else compact(rows)

    def rounding_target(self, x, *, block_scale="6"):
        return self, None

    def round_rows(self, x2, amax, *, use_triton, out_dtype, capture, block_scale="6"):
        K = x2.shape[-1]
        scales = self.scales.reshape(-1, K // BLOCK_SIZE)
        if use_triton:
            from .. import triton_kernels  # Triton is optional on a CPU machine: imported when it runs

            mbits = self.mbits.reshape(-1, K // 8)
            return triton_kernels.quantize_guided(x2, scales, amax, mbits, full=False, out_dtype=out_dtype, capture=capture,
                                                  block_scale=block_scale)
        return (*reference.quantize_guided(x2, scales, amax, mbits=self.unpacked_bits().reshape(-1, K),
                                           block_scale=block_scale), None)

    def mismatches(self, q) -> int:
        # Only the mantissa bits are known: exact for the adjacent-codeword disagreements guided rounding
        # fixes, a lower bound otherwise.
        return int((compact(q).unpacked_bits() != self.unpacked_bits()).sum())


def compact(q) -> CompactGuide:
    """An NVFP4Tensor's compact guide: its mantissa bits and scales (and amax)."""
    return CompactGuide(q.mantissa_bits(), q.scales, q.global_amax)
