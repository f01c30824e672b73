"""End to end on gpt-oss: `trace-fp4 align --model <tiny gpt-oss>` (real vLLM rollouts with the expert
biases, clamped SwiGLU, sinks and sliding window; Megatron-Core recompute through the gpt-oss
converter). One run of the real command; the assertions read its JSON."""

import pytest

from align_helpers import run_align

from trace_fp4.archs.gpt_oss import build_tiny
from vllm_helpers import MODELS_DIR

SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")  # every gpt-oss layer: routed experts and a K/V cache


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    model = build_tiny(MODELS_DIR / "gpt_oss")
    d = tmp_path_factory.mktemp("align_gpt_oss")
    return run_align(model, d, num_prompts=2, max_tokens=6)[1]


def test_full_guidance_leaves_no_adjacent_mismatch_at_any_site(result):
    full, rtn = result["modes"]["trace_full"], result["modes"]["fp4_rtn"]
    assert full["mismatched_adjacent_elements"] == 0 and full["codeword_mismatch_rate_adjacent"] == 0
    assert full["fallback_rows"] == 0
    assert rtn["codeword_mismatch_rate"] > 0.01  # the problem is real on this model
    for row in full["per_layer"]:
        for s in SITES:
            assert row[s] is not None and row[f"{s}_mismatch_adjacent"] == 0, (row["layer"], s)
    # guided rollout log-probs closer to the FP4 rollout than plain FP4 QAT's
    assert full["logprob_abs_diff_mean"] < 0.5 * rtn["logprob_abs_diff_mean"]


def test_the_engine_loaded_biases_and_ran_every_layer(result):
    c = result["engine_counters"]
    layers = result["model_shape"]["num_layers"]
    assert c["expert_bias_rows_loaded"] == 2 * layers * result["model_shape"]["num_experts"]
    assert all(c[f"moe_calls.layer{i}"] > 0 and c[f"kv_calls.layer{i}"] > 0 for i in range(layers))
