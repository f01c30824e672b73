"""A checkpoint that ships `quantization_config: {quant_method: trace_fp4}` in config.json runs with
the default TraceConfig (sparse guidance at every layer) and no other argument."""

import trace_kernels
from trace_kernels.guides.sparse import SparseGuide
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
        assert rec.modes == ("sparse",) * 4  # the default: sparse guidance at every layer
        assert rec.config == trace_kernels.TraceConfig()
        guide = rec.site(0, "moe_fc2_in")
        assert isinstance(guide, SparseGuide)
        assert tuple(guide.shape) == (rec.num_tokens, 2, 32)
        assert rec.routed_experts(0).shape == (rec.num_tokens, 2)
