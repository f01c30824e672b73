"""Unsupported configurations fail at engine start with an error that names the problem."""

import pytest

from vllm_helpers import make_llm, tiny_dense, tiny_moe, with_quant_config


def test_unknown_config_key():
    model = with_quant_config(tiny_moe(), "moe_badkey", {"quant_method": "trace_fp4", "guidence": "full"})
    with pytest.raises(Exception, match=r"unknown TraceConfig key\(s\) \['guidence'\]"):
        make_llm(model)


def test_bad_config_value():
    with pytest.raises(Exception, match="guidance must be one of"):
        make_llm(tiny_moe(), quant_config={"quant_method": "trace_fp4", "guidance": "half"})


def test_model_without_routed_experts():
    with pytest.raises(Exception, match="trace_fp4 quantizes routed experts.*Qwen3ForCausalLM has none"):
        make_llm(tiny_dense(), quantization="trace_fp4")


@pytest.mark.parametrize(
    "shape, what",
    [({"head_dim": 40}, "head_dim=40"), ({"moe_intermediate_size": 40}, "moe_intermediate_size=40")],
)
def test_dimensions_not_divisible_by_16(shape, what):
    with pytest.raises(Exception, match=f"{what} is not divisible by 16"):
        make_llm(tiny_moe(**shape), quantization="trace_fp4")


def test_fp8_kv_cache_is_refused():
    with pytest.raises(Exception, match="needs kv_cache_dtype='auto'"):
        make_llm(tiny_moe(), quantization="trace_fp4", kv_cache_dtype="fp8")


def test_config_naming_layers_the_model_lacks_is_refused_at_start():
    # The tiny model has 4 layers: layer 99 would otherwise be silently ignored.
    with pytest.raises(Exception, match=r"guided_layers names \[99\] but model .* has 4 layers"):
        make_llm(tiny_moe(), quant_config={"quant_method": "trace_fp4", "guided_layers": [0, 99]})
