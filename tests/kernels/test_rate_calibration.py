"""Rates that follow the data (issue 27): the controller's density floor and log2 raise, the fc2 residual
charged to the fc1 codes that feed it, amax bits raised by rows with a wrong amax, the per-layer cost in
the JSON, and align's calibration passes (trace_fp4/rate_calibration.py) converging below their target."""

import dataclasses
import math

import pytest

import trace_kernels as tk
from record_factory import SHAPE, captured_builder
from trace_fp4 import rate_calibration as rc
from trace_fp4.recompute import SiteCounts
from trace_kernels.guides.sparse.controller import (REFERENCE_BITS, REFERENCE_DENSITY, RateController,
                                                    bits_per_value_change, bits_per_value_change_by_layer,
                                                    code_bits_for_density, raise_step)
from trace_kernels.guides.sparse.rates import layer_rates
from trace_kernels.guides.sparse.search import WIDE_STEPS, wide_search_for

SPARSE = tk.TraceConfig(guidance="sparse", guided_layers="all")


def _metrics(layer, site, values, mismatch, rtn, amax_rows=0, amax_row_mismatch=0):
    p = f"trace/layer{layer}/{site}"
    return {f"{p}/audit_values": values, f"{p}/audit_mismatch": mismatch, f"{p}/audit_mismatch_rtn": rtn,
            f"{p}/sparse_segments": values / 64, f"{p}/sparse_unresolved_code_segments": 0,
            f"{p}/sparse_unresolved_scale_segments": 0, f"{p}/amax_mismatch_rows": amax_rows,
            f"{p}/amax_row_mismatch": amax_row_mismatch}


def test_the_density_table_rises_with_the_density_and_meets_the_reference():
    for seg in (64, 32):
        bits = [code_bits_for_density(d / 1000, seg) for d in range(1, 200)]
        assert bits == sorted(bits) and max(bits) <= seg // 2
        assert code_bits_for_density(REFERENCE_DENSITY, seg) == REFERENCE_BITS[seg]
        assert code_bits_for_density(2 * REFERENCE_DENSITY, seg) > REFERENCE_BITS[seg]
        assert code_bits_for_density(REFERENCE_DENSITY / 3, seg) < REFERENCE_BITS[seg]


@pytest.mark.parametrize("ratio", [1.01, 1.9, 2.0, 3.0, 7.9, 15.0])
def test_a_raise_halves_the_residual_per_bit_down_to_the_target(ratio):
    step = raise_step(ratio * 1e-4, 1e-4)
    assert ratio * 2.0**-step <= 1.0 < ratio * 2.0 ** -(step - 1)  # the fewest bits that reach the target
    assert raise_step(0.5e-4, 1e-4) == 0 and raise_step(1e3, 1e-4, max_step=4) == 4


@pytest.mark.parametrize("density", [0.01, 0.03, 0.05, 0.1])
def test_a_raised_site_gets_at_least_its_densitys_rate(density):
    n = 20000
    ctl = RateController(relative_target=0.005)
    ctl.observe({**_metrics(1, "k", n, 20, density * n), **_metrics(1, "moe_fc1_in", n, 20, density * n)})
    new, changes = ctl.update(SPARSE, SHAPE)
    for c in changes:
        site = c["site"].split(".")[1]
        K = SHAPE.row_shape(site)[-1]
        assert c["to"][2] >= code_bits_for_density(density, 64 if K % 64 == 0 else 32)
        assert c["to"][2] > c["from"][2] and c["target"] == pytest.approx(min(1e-3, 0.005 * density))
    assert {c["site"] for c in changes} == {"1.k", "1.moe_fc1_in"}


def test_fc2_mismatches_raise_the_fc1_codes_that_feed_them():
    n = 20000
    ctl = RateController(relative_target=0.005)
    # fc1 decoded all but 2 values; its layer's fc2 rows (check-only) are off in 60 values: fc1's doing
    ctl.observe({**_metrics(2, "moe_fc1_in", n, 2, 0.03 * n), **_metrics(2, "moe_fc2_in", n, 60, 60),
                 **_metrics(3, "moe_fc1_in", n, 2, 0.03 * n)})
    new, changes = ctl.update(SPARSE, SHAPE)
    assert [c["site"] for c in changes] == ["2.moe_fc1_in"]  # not fc2 (check-only), not layer 3 (2 < 3 values)
    assert changes[0]["charged_from_downstream"] == 60
    assert new.sparse_rates["2.moe_fc1_in"][2] > layer_rates(SPARSE, 2, "moe_fc1_in", 64).code_bits


def test_rows_with_a_wrong_amax_raise_the_amax_bits_not_the_code_bits():
    n = 20000
    ctl = RateController(relative_target=0.005)
    ctl.observe({**_metrics(0, "v", n, 64, 0.02 * n, amax_rows=3, amax_row_mismatch=64),
                 **_metrics(1, "v", n, 64, 0.02 * n, amax_rows=1, amax_row_mismatch=20)})
    new, changes = ctl.update(SPARSE, SHAPE)
    by = {c["site"]: c for c in changes}
    assert by["0.v"]["to"] == [4, 1, 11]  # one more coset bit; the codes were right
    assert by["1.v"]["to"][0] == 3 and by["1.v"]["to"][2] > 11  # one amax row is not evidence; 44 code mismatches are


def test_the_per_layer_cost_is_the_measured_payload_growth():
    raised = dataclasses.replace(SPARSE, sparse_rates={"1.k": [3, 1, 14], "3.moe_fc1_in": [4, 3, 19]}, rates_version=1)
    per_layer = bits_per_value_change_by_layer(SPARSE, raised, SHAPE)
    assert set(per_layer) == {"1", "3"} and all(v > 0 for v in per_layer.values())
    full = captured_builder(tk.TraceConfig(guidance="full", guided_layers="all"), steps=(256,)).build()
    off = dataclasses.replace(SPARSE, sparse_audit=0.0)
    a, b = full.reencode(off), full.reencode(dataclasses.replace(raised, sparse_audit=0.0))
    values = full.num_tokens * sum(math.prod(SHAPE.row_shape(s)) for l in range(SHAPE.num_layers) for s in SHAPE.layer_sites(l))
    measured = 8 * (b.nbytes - a.nbytes) / values
    assert sum(per_layer.values()) == pytest.approx(measured, rel=0.02)
    assert bits_per_value_change(SPARSE, raised, SHAPE)["1.k"] == pytest.approx(3 / 32)


class _Outcome:
    def __init__(self, sites, sparse_by_site=None):
        self.sites, self.sparse_by_site = sites, sparse_by_site or {}


def _model_outcome(config, need, n=20000, density=0.03, stuck=None):
    """The residual a decode leaves where each code bit halves the wrong patterns: a site needing
    `need[site]` bits leaves 2**(need - bits) * 4 mismatches per 1000 RTN flips below that rate; plus, at
    a site of `stuck`, that many values in segments no search pattern explains (3 per unresolved segment)
    at any rate: what more code bits cannot fix."""
    sites, by_site = {}, {}
    for layer in range(SHAPE.num_layers):
        for site in SHAPE.layer_sites(layer):
            K = SHAPE.row_shape(site)[-1]
            r = layer_rates(config, layer, site, K)
            rtn = int(density * n)
            miss = 0 if r.check else int(rtn * 0.004 * 2.0 ** (need.get(f"{layer}.{site}", 0) - r.code_bits))
            left = (stuck or {}).get(f"{layer}.{site}", 0)
            sites[(layer, site)] = SiteCounts(elements=n, mismatched=miss + left, rtn_mismatched=rtn)
            by_site[f"layer{layer}/{site}"] = {"sparse_segments": n / 64, "sparse_unresolved_code_segments": left // 3}
    return _Outcome(sites, by_site)


def test_calibration_passes_converge_below_the_target_and_only_where_the_data_asks():
    need = {"2.moe_fc1_in": 22, "3.moe_fc1_in": 24, "3.k": 15}  # bits beyond the defaults at three sites
    runs = []

    def recompute(config):
        runs.append(config)
        return _model_outcome(config, need)

    first = _model_outcome(SPARSE, need)
    assert not rc.below_target(first)
    config, last, passes, end = rc.calibrate(SPARSE, first, SHAPE, recompute, max_passes=4)
    assert rc.below_target(last) and len(passes) == len(runs) <= 3
    assert end["stopped"].startswith("below target") and end["skipped"] is None
    assert passes[-1]["next"].startswith("stop: below target") and all(p["next"].startswith("continue") for p in passes[:-1])
    assert set(config.sparse_rates) == set(need)  # the other sites keep their rates
    assert all(p["kept"] for p in passes) and config.rates_version == len(passes)
    assert passes[-1]["mismatch_removed_vs_rtn"] >= 1 - rc.STOP_SHARE


def test_a_pass_that_leaves_more_mismatches_is_not_kept():
    base = _model_outcome(SPARSE, {"3.moe_fc1_in": 22})

    def worse(config):  # more syndrome bits, more segments the search cannot reach
        out = _model_outcome(SPARSE, {"3.moe_fc1_in": 22})
        out.sites[(3, "moe_fc1_in")].mismatched *= 2
        return out

    config, last, passes, end = rc.calibrate(SPARSE, base, SHAPE, worse)
    assert config is SPARSE and last is base
    assert len(passes) == 1 and passes[0]["kept"] is False and "not kept" in end["stopped"]


def test_a_code_raise_beyond_the_widest_search_where_segments_stay_unresolved_is_not_run():
    # 3.fc1 needs 22 bits against wrong patterns, and 60 of its values sit in segments no pattern explains
    need, stuck = {"3.moe_fc1_in": 22}, {"3.moe_fc1_in": 60}
    runs = []

    def recompute(config):
        runs.append(config)
        return _model_outcome(config, need, stuck=stuck)

    config, last, passes, end = rc.calibrate(SPARSE, _model_outcome(SPARSE, need, stuck=stuck), SHAPE, recompute,
                                             max_passes=6)
    assert not rc.below_target(last) and len(runs) == len(passes) < 6  # stopped before the passes ran out
    bits = config.sparse_rates["3.moe_fc1_in"][2]
    assert wide_search_for(bits, 64) == WIDE_STEPS[-1]  # the raises ran up to the widest search
    assert end["stopped"].startswith("predicted no gain") and passes[-1]["next"] == "stop: " + end["stopped"]
    skipped = end["skipped"]
    assert [c["site"] for c in skipped["changes"]] == ["3.moe_fc1_in"] and skipped["unresolved_code_segments"] == {"3.moe_fc1_in": 20}
    # the prediction holds in this model: the skipped rates leave the same residual
    higher = dataclasses.replace(config, sparse_rates={**config.sparse_rates, "3.moe_fc1_in": skipped["changes"][0]["to"]})
    assert rc.totals(_model_outcome(higher, need, stuck=stuck)) == rc.totals(last)


def test_a_raise_beyond_the_widest_search_runs_where_the_residual_is_wrong_patterns():
    need = {"3.moe_fc1_in": 30}  # no unresolved segment: each code bit still halves the residual

    def recompute(config):
        return _model_outcome(config, need)

    config, last, passes, end = rc.calibrate(SPARSE, _model_outcome(SPARSE, need), SHAPE, recompute, max_passes=6)
    assert end["skipped"] is None and not end["stopped"].startswith("predicted")
    assert config.sparse_rates["3.moe_fc1_in"][2] > 24 and all(p["futile_sites_run_anyway"] == [] for p in passes)


def test_only_code_raises_at_the_widest_search_with_unresolved_segments_are_futile():
    at_top = dataclasses.replace(SPARSE, sparse_rates={"3.moe_fc1_in": [3, 3, 24], "2.moe_fc1_in": [3, 3, 20]})
    out = _model_outcome(at_top, {}, stuck={"3.moe_fc1_in": 30, "2.moe_fc1_in": 30, "1.moe_fc1_in": 0})
    changes = [{"site": "3.moe_fc1_in", "from": [3, 3, 24], "to": [3, 3, 28]},  # futile
               {"site": "2.moe_fc1_in", "from": [3, 3, 20], "to": [3, 3, 24]},  # 20 bits: below the widest search
               {"site": "1.moe_fc1_in", "from": [3, 3, 16], "to": [3, 3, 20]}]  # no unresolved segment
    assert rc.futile_changes(changes, at_top, out, SHAPE) == ["3.moe_fc1_in"]
    amax_too = [{"site": "3.moe_fc1_in", "from": [3, 3, 24], "to": [4, 3, 28]}]  # a wrong amax: worth a pass
    assert rc.futile_changes(amax_too, at_top, out, SHAPE) == []
