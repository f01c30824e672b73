"""TraceConfig.bf16_layers: the BF16 boundary layers, as a config and in records (no engine)."""

import pytest

from record_factory import SHAPE, captured_builder
from trace_kernels import RecordError, TraceConfig


def test_bf16_layers_are_unguided_and_unquantized_there_only():
    c = TraceConfig(guidance="full", guided_layers="all", bf16_layers=[3, 0, 3])
    assert c.bf16_layers == (0, 3)
    assert c.layer_modes(4) == [None, "full", "full", None]
    assert c.for_layer(1) is c
    b = c.for_layer(3)
    assert (b.quantize_expert_weights, b.quantize_expert_inputs, b.quantize_kv) == (False, False, False)
    assert b.guidance == "full" and b.bf16_layers == (0, 3)


def test_the_default_serialises_as_before_and_old_configs_read_the_same():
    assert "bf16_layers" not in TraceConfig().to_dict()  # records of the default config are byte-identical
    old = {"quant_method": "trace_fp4", "guidance": "compact", "guided_layers": "deeper_half"}
    assert TraceConfig.from_dict(old) == TraceConfig(guidance="compact", guided_layers="deeper_half")
    c = TraceConfig(bf16_layers=[1])
    assert TraceConfig.from_dict(c.to_dict()) == c and c.to_dict()["bf16_layers"] == [1]


@pytest.mark.parametrize("kwargs,needle", [
    ({"bf16_layers": [-1]}, "bf16_layers must be non-negative"),
    ({"bf16_layers": "first"}, "bf16_layers must be a list"),
    ({"bf16_layers": [2], "full_layers": [2, 3]}, "in both full_layers and bf16_layers"),
])
def test_bad_bf16_layers_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        TraceConfig(**kwargs)


def test_a_layer_the_model_lacks_is_refused_and_static_scales_skip_bf16_layers():
    with pytest.raises(ValueError, match=r"bf16_layers names \[4\]"):
        TraceConfig(bf16_layers=[4]).check_layers(4)
    amax = {f"{i}.{s}": 1.0 for i in (1, 2, 3) for s in ("moe_fc1_in", "moe_fc2_in", "k", "v")}
    TraceConfig(activation_scale="static", static_activation_amax=amax, bf16_layers=[0]).check_layers(4)
    with pytest.raises(ValueError, match="no entry for 0.moe_fc1_in"):
        TraceConfig(activation_scale="static", static_activation_amax=amax).check_layers(4)


def test_records_hold_no_site_rows_for_bf16_layers_and_a_mismatch_is_refused():
    config = TraceConfig(guidance="full", guided_layers="all", bf16_layers=[0, 3])
    record = captured_builder(config).build()
    assert record.modes == (None, "full", "full", None)
    layers_with_rows = {int(n.split(".")[1]) for n in record.tensors if n.split(".")[2] in ("moe_fc1_in", "moe_fc2_in", "k", "v")}
    assert layers_with_rows == {1, 2}, sorted(record.tensors)
    assert "layer.0.routed_experts" in record.tensors  # routing is still recorded: the trainer replays it
    record.check_compatible(SHAPE, config)
    with pytest.raises(RecordError, match=r"bf16_layers: record \[0, 3\] vs expected None"):
        record.check_compatible(SHAPE, TraceConfig(guidance="full", guided_layers="all"))
