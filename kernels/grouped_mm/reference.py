"""Torch backend of the NVFP4 grouped GEMM: the reference the Triton kernel equals bit for bit.

Arithmetic (the same in `triton_jit.py`, step for step):
  1. A rows are quantized with the contract (`trace_kernels.reference.quantize`, global amax per row).
     Quantization is row-local, so quantizing each source row once and gathering it is the same as
     quantizing it on load for every expert that uses it.
  2. Operands are decoded WITHOUT their global scales: value = e2m1(code) * e4m3(block scale).
     These are exact in fp16 and fp32 (<= 6 significant bits, magnitudes 2^-10 .. 2688); a NaN block
     scale (0x7F) decodes to NaN.
  3. Per 16-element K block kb: p[kb] = sum_j a[m, 16 kb + j] * w[n, 16 kb + j] in fp32. It is exact
     in any order: a block's products are all multiples of s_a * s_w / 4 with |p| <= 2304 * s_a * s_w,
     i.e. at most 20 significant bits.
  4. acc = 0; acc = acc + p[0]; acc = acc + p[1]; ... in fp32, in increasing kb (the one fixed K order).
  5. Epilogue: out = acc * (g_dec_a[row] * g_dec_w[expert]), fp32.
No resident dequantized weight: each expert's W is decoded inside the loop and dropped.

Shapes (M = rows sorted by expert, Ra = source rows of A, E experts, W is [E, N, K]):
  a [Ra, K] float, a_amax fp32 [Ra], a_rows int64 [M] or None (identity), offs int32 [E] cumulative
  w_codes uint8 [E, N, K/2], w_scales uint8 [E, N, K/16], w_amax fp32 [E]  ->  out fp32 [M, N]
"""

import torch

from .. import reference as contract
from ..format import BLOCK_SIZE, E2M1_GRID

_F32 = torch.float32


def _tables(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(byte -> two signed E2M1 values [256, 2], E4M3 byte -> value [256] with NaN for 0x7F/0xFF)."""
    grid = torch.tensor(E2M1_GRID, dtype=_F32, device=device)
    nibble = torch.cat((grid, -grid))  # code = sign << 3 | magnitude index; -0.0 for code 8
    b = torch.arange(256, device=device)
    pairs = torch.stack((nibble[b & 0xF], nibble[b >> 4]), dim=-1)
    scales = contract.decode_e4m3(b)
    return pairs, scales


_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def decode_operand(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Step 2: packed codes [R, K/2] + scale bytes [R, K/16] -> fp32 [R, K] = e2m1 * e4m3 (no global)."""
    dev = codes.device
    if dev not in _TABLES:
        _TABLES[dev] = _tables(dev)
    pairs, scale_values = _TABLES[dev]
    R, K = codes.shape[0], codes.shape[1] * 2
    vals = pairs[codes.long()].reshape(R, K // BLOCK_SIZE, BLOCK_SIZE)  # [R, KB, 16]
    return (vals * scale_values[scales.long()][..., None]).reshape(R, K)


def block_sequential_mm(a_val: torch.Tensor, w_val: torch.Tensor) -> torch.Tensor:
    """Steps 3-4: a_val [n, K] x w_val [N, K]^T with exact per-block partials summed in kb order."""
    n, K = a_val.shape
    N = w_val.shape[0]
    KB = K // BLOCK_SIZE
    # [KB, n, 16] @ [KB, 16, N] -> [KB, n, N]: one exact partial per K block
    partial = torch.bmm(a_val.reshape(n, KB, BLOCK_SIZE).transpose(0, 1), w_val.reshape(N, KB, BLOCK_SIZE).permute(1, 2, 0))
    acc = torch.zeros((n, N), dtype=_F32, device=a_val.device)
    for kb in range(KB):
        acc.add_(partial[kb])
    return acc


def grouped_mm(
    a: torch.Tensor,
    a_amax: torch.Tensor,
    a_rows: torch.Tensor | None,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_amax: torch.Tensor,
    offs: torch.Tensor,
    capture: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """See the module docstring. `capture` = (dest row per sorted row int64 [M] (-1: none), codes out
    uint8 [Rc, K/2], scales out uint8 [Rc, K/16]): the A codes of sorted row m go to row dest[m]."""
    E, N = w_codes.shape[0], w_codes.shape[1]
    M = a_rows.shape[0] if a_rows is not None else a.shape[0]
    out = torch.empty((M, N), dtype=_F32, device=a.device)
    a_codes, a_scales = contract.quantize(a.to(_F32), a_amax)  # [Ra, K/2], [Ra, K/16]
    if capture is not None:
        dest, cap_codes, cap_scales = capture
        keep = dest >= 0
        src = a_rows[keep] if a_rows is not None else torch.nonzero(keep).flatten()
        cap_codes[dest[keep]] = a_codes[src]
        cap_scales[dest[keep]] = a_scales[src]
    if M == 0:
        return out
    a_val = decode_operand(a_codes, a_scales)  # [Ra, K]
    _, g_dec_a = contract.global_scales(a_amax)  # [Ra]
    _, g_dec_w = contract.global_scales(w_amax)  # [E]
    ends = offs.tolist()  # host sync: fine on the CPU (the Triton path needs none)
    start = 0
    for e in range(E):
        end = ends[e]
        if end == start:
            continue
        rows = a_rows[start:end] if a_rows is not None else torch.arange(start, end, device=a.device)
        w_val = decode_operand(w_codes[e], w_scales[e])  # [N, K], this expert only
        acc = block_sequential_mm(a_val[rows], w_val)  # [n, N]
        out[start:end] = acc * (g_dec_a[rows] * g_dec_w[e])[:, None]
        start = end
    return out
