"""The sparse guide on disk: one uint8 tensor per layer and site.

A 3-byte header (version and rates), a float32 amax when every row shares one (a static scale), then
per row its amax bits and per segment m_s + m_c bits (+ one 4over6 choice bit per block with
Rates.choice), LSB first.
"""

import functools
import math

import torch

from ...errors import SparseError
from ...format import BLOCK_SIZE
from .bits import bits_to_int, int_to_bits
from .header import check_header, make_header, parse_header
from .rates import Rates, segment

VERSION = 3  # 3 adds check-only sites (Rates.check)
CHOICE_VERSION = 4  # 4 adds 4over6 choice bits (Rates.choice); only such payloads are written as 4, so a
# default payload stays byte for byte what version 3 wrote
READABLE_VERSIONS = (2, 3, 4)  # an older payload is a version-4 one without the sections it lacks


def version_for(rates: Rates) -> int:
    return CHOICE_VERSION if rates.choice else VERSION
_HEADER = 3  # version << 4 | amax bits; m_s | static << 3 | (shift == 16) << 4 | check << 5; m_c
_STATIC = 4  # float32 amax after the header when static


def row_bits(K: int, rates: Rates) -> int:
    seg = segment(K)
    return rates.amax_bits + (K // seg) * (rates.scale_bits + rates.code_bits + rates.choice * (seg // BLOCK_SIZE))


def payload_bits(guide) -> int:
    """Bits on disk for a SparseGuide's rows, header included."""
    R, K = math.prod(guide.shape[:-1]), guide.shape[-1]
    if R == 0:
        return 8 * _HEADER
    _, rates, static = parse_header(int(guide.row_header.reshape(-1)[0]))
    return 8 * (_HEADER + _STATIC * static) + R * row_bits(K, rates)


def pack(guide) -> torch.Tensor:
    """uint8 [n]: the header (and a static amax), then per row amax bits + segments x (m_s + m_c) bits,
    LSB first."""
    K = guide.shape[-1]
    R, seg = math.prod(guide.shape[:-1]), segment(K)
    S, bps = K // seg, seg // BLOCK_SIZE
    header = guide.row_header.reshape(R).to(torch.int64).cpu()
    if R == 0:
        return torch.tensor([VERSION << 4, 1 << 4, 0], dtype=torch.uint8)
    shift, rates, static = check_header(header, K)
    both = guide.scale_syndromes.reshape(R, S, bps).to(torch.int64).cpu()
    ssyn = both[..., : rates.scale_bits] & 1
    csyn = int_to_bits(guide.syndromes.reshape(R, S).to(torch.int64).cpu(), rates.code_bits)
    seg_parts = [ssyn, csyn] + ([(both >> 1) & 1] if rates.choice else [])
    fields = torch.cat(
        [int_to_bits(header & ((1 << rates.amax_bits) - 1), rates.amax_bits), torch.cat(seg_parts, -1).reshape(R, -1)],
        dim=1,
    ).reshape(-1)
    fields = torch.cat([fields, torch.zeros((-fields.numel()) % 8, dtype=torch.int64)]).reshape(-1, 8)
    head = [version_for(rates) << 4 | rates.amax_bits, rates.scale_bits | int(static) << 3 | int(shift == 16) << 4 | int(rates.check) << 5
            | int(rates.choice) << 6, rates.code_bits]
    parts = [torch.tensor(head, dtype=torch.uint8)]
    if static:
        parts.append(torch.tensor([int(header[0]) & 0xFFFFFFFF], dtype=torch.int64).to(torch.int32).view(torch.uint8))
    parts.append(bits_to_int(fields).to(torch.uint8))
    return torch.cat(parts)


def _plan(blob: torch.Tensor, lead: tuple, K: int):
    """A payload's header read and checked against rows `lead` x K: (R, S, nb, bps, off, nbits, rates,
    static, shift); SparseError names what does not fit."""
    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1:
        raise SparseError(f"sparse payload must be a 1-D uint8 tensor, got {getattr(blob, 'dtype', type(blob))}")
    if blob.numel() < _HEADER:
        raise SparseError(f"sparse payload of {blob.numel()} bytes is shorter than its {_HEADER}-byte header")
    # (numpy for a host payload: a trainer's step plans every payload of every record, layer and site)
    head = (blob.numpy() if blob.device.type == "cpu" else blob)[:_HEADER].tolist()
    return _plan_of(tuple(head), blob.numel(), tuple(int(n) for n in lead), K)


@functools.lru_cache(maxsize=1024)
def _plan_of(head: tuple, numel: int, lead: tuple, K: int):
    """_plan's plan from the payload's header bytes and length alone, kept: a trainer's step plans every
    payload of every record, layer and site (64 here), and they share a handful of (header, length, rows)
    combinations; a refusal is raised again each time (lru_cache keeps results only)."""
    head = list(head)
    R, seg, nb = math.prod(lead), segment(K), K // BLOCK_SIZE
    S, bps = K // seg, seg // BLOCK_SIZE
    version, amax_bits = head[0] >> 4, head[0] & 0xF
    m_s, static, shift, m_c = head[1] & 0x7, (head[1] >> 3) & 1, 16 * ((head[1] >> 4) & 1), head[2]
    check = bool((head[1] >> 5) & 1)
    choice = bool((head[1] >> 6) & 1)
    if version not in READABLE_VERSIONS or head[1] >> 7 or (check and version < 3) or (choice and version < 4):
        raise SparseError(f"sparse payload header {head}: version {version}, this trace-fp4 reads versions {READABLE_VERSIONS}")
    rates = Rates(amax_bits, m_s, m_c, check, choice)  # raises SparseError when out of range
    if m_s > bps or (static and amax_bits):
        raise SparseError(f"sparse payload header {head}: rates do not fit segments of {seg}")
    off = _HEADER + _STATIC * static
    need = off + (R * row_bits(K, rates) + 7) // 8
    if numel != need:
        raise SparseError(f"sparse payload has {numel} bytes; {R} rows of K={K} need {need}")
    return R, S, nb, bps, off, row_bits(K, rates), rates, bool(static), shift


def _static_low(blob: torch.Tensor, off: int) -> torch.Tensor:
    """The static amax's float32 bits (after the header) as an int64 tensor of one element."""
    return blob[_HEADER:off].clone().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def unpack_fields(blob: torch.Tensor, lead: tuple, K: int):
    """Inverse of `pack` for rows of shape `lead` x K: the SparseGuide's fields; SparseError names what
    does not fit."""
    R, S, nb, bps, off, nbits, rates, static, shift = _plan(blob, lead, K)
    amax_bits, m_s, m_c, choice = rates.amax_bits, rates.scale_bits, rates.code_bits, rates.choice
    if static:
        low_static = _static_low(blob, off)
    from ... import cpu_native

    if cpu_native.applies(blob):  # one numba loop over the bit stream, same fields (cpu_native/sparse_wire.py)
        from ...cpu_native.sparse_wire import unpack

        header_bits = make_header(0, shift, rates, static)  # a Python int: no tensor op per payload
        csyn, ssyn, header = unpack(blob, off, R, nbits, rates, S, bps, header_bits,
                                    int(low_static) if static else 0)
        return csyn.reshape(*lead, S), ssyn.reshape(*lead, nb), header.reshape(lead)
    bits = int_to_bits(blob[off:].to(torch.int64), 8).reshape(-1)[: R * nbits].reshape(R, nbits)
    if static:
        low = low_static.expand(R)
    else:
        low = bits_to_int(bits[:, :amax_bits])
    per_seg = bits[:, amax_bits:].reshape(R, S, m_s + m_c + choice * bps)
    ssyn = torch.zeros(R, S, bps, dtype=torch.uint8)
    ssyn[..., :m_s] = per_seg[..., :m_s].to(torch.uint8)
    if choice:
        ssyn |= (per_seg[..., m_s + m_c:] << 1).to(torch.uint8)
    csyn = bits_to_int(per_seg[..., m_s : m_s + m_c])
    header = make_header(low, shift, rates, static)
    return csyn.reshape(*lead, S), ssyn.reshape(*lead, nb), header.reshape(lead)


def unpack_fields_many(blobs: list, leads: list, K: int, where=None):
    """The fields of several payloads of one site (rows `leads[i]` x K each, e.g. every record of a
    micro-batch), concatenated along the first row dimension: what `unpack_fields` of each, then
    torch.cat, gives. On the native path one numba call unpacks them all (a trainer's batch has a
    payload per record, layer and site). `where(i)`: a name for payload i, put in front of its
    SparseError's message (each payload's header is checked as unpack_fields checks it)."""
    from ... import cpu_native

    # cpu_native.applies of every payload, the environment read once
    if len(blobs) < 2 or not cpu_native.enabled() or not all(isinstance(b, torch.Tensor) and b.device.type == "cpu" for b in blobs):
        parts = [_named(i, where, unpack_fields, b, lead, K) for i, (b, lead) in enumerate(zip(blobs, leads))]
        return tuple(torch.cat(f) for f in zip(*parts))
    plans = [_named(i, where, _plan, b, lead, K) for i, (b, lead) in enumerate(zip(blobs, leads))]
    csyn, ssyn, header = unpack_planned(blobs, plans)
    inner = tuple(leads[0][1:])
    S, nb = plans[0][1], plans[0][2]
    return csyn.reshape(-1, *inner, S), ssyn.reshape(-1, *inner, nb), header.reshape(-1, *inner)


def unpack_planned(blobs: list, plans: list):
    """The native unpack of payloads already checked and planned (`_plan` of each; rows split alike):
    (code syndromes, scale syndromes, row headers), every payload's rows in order, flat along the
    rows. One numba call for all of them (unpack_fields_many, records/site_batch.py)."""
    from ...cpu_native.sparse_wire import unpack_many

    return unpack_many(blobs, plans, [make_header(0, p[8], p[6], p[7]) for p in plans],
                       [int(_static_low(b, p[4])) if p[7] else 0 for b, p in zip(blobs, plans)])


def payload_rates(blob: torch.Tensor) -> Rates:
    """The rates a packed payload was encoded with (its header), without decoding it."""
    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1 or blob.numel() < _HEADER:
        raise SparseError("sparse payload must be a 1-D uint8 tensor of at least its header")
    head = blob[:_HEADER].tolist()
    return Rates(head[0] & 0xF, head[1] & 0x7, head[2], bool((head[1] >> 5) & 1), bool((head[1] >> 6) & 1))


def _named(i, where, fn, *args):
    """fn(*args), its SparseError prefixed with payload i's name (`where(i)`), so a refusal in a batch of
    payloads says which record it came from."""
    try:
        return fn(*args)
    except SparseError as e:
        raise SparseError(f"{where(i)}: {e}" if where else str(e)) from None
