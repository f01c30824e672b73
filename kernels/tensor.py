"""NVFP4Tensor: what the engines capture, and the full guide the trainer rounds toward.

Storage only; its behaviour as a guide is guides/full.py, and its numerics are the kernels'.
"""

from dataclasses import dataclass

import torch

from .backend import dequantize as _dequantize
from .guides.full import FullGuide


@dataclass(frozen=True)
class NVFP4Tensor(FullGuide):
    """NVFP4 data of a tensor `[..., K]`.

    codes:       uint8 `[..., K // 2]`, two E2M1 codes per byte, element 2i in the low nibble
    scales:      uint8 `[..., K // 16]`, E4M3 bit patterns of the block scales
    global_amax: float32, one element (per tensor) or `[...]` (per row)
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_amax: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """Shape of the tensor this quantizes."""
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 2))

    def dequantize(self, dtype: torch.dtype = torch.float32, *, block_scale: str = "6") -> torch.Tensor:
        return _dequantize(self, dtype, block_scale=block_scale)

    def mantissa_bits(self) -> torch.Tensor:
        """uint8 `[..., K // 8]`: the mantissa bit (code & 1) of each element, eight per byte,
        element 8i + j in bit j."""
        lo = self.codes & 1
        hi = (self.codes >> 4) & 1
        bits = torch.stack((lo, hi), dim=-1).reshape(*self.codes.shape[:-1], -1, 8)
        weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=bits.device)
        return (bits * weights).sum(-1, dtype=torch.uint8)

    def __getitem__(self, index) -> "NVFP4Tensor":
        """Select rows (leading dimensions only); the global amax follows when it is per row."""
        amax = self.global_amax if self.global_amax.numel() == 1 else self.global_amax[index]
        return NVFP4Tensor(self.codes[index], self.scales[index], amax)

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() + 4 * self.global_amax.numel()
