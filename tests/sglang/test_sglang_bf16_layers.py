"""BF16 boundary layers in a real SGLang engine (CPU): TraceConfig(bf16_layers=[0, 3]) with the
dequantized KV pool (the packed pool holds NVFP4 rows for every layer, so it is refused there). The
records hold site rows for layers 1 and 2 only; K/V of layers 0 and 3 never reach the FP4 hooks."""

import pytest

from sglang_helpers import EngineProcess, base_engine_kwargs, sglang_skip_reason, write_quantization_config
from trace_fp4.tiny_model import build_tiny_qwen3_moe
from trace_kernels import ALL_SITES
from trace_sglang_plugin.transport import payload_from_meta_info, record_from_meta_info

pytestmark = pytest.mark.skipif(sglang_skip_reason() is not None, reason=str(sglang_skip_reason()))

CONFIG = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all", "bf16_layers": [0, 3]}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    d = build_tiny_qwen3_moe(tmp_path_factory.mktemp("sglang_bf16") / "moe")
    write_quantization_config(d, CONFIG)
    log = tmp_path_factory.mktemp("sglang_logs") / "engine.log"
    with EngineProcess(base_engine_kwargs(d), env_extra={"TRACE_FP4_KV_CACHE": "dequantized"}, log_path=log) as eng:
        yield eng.generate("Once upon a time there was a tiny model", {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True})


def test_records_hold_rows_only_for_the_fp4_layers(out):
    record = record_from_meta_info(out["meta_info"])
    assert record.modes == (None, "full", "full", None)
    assert record.config.bf16_layers == (0, 3)
    assert {int(n.split(".")[1]) for n in record.tensors if n.split(".")[2] in ALL_SITES} == {1, 2}
    assert record.routed_experts(3).shape == (record.num_tokens, 2)


def test_bf16_layers_skip_the_fp4_kv_and_expert_paths(out):
    counters = payload_from_meta_info(out["meta_info"])["counters"]
    for layer in (0, 3):
        assert counters.get(f"moe_calls.layer{layer}", 0) > 0, counters
        assert counters.get(f"kv_writes.layer{layer}", 0) == 0, counters
    for layer in (1, 2):
        assert counters.get(f"kv_writes.layer{layer}", 0) > 0, counters
    # BF16 layers run the per-expert loop on BF16 weights and inputs, the others the NVFP4 grouped GEMM
    assert counters.get("emulated_expert_gemm_calls", 0) > 0 and counters.get("nvfp4_grouped_gemm_calls", 0) > 0
