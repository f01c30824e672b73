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
    def __init__(self, sites):
        self.sites, self.sparse_by_site = sites, {}


def _model_outcome(config, need, n=20000, density=0.03):
    """The residual a decode leaves where each code bit halves the wrong patterns: a site needing
    `need[site]` bits leaves 2**(need - bits) * 4 mismatches per 1000 RTN flips below that rate."""
    sites = {}
    for layer in range(SHAPE.num_layers):
        for site in SHAPE.layer_sites(layer):
            K = SHAPE.row_shape(site)[-1]
            r = layer_rates(config, layer, site, K)
            rtn = int(density * n)
            miss = 0 if r.check else int(rtn * 0.004 * 2.0 ** (need.get(f"{layer}.{site}", 0) - r.code_bits))
            sites[(layer, site)] = SiteCounts(elements=n, mismatched=miss, rtn_mismatched=rtn)
    return _Outcome(sites)


def test_calibration_passes_converge_below_the_target_and_only_where_the_data_asks():
    need = {"2.moe_fc1_in": 22, "3.moe_fc1_in": 24, "3.k": 15}  # bits beyond the defaults at three sites
    runs = []

    def recompute(config):
        runs.append(config)
        return _model_outcome(config, need)

    first = _model_outcome(SPARSE, need)
    assert not rc.below_target(first)
    config, last, passes = rc.calibrate(SPARSE, first, SHAPE, recompute, max_passes=4)
    assert rc.below_target(last) and len(passes) == len(runs) <= 3
    assert set(config.sparse_rates) == set(need)  # the other sites keep their rates
    assert all(p["kept"] for p in passes) and config.rates_version == len(passes)
    assert passes[-1]["mismatch_removed_vs_rtn"] >= 1 - rc.STOP_SHARE


def test_a_pass_that_leaves_more_mismatches_is_not_kept():
    base = _model_outcome(SPARSE, {"3.moe_fc1_in": 22})

    def worse(config):  # more syndrome bits, more segments the search cannot reach
        out = _model_outcome(SPARSE, {"3.moe_fc1_in": 22})
        out.sites[(3, "moe_fc1_in")].mismatched *= 2
        return out

    config, last, passes = rc.calibrate(SPARSE, base, SHAPE, worse)
    assert config is SPARSE and last is base
    assert len(passes) == 1 and passes[0]["kept"] is False
