"""`trace-fp4 align --model DIR` on the tiny DeepSeek-V3 (MLA latent KV, dense first layer, shared
expert, sigmoid grouped routing with a correction bias, routed_scaling_factor): real vLLM rollouts,
real Megatron-Core recompute (MLA on the local spec). One run of the real command; the assertions read
its JSON and its table. (~2.5 min on 2 cores: 1 prompt x 6 tokens keeps it short.)"""

import pytest

from align_helpers import run_align

from trace_fp4.archs import deepseek_v3

MOE_SITES = ("moe_fc1_in", "moe_fc2_in")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("align_deepseek")
    return run_align(deepseek_v3.build_tiny(d / "tiny_deepseek_v3"), d, num_prompts=1, max_tokens=6)


def test_per_layer_sites_follow_the_model(run):
    _, result = run
    assert result["layer_kinds"] == ["dense+mla", "moe+mla", "moe+mla"]
    assert result["model_shape"]["kv_kind"] == "mla" and result["model_shape"]["head_dim"] == 512
    for mode in ("fp4_rtn", "trace_full"):
        rows = result["modes"][mode]["per_layer"]
        assert set(rows[0]) >= {"kv_latent"} and not any(s in rows[0] for s in MOE_SITES + ("k", "v"))
        assert all({*MOE_SITES, "kv_latent"} <= set(r) and "k" not in r for r in rows[1:])


def test_full_guidance_leaves_no_adjacent_mismatch(run):
    _, result = run
    full, rtn = result["modes"]["trace_full"], result["modes"]["fp4_rtn"]
    assert full["mismatched_adjacent_elements"] == 0
    assert all(r["kv_latent"] == 0 for r in full["per_layer"])
    assert rtn["codeword_mismatch_rate"] > 0.001  # round-to-nearest disagrees: guidance had work to do
    assert full["fallback_rows"] == 0 and full["trainer_counters"].get("routing_fallback_rows", 0) == 0
    assert full["logprob_abs_diff_mean"] < rtn["logprob_abs_diff_mean"]


def test_table_shows_which_sites_each_layer_has(run):
    proc, _ = run
    lines = [l.split() for l in proc.stdout.splitlines()]
    dense = [l for l in lines if len(l) >= 2 and l[0] == "0" and l[1] == "dense+mla"]
    assert dense and all(l[2:4] == ["-", "-"] for l in dense), proc.stdout[-2000:]
    assert any(len(l) >= 2 and l[0] == "1" and l[1] == "moe+mla" and "-" not in l[2:] for l in lines)
