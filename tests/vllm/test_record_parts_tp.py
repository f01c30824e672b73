"""Tensor-parallel record parts (no engine): the ranks' parts of a request assemble into exactly the
record one rank would have captured, and a part missing, doubled or disagreeing is refused naming the
rank and the site. Plus the numerics the layout relies on: a split fc2 row quantized with the
all-reduced row amax has the single-rank codes, and expert weights loaded per rank are slices of the
single-rank packed weights with the same digest."""

import pytest
import torch

import trace_kernels as tk
from trace_kernels.engine import assemble_record
from trace_kernels.engine.rank_parts import assemble_rank_parts, rank_part
from trace_kernels.grouped_mm.weights import ExpertWeightStream, PackedExperts
from trace_kernels.weight_digest import layer_digest
from trace_vllm_plugin.tensor_parallel import core_shares, reassembled_digest

SHAPE = tk.ModelShape(num_layers=2, hidden_size=32, moe_intermediate_size=64, num_experts=4, top_k=2,
                      num_kv_heads=2, head_dim=16)
CONFIG = tk.TraceConfig(guidance="full", guided_layers="all")
TP = 2


def _q(x):
    return tk.quantize(x, tk.row_amax(x))


def _full_rows(T, gen):
    """The activations one single rank sees for a request of T tokens (per layer and site)."""
    acts = {}
    for layer in range(SHAPE.num_layers):
        acts[(layer, "moe_fc1_in")] = torch.randn(T, SHAPE.hidden_size, generator=gen)
        acts[(layer, "moe_fc2_in")] = torch.randn(T, SHAPE.top_k, SHAPE.moe_intermediate_size, generator=gen)
        for s in ("k", "v"):
            acts[(layer, s)] = torch.randn(T, SHAPE.num_kv_heads, SHAPE.head_dim, generator=gen)
    routing = {layer: torch.randint(0, SHAPE.num_experts, (T, SHAPE.top_k), generator=gen, dtype=torch.int16)
               for layer in range(SHAPE.num_layers)}
    return acts, routing


def _rank_chunks(acts, routing, rank, splits=(4, 1, 1)):
    """What rank `rank` captures, in chunks (prefill, then decode steps) as its capture store holds them."""
    I = SHAPE.moe_intermediate_size // TP
    H = SHAPE.num_kv_heads // TP
    chunks, start = [], 0
    for n in splits:
        sites = {}
        for (layer, site), x in acts.items():
            x = x[start : start + n]
            if site == "moe_fc2_in":
                # The rank's slice, quantized with the amax of the whole row (the all-reduce).
                part = x[..., rank * I : (rank + 1) * I]
                sites[(layer, site)] = tk.quantize(part, tk.row_amax(x))
            elif site in ("k", "v"):
                sites[(layer, site)] = _q(x[:, rank * H : (rank + 1) * H])
            else:
                sites[(layer, site)] = _q(x)
        chunks.append((n, sites, {k: v[start : start + n] for k, v in routing.items()}))
        start += n
    return chunks


def _parts(seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = 6
    acts, routing = _full_rows(T, gen)
    parts = [rank_part(_rank_chunks(acts, routing, r), T, rank=r, tp_size=TP, shape=SHAPE, config=CONFIG,
                       weights=(0, "d" * 64)) for r in range(TP)]
    single = assemble_record(SHAPE, CONFIG, [(routing, {k: _q(x) for k, x in acts.items()})], weights=(0, "d" * 64))
    return parts, single


def test_parts_assemble_to_the_single_rank_record():
    parts, single = _parts()
    record, seconds = assemble_rank_parts(parts)
    assert seconds >= 0 and record.num_tokens == single.num_tokens
    assert set(record.tensors) == set(single.tensors)
    for name, t in single.tensors.items():
        assert torch.equal(record.tensors[name], t), name
    # Rank order does not matter, only that every rank is there once.
    again, _ = assemble_rank_parts(parts[::-1])
    assert all(torch.equal(again.tensors[n], t) for n, t in record.tensors.items())


def test_replicated_sites_travel_once():
    parts, _ = _parts()
    from safetensors.torch import load

    rank1 = load(parts[1]["tensors"])
    assert not any(k.endswith("moe_fc1_in.codes") or k.endswith("routing") for k in rank1)
    assert "0.moe_fc1_in" in parts[1]["digests"] and "0.routing" in parts[1]["digests"]


def test_a_missing_rank_is_refused_naming_it():
    parts, _ = _parts()
    with pytest.raises(ValueError, match="no part from rank 1"):
        assemble_rank_parts(parts[:1])


def test_a_rank_present_twice_is_refused_naming_it():
    parts, _ = _parts()
    with pytest.raises(ValueError, match="rank 0 is present twice"):
        assemble_rank_parts([parts[0], parts[0], parts[1]])


def test_a_site_missing_from_a_part_is_refused_naming_rank_and_site():
    from safetensors.torch import load, save

    parts, _ = _parts()
    t = load(parts[1]["tensors"])
    del t["1.moe_fc2_in.codes"]
    parts[1]["tensors"] = save(t)
    with pytest.raises(ValueError, match="rank 1: layer 1 moe_fc2_in: missing"):
        assemble_rank_parts(parts)


def test_ranks_disagreeing_on_replicated_rows_are_refused():
    parts, _ = _parts()
    other, _ = _parts(seed=1)
    parts[1]["digests"]["1.moe_fc1_in"] = other[1]["digests"]["1.moe_fc1_in"]
    with pytest.raises(ValueError, match="rank 1: layer 1 moe_fc1_in differs from rank 0"):
        assemble_rank_parts(parts)


def test_fc2_rows_quantized_with_each_ranks_own_amax_are_refused():
    from safetensors.torch import load, save

    parts, _ = _parts()
    t = load(parts[1]["tensors"])
    t["0.moe_fc2_in.amax"] = t["0.moe_fc2_in.amax"] * 0.5
    parts[1]["tensors"] = save(t)
    with pytest.raises(ValueError, match="rank 1: layer 0 moe_fc2_in: row amax differs"):
        assemble_rank_parts(parts)


def test_split_rows_need_the_all_reduced_amax_for_single_rank_codes():
    # The property the all-reduce exists for: with each slice's own amax the codes would differ.
    x = torch.randn(64, 128) * torch.logspace(0, 2, 128)
    whole = tk.codewords(_q(x))
    halves = x.split(64, dim=-1)
    shared = torch.cat([tk.codewords(tk.quantize(h, tk.row_amax(x))) for h in halves], dim=-1)
    own = torch.cat([tk.codewords(_q(h)) for h in halves], dim=-1)
    assert torch.equal(shared, whole)
    assert not torch.equal(own, whole)


def test_expert_weights_per_rank_are_slices_of_the_single_rank_weights():
    E, I, H = 3, 64, 32
    gen = torch.Generator().manual_seed(0)
    w1, w3, w2 = (torch.randn(E, I, H, generator=gen), torch.randn(E, I, H, generator=gen) * 3,
                  torch.randn(E, H, I, generator=gen))

    def load(rank, size):
        w13, w2p = PackedExperts.empty(E, 2 * I // size, H), PackedExperts.empty(E, H, I // size)
        stream = ExpertWeightStream(w13, w2p, "test", rank, size)
        for e in range(E):
            stream.load("w1", e, w1[e])
            stream.load("w2", e, w2[e])
            stream.load("w3", e, w3[e])
        stream.check_complete()
        return w13, w2p

    one = load(0, 1)
    ranks = [load(r, TP) for r in range(TP)]
    for r, (w13, w2p) in enumerate(ranks):
        assert torch.equal(w13.amax, one[0].amax) and torch.equal(w2p.amax, one[1].amax)
        assert torch.equal(w2p.codes, one[1].codes[:, :, r * I // 4 : (r + 1) * I // 4])
    digest = reassembled_digest(
        [[w.codes for w, _ in ranks], [w.scales for w, _ in ranks]],
        [[w.codes for _, w in ranks], [w.scales for _, w in ranks]], ranks[0][0].amax, ranks[0][1].amax,
    )
    assert digest == layer_digest(*one)
    with pytest.raises(ValueError, match="expected the full"):
        ExpertWeightStream(*ranks[0], "test", 0, TP).load("w2", 0, w2[0][:, : I // 2])


def test_core_shares_give_each_rank_its_own_cores():
    assert core_shares([1, 0], 2) == "0|1"
    assert core_shares([0, 1, 2, 3, 4], 2) == "0,1|2,3"
    with pytest.raises(ValueError, match="only 1 allowed CPUs"):
        core_shares([0], 2)


def test_expert_parallel_rows_come_from_the_rank_that_holds_the_expert():
    gen = torch.Generator().manual_seed(3)
    T = 6
    acts, routing = _full_rows(T, gen)
    held = [[0, 1], [2, 3]]  # global experts of rank 0 and rank 1

    def ep_chunks(rank):
        chunks = _rank_chunks(acts, routing, rank, splits=(T,))
        n, sites, r = chunks[0]
        for layer in range(SHAPE.num_layers):
            q = _q(acts[(layer, "moe_fc2_in")])
            # A pair routed to another rank's expert is computed with a stand-in expert here: garbage.
            junk = _q(torch.randn(q.shape[0], SHAPE.top_k, SHAPE.moe_intermediate_size, generator=gen))
            mine = torch.isin(routing[layer].long(), torch.tensor(held[rank]))
            pick = lambda a, b: torch.where(mine.view(*mine.shape, *([1] * (a.dim() - 2))), a, b)  # noqa: E731
            sites[(layer, "moe_fc2_in")] = tk.NVFP4Tensor(pick(q.codes, junk.codes), pick(q.scales, junk.scales),
                                                          pick(q.global_amax, junk.global_amax))
        return [(n, sites, r)]

    parts = [rank_part(ep_chunks(r), T, rank=r, tp_size=TP, shape=SHAPE, config=CONFIG, weights=(0, None),
                       experts=held[r]) for r in range(TP)]
    single = assemble_record(SHAPE, CONFIG, [(routing, {k: _q(x) for k, x in acts.items()})], weights=(0, None))
    record, _ = assemble_rank_parts(parts)
    for name, t in single.tensors.items():
        assert torch.equal(record.tensors[name], t), name
    parts[1]["experts"] = [1, 2, 3]
    with pytest.raises(ValueError, match="expert 1 is present twice"):
        assemble_rank_parts(parts)
    parts[1]["experts"] = [2]
    with pytest.raises(ValueError, match="expert 3 is held by no rank"):
        assemble_rank_parts(parts)


# ---- pipeline parallel: each stage's ranks hold that stage's layers ---------------------------------
LAYER_DIGESTS = {0: "a" * 64, 1: "b" * 64}


def _stage_chunks(chunks, layers):
    """A stage's capture: only its layers' rows and routing."""
    return [(n, {k: v for k, v in sites.items() if k[0] in layers}, {k: v for k, v in routing.items() if k in layers})
            for n, sites, routing in chunks]


def _pp_parts(tp=1, seed=0):
    """Parts of a request computed with PP=2 (layer 0 on stage 0, layer 1 on stage 1) x TP=`tp`."""
    from trace_kernels.weight_digest import model_digest

    gen = torch.Generator().manual_seed(seed)
    T = 6
    acts, routing = _full_rows(T, gen)
    parts = []
    for stage, layers in enumerate(([0], [1])):
        mine = {x: LAYER_DIGESTS[x] for x in layers}
        for r in range(tp):
            chunks = _rank_chunks(acts, routing, r) if tp > 1 else [(T, {k: _q(x) for k, x in acts.items()}, routing)]
            parts.append(rank_part(_stage_chunks(chunks, layers), T, rank=r, tp_size=tp, shape=SHAPE, config=CONFIG,
                                   weights=(0, model_digest(mine)), pp_rank=stage, pp_size=2, layers=layers,
                                   layer_digests=mine))
    single = assemble_record(SHAPE, CONFIG, [(routing, {k: _q(x) for k, x in acts.items()})],
                             weights=(0, model_digest(LAYER_DIGESTS)))
    return parts, single


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "tp2_pp2"])
def test_pipeline_stage_parts_assemble_to_the_single_rank_record(tp):
    parts, single = _pp_parts(tp)
    record, _ = assemble_rank_parts(parts[::-1])
    assert set(record.tensors) == set(single.tensors)
    for name, t in single.tensors.items():
        assert torch.equal(record.tensors[name], t), name
    # The weights digest is the whole model's, as a single-rank engine names it (no stage's own).
    assert record.identity.weights_digest == single.identity.weights_digest
    assert record.identity.weights_digest not in {p["weights"][1] for p in parts}


def test_a_missing_or_doubled_pipeline_stage_is_refused_naming_it():
    parts, _ = _pp_parts(tp=2)
    with pytest.raises(ValueError, match="no part from pipeline stage 1"):
        assemble_rank_parts(parts[:2])
    with pytest.raises(ValueError, match="no part from pipeline stage 1 rank 1"):
        assemble_rank_parts(parts[:3])
    with pytest.raises(ValueError, match="the part of pipeline stage 1 rank 0 is present twice"):
        assemble_rank_parts(parts + [parts[2]])


def test_a_layer_held_by_two_stages_or_none_is_refused_naming_it():
    parts, _ = _pp_parts()
    twice = [dict(parts[0]), dict(parts[1], layers=[0, 1])]
    with pytest.raises(ValueError, match="layer 0 is present twice \\(pipeline stage 0 and stage 1\\)"):
        assemble_rank_parts(twice)
    none = [dict(parts[0], layers=[]), parts[1]]
    with pytest.raises(ValueError, match="layer 0: no pipeline stage's part holds it"):
        assemble_rank_parts(none)


def test_a_stage_missing_a_site_of_its_layer_is_refused_naming_stage_and_site():
    from safetensors.torch import load, save

    parts, _ = _pp_parts(tp=2)
    t = load(parts[3]["tensors"])
    del t["1.k.codes"]
    parts[3]["tensors"] = save(t)
    with pytest.raises(ValueError, match="pipeline stage 1 rank 1: layer 1 k: missing from its part"):
        assemble_rank_parts(parts)


def test_stage_layer_digests_must_give_the_stages_weights_digest():
    parts, _ = _pp_parts()
    parts[1]["layer_digests"] = {"1": "c" * 64}
    with pytest.raises(ValueError, match="pipeline stage 1: its layer digests do not give its weights digest"):
        assemble_rank_parts(parts)
