"""SparseGuide: the in-memory rows of a sparse record, fixed width per row, so the row code written for
every Guide (select, concatenate, slot-gather, ship through the dispatcher) works on it unchanged."""

from dataclasses import dataclass

import torch

from ...format import BLOCK_SIZE
from ..base import Guide
from . import codec, decoder, wire
from .rates import segment


@dataclass(frozen=True)
class SparseGuide(Guide):
    """Sparse guidance rows `[..., K]`.

    syndromes:       int64 `[..., K // seg]`: the code syndrome of each segment (m_c bits)
    scale_syndromes: uint8 `[..., K // 16]`: per segment, its m_s scale-syndrome bits in its first
                     block slots (bit 0); with 4over6 (Rates.choice) each block's choice bit in bit 1
    row_header:      int64 `[...]`: amax coset (or, static, the amax's float32 bits), shift, rates,
                     static flag (header.py)
    """

    syndromes: torch.Tensor
    scale_syndromes: torch.Tensor
    row_header: torch.Tensor

    encoding = "sparse"
    serves = ("sparse",)
    packed_routing = True
    whole_rows = True  # syndromes cover whole segments of a row

    def fields(self):
        return self.syndromes, self.scale_syndromes, self.row_header

    def nbytes(self) -> int:
        """Bytes on disk for these rows (header included)."""
        return (wire.payload_bits(self) + 7) // 8

    @classmethod
    def row_fields(cls, K: int):
        return ((K // segment(K),), torch.int64), ((K // BLOCK_SIZE,), torch.uint8), ((), torch.int64)

    @classmethod
    def record_layout(cls, lead: tuple, K: int):
        return {"sparse": (None, torch.uint8)}

    def record_parts(self):
        return {"sparse": wire.pack(self)}

    @classmethod
    def from_record_parts(cls, parts, lead, K):
        return cls(*wire.unpack_fields(parts["sparse"], lead, K))

    @classmethod
    def encode(cls, rows, site, rates=None):
        return cls(*codec.encode_fields(rows, site, rates))

    def rounding_target(self, x, *, block_scale="6"):
        report = decoder.DecodeReport()
        return decoder.decode(self, x, report, block_scale=block_scale), report

    def rounding_target_values(self, x, *, block_scale="6", rtn_out: list | None = None):
        """(decoded rows, report, their values in x's dtype): the decode already is x's guided rounding,
        so a trainer site only needs its values (decoder.decode_dequantized; `rtn_out`: see there)."""
        report = decoder.DecodeReport()
        q, values = decoder.decode_dequantized(self, x, report, block_scale=block_scale, rtn_out=rtn_out)
        return q, report, values

    def mismatches(self, q) -> int:
        raise TypeError("a sparse guide is compared after decoding: count against its rounding_target")
