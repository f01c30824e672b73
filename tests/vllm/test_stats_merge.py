"""`trace_vllm_plugin.stats` under pipeline parallelism: every stage's per-layer counters merged into rank
0's view; a layer two stages both claim, or a stage that did not answer, is an error (the engine test in
test_vllm_tensor_parallel.py checks the merged view of a real PP=2 engine)."""

import pytest

from trace_vllm_plugin.api import merge_pipeline_stages


def _stage(rank, layers, size=2, extra=None):
    counters = {f"moe_calls.layer{i}": 3 for i in layers} | {"requests_started": 2} | (extra or {})
    return {"pp_rank": rank, "pp_size": size, "counters": counters}


def test_stages_merge_their_layers_and_keep_rank0_totals():
    per_rank = [_stage(0, [0, 1]), _stage(0, [0, 1]), _stage(1, [2, 3]), _stage(1, [2, 3])]  # TP=2 x PP=2
    out = merge_pipeline_stages(per_rank)
    assert sorted(k for k in out["counters"] if k.startswith("moe_calls")) == [f"moe_calls.layer{i}" for i in range(4)]
    assert out["counters"]["requests_started"] == 2  # not summed over stages: every stage sees every request
    assert [s["pp_rank"] for s in out["pipeline_stages"]] == [0, 1]


def test_a_layer_claimed_by_two_stages_is_refused():
    with pytest.raises(RuntimeError, match="moe_calls.layer1 counted by pipeline stages 0 and 1"):
        merge_pipeline_stages([_stage(0, [0, 1]), _stage(1, [1, 2])])


def test_a_missing_stage_is_refused():
    with pytest.raises(RuntimeError, match="stages \\[0\\] answered"):
        merge_pipeline_stages([_stage(0, [0, 1])])


def test_without_pipeline_parallelism_rank0_is_returned_as_is():
    s = _stage(0, [0, 1], size=1)
    assert merge_pipeline_stages([s, _stage(0, [0, 1], size=1)]) == s
