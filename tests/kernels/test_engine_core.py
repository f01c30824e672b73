"""trace_kernels.engine and trace_kernels.envs on their own (no engine): what both plugins share."""

import pytest
import torch

import trace_kernels
from trace_kernels import ModelShape, TraceConfig, envs
from trace_kernels.engine import EngineCounters, WeightsIdentity, assemble_record, kv_cache_mode
from trace_kernels.weight_digest import model_digest

SHAPE = ModelShape(num_layers=2, hidden_size=32, moe_intermediate_size=16, num_experts=4, top_k=2, num_kv_heads=1, head_dim=16)


def test_env_vars_are_read_when_asked_and_bad_values_name_the_variable(monkeypatch):
    monkeypatch.delenv("TRACE_FP4_KV_CACHE", raising=False)
    assert kv_cache_mode() == "packed"
    monkeypatch.setenv("TRACE_FP4_KV_CACHE", "dequantized")
    assert kv_cache_mode() == "dequantized"
    monkeypatch.setenv("TRACE_FP4_KV_CACHE", "fp8")
    with pytest.raises(ValueError, match=r"TRACE_FP4_KV_CACHE='fp8'.*packed"):
        kv_cache_mode()
    monkeypatch.setenv("TRACE_FP4_CAPTURE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="TRACE_FP4_CAPTURE_MAX_BYTES='lots'"):
        envs.TRACE_FP4_CAPTURE_MAX_BYTES
    for raw, on in (("", False), ("0", False), ("false", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("TRACE_FP4_PREFIX_CACHING", raw)
        assert envs.TRACE_FP4_PREFIX_CACHING is on
    assert all(name.startswith("TRACE_FP4_") for name in envs.ENV_VARS)


def test_weights_identity_counts_updates_and_clears_a_named_version():
    counters = EngineCounters()
    w = WeightsIdentity(counters)
    assert w.current() == (None, None)
    w.updated(0, "a")
    w.updated(1, "b")
    assert w.current() == (0, model_digest({0: "a", 1: "b"}))
    w.set_version(7)
    assert w.current()[0] == 7
    w.changed(0, lambda: "c")  # a loader requantized layer 0: settled when next read
    w.changed(1, lambda: "d")
    assert w.current() == (1, model_digest({0: "c", 1: "d"}))
    assert counters["weights_version_override_cleared"] == 1 and counters["weights_updates_settled_lazily"] == 2


def test_assemble_record_equals_the_builder_fed_by_hand():
    config = TraceConfig(guidance="full", guided_layers="all")
    g = torch.Generator().manual_seed(0)
    chunks = []
    for n in (3, 1):
        sites = {}
        for layer in range(2):
            for site in ("moe_fc1_in", "moe_fc2_in", "k", "v"):
                x = torch.randn(n, *SHAPE.row_shape(site), generator=g)
                sites[(layer, site)] = trace_kernels.quantize(x, trace_kernels.row_amax(x))
        chunks.append(({layer: torch.randint(0, 4, (n, 2), generator=g) for layer in range(2)}, sites))
    record = assemble_record(SHAPE, config, chunks, weights=(3, "w"), identity={"num_prompt_tokens": 2})
    builder = trace_kernels.RecordBuilder(SHAPE, config, weights_version=3, weights_digest="w", num_prompt_tokens=2)
    for routing, sites in chunks:
        for layer, ids in routing.items():
            builder.add_routing(layer, ids)
        for (layer, site), q in sites.items():
            builder.add(layer, site, q)
    assert record.to_bytes() == builder.build().to_bytes()


def test_counters_snapshot_flattens_saturation():
    c = EngineCounters()
    c.count("a", 2)
    c.set_value("bytes", 5)
    c.saturation.add(0, "k", torch.tensor([[1.0, 9.0]]), torch.tensor(2.0))
    snap = c.snapshot()
    assert snap["a"] == 2 and snap["bytes"] == 5 and snap["saturated.0.k"] == 1
    c.reset()
    assert c.snapshot() == {}
