"""How far the audit can be off, from where the mismatches really are.

The audit draws whole token rows (about 1% per record, layer and site), so its sampling unit is a row,
not a value. A binomial error over the audited values assumes the mismatched values are spread
independently; they are not: a wrong syndrome pattern flips 2-4 values of one segment, a wrong amax a
whole row, and a few tokens hold most of a site's residual. align knows the true mismatches of every
row (it holds the full records), so it can give the audit's real sampling error (stratified sampling of
rows without replacement: one stratum per record, layer and site) and the chance that an audit of
this size sees no mismatch at all.
"""

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Stratum:
    """One record's rows of one (layer, site): the true mismatched values per token row, and the rows
    the record's audit drew."""

    row_mismatches: torch.Tensor  # int64 [T]
    audited: torch.Tensor  # int64 [n]: token rows
    values_per_row: int
    fraction: float  # the audit fraction the rows were drawn with


@dataclass
class AuditStrata:
    strata: list[Stratum] = field(default_factory=list)

    def add(self, row_mismatches: torch.Tensor, audited: torch.Tensor, values_per_row: int, fraction: float) -> None:
        self.strata.append(Stratum(row_mismatches.to(torch.int64).cpu(), audited.to(torch.int64).cpu(), values_per_row,
                                   fraction))


def _p_none(T: int, bad: int, fraction: float) -> float:
    """P(an audit of T rows draws none of `bad` rows): n = floor(fT + u), u uniform, drawn without
    replacement, as audit.audit_rows draws them."""
    base = math.floor(fraction * T)
    p_up = fraction * T - base
    out = 0.0
    for n, p in ((base, 1 - p_up), (min(base + 1, T), p_up)):
        if p > 0:
            out += p * (math.comb(T - bad, n) / math.comb(T, n) if n <= T - bad else 0.0)
    return out


def summarize(s: AuditStrata) -> dict:
    """The audit's expected count, its design-based standard deviation (rows drawn without
    replacement within each stratum), the chance it sees nothing, and whether the rows the audit drew
    hold exactly the mismatches the trainer counted there (`true_mismatch_at_audited_rows`)."""
    expected = var = at_audited = values = 0.0
    p_zero = 1.0
    bad_rows = rows = 0
    for st in s.strata:
        m = st.row_mismatches.to(torch.float64)
        T, n = m.numel(), st.audited.numel()
        rows += T
        bad_rows += int((m > 0).sum())
        values += n * st.values_per_row
        at_audited += float(m[st.audited].sum()) if n else 0.0
        expected += st.fraction * float(m.sum())
        if T > 1:
            nf = st.fraction * T  # the expected number of audited rows
            var += nf * (1 - nf / T) * float(m.var(unbiased=True))
        p_zero *= _p_none(T, int((m > 0).sum()), st.fraction)
    return {
        "audited_values": values,
        "true_mismatch_at_audited_rows": at_audited,
        "expected_audit_mismatch": expected,
        "audit_mismatch_sd": math.sqrt(var),
        "p_audit_sees_none": p_zero,
        "rows": rows,
        "rows_with_mismatch": bad_rows,
    }
