"""The RL miniature's loop at its smallest setting: 2 GRPO steps of every arm, real vLLM rollouts, real
Megatron-Core training, a weight sync after every step (bench/rl_miniature.py is the benchmark)."""

import math

import pytest
import torch
from safetensors.torch import load_file

from trace_fp4.rl.experiment import run_experiment
from trace_fp4.rl.export import to_hf
from trace_fp4.rl.loop import RunConfig
from vllm_helpers import MODELS_DIR

STEPS = 2
CFG = RunConfig(steps=STEPS, prompts_per_step=4, group_size=4, check_weights=True)


@pytest.fixture(scope="module")
def result():
    return run_experiment(["bf16", "fp4_qat", "trace", "trace_default"], [0], CFG, MODELS_DIR / "rl_miniature",
                          sft_target=0.3, num_eval=32, log=lambda m: None)


def _runs(result, arm):
    return result["arms"][arm]["seeds"]


def test_sft_init_round_trips_through_megatron(result):
    """The SFT checkpoint was written by exporting Megatron weights to HF names: converting it back
    must give the same tensors (the export is the inverse of hf_to_megatron)."""
    from trace_fp4 import hf_to_megatron as h2m
    from trace_fp4.hf_checkpoint import read_config

    path = MODELS_DIR / "rl_miniature" / "sft_init"
    hf = read_config(path)
    tensors = load_file(path / "model.safetensors")
    back = to_hf(h2m.convert_state_dict(tensors, hf, dtype=torch.bfloat16), hf)
    assert back.keys() == tensors.keys()
    for k in tensors:
        assert torch.equal(back[k], tensors[k]), k


@pytest.mark.parametrize("arm", ["bf16", "fp4_qat", "trace", "trace_default"])
def test_loop_runs_and_measures(result, arm):
    for run in _runs(result, arm):
        assert len(run["steps"]) == STEPS
        for step in run["steps"]:
            for key in ("reward_mean", "logprob_abs_diff_mean", "k3_kl", "time_rollout_s", "time_train_s", "loss"):
                assert math.isfinite(step[key]), (arm, key, step[key])
            assert 0 <= step["reward_mean"] <= 1
            # the rollout of step s ran on the weights of s syncs; the sync after it made s + 1
            assert step["rollout_weights_version"] == step["step"]
            assert step["weights_version"] == step["step"] + 1
        assert 0 <= run["final_eval_reward"] <= 1
        # every sync was checked: the engine's FP4 codes / BF16 masters equal the trainer's
        assert run["weight_checks"] == STEPS


@pytest.mark.parametrize("arm", ["fp4_qat", "trace", "trace_default"])
def test_records_consumed_exactly_once(result, arm):
    for run in _runs(result, arm):
        n = sum(s["num_samples"] for s in run["steps"])
        # the engine put one record per sample in the store, the trainer took each once, none is left
        assert run["records"] == {"put": n, "taken": n, "outstanding": 0}
        assert run["engine_counters"]["records_taken"] == n


def test_trace_arm_matches_every_codeword(result):
    for run in _runs(result, "trace"):
        for step in run["steps"]:
            assert step["codeword_mismatch_rate_adjacent"] == 0.0
            assert step["codeword_mismatch_rate"] == 0.0  # full guidance at every layer
            assert step["guidance_bytes_per_token"] > 0


def test_unguided_arms_do_mismatch(result):
    """The measurement can fail: plain FP4 QAT disagrees with the rollout on some codewords, the
    default config less, and the BF16 trainer has no FP4 sites at all."""
    qat = [s["codeword_mismatch_rate"] for r in _runs(result, "fp4_qat") for s in r["steps"]]
    default = [s["codeword_mismatch_rate"] for r in _runs(result, "trace_default") for s in r["steps"]]
    assert min(qat) > 0
    assert sum(default) < sum(qat)
    assert all(s["codeword_mismatch_rate"] is None for r in _runs(result, "bf16") for s in r["steps"])
    # plain QAT's log-probabilities are further from its rollout's than TRACE's
    trace = [s["logprob_abs_diff_mean"] for r in _runs(result, "trace") for s in r["steps"]]
    assert sum(q["logprob_abs_diff_mean"] for r in _runs(result, "fp4_qat") for q in r["steps"]) > sum(trace)
