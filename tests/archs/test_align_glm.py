"""`trace-fp4 align --model DIR` on a tiny GLM-4.5 (dense first layer, shared expert, sigmoid routing with
a correction bias, partial rotary, Q/K/V biases): real vLLM rollouts, real Megatron-Core recompute.
One run of the real command; the assertions read its JSON and its table. (Mixtral, the control:
test_align_mixtral.py.)"""

import pytest

from align_helpers import run_align

from trace_fp4.archs import glm4_moe

MOE_SITES = ("moe_fc1_in", "moe_fc2_in")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("align_glm")
    return run_align(glm4_moe.build_tiny(d / "tiny_glm4_moe"), d, num_prompts=2, max_tokens=8)


def test_per_layer_sites_follow_the_model(run):
    _, result = run
    assert result["layer_kinds"] == ["dense+kv", "moe+kv", "moe+kv", "moe+kv"]
    assert result["model_shape"]["moe_layers"] == [1, 2, 3]
    for mode in ("fp4_rtn", "trace_full"):
        rows = result["modes"][mode]["per_layer"]
        assert not any(s in rows[0] for s in MOE_SITES) and {"k", "v"} <= set(rows[0])
        assert all({*MOE_SITES, "k", "v"} <= set(r) for r in rows[1:])


def test_full_guidance_leaves_no_adjacent_mismatch(run):
    _, result = run
    full, rtn = result["modes"]["trace_full"], result["modes"]["fp4_rtn"]
    assert full["mismatched_adjacent_elements"] == 0
    assert rtn["codeword_mismatch_rate"] > 0.001  # round-to-nearest disagrees: guidance had work to do
    assert full["fallback_rows"] == 0 and full["trainer_counters"].get("routing_fallback_rows", 0) == 0
    assert full["logprob_abs_diff_mean"] < rtn["logprob_abs_diff_mean"]


def test_table_shows_which_sites_each_layer_has(run):
    proc, _ = run
    table = proc.stdout
    lines = [l.split() for l in table.splitlines()]
    dense = [l for l in lines if len(l) >= 2 and l[0] == "0" and l[1] == "dense+kv"]
    assert dense and all(l[2:4] == ["-", "-"] for l in dense), table[-2000:]
    assert any(len(l) >= 2 and l[0] == "1" and l[1] == "moe+kv" and "-" not in l[2:] for l in lines)
