"""trace_verl's config keys on verl 0.9.1's real config classes: what turns TRACE on, what is refused.

No engine starts here: these are the checks the rollout server and the Megatron engine run at start."""

import pytest

pytest.importorskip("verl")

import trace_verl  # noqa: E402
from trace_kernels import TraceConfig  # noqa: E402
from trace_verl import TraceConfigError, check_config, rollout_settings, trainer_settings  # noqa: E402
from verl.workers.config import McoreEngineConfig, RolloutConfig  # noqa: E402

QC = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}


def rollout(qc=QC, store="file:/tmp/trace_fp4_verl_cfg", **kw):
    engine_kwargs = {"vllm": {"hf_overrides": {"quantization_config": qc}}} if qc else {}
    custom = {"trace_fp4": {"store": store}} if store is not None else None
    kw.setdefault("tensor_model_parallel_size", 1)  # verl's default is 2
    return RolloutConfig(name="vllm", engine_kwargs=engine_kwargs, custom=custom, **kw)


def megatron(trace=QC, **kw):
    over = {"trace_fp4": {k: v for k, v in trace.items() if k != "quant_method"}} if trace else {}
    return McoreEngineConfig(override_mcore_model_config=over, use_remove_padding=True, **kw)


def full_config(r, m, strategy="megatron"):
    return {"actor_rollout_ref": {"rollout": r, "actor": {"strategy": strategy, "megatron": m}}}


def test_both_sides_on_agree():
    r, t = check_config(full_config(rollout(), megatron()))
    assert r.trace_config == t.trace_config == TraceConfig(guidance="full", guided_layers="all")
    assert r.store == "file:/tmp/trace_fp4_verl_cfg" and r.engine == "vllm"


def test_off_is_off():
    assert check_config(full_config(rollout(qc=None, store=None), megatron(trace=None))) == (None, None)


@pytest.mark.parametrize(
    "r, m, words",
    [
        (rollout(), megatron(trace=None), "TRACE on the rollout only"),
        (rollout(qc=None, store=None), megatron(), "TRACE on the trainer only"),
        (rollout(), megatron(trace={"guidance": "compact", "guided_layers": "all"}), "TRACE configs differ"),
        (rollout(qc={**QC, "block_scale": "4over6"}), megatron(), "TRACE configs differ.*'block_scale': '4over6'"),
    ],
)
def test_one_side_only_or_different(r, m, words):
    with pytest.raises(TraceConfigError, match=words):
        check_config(full_config(r, m))


def test_fsdp_actor_is_refused():
    with pytest.raises(TraceConfigError, match="strategy='fsdp'"):
        check_config(full_config(rollout(), megatron(), strategy="fsdp"))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"store": None}, "without a record store"),
        ({"store": ""}, "without a record store"),
        ({"qc": None}, "not told to run TRACE"),
        ({"quantization": "fp8"}, "quantization='fp8' cannot be combined"),
        ({"qat": {"enable": True}}, "qat.enable"),
        ({"enable_rollout_routing_replay": True}, r"\(R3\)"),
        ({"data_parallel_size": 2}, "data_parallel_size=2"),
    ],
)
def test_rollout_refusals(kwargs, words):
    with pytest.raises(TraceConfigError, match=words):
        rollout_settings(rollout(**kwargs))


def test_tensor_and_pipeline_parallel_rollouts_are_accepted_where_records_are_assembled():
    # vLLM's driver assembles the TP ranks' and PP stages' parts into one record; SGLang the TP ranks'.
    assert rollout_settings(rollout(tensor_model_parallel_size=2)).engine == "vllm"
    sglang = dict(name="sglang", engine_kwargs={"sglang": {"quantization": "trace_fp4"}},
                  custom={"trace_fp4": {"store": "file:/tmp/x"}})
    assert rollout_settings(RolloutConfig(**sglang, tensor_model_parallel_size=2)).engine == "sglang"
    # verl 0.9.1's RolloutConfig refuses pipeline_model_parallel_size > 1 itself ("not implemented"), so the
    # PP keys go in as the plain mapping a newer verl would hand over.
    vllm = dict(name="vllm", engine_kwargs={"vllm": {"hf_overrides": {"quantization_config": QC}}},
                custom={"trace_fp4": {"store": "file:/tmp/x"}})
    assert rollout_settings({**vllm, "pipeline_model_parallel_size": 2}).engine == "vllm"
    with pytest.raises(TraceConfigError, match="pipeline_model_parallel_size=2: the sglang rollout plugin"):
        rollout_settings({**sglang, "pipeline_model_parallel_size": 2})


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"router_replay": {"mode": "R3"}}, "router_replay.mode='R3' cannot be combined"),
        ({"router_replay": {"mode": "R2"}}, "router_replay.mode='R2'"),
        ({"dynamic_context_parallel": True, "max_seqlen_per_dp_cp_rank": 1024}, "dynamic_context_parallel"),
        ({"vanilla_mbridge": True}, "vanilla_mbridge"),
    ],
)
def test_trainer_refusals(kwargs, words):
    from verl.workers.config.engine import EngineRouterReplayConfig

    if "router_replay" in kwargs:
        kwargs = {**kwargs, "router_replay": EngineRouterReplayConfig(**kwargs["router_replay"])}
    with pytest.raises(TraceConfigError, match=words):
        trainer_settings(megatron(**kwargs))


def test_tensor_parallel_trainer_with_sequence_parallelism_is_accepted():
    # trace_megatron follows Megatron's sequence-parallel scatter along the packed layout.
    assert trainer_settings(megatron(tensor_model_parallel_size=2, sequence_parallel=True)) is not None


def test_context_parallel_trainer_is_accepted():
    # guidance rows follow verl's CP order; trace_megatron's core attention gathers K/V over the CP group
    assert trainer_settings(megatron(context_parallel_size=2)) is not None


def test_unknown_trace_key_is_named():
    with pytest.raises(ValueError, match="guidanse"):
        trainer_settings(megatron(trace={"guidanse": "full"}))


@pytest.mark.parametrize("spec", ["file:/proc/trace_fp4_no_such_store", "ray:bad#namespace"])
def test_unusable_store_is_refused_at_open(spec):
    from trace_verl.store import open_configured_store

    with pytest.raises(TraceConfigError, match="rollout.custom.trace_fp4.store: cannot open the TRACE record store"):
        open_configured_store(spec, where="rollout.custom.trace_fp4.store")


def test_entry_point_is_declared():
    """verl imports `verl.plugins` entry points (it does not call them): the target is a module whose
    import registers trace_verl."""
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["verl.plugins"] == {"trace_fp4": "trace_verl.plugin"}
    assert "trace_verl" in meta["tool"]["setuptools"]["packages"]
    assert trace_verl.register is not None


def test_registry_after_registration():
    """Replica "vllm" resolves to the TRACE server; the Megatron LM engine to the TRACE engine once verl
    imports its Megatron engine (not before: other processes need not import Megatron-Core)."""
    import trace_verl.plugin  # noqa: F401  (what verl's entry-point loader does)
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    assert RolloutReplicaRegistry._registry["vllm"].__module__ == "trace_verl"
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from trace_verl.engine import TraceMegatronEngineWithLMHead

    table = EngineRegistry._engines["language_model"]["megatron"]
    assert table["cuda"] is TraceMegatronEngineWithLMHead
    assert issubclass(TraceMegatronEngineWithLMHead, MegatronEngineWithLMHead)


def test_trainer_store_names_the_store_it_resolves_and_must_be_the_rollouts():
    """The trainer side's `store` is the one store whose handles it resolves (docs/record-format.md, 'Trust')."""
    trace = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}
    r, t = check_config(full_config(rollout(), megatron(trace={**trace, "store": "file:/tmp/trace_fp4_verl_cfg"})))
    assert t.store == "file:/tmp/trace_fp4_verl_cfg" and r.trace_config == t.trace_config
    with pytest.raises(TraceConfigError, match="record stores differ.*override_mcore_model_config.trace_fp4.store"):
        check_config(full_config(rollout(), megatron(trace={**trace, "store": "file:/tmp/elsewhere"})))
