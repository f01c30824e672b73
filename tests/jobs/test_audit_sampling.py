"""The audit's sampling error (trace_fp4/audit_sampling.py): rows, not values, are what the audit draws,
so a residual crowded into few rows is often invisible to it; the summary's chance of seeing nothing and
its standard deviation must match the audit's own draws (audit.audit_rows), replayed many times."""

import math

import torch

from trace_fp4.align import _audit_summary
from trace_fp4.audit_sampling import AuditStrata, summarize
from trace_kernels.guides.sparse.audit import audit_rows


def _strata(seed: int, fraction: float, replay: int | None = None) -> AuditStrata:
    """8 records x 4 sites of 40-60 token rows; 10 rows in all hold every mismatch (8-64 values each,
    as a wrong pattern or a wrong amax leaves them). `replay`: draw the audit rows with that digest."""
    g = torch.Generator().manual_seed(seed)
    s = AuditStrata()
    bad = set(torch.randperm(32, generator=g)[:10].tolist())
    for k in range(32):
        T = 40 + k % 21
        m = torch.zeros(T, dtype=torch.int64)
        if k in bad:
            m[int(torch.randint(0, T, (1,), generator=g))] = int(torch.randint(8, 65, (1,), generator=g))
        rows = audit_rows(T, k // 4, f"site{k % 4}", fraction, token_digest=f"{replay}") if replay is not None else \
            torch.zeros(0, dtype=torch.int64)
        s.add(m, rows, 64, fraction)
    return s


def test_chance_of_seeing_nothing_and_sd_match_replayed_audits():
    fraction = 0.05
    summary = summarize(_strata(0, fraction))
    counts = []
    for replay in range(1500):
        counts.append(summarize(_strata(0, fraction, replay))["true_mismatch_at_audited_rows"])
    counts = torch.tensor(counts, dtype=torch.float64)
    p_none = float((counts == 0).double().mean())
    assert abs(p_none - summary["p_audit_sees_none"]) < 0.04, (p_none, summary["p_audit_sees_none"])
    assert abs(float(counts.mean()) - summary["expected_audit_mismatch"]) < 0.15 * summary["expected_audit_mismatch"]
    # the design-based sd (n fixed at its mean) is within 20% of the replayed one
    assert abs(float(counts.std()) - summary["audit_mismatch_sd"]) < 0.2 * summary["audit_mismatch_sd"]
    # and far above what a binomial over the audited values would claim
    values = 32 * 50 * fraction * 64
    rate = summary["expected_audit_mismatch"] / values
    assert summary["audit_mismatch_sd"] > 2 * math.sqrt(values * rate * (1 - rate))


def test_align_summary_uses_the_row_sampling_error():
    strata = _strata(1, 0.01, replay=0)
    s = summarize(strata)
    sparse = {"audit_values": s["audited_values"], "audit_mismatch": s["true_mismatch_at_audited_rows"],
              "audit_mismatch_rtn": 0.0, "audit_rows": 10.0}
    true_rate = 0.004
    out = _audit_summary(sparse, true_rate, strata)
    assert out["audit_counts_true_rows"]
    assert out["sampling_error_2sigma"] > out["sampling_error_2sigma_binomial"]
    assert out["agrees_within_sampling_error"] == (abs(out["audited_residual"] - true_rate) <= out["sampling_error_2sigma"])
    wrong = _audit_summary({**sparse, "audit_mismatch": sparse["audit_mismatch"] + 5}, true_rate, strata)
    assert not wrong["audit_counts_true_rows"]  # an audit that counted something else is caught
