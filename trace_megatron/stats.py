"""Per-layer, per-site counters: how many rows were guided or fell back, and codeword mismatches.

A codeword is an element's sign and magnitude index; +0 and -0 are the same codeword. Block scales are
not part of the comparison (RTN uses the trainer's own scales, the record the engine's; both are counted
per element of the grid they index). Each guide encoding counts its own mismatches (`Guide.mismatches`):
a compact record keeps only each element's mantissa bit, so against it mantissa bits are compared.
"""

from dataclasses import dataclass, fields

import torch

FALLBACK_REASONS = ("no_record", "not_guided", "route_mismatch")


@dataclass
class SiteStats:
    guided_rows: int = 0
    fallback_no_record: int = 0  # padding, tokens past the record's end (e.g. the last sampled token)
    fallback_not_guided: int = 0  # the layer has no guidance in this config (e.g. compact's shallow half)
    fallback_route_mismatch: int = 0  # the token reached an expert its record did not route it to
    guided_elements: int = 0
    mismatch_rtn: int = 0  # elements where the trainer's own round-to-nearest differs from the record
    mismatch_guided: int = 0  # elements where the guided result still differs from the record
    # elements above a static activation amax (round-to-nearest saturates them), over the rows this
    # trainer quantizes: a token's moe_fc1_in row once per routed expert (top_k copies)
    saturated_values: int = 0
    # sparse guidance: what the decode could not resolve (it keeps the trainer's own rounding there)
    sparse_segments: int = 0
    sparse_unresolved_code_segments: int = 0
    sparse_unresolved_scale_segments: int = 0
    sparse_code_flips: int = 0  # mantissa bits the decode changed from the trainer's own rounding
    sparse_amax_list_rows: int = 0  # rows whose amax came from the list decode, not the nearest coset member
    # the audit (full codes of a sample of each sparse record's tokens): rows compared, their values, and
    # the values where the guided result (audit_mismatch) or the trainer's own round-to-nearest
    # (audit_mismatch_rtn: the flip density) differs from the rollout's codes; rows whose audit could not
    # be lined up with this rank's columns (tensor-parallel splits) are counted, not compared
    audit_rows: int = 0
    audit_values: int = 0
    audit_mismatch: int = 0
    audit_mismatch_rtn: int = 0
    audit_skipped_rows: int = 0
    # rows whose expert GEMM ran Megatron's BF16 path instead of the engine's exact FP4 GEMM (K split
    # over expert-TP ranks: linear_fc2 partial sums); their outputs differ from the engine's in the last bits
    expert_gemm_bf16: int = 0

    def add(self, other: "SiteStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def fallback_rows(self) -> int:
        return self.fallback_no_record + self.fallback_not_guided + self.fallback_route_mismatch

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "SiteStats":
        return cls(*(int(v) for v in t.tolist()))
