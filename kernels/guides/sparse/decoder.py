"""Trainer side: the rollout's NVFP4 rows from a sparse guide and the trainer's own values.

The trainer rounds its own values, then takes, per segment, the cheapest flips of its bits that explain
the sent syndromes (search.py); the row amax is list-decoded among the members of the sent coset.
"""

import math
from dataclasses import dataclass

import torch

from ... import cpu_compiled, reference
from ...backend import resolve_backend
from ...errors import SparseError
from ...format import BLOCK_SIZE, E2M1_MIDPOINTS, E4M3_MAX, FLT_MAX
from ...tensor import NVFP4Tensor
from .bits import bits_to_int
from .header import amax_key, check_header, header_groups, uniform_header
from .parity import columns, matrix, syndrome, syndrome_with
from .rates import Rates, segment
from . import dispatch
from .search import decode_bits, wide_search_for

# A flip costs its distance to the midpoint plus this: a small price per flip, so that among patterns of
# about the same distance the one with fewer flips wins (part of the decode's numerics: changing it
# changes which pattern some segments take).
FLIP_OFFSET = 0.006
AMAX_LIST = 1  # amax candidates tried besides the nearest coset member: this many on either side
AMAX_PRIOR = 0.05  # cost per bf16 ulp between a candidate amax and the trainer's own (ties go to the nearest)


@dataclass
class DecodeReport:
    rows: int = 0
    segments: int = 0
    unresolved_code_segments: int = 0  # no pattern of <= MAX_FLIPS flips explains the code syndrome
    unresolved_scale_segments: int = 0
    code_flips: int = 0  # mantissa bits the decode changed from the trainer's own rounding
    scale_flips: int = 0  # block scales the decode moved across an E4M3 boundary
    amax_list_rows: int = 0  # rows whose amax is not the coset member nearest the trainer's own (list decode)

    def add(self, other: "DecodeReport") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def _unrounded_scales(xb: torch.Tensor, g_enc: torch.Tensor) -> torch.Tensor:
    """The block scales before their E4M3 rounding (the second step of the NVFP4 quantization)."""
    amax_b = xb.abs().amax(-1)
    s = amax_b * (g_enc[:, None] * torch.tensor(1.0 / 6.0, dtype=torch.float32, device=xb.device))
    s = torch.minimum(s, torch.tensor(FLT_MAX, dtype=torch.float32, device=xb.device))
    return torch.nan_to_num(torch.clamp(s, -E4M3_MAX, E4M3_MAX), nan=0.0)


def _scale_flip_costs(s: torch.Tensor, byte: torch.Tensor, value: torch.Tensor):
    """For each block: the byte across the nearest E4M3 rounding boundary and the relative distance to it."""
    up = torch.clamp(byte + 1, max=0x7E)
    down = torch.clamp(byte - 1, min=0)
    v_up, v_down = reference.decode_e4m3(up), reference.decode_e4m3(down)
    d_up = torch.where(up != byte, ((value + v_up) / 2 - s).abs(), torch.inf)
    d_down = torch.where(down != byte, (s - (value + v_down) / 2).abs(), torch.inf)
    other = torch.where(d_up <= d_down, up, down)
    cost = torch.minimum(d_up, d_down) / torch.clamp(s, min=1e-30)
    return other, cost


def code_flip_costs(a: torch.Tensor) -> torch.Tensor:
    """Distance of |y| to its nearest E2M1 rounding midpoint (grid units): the cost of flipping its bit."""
    mids = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float32, device=a.device)
    dist = (a[..., None] - mids).abs()
    cost, which = dist.min(-1)
    cost = cost + FLIP_OFFSET
    k, k_up = reference.grid_neighbours(a)
    return torch.where(k == k_up, torch.inf, cost)  # on the grid (or saturated): nothing to flip to


@dataclass
class _Hypothesis:
    """The decode of some rows under one amax per row: what the row would become, and what it cost."""

    scales: torch.Tensor  # uint8 [R, nb]
    bits: torch.Tensor  # int64 [R, K]: mantissa bits
    cost: torch.Tensor  # float32 [R]: summed cost of every flip the row needed (inf: a segment unresolved)
    code_unresolved: torch.Tensor  # int64 [R]: segments per row
    scale_unresolved: torch.Tensor
    code_flips: torch.Tensor
    scale_flips: torch.Tensor


def _ops(triton: bool):
    """(syndrome, decode_bits): the torch reference's, or the same steps on the Triton kernels."""
    if triton:
        from . import triton_launch

        return triton_launch.syndrome, triton_launch.decode_bits
    return syndrome, decode_bits


def _decode_rows(xb, amax, mbits, ssyn, rates: Rates, seg: int, wide: bool = True, triton: bool = False,
                 compiled: bool = False, block_scale: str = "6", four=None) -> _Hypothesis:
    """Scales then codes of rows `xb` [R, nb, 16] for the given float32 amax [R] (the NVFP4 steps
    with the trainer's values, then the cheapest flips that explain the syndromes). `wide`: give the
    segments the first search leaves unresolved the wider one (off for the amax list's alternatives:
    a wide search explains almost any syndrome, so it would not tell a wrong amax from the right one)."""
    R, nb, _ = xb.shape
    K, dev = nb * BLOCK_SIZE, xb.device
    S, bps = K // seg, seg // BLOCK_SIZE
    m_s, m_c = rates.scale_bits, rates.code_bits
    syndrome_of, search = _ops(triton)
    # block scales: own rounding, then the cheapest LSB flips that explain each segment's syndrome
    g_dec, byte, other, cost = cpu_compiled.piece_or_eager("sparse_decode_scales", _scale_stage, compiled)(xb, amax, four, block_scale)
    scale_unresolved = torch.zeros(R, dtype=torch.int64, device=dev)
    if m_s == bps:  # every LSB was sent: take whichever neighbour has it
        flips = ((byte & 1).reshape(R * S, bps) != ssyn).reshape(R, nb)
        scost = torch.where(flips, cost, 0.0).sum(-1)
        if rates.check:  # a check-only site: a disagreeing LSB is counted, not followed
            scale_unresolved = flips.reshape(R, S, bps).any(-1).sum(-1)
            flips = torch.zeros_like(flips)
    elif m_s == 0:
        flips = torch.zeros(R, nb, dtype=torch.bool, device=dev)
        scost = torch.zeros(R, device=dev)
    else:
        cols = columns(m_s, bps, 1, dev)
        residual = bits_to_int(ssyn[:, :m_s]) ^ syndrome_of((byte & 1).reshape(R * S, bps), m_s, 1)
        flips, ok, total = search(residual, cols.expand(R * S, bps), cost.reshape(R * S, bps), wide, rates.check)
        flips = flips.reshape(R, nb)
        scale_unresolved = (~ok).reshape(R, S).sum(-1)
        scost = torch.where(ok, total, 0.0).reshape(R, S).sum(-1)
    byte = torch.where(flips, other, byte)
    scales = byte.to(torch.uint8)
    # codes: own rounding with those scales, then the cheapest mantissa-bit flips
    cols, h, weights = matrix(m_c, seg, 2, dev) if m_c else (columns(m_c, seg, 2, dev), None, None)
    own_bits, flip_costs, own_syn = cpu_compiled.piece_or_eager("sparse_decode_codes", _code_stage, compiled)(
        xb, scales, g_dec, seg, None if triton else h, weights)
    if triton and m_c:  # the syndrome on the kernel
        own_syn = syndrome_of(own_bits, m_c, 2)
    residual = mbits ^ own_syn
    cflips, ok, total = search(residual, cols.expand(R * S, seg), flip_costs, wide, rates.check,
                               widths=wide_search_for(m_c, seg))
    code_unresolved = (~ok).reshape(R, S).sum(-1)
    ccost = torch.where(ok, total, 0.0).reshape(R, S).sum(-1)
    cost = torch.where((code_unresolved + scale_unresolved) > 0, torch.inf, scost + ccost)
    return _Hypothesis(scales, (own_bits ^ cflips.to(torch.int64)).reshape(R, K), cost, code_unresolved,
                       scale_unresolved, cflips.reshape(R, K).sum(-1), flips.sum(-1))


def _scale_stage(xb, amax, four=None, block_scale: str = "6"):
    """The trainer's own block scales of rows `xb` under `amax`, and for each block the byte across its
    nearest E4M3 boundary with the relative cost of moving there: (g_dec, byte int64, other, cost).
    `four`: 4over6 only, the blocks whose rollout took the 4-candidate (their choice bits)."""
    g_enc, g_dec = reference.global_scales(amax, block_scale)
    s = _unrounded_scales(xb, g_enc)
    if four is not None:
        s = torch.where(four, reference.four_scales(s), s)
    byte, value = reference.round_to_e4m3(s)
    byte = byte.to(torch.int64)
    other, cost = _scale_flip_costs(s, byte, value)
    return g_dec, byte, other, cost


def _code_stage(xb, scales, g_dec, seg: int, h, weights):
    """The trainer's own mantissa bits under `scales` (per segment of `seg`), their flip costs and the
    code syndrome of those bits (H^T `h` and bit `weights`; None: no code bits, syndrome 0)."""
    R, nb, _ = xb.shape
    y = reference._scaled(xb, reference.decode_e4m3(scales), g_dec).reshape(R * nb * BLOCK_SIZE // seg, seg)
    a = y.abs()
    own_bits = (reference.e2m1_index(a) & 1).to(torch.int64)
    syn = torch.zeros(a.shape[0], dtype=torch.int64, device=a.device) if h is None else syndrome_with(own_bits, h, weights)
    return own_bits, code_flip_costs(a), syn


def _pick(best: _Hypothesis, other: _Hypothesis, rows: torch.Tensor, take: torch.Tensor) -> None:
    """Replace, in place, best's rows `rows[take]` with other's rows `take` (other covers `rows` only)."""
    idx = rows[take]
    for name in best.__dataclass_fields__:
        getattr(best, name)[idx] = getattr(other, name)[take]


def _decode_groups(guide, x, report, backend, block_scale, _values, groups) -> NVFP4Tensor:
    """decode of rows whose headers differ (header.header_groups): each group of rows decoded alone, the
    results put back in row order; the report counts every group's rows."""
    lead, K = x.shape[:-1], x.shape[-1]
    R = math.prod(lead)
    rows = guide.map_rows(lambda t: t.reshape(R, *t.shape[len(lead):]))
    xr = x.reshape(R, K)
    codes = scales = amax = values = None
    for idx in groups:
        part = [] if _values is not None else None
        q = decode(rows[idx], xr[idx], report, backend, block_scale=block_scale, _values=part)
        if codes is None:
            codes = q.codes.new_empty((R, K // 2))
            scales = q.scales.new_empty((R, K // BLOCK_SIZE))
            amax = q.global_amax.new_empty((R,))
            values = x.new_empty((R, K)) if _values is not None else None
        codes[idx], scales[idx], amax[idx] = q.codes, q.scales, q.global_amax
        if values is not None:
            values[idx] = part[0] if part else q.dequantize(x.dtype, block_scale=block_scale)
    if values is not None:
        _values.append(values.reshape(x.shape))
    return NVFP4Tensor(codes.reshape(*lead, K // 2), scales.reshape(*lead, K // BLOCK_SIZE), amax.reshape(lead))


def decode_dequantized(guide, x: torch.Tensor, report: DecodeReport | None = None, backend: str = "auto", *,
                       block_scale: str = "6", rtn_out: list | None = None):
    """`decode` and the decode's values in x's dtype (`dequantize(q, x.dtype)`): what a trainer site needs,
    since the decode already is x's guided rounding. The native path computes both in one pass.
    `rtn_out` (a list): where the native decode ran (one header group, the "6" block scale), the trainer's
    own round-to-nearest of x under each row's own amax, `quantize(x, row_amax(x))`'s NVFP4Tensor, made in
    the same pass, is appended; otherwise the list stays empty and the caller rounds x itself."""
    values = []
    q = decode(guide, x, report, backend, block_scale=block_scale, _values=values, _rtn=rtn_out)
    return q, (values[0] if values else q.dequantize(x.dtype, block_scale=block_scale))


_NATIVE = None  # cpu_native/sparse_decode.py once imported (it imports numba: not at this module's import)


def _native():
    global _NATIVE
    from ...cpu_native import sparse_decode

    _NATIVE = sparse_decode
    return _NATIVE


def decode(guide, x: torch.Tensor, report: DecodeReport | None = None, backend: str = "auto", *,
           block_scale: str = "6", _values: list | None = None, _rtn: list | None = None) -> NVFP4Tensor:
    """The rollout's NVFP4 rows as far as `x` (the trainer's values, shape `guide.shape`) and the sparse
    guide determine them. Segments the search cannot resolve keep the trainer's own rounding (counted
    in `report`). Vectorized over rows and segments; no per-element Python loops.

    The row amax is list-decoded: the member of the sent coset nearest the trainer's own amax, and the
    AMAX_LIST next members on either side, each decoded in full; a row takes the one whose scales and
    codes need the cheapest flips (plus AMAX_PRIOR per ulp from its own amax). A wrong amax moves every
    value of the row by a percent or more, so its syndromes need many costly flips or none fits: that is
    what tells them apart, and it lets a few coset bits cover amax moves well beyond their window.

    `backend`: "triton" runs the syndromes, the flip search and the final guided rounding on the Triton
    kernels (triton_launch.py; "auto" picks them for CUDA rows), bit-identical to "torch"."""
    if tuple(guide.shape) != tuple(x.shape):
        raise ValueError(f"sparse guide covers shape {tuple(guide.shape)} but x has shape {tuple(x.shape)}")
    report = report if report is not None else DecodeReport()
    lead, K = x.shape[:-1], x.shape[-1]
    R, nb, dev = math.prod(lead), K // BLOCK_SIZE, x.device
    seg = segment(K)
    S, bps = K // seg, seg // BLOCK_SIZE
    if R == 0:
        z = torch.zeros(*lead, K // 2, dtype=torch.uint8, device=dev)
        return NVFP4Tensor(z, torch.zeros(*lead, nb, dtype=torch.uint8, device=dev), torch.zeros(lead, device=dev))
    header = guide.row_header
    if header.dim() != 1:
        header = header.reshape(R)
    if header.dtype != torch.int64:
        header = header.to(torch.int64)
    plan = uniform_header(header, K)  # check_header's answer, or None: rows whose headers differ
    if plan is None:  # rows of records whose headers differ: each group on its own
        return _decode_groups(guide, x, report, backend, block_scale, _values, header_groups(header))
    shift, rates, static = plan
    if rates.choice != (block_scale == "4over6"):
        raise SparseError(f"sparse guide rows {'carry' if rates.choice else 'carry no'} 4over6 choice bits but the "
                          f"trainer's block_scale is {block_scale!r}")
    # decided once for this decoder's stages (search.py's flip search reads the env var itself); the
    # compiled pieces implement the default block scale, so 4over6 resolves to torch, counted
    chosen = resolve_backend(backend, dev, block_scale)
    tri = chosen == "triton" and dispatch.use_triton(backend, dev, "decode")
    if chosen == "native":  # the whole decode in one numba call, bit-identical (cpu_native/sparse_decode.py)
        native = _NATIVE or _native()
        with_rtn = _rtn is not None and block_scale == "6"
        out, why = native.decode(guide, x, report, rates, shift, static, header, block_scale, _values is not None,
                                 with_rtn)
        if out is not None:
            report.rows += R
            report.segments += R * S
            codes, scales, amax = out[:3]
            flat = len(lead) == 1  # the kernel's [R, ...] outputs already have x's leading shape: no reshapes
            if _values is not None:
                _values.append(out[3] if flat else out[3].reshape(x.shape))
            if with_rtn:
                rc, rs, ra = out[-1]
                _rtn.append(NVFP4Tensor(rc, rs, ra) if flat else
                            NVFP4Tensor(rc.reshape(*lead, K // 2), rs.reshape(*lead, nb), ra.reshape(lead)))
            if flat:
                return NVFP4Tensor(codes, scales, amax)
            return NVFP4Tensor(codes.reshape(*lead, K // 2), scales.reshape(*lead, nb), amax.reshape(lead))
        from ... import cpu_native

        chosen = cpu_native.torch_for("sparse_decode", f"first seen: {why} (cpu_native/sparse_decode.py)")
    comp = chosen == "compiled"
    xb = x.detach().reshape(R, nb, BLOCK_SIZE).to(torch.float32)
    mbits = guide.syndromes.reshape(R * S).to(torch.int64)
    both = guide.scale_syndromes.reshape(R * S, bps).to(torch.int64)
    ssyn = both & 1
    four = ((both >> 1) & 1).reshape(R, nb).bool() if rates.choice else None
    report.rows += R
    report.segments += R * S
    to_float = lambda k: (k << shift).to(torch.int32).view(torch.float32)  # noqa: E731
    if static:  # one amax, sent
        shift = 0
        key = header & 0xFFFFFFFF
        best = _decode_rows(xb, to_float(key), mbits, ssyn, rates, seg, triton=tri, compiled=comp, block_scale=block_scale,
                            four=four)
    else:  # the member of its coset nearest the trainer's own amax, then its neighbours in the coset
        key_t = amax_key(xb.abs().amax(dim=(-1, -2)), shift)
        mod = 1 << rates.amax_bits
        diff = ((header & (mod - 1)) - key_t) % mod
        diff = torch.where(diff >= (mod + 1) // 2, diff - mod, diff)
        key = torch.clamp(key_t + diff, min=0)
        best = _decode_rows(xb, to_float(key), mbits, ssyn, rates, seg, triton=tri, compiled=comp, block_scale=block_scale,
                            four=four)
        score = best.cost + AMAX_PRIOR * diff.abs()
        # Only rows whose nearest member lies at the window's edge (offset -mod/2, -mod/2 + 1 or
        # mod/2 - 1: -4, -3, +3 ulps at 3 bits) can have their amax in the next member: the others would
        # need a move of mod - 2 ulps or more (6 at 3 bits; measured moves stay within 4). A row whose
        # nearest member needed no flip at all cannot do better elsewhere (the prior grows). Check-only
        # sites take the trainer's own amax or nothing (a checksum cannot rank alternatives).
        edge = (diff <= -(mod // 2) + 1) | (diff >= mod // 2 - 1)
        rows = torch.nonzero((best.cost > 0) & edge).flatten() if not rates.check else key.new_zeros(0)
        if rows.numel() and comp:
            cpu_compiled.count_eager("amax_list")
        for j in [j for k in range(1, AMAX_LIST + 1) for j in (-k, k)] if rows.numel() else []:
            cand_diff = diff[rows] + j * mod
            cand = key_t[rows] + cand_diff
            valid = (cand >= 0) & (cand <= 0x7F7FFFFF >> shift)  # a finite float32 / bf16 amax
            seg_rows = (rows[:, None] * S + torch.arange(S, device=dev)).reshape(-1)
            h = _decode_rows(xb[rows], to_float(torch.where(valid, cand, key[rows])), mbits[seg_rows], ssyn[seg_rows],
                             rates, seg, wide=False, triton=tri, compiled=comp, block_scale=block_scale,
                             four=None if four is None else four[rows])
            cand_score = h.cost + AMAX_PRIOR * cand_diff.abs()
            take = valid & (cand_score < score[rows])
            if bool(take.any()):
                _pick(best, h, rows, take)
                key[rows[take]] = cand[take]
                score[rows[take]] = cand_score[take]
                report.amax_list_rows += int(take.sum())
    report.unresolved_code_segments += int(best.code_unresolved.sum())
    report.unresolved_scale_segments += int(best.scale_unresolved.sum())
    report.code_flips += int(best.code_flips.sum())
    report.scale_flips += int(best.scale_flips.sum())
    amax = to_float(key)
    xf = x.detach().reshape(R, K).to(torch.float32)
    if tri:
        from ... import triton_kernels
        from .triton_launch import pack_bits

        codes = triton_kernels.quantize_guided(xf, best.scales, amax, pack_bits(best.bits), full=False,
                                               block_scale=block_scale)[0]
    elif comp:
        codes, _, _ = cpu_compiled.quantize_guided(xf, best.scales, amax, mbits=best.bits)
    else:
        codes, _ = reference.quantize_guided(xf, best.scales, amax, mbits=best.bits, block_scale=block_scale)
    return NVFP4Tensor(codes.reshape(*lead, K // 2), best.scales.reshape(*lead, nb), amax.reshape(lead))
