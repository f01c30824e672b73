"""trace_slime's start-up refusals and handle encoding, on slime's attribute names (no slime import:
the real command line is checked in test_slime_e2e.py, which parses it with slime's own parser)."""

import json
from argparse import Namespace

import pytest
import torch

from trace_slime import TraceSlimeError, check_args
from trace_slime.handles import decode, encode

STORE = "TRACE_FP4_RECORD_STORE"


def _args(tmp_path, *, trace_ckpt=True, **over):
    """slime's args for the README command line; the checkpoint's config.json selects trace_fp4 or not."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    qc = {"quantization_config": {"quant_method": "trace_fp4", "guidance": "full"}} if trace_ckpt else {}
    (ckpt / "config.json").write_text(json.dumps(qc))
    base = dict(
        hf_checkpoint=str(ckpt), sglang_quantization=None, sglang_json_model_override_args=None,
        spec=["trace_slime", "get_trace_spec"], custom_generate_function_path="trace_slime.generate",
        custom_megatron_before_log_prob_hook_path="trace_slime.before_log_prob_hook",
        custom_megatron_before_train_step_hook_path="trace_slime.before_train_step_hook",
        use_rollout_routing_replay=False, use_routing_replay=False, tensor_model_parallel_size=1,
        context_parallel_size=1, pipeline_model_parallel_size=1, rollout_num_gpus_per_engine=1,
    )
    base.update(over)
    return Namespace(**base)


@pytest.fixture(autouse=True)
def store(monkeypatch, tmp_path):
    monkeypatch.setenv(STORE, f"file:{tmp_path / 'store'}")


def test_the_readme_flags_pass_and_read_the_servers_trace_config(tmp_path):
    trace = check_args(_args(tmp_path))
    assert trace.trace_config.guidance == "full" and trace.store.endswith("store")
    # --sglang-json-model-override-args wins over the checkpoint, as in SGLang
    over = json.dumps({"quantization_config": {"quant_method": "trace_fp4", "guidance": "sparse"}})
    assert check_args(_args(tmp_path, sglang_json_model_override_args=over)).trace_config.guidance == "sparse"


def test_trace_off_is_none_and_the_generate_function_alone_is_refused(tmp_path):
    assert check_args(_args(tmp_path, trace_ckpt=False, spec=None, custom_generate_function_path=None)) is None
    with pytest.raises(TraceSlimeError, match="--custom-generate-function-path trace_slime.generate without TRACE"):
        check_args(_args(tmp_path, trace_ckpt=False, spec=None))


@pytest.mark.parametrize("over, match", [
    ({"spec": None}, "TRACE on the rollout only.*--spec trace_slime get_trace_spec"),
    ({"custom_megatron_before_log_prob_hook_path": None}, "--custom-megatron-before-log-prob-hook-path"),
    ({"custom_megatron_before_train_step_hook_path": "x.y"}, "--custom-megatron-before-train-step-hook-path"),
    ({"custom_generate_function_path": None}, "--custom-generate-function-path"),
    ({"use_rollout_routing_replay": True}, "--use-rollout-routing-replay.*routes come from the guidance record"),
    ({"use_routing_replay": True}, "--use-routing-replay"),
    ({"use_critic": True}, "--use-critic"),
    ({"tensor_model_parallel_size": 2}, "--tensor-model-parallel-size=2"),
    ({"rollout_num_gpus_per_engine": 4}, "--rollout-num-gpus-per-engine=4"),
])
def test_refusals_name_the_flag(tmp_path, over, match):
    with pytest.raises(TraceSlimeError, match=match):
        check_args(_args(tmp_path, **over))


def test_trace_on_the_trainer_only_is_refused(tmp_path):
    with pytest.raises(TraceSlimeError, match="TRACE on the trainer only.*quant_method"):
        check_args(_args(tmp_path, trace_ckpt=False))


def test_a_missing_store_is_refused_naming_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(STORE)
    with pytest.raises(TraceSlimeError, match="without a record store: set TRACE_FP4_RECORD_STORE"):
        check_args(_args(tmp_path))


def test_another_quant_method_in_the_override_is_refused(tmp_path):
    over = json.dumps({"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(TraceSlimeError, match="quant_method='fp8'"):
        check_args(_args(tmp_path, sglang_quantization="trace_fp4", sglang_json_model_override_args=over))


def test_handles_survive_slimes_concatenation_over_a_micro_batch():
    handles = ["trace-fp4:file:/s#a1", None, "trace-fp4:ray:ns#" + "f" * 32]
    # slime's get_batch concatenates each sample's tensor along dim 0
    assert decode(torch.cat([encode(h) for h in handles])) == handles
    with pytest.raises(ValueError, match="0-terminated"):
        decode(torch.tensor([65, 66], dtype=torch.uint8))
