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
  5. Epilogue: out = acc * (g_dec_a[row] * g_dec_w[expert]), fp32; then, when the experts have a bias
     (gpt-oss), out = out + bias[expert] as a separate fp32 add (fp32 [E, N]; the bias is not
     quantized: it never enters the FP4 dot, as in HF's and vLLM's `x @ W + b`).
No resident dequantized weight: W is decoded inside each call (all experts at once for small layers,
one expert at a time above BATCHED_DECODE_MAX elements) and dropped.

Shapes (M = rows sorted by expert, Ra = source rows of A, E experts, W is [E, N, K]):
  a [Ra, K] float, a_amax fp32 [Ra], a_rows int64 [M] or None (identity), offs int32 [E] cumulative
  w_codes uint8 [E, N, K/2], w_scales uint8 [E, N, K/16], w_amax fp32 [E], bias fp32 [E, N] or None
  ->  out fp32 [M, N]
"""

import torch

from .. import reference as contract
from ..format import BLOCK_SIZE, E2M1_GRID, FLT_MAX

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


def tables(device) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode tables of `device`, built once."""
    if device not in _TABLES:
        _TABLES[device] = _tables(device)
    return _TABLES[device]


def decode_operand(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Step 2: packed codes [R, K/2] + scale bytes [R, K/16] -> fp32 [R, K] = e2m1 * e4m3 (no global)."""
    return decode_with(codes, scales, *tables(codes.device))


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """`trace_kernels.reference.dequantize` in a few table lookups (the packed KV cache's read runs it
    for every layer call): the signed E2M1 values from the byte table, times the same block multiplier
    `e4m3(scale) * g_dec` the reference forms, in the same order. Bit-identical, NaN scales included
    (tests/kernels/test_cpu_compiled.py runs every code and scale byte)."""
    pairs, scale_values = tables(codes.device)
    R, K = codes.shape[0], codes.shape[1] * 2
    _, g_dec = contract.global_scales(amax)
    block_mult = scale_values[scales.long()] * g_dec[:, None]
    vals = pairs[codes.long()].reshape(R, K // BLOCK_SIZE, BLOCK_SIZE)
    return (vals * block_mult[..., None]).reshape(R, K)


def decode_with(codes, scales, pairs, scale_values) -> torch.Tensor:
    """`decode_operand` with its tables passed in (the form the compiled path compiles)."""
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


def quantize_rows(x: torch.Tensor, amax: torch.Tensor, block_scale: str = "6") -> tuple[torch.Tensor, torch.Tensor]:
    """`trace_kernels.reference.quantize` in fewer torch ops (the CPU engine path runs it twice per
    MoE layer and forward): the same float32 steps, with Python float32-representable scalars instead
    of constant tensors, `torch.round` (half to even, exact here: s * 512 < 8 is exact) for the
    subnormal E4M3 scales, and the E2M1 decision points counted with two `bucketize` calls (ties down
    at 0.25, 1.25, 2.5, 5: boundaries strictly below; ties up at 0.75, 1.75, 3.5: boundaries at or
    below). Bit-identical: tested against the contract on adversarial rows (tests/kernels/test_grouped_mm.py)."""
    if block_scale != "6":  # 4over6: the contract's own two-candidate selection
        return contract.quantize(x, amax, block_scale)
    R, K = x.shape
    xb = x.to(_F32).reshape(R, K // BLOCK_SIZE, BLOCK_SIZE)  # [R, KB, 16]
    g_enc, g_dec = contract.global_scales(amax)  # step 1, [R]
    # step 2: s = amax_b * (g_enc * fp32(1/6)), clamped to [0, 448]; NaN (bad blocks) -> 0
    s = (xb.abs().amax(-1) * (g_enc * _SIXTH)[:, None]).clamp_(max=448.0).nan_to_num_(nan=0.0)
    bits = s.view(torch.int32)
    rounded = (bits + (0x7FFFF + ((bits >> 20) & 1))) & ~0xFFFFF
    is_normal = s >= 2.0**-6
    q = torch.round(s * 512.0)
    s_value = torch.where(is_normal, rounded.view(_F32), q * 2.0**-9)
    scale_byte = torch.where(is_normal, (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 0x7), q.to(torch.int32))
    # step 3: y = clamp(x * min(1 / (s * g_dec), FLT_MAX), -6, 6)
    enc = torch.reciprocal(s_value * g_dec[:, None]).clamp_(max=FLT_MAX)
    y = (xb * enc[..., None]).clamp_(-6.0, 6.0)
    dev = y.device
    if dev not in _MIDS:
        _MIDS[dev] = (torch.tensor([0.25, 1.25, 2.5, 5.0], device=dev), torch.tensor([0.75, 1.75, 3.5], device=dev))
    return _finish_rows(xb, amax, y, scale_byte, *_MIDS[dev])


def _finish_rows(xb, amax, y, scale_byte, down, up):
    """Step 4 and the bad-block rule of `quantize_rows`."""
    a = y.abs()
    idx = (torch.bucketize(a, down, right=False) + torch.bucketize(a, up, right=True)).to(torch.int32)  # step 4
    return contract._finish(y, idx, contract._bad_blocks(xb, amax), scale_byte)


_SIXTH = torch.tensor(1.0 / 6.0, dtype=_F32).item()  # fp32(1/6) as a Python float: exact in float32
_MIDS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
# Above this many weight elements per layer the experts are decoded one at a time (bounded transient
# memory); below it all at once (fewer ops). Same bits either way.
BATCHED_DECODE_MAX = 1 << 22


def grouped_mm(
    a: torch.Tensor,
    a_amax: torch.Tensor,
    a_rows: torch.Tensor | None,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_amax: torch.Tensor,
    offs: torch.Tensor,
    capture: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    bias: torch.Tensor | None = None,
    block_scale: str = "6",
    compiled: bool = False,
) -> torch.Tensor:
    """See the module docstring (`block_scale`: the A quantization's rule and both global scales;
    `compiled`: run the pieces compiled (cpu_compiled.py, default rule only), same bits). `capture` = (dest row per sorted row int64 [M] (-1: none), codes out
    uint8 [Rc, K/2], scales out uint8 [Rc, K/16]): the A codes of sorted row m go to row dest[m]."""
    E, N, K = w_codes.shape[0], w_codes.shape[1], w_codes.shape[2] * 2
    KB = K // BLOCK_SIZE
    M = a_rows.shape[0] if a_rows is not None else a.shape[0]
    dev = a.device
    if compiled:
        from .. import cpu_compiled

        a_codes, a_scales, a_val = cpu_compiled.piece("grouped_mm_quantize_a", _quantize_decode_a)(a, a_amax, *tables(dev))
    else:
        a_codes, a_scales = quantize_rows(a, a_amax, block_scale)  # [Ra, K/2], [Ra, K/16]
    if capture is not None:
        dest, cap_codes, cap_scales = capture
        keep = dest >= 0
        src = a_rows[keep] if a_rows is not None else torch.nonzero(keep).flatten()
        cap_codes[dest[keep]] = a_codes[src]
        cap_scales[dest[keep]] = a_scales[src]
    if M == 0:
        return torch.empty((0, N), dtype=_F32, device=dev)
    if not compiled:
        a_val = decode_operand(a_codes, a_scales)  # [Ra, K]
    if a_rows is not None:
        a_val, a_amax = a_val[a_rows], a_amax[a_rows]  # [M, K], [M]
    _, g_dec_a = contract.global_scales(a_amax, block_scale)  # [M]
    _, g_dec_w = contract.global_scales(w_amax, block_scale)  # [E]
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))  # [E]
    if E * N * K > BATCHED_DECODE_MAX:
        if compiled:
            from .. import cpu_compiled

            cpu_compiled.count_eager("grouped_mm_per_expert")
        out = _per_expert(a_val, g_dec_a, w_codes, w_scales, g_dec_w, counts.tolist())
        return out if bias is None else out + bias[torch.repeat_interleave(torch.arange(E, device=dev), counts, output_size=M)]
    # All experts at once: rows padded to the largest expert group (host sync: fine on the CPU).
    cmax = int(counts.max())
    e_of = torch.repeat_interleave(torch.arange(E, device=dev), counts, output_size=M)  # [M] expert of each row
    pos = torch.arange(M, device=dev) - (offs.to(torch.int64) - counts)[e_of]  # [M] row within its expert
    if compiled:
        from .. import cpu_compiled

        out = cpu_compiled.piece("grouped_mm_batched", _batched)(
            a_val, g_dec_a, g_dec_w, e_of, pos, w_codes, w_scales, cmax, *tables(dev))
        return out if bias is None else out + bias[e_of]
    return _batched(a_val, g_dec_a, g_dec_w, e_of, pos, w_codes, w_scales, cmax, *tables(dev),
                    bias=bias)


def _quantize_decode_a(a, a_amax, pairs, scale_values):
    """Step 1 and 2 for A in one piece (the compiled path's): codes, scales and decoded values."""
    codes, scales = quantize_rows(a, a_amax)
    return codes, scales, decode_with(codes, scales, pairs, scale_values)


def _batched(a_val, g_dec_a, g_dec_w, e_of, pos, w_codes, w_scales, cmax, pairs, scale_values, bias=None):
    """Steps 2-5 with every expert at once, rows padded to the largest group `cmax`."""
    E, N, K = w_codes.shape[0], w_codes.shape[1], w_codes.shape[2] * 2
    KB, M, dev = K // BLOCK_SIZE, a_val.shape[0], a_val.device
    a_pad = a_val.new_zeros((E, cmax, KB, BLOCK_SIZE))
    a_pad[e_of, pos] = a_val.view(M, KB, BLOCK_SIZE)
    w_val = decode_with(w_codes.view(E * N, K // 2), w_scales.view(E * N, KB), pairs, scale_values).view(E, N, KB, BLOCK_SIZE)
    # [E * KB, cmax, 16] @ [E * KB, 16, N] -> [E, KB, cmax, N]: the exact block partials
    partial = torch.bmm(
        a_pad.permute(0, 2, 1, 3).reshape(E * KB, cmax, BLOCK_SIZE),
        w_val.permute(0, 2, 3, 1).reshape(E * KB, BLOCK_SIZE, N),
    ).view(E, KB, cmax, N)
    acc = torch.zeros((E, cmax, N), dtype=_F32, device=dev)
    for kb in range(KB):  # the fixed K order
        acc.add_(partial[:, kb])
    out = acc[e_of, pos] * (g_dec_a * g_dec_w[e_of])[:, None]
    return out if bias is None else out + bias[e_of]  # step 5's bias: a separate fp32 add


def _per_expert(a_val, g_dec_a, w_codes, w_scales, g_dec_w, counts) -> torch.Tensor:
    """The same computation one expert at a time (each expert's W decoded inside the loop)."""
    M, N = a_val.shape[0], w_codes.shape[1]
    out = torch.empty((M, N), dtype=_F32, device=a_val.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            w_val = decode_operand(w_codes[e], w_scales[e])  # [N, K], this expert only
            acc = block_sequential_mm(a_val[start : start + n], w_val)  # [n, N]
            out[start : start + n] = acc * (g_dec_a[start : start + n] * g_dec_w[e])[:, None]
        start += n
    return out
