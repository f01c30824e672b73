"""The capture store's host arena commit (trace_kernels.engine.host_arena): a step's rows of every key copied
from the arrays the kernels wrote into their chunk's rows, in one kernel call.

Why: ~52 arrays a step on the tiny model (4 layers x 4 sites x codes, scales, amax, and 4 routing ids), each
a numpy slice assignment of ~3 us in the engine: ~11 ms a 16 x 64 generate, where the copy itself is ~1 MB.
Here the arrays are given as data addresses (the caller holds them alive for the call) and row sizes.
The GIL is kept (nogil=False): the copy is ~1 us, too short to gain from releasing it, and a release
lets another of the engine's threads take it before the capture thread gets it back.
"""

from numba import carray

from . import njit
from .pointers import uint8_pointer


@njit(nogil=False)
def copy_rows_kernel(src, dst, row_bytes, rows, first):
    """For each array p: its `rows` rows (row_bytes[p] bytes each) at address src[p] copied to rows
    [first, first + rows) of the array at address dst[p] (a byte-for-byte copy)."""
    for p in range(src.shape[0]):
        n = rows * row_bytes[p]
        s = carray(uint8_pointer(src[p]), (n,))
        d = carray(uint8_pointer(dst[p] + first * row_bytes[p]), (n,))
        for i in range(n):
            d[i] = s[i]
