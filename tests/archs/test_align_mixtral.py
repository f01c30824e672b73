"""`trace-fp4 align --model DIR` on a tiny Mixtral, the control among the architectures: every layer
routed experts (softmax top-2) and standard K/V, no shared expert. Real vLLM rollouts, real
Megatron-Core recompute through the Mixtral converter; one run of the real command."""

import pytest

from align_helpers import run_align
from trace_fp4.archs import mixtral

SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    d = tmp_path_factory.mktemp("align_mixtral")
    return run_align(mixtral.build_tiny(d / "tiny_mixtral"), d, num_prompts=1, max_tokens=6)[1]


def test_every_layer_has_every_site(result):
    assert set(result["layer_kinds"]) == {"moe+kv"}
    for mode in ("fp4_rtn", "trace_full"):
        assert all(set(SITES) <= set(row) for row in result["modes"][mode]["per_layer"])


def test_full_guidance_leaves_no_adjacent_mismatch(result):
    full, rtn = result["modes"]["trace_full"], result["modes"]["fp4_rtn"]
    assert rtn["codeword_mismatch_rate"] > 0.001  # round-to-nearest disagrees: guidance had work to do
    assert full["mismatched_adjacent_elements"] == 0
    assert full["fallback_rows"] == 0 and full["trainer_counters"].get("routing_fallback_rows", 0) == 0
    assert full["logprob_abs_diff_mean"] < rtn["logprob_abs_diff_mean"]
