"""Launchers of the sparse guide's Triton kernels (source in `triton_jit.py`): the encoder's payload bits,
and the decoder's syndromes and staged flip-pattern search.

CUDA tensors run the compiled kernels, CPU tensors the same source under the Triton interpreter (slow:
seconds per launch; what the tests check bit for bit against the torch reference). The torch steps
left around the kernels are the ones both paths share: the candidates (torch.topk: its tie order is
the reference's by construction) and their cost bounds (torch.cumsum, whose CPU accumulator is float64),
so the kernels see the very inputs the reference's search sees.
"""

from pathlib import Path

import torch
import triton

from ...format import BLOCK_SIZE
from ...triton_kernels import kernel_source
from . import search
from .parity import columns
from .rates import Rates
from .search import _patterns


_kernels = kernel_source("trace_kernels.guides.sparse", Path(__file__).with_name("triton_jit.py"), uses_helpers=False)


def _pad(n: int) -> int:
    return max(2, triton.next_power_of_2(max(n, 1)))


def encode_bits(codes: torch.Tensor, scales: torch.Tensor, key: torch.Tensor | None, rates: Rates, a_bits: int,
                seg: int) -> torch.Tensor:
    """uint8 [R, row bits], one 0/1 per payload bit, in the payload's order: the amax coset bits (`key`
    int64 [R], its low `a_bits`), then per segment its scale syndrome (or raw scale LSBs) and code syndrome.
    codes: uint8 [R, K // 2]; scales: uint8 [R, K // 16]."""
    R, K = codes.shape[0], codes.shape[1] * 2
    S, bps = K // seg, seg // BLOCK_SIZE
    m_s, m_c = rates.scale_bits, rates.code_bits
    row_bits = a_bits + S * (m_s + m_c)
    out = torch.empty(R * row_bits, dtype=torch.uint8, device=codes.device)
    if R == 0 or row_bits == 0:
        return out.reshape(R, row_bits)
    dev = codes.device
    ccol = columns(m_c, seg, 2, dev) if m_c else torch.zeros(seg, dtype=torch.int64, device=dev)
    scol = columns(m_s, bps, 1, dev) if 0 < m_s < bps else torch.zeros(bps, dtype=torch.int64, device=dev)
    key = key.contiguous() if key is not None else torch.zeros(R, dtype=torch.int64, device=dev)
    work = (1 << 18) if dev.type != "cuda" else 4096  # elements of the [rows, seg / 2, m_c] count tile
    block_r = max(1, min(triton.next_power_of_2(R), work // (seg // 2 * _pad(m_c))))
    _kernels(codes)._encode_bits_kernel[(triton.cdiv(R, block_r), S)](
        codes.contiguous(), scales.contiguous(), key, ccol, scol, out,
        R, K, row_bits, a_bits, m_s, m_c,
        SEG=seg, BPS=bps, A_PAD=_pad(a_bits), MS_PAD=_pad(bps), MC_PAD=_pad(m_c), SCALE_RAW=m_s == bps,
        BLOCK_R=block_r,
    )
    return out.reshape(R, row_bits)


def syndrome(bits: torch.Tensor, m: int, salt: int) -> torch.Tensor:
    """parity.syndrome on the kernel: H @ bits over GF(2) for 0/1 rows [N, n] -> int64 [N]."""
    N, n = bits.shape
    out = torch.zeros(N, dtype=torch.int64, device=bits.device)
    if N == 0 or n == 0 or m == 0:
        return out
    work = (1 << 18) if bits.device.type != "cuda" else 4096  # elements of the [rows, n, m] count tile
    block = max(1, min(triton.next_power_of_2(N), work // (_pad(n) * _pad(m))))
    _kernels(bits)._syndrome_kernel[(triton.cdiv(N, block),)](
        bits.contiguous(), columns(m, n, salt, bits.device), out, N, n, N_PAD=_pad(n), M_PAD=_pad(m), BLOCK_N=block)
    return out


_TABLES: dict = {}


def _table(C: int, W: int, device):
    """(bool [P, C] patterns, int32 [P] their bit masks, int32 [P] their sizes): search._patterns' table."""
    key = (C, W, str(device))
    if key not in _TABLES:
        pats = _patterns(C, W, device)
        weights = torch.ones(C, dtype=torch.int64, device=device) << torch.arange(C, device=device)
        _TABLES[key] = (pats, (pats.to(torch.int64) * weights).sum(-1).to(torch.int32), pats.sum(-1).to(torch.int32))
    return _TABLES[key]


def _search(residual, cols, cost, candidates, max_flips):
    """search._search with the pattern search on the kernel: same (flips, resolved, cost)."""
    R, n = cost.shape
    dev = cost.device
    C = min(candidates, n)
    W = min(max_flips, C)
    c_cost, c_idx = torch.topk(cost, C, dim=-1, largest=False)
    flips_c = torch.zeros(R, C, dtype=torch.bool, device=dev)
    ok = residual == 0
    total = torch.where(ok, 0.0, torch.inf).to(torch.float32)
    todo = torch.nonzero(~ok).flatten()
    if todo.numel() and W:
        c_cols = torch.gather(cols, 1, c_idx)[todo].contiguous()
        bound = torch.cumsum(c_cost, dim=-1)[todo].contiguous()
        pats, masks, sizes = _table(C, W, dev)
        N, P = todo.numel(), masks.numel()
        idx = torch.empty(N, dtype=torch.int32, device=dev)
        cst = torch.empty(N, dtype=torch.float32, device=dev)
        cuda = dev.type == "cuda"
        block_p = min(triton.next_power_of_2(P), 256 if cuda else 1024)
        block_n = max(1, min(triton.next_power_of_2(N), 16 if cuda else 65536 // block_p))
        _kernels(cost)._search_kernel[(triton.cdiv(N, block_n),)](
            residual[todo].contiguous(), c_cols, c_cost[todo].contiguous(), bound, masks, sizes, idx, cst, N, P,
            C=C, W=W, W_PAD=_pad(W + 1), BLOCK_N=block_n, BLOCK_P=block_p,
        )
        found = idx >= 0
        flips_c[todo] = pats[idx.clamp(min=0).long()] & found[:, None]
        ok[todo] = torch.isfinite(cst)
        total[todo] = cst
    flips = torch.zeros(R, n, dtype=torch.bool, device=dev)
    flips.scatter_(1, c_idx, flips_c)
    return flips, ok, total


def decode_bits(residual, cols, cost, wide: bool = True, check: bool = False, widths=None):
    """search.decode_bits on the kernels: the same flips, resolved flags and pattern costs (`widths`:
    the wide search's (flips, candidates), as search.decode_bits)."""
    return search.decode_bits(residual, cols, cost, wide, check,
                              search_fn=lambda *a, wide_stage=False: _search(*a), widths=widths)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K // 8] from 0/1 ints [R, K], LSB first: the packed mantissa bits the guided-rounding
    kernel reads (compact guidance's layout)."""
    R, K = bits.shape
    w = torch.ones(8, dtype=torch.int32, device=bits.device) << torch.arange(8, device=bits.device, dtype=torch.int32)
    return (bits.reshape(R, K // 8, 8).to(torch.int32) * w).sum(-1).to(torch.uint8)


__all__ = ["decode_bits", "encode_bits", "pack_bits", "syndrome"]
