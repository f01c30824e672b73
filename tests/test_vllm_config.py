"""A checkpoint that ships `quantization_config: {quant_method: trace_fp4}` in config.json runs with
the default TraceConfig (compact guidance for the deeper half of the layers) and no other argument."""

import trace_kernels
import trace_vllm_plugin as tvp
from vllm_helpers import PROMPTS, greedy, make_llm, shutdown, tiny_moe, with_quant_config


def test_quant_method_from_config_json_with_defaults():
    model = with_quant_config(tiny_moe(), "moe_trace_default", {"quant_method": "trace_fp4"})
    llm = make_llm(model)  # no quantization= argument
    try:
        assert llm.llm_engine.vllm_config.model_config.quantization == "trace_fp4"
        outs = llm.generate(PROMPTS, greedy(5))
        records = tvp.get_records(llm, outs)
    finally:
        shutdown(llm)
    for out, rec in zip(outs, records):
        assert rec.num_tokens == len(out.prompt_token_ids) + 4
        assert rec.modes == (None, None, "compact", "compact")
        assert rec.config == trace_kernels.TraceConfig()
        assert rec.site(0, "k") is None
        guide = rec.site(3, "moe_fc2_in")
        assert isinstance(guide, trace_kernels.CompactGuide)
        assert tuple(guide.shape) == (rec.num_tokens, 2, 32)
        assert rec.routed_experts(0).shape == (rec.num_tokens, 2)
