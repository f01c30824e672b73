"""Comparing rows with a guide on the native path: the count of codewords that differ (FullGuide.mismatches),
which the trainer takes at every guided site and step (its RTN flip count beside the guided result).

Bit-identical by construction (integer compares): a codeword is the code nibble with -0 folded into +0,
as guides/full.py `codewords` defines it.
"""

import numpy as np
import torch

from . import njit


@njit
def _mismatches(a, b):
    n = 0
    for i in range(a.shape[0]):
        x = a[i]
        y = b[i]
        if x == y:
            continue
        lo_x, lo_y = x & 0xF, y & 0xF
        hi_x, hi_y = x >> 4, y >> 4
        if (lo_x & 7) == 0:
            lo_x = 0
        if (lo_y & 7) == 0:
            lo_y = 0
        if (hi_x & 7) == 0:
            hi_x = 0
        if (hi_y & 7) == 0:
            hi_y = 0
        n += (lo_x != lo_y) + (hi_x != hi_y)
    return n


def codeword_mismatches(codes_a: torch.Tensor, codes_b: torch.Tensor) -> int:
    """Elements whose codewords differ between two packed code tensors of one shape (uint8, CPU)."""
    if codes_a.shape != codes_b.shape:
        raise ValueError(f"packed codes of shapes {tuple(codes_a.shape)} and {tuple(codes_b.shape)} do not line up")
    a = codes_a.contiguous().reshape(-1).numpy()
    b = codes_b.contiguous().reshape(-1).numpy()
    return int(_mismatches(a, b)) if a.size else 0


__all__ = ["codeword_mismatches"]
