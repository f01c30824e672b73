"""Rollout side: the sparse guide's fields from the rollout's captured rows.

The encoder needs only the rollout's codes (or mantissa bits), scales and amax, no unrounded values, so a
full or compact record can be re-encoded.
"""

import math

import torch

from ... import reference
from ...errors import SparseError
from ...format import BLOCK_SIZE
from ...tensor import NVFP4Tensor
from ..compact import CompactGuide
from .bits import int_to_bits
from .header import amax_key, make_header
from .parity import syndrome
from .rates import Rates, rates_for, segment


def _rows_amax(q) -> torch.Tensor:
    R = math.prod(q.shape[:-1])
    amax = q.global_amax.to(torch.float32)
    return (amax.reshape(1).expand(R) if amax.numel() == 1 else amax.reshape(R)).contiguous()


def block_choices(q) -> torch.Tensor:
    """int64 [R, K // 16]: 1 where the rollout's block took 4over6's 4-candidate, read off its codes.

    Under the 6-candidate the block amax lands on the top grid value 6 (index 7), under the 4-candidate on
    4 (index 6): with a normal E4M3 scale the scale's rounding moves it by at most 1/16, i.e. into
    [5.65, 6.4] or [3.76, 4.27], so the largest magnitude index of a non-zero block says which. Blocks
    with a subnormal scale (block amax below ~2^-14 of the row amax) or a static amax the block exceeds
    can read wrong; the trainer then misses that block's scale, which its scale syndrome and the audit
    count (never silently)."""
    if not isinstance(q, NVFP4Tensor):
        raise SparseError("4over6 sparse guidance needs the rollout's full codes (its block choices are read off "
                          "the codes; a compact record has only mantissa bits)")
    K = q.shape[-1]
    R = math.prod(q.shape[:-1])
    mag = reference.unpack_nibbles(q.codes.reshape(R, K // 2)).to(torch.int64) & 7
    return (mag.reshape(R, K // BLOCK_SIZE, BLOCK_SIZE).amax(-1) == 6).to(torch.int64)


def encode_fields(q, site: str | None = None, rates: Rates | None = None):
    """A sparse guide's fields (code syndromes, scale syndromes, row headers) from the rollout's rows of
    `site`: full (codes, scales, amax) or compact (mantissa bits, scales, amax) will do, since the
    syndromes are of the mantissa bits and scale LSBs."""
    if not isinstance(q, (NVFP4Tensor, CompactGuide)):
        raise TypeError(f"encode needs an NVFP4Tensor or CompactGuide, got {type(q).__name__}")
    lead, K = q.shape[:-1], q.shape[-1]
    R, dev = math.prod(lead), q.scales.device
    seg, nb = segment(K), K // BLOCK_SIZE
    S, bps = K // seg, seg // BLOCK_SIZE
    rates = rates or rates_for(site, K)
    if rates.scale_bits > bps:
        raise SparseError(f"scale_bits={rates.scale_bits} exceeds the {bps} blocks of a segment of {seg}")
    amax = _rows_amax(q)
    bits = amax.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    static = R > 0 and bool((bits == bits[0]).all())
    if static:  # one amax for every row (a static / per-tensor scale): sent once, in the header
        shift, low, rates = 0, bits, Rates(0, rates.scale_bits, rates.code_bits, rates.check, rates.choice)
    else:
        shift = 16 if bool(((bits & 0xFFFF) == 0).all()) else 0
        low = amax_key(amax, shift) & ((1 << rates.amax_bits) - 1)
    lsb = q.scales.reshape(R * S, bps).to(torch.int64) & 1
    ssyn = torch.zeros(R * S, bps, dtype=torch.int64, device=dev)
    if rates.scale_bits == bps:
        ssyn = lsb
    elif rates.scale_bits:
        ssyn[:, : rates.scale_bits] = int_to_bits(syndrome(lsb, rates.scale_bits, 1), rates.scale_bits)
    if rates.choice:
        ssyn = ssyn | (block_choices(q).reshape(R * S, bps) << 1)
    if isinstance(q, NVFP4Tensor):
        mbits = reference.unpack_nibbles(q.codes.reshape(R, K // 2)).to(torch.int64) & 1
    else:
        mbits = q.unpacked_bits().reshape(R, K).to(torch.int64)
    csyn = syndrome(mbits.reshape(R * S, seg), rates.code_bits, 2)
    header = make_header(low, shift, rates, static)
    return csyn.reshape(*lead, S), ssyn.to(torch.uint8).reshape(*lead, nb), header.reshape(lead)
