"""Launcher of the Triton grouped GEMM (source in `triton_jit.py`).

CUDA tensors run the compiled kernel; CPU tensors run the same source under the Triton interpreter.
The interpreted copy is imported like `trace_kernels.triton_kernels` does it (TRITON_INTERPRET=1 only
while that import runs), with `trace_kernels.triton_jit` pointing at the helpers' interpreted copy
for the duration, so the kernel calls interpreted helpers (an interpreted kernel cannot call
compiled-mode jit functions).

No host synchronisation: the grid is (cdiv(M, BLOCK_M) + E, cdiv(N, BLOCK_N)), an upper bound of the
tiles any split of M rows over E experts needs; programs without a tile return at once. So the launch
can be captured in a CUDA graph.
"""

from pathlib import Path

import torch
import triton

from .. import triton_kernels
from ..format import check_block_scale

_kernels = triton_kernels.kernel_source("trace_kernels.grouped_mm", Path(__file__).with_name("triton_jit.py"))


def _tiles(M: int, N: int, cuda: bool) -> tuple[int, int]:
    if cuda:
        block_m = 16 if M <= 16 * 64 else 64  # decode: few rows per expert
        return block_m, 64 if N <= 1024 or M <= 1024 else 128
    # Interpreted programs cost per launch: as large as the data allows.
    return max(16, min(triton.next_power_of_2(max(M, 1)), 64)), max(16, min(triton.next_power_of_2(N), 256))


def grouped_mm(a, a_amax, a_rows, w_codes, w_scales, w_amax, offs, capture, bias=None, block_scale="6") -> torch.Tensor:
    """Same arguments and result as `reference.grouped_mm`."""
    E, N, K = w_codes.shape[0], w_codes.shape[1], w_codes.shape[2] * 2
    M = a_rows.shape[0] if a_rows is not None else a.shape[0]
    dev = a.device
    out = torch.empty((M, N), dtype=torch.float32, device=dev)
    if M == 0 or N == 0:
        return out
    cuda = dev.type == "cuda"
    block_m, block_n = _tiles(M, N, cuda)
    grid = (triton.cdiv(M, block_m) + E, triton.cdiv(N, block_n))
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    dest, cap_codes, cap_scales = capture if capture is not None else (dummy, dummy, dummy)
    _kernels(a)._grouped_mm_kernel[grid](
        a.contiguous(), a_rows.contiguous() if a_rows is not None else dummy, a_amax.contiguous(),
        w_codes, w_scales, w_amax,
        offs.contiguous(),
        out,
        dest, cap_codes, cap_scales,
        bias.contiguous() if bias is not None else dummy,
        N, K, E,
        GATHER=a_rows is not None, CAPTURE=capture is not None, BIAS=bias is not None, PTX_ADD=cuda,
        BLOCK_M=block_m, BLOCK_N=block_n, FOUR6=check_block_scale(block_scale),
    )
    return out
