"""The sparse encoder straight to the packed payload: the bytes `wire.pack(SparseGuide.encode(q))` writes,
without the in-memory guide in between (no int64 row headers to build and parse back, syndromes kept
as the parity bits the payload stores, one host sync for the amax checks). What the engine's record
builder runs; `wire.pack(codec.encode_fields(...))` stays the reference it is tested against.
"""

import math

import torch

from ... import cpu_compiled
from ...backend import resolve_backend
from ...errors import SparseError
from ...format import BLOCK_SIZE
from ...tensor import NVFP4Tensor
from ..compact import CompactGuide
from . import dispatch
from .parity import matrix
from .rates import Rates, rates_for, segment
from .wire import version_for


def _parity_bits(bits: torch.Tensor, m: int, salt: int) -> torch.Tensor:
    """uint8 [R, m]: H @ bits over GF(2), bit i in column i (the payload's LSB-first order)."""
    if m == 0:
        return bits.new_zeros(bits.shape[0], 0, dtype=torch.uint8)
    _, h, _ = matrix(m, bits.shape[1], salt, bits.device)
    return cpu_compiled.piece_or_eager("sparse_encode_parity", _parity_with, cpu_compiled.applies(bits))(bits, h)


def _parity_with(bits, h):
    return ((bits.to(torch.float32) @ h).to(torch.int32) & 1).to(torch.uint8)


def _code_parity(c, seg: int, h):
    """uint8 [R * S, m]: the code syndromes' bits of packed codes c [R, K/2] (mantissa bits = bit 0 of
    each nibble), segments of `seg`."""
    mbits = torch.stack((c & 1, (c >> 4) & 1), dim=-1).reshape(-1, seg)
    return _parity_with(mbits, h)


def encode_payload(q, site: str | None = None, rates: Rates | None = None, backend: str = "auto") -> torch.Tensor:
    """uint8 [n]: the packed sparse payload of the rollout's rows `q` (NVFP4Tensor or CompactGuide).
    `backend`: "triton" runs the syndromes on the kernel (triton_launch.encode_bits; "auto" picks it for
    CUDA rows), "torch" the matmul reference (compiled on the compiled CPU path), "native" the whole
    payload in one numba kernel (cpu_native/sparse_encode.py; "auto" picks it under
    TRACE_FP4_CPU_BACKEND=native); compact rows have no Triton kernel (a counted fallback)."""
    from . import codec, wire

    if not isinstance(q, (NVFP4Tensor, CompactGuide)):
        raise TypeError(f"encode needs an NVFP4Tensor or CompactGuide, got {type(q).__name__}")
    lead, K = q.shape[:-1], q.shape[-1]
    R = math.prod(lead)
    if R == 0:  # the fixed empty payload
        from .guide import SparseGuide

        return wire.pack(SparseGuide(*codec.encode_fields(q, site, rates)))
    seg = segment(K)
    S, bps = K // seg, seg // BLOCK_SIZE
    rates = rates or rates_for(site, K)
    if rates.scale_bits > bps:
        raise SparseError(f"scale_bits={rates.scale_bits} exceeds the {bps} blocks of a segment of {seg}")
    amax = codec._rows_amax(q)
    native = _native_payload(q, amax, K, seg, rates, backend)
    if native is not None:
        return native
    bits = amax.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    static, bf16 = (torch.stack([(bits == bits[0]).all(), ((bits & 0xFFFF) == 0).all()])).tolist()
    shift = 0 if static else (16 if bf16 else 0)
    a_bits = 0 if static else rates.amax_bits
    # The kernel writes no 4over6 choice bits yet: those rows run the reference (counted, never dropped).
    no_kernel = "compact_rows" if not isinstance(q, NVFP4Tensor) else ("4over6_choice_bits" if rates.choice else None)
    if dispatch.use_triton(backend, q.scales.device, "encode", no_kernel):
        from .triton_launch import encode_bits

        key = ((bits & 0x7FFFFFFF) >> shift) & ((1 << a_bits) - 1) if a_bits else None
        per_seg = encode_bits(q.codes.reshape(R, K // 2), q.scales.reshape(R, K // BLOCK_SIZE), key, rates, a_bits, seg)
        return _assemble(per_seg, rates, a_bits, static, shift, bits)
    lsb = (q.scales.reshape(R * S, bps) & 1)
    ssyn = lsb.to(torch.uint8) if rates.scale_bits == bps else _parity_bits(lsb, rates.scale_bits, 1)
    if isinstance(q, NVFP4Tensor) and rates.code_bits:
        c = q.codes.reshape(R, K // 2)
        _, h, _ = matrix(rates.code_bits, seg, 2, c.device)
        csyn = cpu_compiled.piece_or_eager("sparse_encode_codes", _code_parity, cpu_compiled.applies(c))(c, seg, h)
    else:
        if isinstance(q, NVFP4Tensor):
            c = q.codes.reshape(R, K // 2)
            mbits = torch.stack((c & 1, (c >> 4) & 1), dim=-1).reshape(R * S, seg)
        else:
            mbits = q.unpacked_bits().reshape(R * S, seg)
        csyn = _parity_bits(mbits, rates.code_bits, 2)
    seg_parts = [ssyn, csyn]
    if rates.choice:
        from .codec import block_choices

        seg_parts.append(block_choices(q).reshape(R * S, bps).to(torch.uint8))
    per_seg = torch.cat(seg_parts, dim=1).reshape(R, S * (rates.scale_bits + rates.code_bits + rates.choice * bps))
    if a_bits:
        key = ((bits & 0x7FFFFFFF) >> shift) & ((1 << a_bits) - 1)
        low = ((key[:, None] >> torch.arange(a_bits, device=key.device)) & 1).to(torch.uint8)
        per_seg = torch.cat([low, per_seg], dim=1)
    return _assemble(per_seg, rates, a_bits, static, shift, bits)


def _native_payload(q, amax, K: int, seg: int, rates: Rates, backend: str):
    """The payload from the numba kernel (cpu_native/sparse_encode.py) where `backend` resolves to
    "native", else None. Compact rows with 4over6 choice bits return None: the reference refuses them
    (their choices are read off full codes) with its own error."""
    if resolve_backend(backend, q.scales.device) != "native":
        return None
    full = isinstance(q, NVFP4Tensor)
    if rates.choice and not full:
        return None
    from ...cpu_native import sparse_encode

    return sparse_encode.encode_payload(q.codes if full else None, None if full else q.mbits, q.scales, amax, K, seg,
                                        rates, version_for(rates))


def _assemble(per_seg: torch.Tensor, rates: Rates, a_bits: int, static: bool, shift: int, bits: torch.Tensor):
    """The payload from every row's bits (uint8 0/1 [R, row bits]): header, static amax, packed body."""
    fields = per_seg.reshape(-1)
    pad = (-fields.numel()) % 8
    if pad:
        fields = torch.cat([fields, fields.new_zeros(pad)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32, device=fields.device)
    body = (fields.reshape(-1, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)
    head = [version_for(rates) << 4 | a_bits, rates.scale_bits | int(static) << 3 | int(shift == 16) << 4 | int(rates.check) << 5
            | int(rates.choice) << 6, rates.code_bits]
    parts = [torch.tensor(head, dtype=torch.uint8)]
    if static:
        parts.append(bits[:1].to(torch.int32).cpu().view(torch.uint8))
    parts.append(body.cpu())
    return torch.cat(parts)
