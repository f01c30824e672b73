"""Sparse guidance: send only what the trainer cannot work out from its own values.

Once every earlier site is guided, the trainer's value x_t of a captured element is the rollout's x_r
plus a little noise, so its own rounding already agrees with the rollout's code on ~98% of the
elements, and the disagreements sit where x_t lies near a rounding midpoint (codes) or an E4M3
rounding boundary (block scales), or where the row amax moved by a bf16 ulp or two. The record sends,
per row (one global amax; self-contained, so rows can travel through Megatron's token dispatcher),
split into segments of 64 elements (or 32 / 16 where the row is shorter):

  amax      the low `amax_bits` bits of the rollout's amax (as a bf16 bit pattern when it is one): a coset
            index. The trainer takes the member of that coset nearest its own amax (exact while the two
            differ by -2**(b-1) .. 2**(b-1) - 1 ulps) and, where that member sits at the window's edge
            and its decode needs flips, also decodes the next members on either side (decoder.AMAX_LIST)
            and keeps the cheapest (list decoding; counted in `DecodeReport.amax_list_rows`). A site
            whose rows share one amax (static scale) sends it once instead.
  scales    per segment an m_s-bit syndrome H_s @ lsb(scale bytes) over GF(2) (adjacent E4M3 bytes differ
            in their LSB; every LSB when m_s equals the segment's number of blocks).
  codes     per segment an m_c-bit syndrome H_c @ mantissa bits (adjacent E2M1 codewords differ in it).

This is syndrome (Slepian-Wolf) coding: the trainer computes its own bits b_t, so H @ b_t xor the sent
syndrome is H @ e, the syndrome of its error pattern e. It then takes the cheapest e with that syndrome
among patterns of a few flips of its candidate positions (the elements nearest a midpoint; a flip's
cost is the distance to the midpoint), and flips those bits (search.py). H (parity.py) has distinct
non-zero columns and, at rates of 2q bits or more, the rows of a binary BCH code of distance 5. The
encoder (codec.py) needs only the rollout's codes, scales and amax: a full record can be re-encoded,
and the rate is fixed per site (rates.py; no counts to send). On disk: wire.py. Triton kernels of the encode and
the decode (triton_jit.py, launched by triton_launch.py, bit-identical to the torch steps) run where
dispatch.py picks them: `backend="auto"` is Triton for CUDA rows.

What the trainer cannot resolve is counted, never hidden: `DecodeReport.unresolved_*_segments` (no
pattern searched explains the syndrome: the trainer keeps its own rounding there), per site, for codes
and scales. A wrong pattern with the right syndrome (rate 2**-m_c per cheaper pattern) is not
detectable by the trainer; the align job measures it against full records (residual mismatch).
Check-only sites (`Rates.check`): where the trainer's values are the rollout's by construction
(moe_fc2_in), the syndromes are a checksum with no search; a disagreeing segment is counted
unresolved, not corrected.
"""

import torch

from ...errors import SparseError
from ...tensor import NVFP4Tensor
from .decoder import DecodeReport
from .guide import SparseGuide
from .rates import DEFAULT_RATES, SITE_RATES, Rates, rates_for, segment, with_choice
from .wire import payload_bits, row_bits
from . import decoder as _decoder
from . import wire as _wire


def encode(q, site: str | None = None, rates: Rates | None = None, *, block_scale: str = "6") -> SparseGuide:
    """Sparse guide rows from the rollout's rows of `site`: full (codes, scales, amax) or compact
    (mantissa bits, scales, amax) will do, since the syndromes are of the mantissa bits and scale LSBs.
    With `block_scale="4over6"` the rows also carry each block's choice (full rows only)."""
    if block_scale != "6":
        rates = with_choice(rates or rates_for(site, q.shape[-1]), block_scale)
    return SparseGuide.encode(q, site, rates)


def decode(guide: SparseGuide, x: torch.Tensor, report: DecodeReport | None = None, backend: str = "auto", *,
           block_scale: str = "6") -> NVFP4Tensor:
    """The rollout's NVFP4 rows as far as `x` (the trainer's values) and the sparse guide determine them
    (decoder.py); segments the search cannot resolve keep the trainer's own rounding, counted in `report`."""
    if not isinstance(guide, SparseGuide):
        raise TypeError(f"guide must be a SparseGuide, got {type(guide).__name__}")
    return _decoder.decode(guide, x, report, backend, block_scale=block_scale)


def pack(guide: SparseGuide) -> torch.Tensor:
    """uint8 [n]: the record tensor of these rows (wire.py)."""
    return _wire.pack(guide)


def unpack(blob: torch.Tensor, lead: tuple, K: int) -> SparseGuide:
    """Inverse of `pack` for rows of shape `lead` x K; SparseError names what does not fit."""
    return SparseGuide(*_wire.unpack_fields(blob, lead, K))


__all__ = [
    "DEFAULT_RATES", "DecodeReport", "Rates", "SITE_RATES", "SparseError", "SparseGuide", "decode", "encode",
    "pack", "payload_bits", "rates_for", "row_bits", "segment", "unpack",
]
