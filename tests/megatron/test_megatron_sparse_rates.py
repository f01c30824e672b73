"""The rate loop in a real Megatron-Core model (CPU, world size 1): the trainer measures the audited residual
per layer and site, the controller raises the rates of sites the engine's noise flips more often than the
target allows and lowers the others, and records made with the new rates leave a lower residual."""

import pytest
import torch

pytest.importorskip("megatron.core")
import megatron_cpu as mc  # noqa: E402

mc.init_parallel()

import trace_megatron  # noqa: E402
import trace_kernels as tk  # noqa: E402
from trace_kernels.guides.sparse.controller import RateController  # noqa: E402

LENGTHS, SEQ = [16, 11], 16
# every token audited, so that a two-sample micro-batch measures each site's residual
SPARSE = tk.TraceConfig(guidance="sparse", guided_layers="all", sparse_audit=1.0)


def noisy_engine(x):
    """A second engine whose values differ from the trainer's by ~2**-6 relative noise (a function of the
    value): far more flips than the built-in rates are tuned for, at every site."""
    xf = x.float()
    noise = torch.frac(torch.sin(xf * 12345.678) * 43758.5453) - 0.5
    return (xf * (1 + 2.0**-6 * noise)).to(x.dtype)


def _run(model, layout, inputs, records):
    with torch.no_grad(), trace_megatron.capture(model, layout, records=records) as run:
        model(*inputs)
    return run


def test_the_controller_closes_the_loop_on_the_audited_residual():
    cfg = mc.tiny_config(dispatcher="alltoall", params_dtype=torch.bfloat16, bf16=True)
    model = mc.tiny_model(cfg, trace_config=SPARSE, seed=7)
    inputs = mc.padded_batch(LENGTHS, SEQ, seed=1)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    with torch.no_grad(), trace_megatron.capture(model, layout, perturb=noisy_engine) as cap:
        model(*inputs)
    before = _run(model, layout, inputs, cap.build_records(SPARSE))
    m = before.metrics()
    valid = layout.sample >= 0
    for layer in (0, 1):
        for site in ("moe_fc1_in", "moe_fc2_in", "k", "v"):  # fc2: each row meets its own routed slot
            p = f"trace/layer{layer}/{site}"
            assert m[f"{p}/audit_rows"] > 0 and m[f"{p}/audit_skipped_rows"] == 0
            # every token is audited here, so the audited residual is the true one
            theirs = tk.codewords(cap.captured(layer, site))[valid]
            ours = tk.codewords(before.captured(layer, site))[valid]
            true = float((ours != theirs).float().mean())
            assert m[f"{p}/audit_residual"] == pytest.approx(true, rel=0.05, abs=2e-4), (layer, site)
            if site == "moe_fc2_in":  # check-only: nothing is corrected, the residual is the flip density
                assert m[f"{p}/audit_rtn_flips"] == m[f"{p}/audit_residual"]
            else:
                assert m[f"{p}/audit_rtn_flips"] > m[f"{p}/audit_residual"]
    noisy = {s for s in ("moe_fc1_in", "k", "v") if m[f"trace/layer1/{s}/audit_residual"] > 1e-3}
    assert noisy, m
    ctl = RateController(target=1e-3)
    ctl.observe(m)
    config, changes = ctl.update(SPARSE, cap.build_records(SPARSE)[0].shape)
    assert config.rates_version == 1
    raised = {c["site"] for c in changes if c["to"][2] > c["from"][2]}
    assert {f"1.{s}" for s in noisy} <= raised
    assert not any(c["site"].endswith("moe_fc2_in") for c in changes)  # check-only
    records = cap.build_records(config)
    assert records[0].config.rates_version == 1
    for site in raised:
        assert records[0].rates()[site] == config.sparse_rates[site]
    after = _run(model, layout, inputs, records).metrics()
    total = lambda mm, key: sum(mm[f"trace/layer1/{s}/{key}"] for s in noisy)  # noqa: E731
    for c in changes:  # a site whose rate went down stays within the target
        if c["to"][2] < c["from"][2]:
            layer, site = c["site"].split(".")
            assert after[f"trace/layer{layer}/{site}/audit_residual"] <= 1e-3, c
    assert total(after, "audit_mismatch") < 0.9 * total(m, "audit_mismatch"), (total(after, "audit_mismatch"), total(m, "audit_mismatch"))
