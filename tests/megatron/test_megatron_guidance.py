"""Guided rounding in a real Megatron-Core model reproduces the rollout's codes (CPU, world size 1)."""

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")
import megatron_cpu as mc  # noqa: E402

mc.init_parallel()

import trace_megatron  # noqa: E402
from trace_kernels import PAPER_CONFIG, GuidanceRecord, RecordError, TraceConfig  # noqa: E402

FULL = TraceConfig(guidance="full", guided_layers="all")
COMPACT = PAPER_CONFIG  # compact guidance for the deeper half (layer 1 of 2)
LENGTHS, SEQ = [16, 11], 16
SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")


def bf16_engine(x):
    """A second engine's numerics: the same values, rounded to BF16."""
    return x.to(torch.bfloat16).to(x.dtype)


def _setup(trace_config, **cfg):
    model = mc.tiny_model(mc.tiny_config(**cfg), trace_config=trace_config, seed=7)
    ids, pos, mask = mc.padded_batch(LENGTHS, SEQ, seed=1)
    return model, (ids, pos, mask), trace_megatron.TokenLayout.padded(LENGTHS, SEQ)


def _site_totals(metrics, site):
    return {k.split("/")[-1]: v for k, v in metrics.items() if k.startswith(f"trace/all/{site}/")}


def test_self_made_records_reproduce_every_code():
    model, inputs, layout = _setup(FULL)
    with torch.no_grad(), trace_megatron.capture(model, layout) as cap:
        ref = model(*inputs)
    records = cap.build_records()
    with torch.no_grad(), trace_megatron.guidance(model, records, layout) as batch:
        out = model(*inputs)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    m = batch.metrics()
    for site in SITES:
        t = _site_totals(m, site)
        assert t["guided_rows"] > 0 and t["mismatch_rtn"] == 0 and t["mismatch_guided"] == 0, (site, t)
        assert t["fallback_rows"] == t["fallback_no_record"]  # only the padding falls back
    assert m["trace/layer1/k/fallback_no_record"] == SEQ - LENGTHS[1]  # 5 padding positions
    assert m["trace/layer1/moe_fc2_in/guided_rows"] == sum(LENGTHS) * 2  # every (token, routed slot)


def noisy_engine(x):
    """A second engine for a BF16 model: about one BF16 ulp of relative noise, then BF16. The noise is a
    function of the value (an engine quantizes a token's expert input once, whichever experts it goes to)."""
    xf = x.float()
    noise = torch.frac(torch.sin(xf * 12345.678) * 43758.5453) - 0.5  # deterministic pseudo-random in [-0.5, 0.5)
    return (xf * (1 + 2.0**-7 * noise)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_guidance_removes_every_mismatch_of_a_second_engine(dtype):
    model, inputs, layout = _setup(FULL, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    engine = bf16_engine if dtype == torch.float32 else noisy_engine
    with torch.no_grad(), trace_megatron.capture(model, layout, perturb=engine) as cap:
        model(*inputs)
    with torch.no_grad(), trace_megatron.guidance(model, cap.build_records(), layout) as batch:
        model(*inputs)
    m = batch.metrics()
    for site in SITES:
        t = _site_totals(m, site)
        assert t["mismatch_rtn"] > 0, (site, t)  # the BF16 gap flips some FP4 codes...
        assert t["mismatch_guided"] == 0, (site, t)  # ...and guidance flips them back


def test_compact_guidance_removes_every_adjacent_mismatch():
    """Compact guidance (mantissa bit + scales) fixes every mismatch whose engine code is adjacent to the
    trainer's value, i.e. exactly the ones full guidance fixes. The shallow half runs RTN and is counted."""
    model, inputs, layout = _setup(COMPACT)
    with torch.no_grad(), trace_megatron.capture(model, layout, perturb=bf16_engine) as cap:
        model(*inputs)
    compact_records = cap.build_records()
    assert compact_records[0].modes == (None, "compact")
    full_deep = TraceConfig(guidance="full", guided_layers="deeper_half")  # same layers guided, 4-bit codes
    full_records = cap.build_records(full_deep)
    engine = {site: cap.captured(1, site) for site in SITES}  # the engine's codes in layer 1

    def guided_codes(m, records):
        with torch.no_grad(), trace_megatron.capture(m, layout, records=records) as run:
            m(*inputs)
        return run

    compact_run = guided_codes(model, compact_records)
    full_model = mc.tiny_model(mc.tiny_config(), trace_config=full_deep, seed=7)
    full_model.load_state_dict(model.state_dict())
    full_run = guided_codes(full_model, full_records)
    m = compact_run.metrics()
    valid = layout.sample >= 0
    total_rtn = 0
    for site in SITES:
        theirs = engine[site].dequantize()[valid]
        compact_miss = compact_run.captured(1, site).dequantize()[valid] != theirs
        full_miss = full_run.captured(1, site).dequantize()[valid] != theirs
        assert torch.equal(compact_miss, full_miss), site  # only non-adjacent mismatches remain
        total_rtn += m[f"trace/layer1/{site}/mismatch_rtn"]
        assert m[f"trace/layer0/{site}/fallback_not_guided"] > 0  # the shallow half is RTN, and counted
        assert m[f"trace/layer0/{site}/guided_rows"] == 0
    assert total_rtn > 0


def _shuffle_tokens(record: GuidanceRecord, layer: int, site: str) -> GuidanceRecord:
    """The same record with one site's rows in reversed token order (a mis-indexed record)."""
    tensors = dict(record.tensors)
    for name in list(tensors):
        if name.startswith(f"layer.{layer}.{site}."):
            tensors[name] = tensors[name].flip(0)
    return GuidanceRecord(record.shape, record.config, record.num_tokens, record.modes, tensors)


def test_a_shuffled_record_is_detected():
    model, inputs, layout = _setup(FULL)
    with torch.no_grad(), trace_megatron.capture(model, layout) as cap:
        model(*inputs)
    records = cap.build_records()
    records[0] = _shuffle_tokens(records[0], 1, "moe_fc1_in")
    records[1] = _shuffle_tokens(records[1], 1, "k")
    with torch.no_grad(), trace_megatron.guidance(model, records, layout) as batch:
        model(*inputs)
    m = batch.metrics()
    assert m["trace/layer1/moe_fc1_in/mismatch_guided"] > 0.05
    assert m["trace/layer1/k/mismatch_guided"] > 0.05
    assert m["trace/layer0/moe_fc1_in/mismatch_guided"] == 0


def test_routing_follows_the_records():
    model, inputs, layout = _setup(FULL)
    with torch.no_grad(), trace_megatron.capture(model, layout) as cap:
        model(*inputs)
    records = cap.build_records()
    # Route every token of sample 0 in layer 1 to experts (3, 0): the router must obey.
    r = records[0]
    tensors = dict(r.tensors)
    tensors["layer.1.routed_experts"] = torch.tensor([[3, 0]] * r.num_tokens, dtype=torch.int16)
    records[0] = GuidanceRecord(r.shape, r.config, r.num_tokens, r.modes, tensors)
    with torch.no_grad(), trace_megatron.guidance(model, records, layout) as batch:
        model(*inputs)
    ids = model.decoder.layers[1].mlp.router.router_replay.last_topk_idx
    sample0 = layout.positions_of(0)
    assert (ids[sample0] == torch.tensor([3, 0])).all()
    m = batch.metrics()
    # fc2 rows still find their (token, expert) record even where the expert changed
    assert m["trace/layer1/moe_fc2_in/fallback_route_mismatch"] == 0
    assert m["trace/layer1/routing/replayed_rows"] == sum(LENGTHS)
    assert m["trace/layer1/routing/fallback_rows"] == SEQ - LENGTHS[1]  # padding keeps its own routing


def test_tokens_past_the_record_fall_back_and_are_counted():
    """A rollout record stops before the last sampled token, which never entered the engine."""
    model, inputs, layout = _setup(FULL)
    with torch.no_grad(), trace_megatron.capture(model, layout) as cap:
        model(*inputs)
    records = [_truncate(r, r.num_tokens - 1) for r in cap.build_records()]
    with torch.no_grad(), trace_megatron.guidance(model, records, layout) as batch:
        model(*inputs)
    m = batch.metrics()
    padding = SEQ - LENGTHS[1]
    top_k = model.config.moe_router_topk  # expert rows are (token, routed expert) pairs
    for layer in (0, 1):
        assert m[f"trace/layer{layer}/moe_fc1_in/fallback_no_record"] == top_k * (2 + padding)
        assert m[f"trace/layer{layer}/k/fallback_no_record"] == 2 + padding
        assert m[f"trace/layer{layer}/moe_fc1_in/mismatch_guided"] == 0


def _truncate(record: GuidanceRecord, n: int) -> GuidanceRecord:
    tensors = {k: v[:n] for k, v in record.tensors.items()}
    return GuidanceRecord(record.shape, record.config, n, record.modes, tensors)


RECOMPUTE = {
    "full": dict(recompute=True),
    "selective_moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
    "selective_core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
}


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
def test_activation_recompute_uses_the_same_guidance(recompute):
    model, inputs, layout = _setup(FULL)
    with torch.no_grad(), trace_megatron.capture(model, layout, perturb=bf16_engine) as cap:
        model(*inputs)
    records = cap.build_records()

    def grads(m):
        with trace_megatron.guidance(m, records, layout) as batch:
            out = m(*inputs)
        kept = sum(len(t.binding._pending) for t in trace_megatron.trace_modules(m))
        out.float().pow(2).mean().backward()  # recompute runs here, after the block closed
        return {n: p.grad.clone() for n, p in m.named_parameters() if "local_experts" in n}, batch.metrics(), kept

    plain_grads, plain_metrics, kept = grads(model)
    assert kept == 0
    recomputed = mc.tiny_model(mc.tiny_config(**RECOMPUTE[recompute]), trace_config=FULL, seed=7)
    recomputed.load_state_dict(model.state_dict())
    re_grads, re_metrics, kept = grads(recomputed)
    assert kept >= 2  # the checkpointed modules of both layers kept this batch for their recompute
    for name, g in plain_grads.items():
        torch.testing.assert_close(re_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert re_metrics == plain_metrics  # counted once, in the first pass
    assert all(not m.binding._pending for m in trace_megatron.trace_modules(recomputed))


def test_records_that_do_not_fit_are_refused():
    model, inputs, layout = _setup(FULL)
    with torch.no_grad(), trace_megatron.capture(model, layout) as cap:
        model(*inputs)
    records = cap.build_records()
    r = records[0]
    wrong_shape = GuidanceRecord(dataclasses.replace(r.shape, hidden_size=128), r.config, r.num_tokens, r.modes, r.tensors)
    with pytest.raises(RecordError, match="hidden_size"):
        trace_megatron.guidance(model, [wrong_shape, records[1]], layout)
    wrong_layers = GuidanceRecord(dataclasses.replace(r.shape, num_layers=3), r.config, r.num_tokens, r.modes, r.tensors)
    with pytest.raises(RecordError, match="num_layers"):
        trace_megatron.guidance(model, [records[0], wrong_layers], layout)
    wrong_config = GuidanceRecord(r.shape, COMPACT, r.num_tokens, r.modes, r.tensors)
    with pytest.raises(RecordError, match="guidance"):
        trace_megatron.guidance(model, [wrong_config, records[1]], layout)
    with pytest.raises(ValueError, match="one per sample"):
        trace_megatron.guidance(model, records[:1], layout)
    too_long = trace_megatron.TokenLayout.padded([16, 9], SEQ)
    with pytest.raises(ValueError, match="covers 11 tokens"):
        trace_megatron.guidance(model, records, too_long)
    with pytest.raises(ValueError, match="sees 32 token positions"):
        with trace_megatron.guidance(model, records, trace_megatron.TokenLayout.padded([16, 11], 20)):
            model(*inputs)


def test_micro_batches_in_flight_recompute_with_their_own_guidance():
    """Pipeline schedules run several forwards before their backwards (in the same order)."""
    model, inputs, layout = _setup(FULL)
    other_inputs = mc.padded_batch(LENGTHS, SEQ, seed=9)
    micro_batches = []
    for batch_inputs in (inputs, other_inputs):
        with torch.no_grad(), trace_megatron.capture(model, layout, perturb=bf16_engine) as cap:
            model(*batch_inputs)
        micro_batches.append((batch_inputs, cap.build_records()))

    def grads(m):
        losses = []
        for batch_inputs, records in micro_batches:
            with trace_megatron.guidance(m, records, layout):
                losses.append(m(*batch_inputs).float().pow(2).mean())
        for loss in losses:
            loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if "local_experts" in n}

    expected = grads(model)
    recomputed = mc.tiny_model(mc.tiny_config(recompute=True), trace_config=FULL, seed=7)
    recomputed.load_state_dict(model.state_dict())
    for name, g in grads(recomputed).items():
        torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-6, msg=name)


# ---- identity: a record is used only for the sample and policy that made it ------------------------
def _equal_length_records(seed=1, weights_version=1):
    model = mc.tiny_model(mc.tiny_config(), trace_config=FULL, seed=7)
    ids, pos, mask = mc.padded_batch([12, 12], 12, seed=seed)
    layout = trace_megatron.TokenLayout.padded([12, 12], 12)
    with torch.no_grad(), trace_megatron.capture(model, layout) as cap:
        model(ids, pos, mask)
    records = cap.build_records(token_ids=list(ids), weights_version=weights_version)
    return model, (ids, pos, mask), layout, records


def test_swapped_truncated_foreign_and_stale_records_are_refused():
    model, inputs, layout, records = _equal_length_records()
    ids = list(inputs[0])
    swapped = records[::-1]
    with pytest.raises(RecordError, match="record of sample 0: tokens differ"):
        trace_megatron.guidance(model, swapped, layout, token_ids=ids)
    # Without token_ids the check reads the model's input_ids at the forward.
    with pytest.raises(RecordError, match="record of sample 0: tokens differ"):
        with torch.no_grad(), trace_megatron.guidance(model, swapped, layout):
            model(*inputs)
    _, other_inputs, _, foreign = _equal_length_records(seed=5)
    assert not torch.equal(other_inputs[0], inputs[0])
    with pytest.raises(RecordError, match="record of sample 1: tokens differ"):
        trace_megatron.guidance(model, [records[0], foreign[1]], layout, token_ids=ids)
    # A 3-token record for a 12-token sample (today's silent acceptance).
    with torch.no_grad(), trace_megatron.capture(model, trace_megatron.TokenLayout.padded([3, 12], 12)) as cap:
        model(*inputs)
    short = cap.build_records()[0]
    with pytest.raises(RecordError, match="record of sample 0: length differs: it covers 3 tokens .* holds 12"):
        trace_megatron.guidance(model, [short, records[1]], layout)
    # A record from before a weight update: refused, or counted when the user opts in.
    with pytest.raises(RecordError, match="record of sample 0: weights differ: .*version 1, the trainer expects 2"):
        trace_megatron.guidance(model, records, layout, token_ids=ids, weights_version=2)
    with torch.no_grad(), trace_megatron.guidance(model, records, layout, token_ids=ids, weights_version=2, accept_stale=True) as batch:
        model(*inputs)
    m = batch.metrics()
    assert m["trace/records/stale_weights"] == 2 and m["trace/records/tokens_checked"] == 2
    assert m["trace/records/stale_tokens"] == sum(r.num_tokens for r in records)
    with torch.no_grad(), trace_megatron.guidance(model, records, layout, weights_version=1) as batch:
        model(*inputs)
    m = batch.metrics()
    assert m["trace/records/stale_weights"] == 0 and m["trace/records/tokens_checked"] == 2
    assert m["trace/records/stale_tokens"] == 0
    assert m["trace/all/k/mismatch_guided"] == 0


def test_records_by_handle_are_resolved_and_refusals_name_the_handle(tmp_path):
    from trace_kernels import stores

    model, inputs, layout, records = _equal_length_records()
    store = stores.LocalStore(tmp_path)
    handles = [store.put(r) for r in records]
    with pytest.raises(RecordError, match=rf"record of sample 0 \({handles[1]}\): tokens differ"):
        with torch.no_grad(), trace_megatron.guidance(model, handles[::-1], layout):
            model(*inputs)
    handles = [store.put(r) for r in records]
    with torch.no_grad(), trace_megatron.guidance(model, handles, layout) as batch:
        model(*inputs)
    assert batch.metrics()["trace/records/tokens_checked"] == 2
    assert store.stats()["outstanding"] == 0
