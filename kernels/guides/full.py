"""The full encoding: the rollout's NVFP4 rows themselves (4-bit codes, E4M3 scales, float32 amax per row).

`FullGuide` is the behaviour NVFP4Tensor (tensor.py, the storage) has as a guide; kept here so that the
tensor type stays a plain container and each encoding reads as one module.
"""

import torch

from .. import reference
from ..format import BLOCK_SIZE
from .base import Guide


def codewords(codes: torch.Tensor) -> torch.Tensor:
    """int32 [..., K] of packed codes [..., K // 2]: sign and magnitude index per element, -0 folded into +0."""
    c = reference.unpack_nibbles(codes).to(torch.int32)
    return torch.where((c & 0x7) == 0, 0, c)


class FullGuide(Guide):
    encoding = "full"
    serves = ("full", "compact", "sparse", None)

    def fields(self):
        return self.codes, self.scales, self.global_amax

    @classmethod
    def row_fields(cls, K: int):
        return ((K // 2,), torch.uint8), ((K // BLOCK_SIZE,), torch.uint8), ((), torch.float32)

    @classmethod
    def record_layout(cls, lead: tuple, K: int):
        return {
            "codes": ((*lead, K // 2), torch.uint8),
            "scales": ((*lead, K // BLOCK_SIZE), torch.uint8),
            "amax": (tuple(lead), torch.float32),
        }

    def record_parts(self):
        return {"codes": self.codes, "scales": self.scales, "amax": self.global_amax}

    @classmethod
    def from_record_parts(cls, parts, lead, K):
        return cls(parts["codes"], parts["scales"], parts["amax"])

    @classmethod
    def encode(cls, rows, site):
        if not isinstance(rows, cls):
            raise TypeError(f"full guidance needs the rollout's codes, got {type(rows).__name__}")
        return rows

    def rounding_target(self, x, *, block_scale="6"):
        return self, None

    def round_rows(self, x2, amax, *, use_triton, out_dtype, capture, block_scale="6"):
        K = x2.shape[-1]
        codes, scales = self.codes.reshape(-1, K // 2), self.scales.reshape(-1, K // BLOCK_SIZE)
        if use_triton:
            from .. import triton_kernels  # Triton is optional on a CPU machine: imported when it runs

            return triton_kernels.quantize_guided(x2, scales, amax, codes, full=True, out_dtype=out_dtype, capture=capture,
                                                  block_scale=block_scale)
        return (*reference.quantize_guided(x2, scales, amax, codes=codes, block_scale=block_scale), None)

    def mismatches(self, q) -> int:
        return codeword_mismatches(q.codes, self.codes)


def codeword_mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Values whose codewords differ between packed codes `a` and `b` (-0 and +0 the same codeword); one
    numba loop on the native CPU path, the same count."""
    from .. import cpu_native

    if cpu_native.applies(b) and a.device.type == "cpu":
        from ..cpu_native.guided import codeword_mismatches as native

        return native(a, b)
    return int((codewords(a) != codewords(b)).sum())
