"""The record checks a trainer runs every step, on their shortcuts: `check_compatible` makes its config
dicts only where the configs differ (equal configs pass without them), and an audit's rows are checked
in one pass (increasing, then the first and the last against [0, T)). Each refusal must still come, with
its message, on every way the check can fail."""

import dataclasses

import pytest
import torch

import trace_kernels as tk
from record_factory import SHAPE, captured_builder

FULL = tk.TraceConfig(guidance="full", guided_layers="all")
AUDITED = tk.TraceConfig(guidance="sparse", guided_layers="all", sparse_audit=0.25)  # ~10 audited rows of 40 tokens


def test_equal_configs_pass_rate_changes_pass_other_fields_are_refused():
    rec = captured_builder(FULL, steps=(40,)).build().reencode(AUDITED)
    rec.check_compatible(SHAPE, AUDITED)  # the same config
    rec.check_compatible(SHAPE, dataclasses.replace(AUDITED))  # an equal one, another object
    rec.check_compatible(SHAPE, None)
    rec.check_compatible(SHAPE, dataclasses.replace(AUDITED, sparse_audit=0.5))  # rates and audit may differ
    with pytest.raises(tk.RecordError, match=r"another TRACE config \(guidance: record 'sparse' vs expected 'compact'"):
        rec.check_compatible(SHAPE, dataclasses.replace(AUDITED, guidance="compact"))
    with pytest.raises(tk.RecordError, match=r"another TRACE config \(block_scale: record None vs expected '4over6'"):
        rec.check_compatible(SHAPE, dataclasses.replace(AUDITED, block_scale="4over6"))


@pytest.mark.parametrize("rows", [[-1, 2, 3], [0, 2, 40], [0, 2, 99], [3, 2, 5], [1, 1, 2], [0, 5, 4]],
                         ids=["negative-first", "last-is-T", "last-past-T", "decreasing", "repeated", "last-below"])
def test_every_bad_audit_row_list_is_refused(rows):
    rec = captured_builder(FULL, steps=(40,)).build().reencode(AUDITED)
    T = rec.num_tokens
    assert T == 40
    layer, site = 2, "v"
    blob = rec.tensors[f"layer.{layer}.{site}.audit"].clone()
    n = len(rec.audit(layer, site)[0])
    assert n >= 3, "the audit draws at least three rows here"
    blob[:12] = torch.tensor(rows, dtype=torch.int32).view(torch.uint8)
    rec.tensors[f"layer.{layer}.{site}.audit"] = blob
    with pytest.raises(tk.RecordError, match=rf"layer 2, site v: audit rows must be increasing token rows in \[0, {T}\)"):
        rec.audit(layer, site)


def test_good_audit_rows_at_both_ends_pass():
    rec = captured_builder(FULL, steps=(40,)).build().reencode(AUDITED)
    blob = rec.tensors["layer.2.v.audit"].clone()
    n = len(rec.audit(2, "v")[0])
    edge = [0] + list(range(40 - n + 1, 40))  # row 0 and row T - 1 are in range
    blob[: 4 * n] = torch.tensor(edge, dtype=torch.int32).view(torch.uint8)
    rec.tensors["layer.2.v.audit"] = blob
    assert rec.audit(2, "v")[0].tolist() == edge
