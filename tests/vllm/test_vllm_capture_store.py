"""The worker-side capture store on its own (no engine): row bookkeeping across steps, preemption,
gaps, the memory budget, aborts. The engine tests cover the same paths end to end where vLLM lets
them happen on a CPU; preemption and budget pressure are easier to provoke here."""

import pytest
import torch

import trace_kernels
from trace_kernels import ModelShape, TraceConfig
from trace_vllm_plugin.capture import CaptureStore, StepLayout
from trace_vllm_plugin.worker_rpc import encode

SHAPE = ModelShape(num_layers=2, hidden_size=32, moe_intermediate_size=16, num_experts=4, top_k=2, num_kv_heads=1, head_dim=16)
CONFIG = TraceConfig(guidance="full", guided_layers="all")


def _store(max_bytes=1 << 30) -> CaptureStore:
    store = CaptureStore(SHAPE, CONFIG)
    store.max_bytes = max_bytes
    return store


def _step(store, req_ids, lengths, starts, seed):
    """One forward: random rows for every site, token t of the batch gets expert ids (t, t+1) % 4."""
    g = torch.Generator().manual_seed(seed)
    N = sum(lengths)
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    store.begin_step(StepLayout(req_ids, qsl, starts))
    for layer in range(SHAPE.num_layers):
        for site in ("moe_fc1_in", "moe_fc2_in", "k", "v"):
            x = torch.randn(N, *SHAPE.row_shape(site), generator=g)
            store.put(layer, site, trace_kernels.quantize(x, trace_kernels.row_amax(x)))
        t = torch.arange(N)
        store.put_routing(layer, torch.stack([t % 4, (t + 1) % 4], dim=1))
    store.end_step()


def test_rows_follow_requests_across_steps():
    store = _store()
    _step(store, ["a", "b"], [3, 5], [0, 0], seed=0)  # prefill
    _step(store, ["b", "a"], [1, 1], [5, 3], seed=1)  # decode, batch order changed
    store.finish("a")
    rec_a = encode(store.take("a", 4), store)
    rec_b = encode(store.take("b", 6), store)
    from trace_kernels import GuidanceRecord

    a, b = GuidanceRecord.from_bytes(rec_a), GuidanceRecord.from_bytes(rec_b)
    assert (a.num_tokens, b.num_tokens) == (4, 6)
    # Batch rows 0..2 then row 1 of the decode step belong to "a".
    assert a.routed_experts(0)[:, 0].tolist() == [0, 1, 2, 1]
    assert b.routed_experts(0)[:, 0].tolist() == [3, 0, 1, 2, 3, 0]


def test_preempted_request_is_recomputed_not_duplicated():
    store = _store()
    _step(store, ["a"], [4], [0], seed=0)
    _step(store, ["a"], [1], [4], seed=1)
    _step(store, ["a"], [5], [0], seed=2)  # preempted, recomputed from position 0
    cap = store.take("a", 5)
    assert cap.num_rows == 5 and store.counters["recomputed_rows"] == 5


def test_gap_is_reported():
    store = _store()
    _step(store, ["a"], [2], [3], seed=0)  # first rows start at position 3: a prefix-cache hit
    with pytest.raises(ValueError, match="never computed"):
        encode(store.take("a"), store)


def test_async_overrun_is_trimmed_and_later_rows_ignored():
    store = _store()
    _step(store, ["a"], [3], [0], seed=0)
    _step(store, ["a"], [1], [3], seed=1)  # a step past the end (async scheduling)
    assert store.take("a", 3).num_rows == 3
    _step(store, ["a"], [1], [4], seed=2)
    assert "a" not in store.live and store.counters["trimmed_rows"] == 1
    store.finish("a")
    assert not store.done


def test_budget_evicts_oldest_finished_first_and_says_so():
    store = _store()
    _step(store, ["a", "b", "c"], [4, 4, 4], [0, 0, 0], seed=0)
    per_request = store.live["a"].nbytes
    store.finish("a")
    store.finish("b")
    store.max_bytes = 2 * per_request + per_request // 2
    _step(store, ["c"], [1], [4], seed=1)
    assert "a" not in store.done and "b" in store.done and "c" in store.live
    assert store.counters["evicted_done_records"] == 1
    with pytest.raises(KeyError, match="evicted"):
        store.take("a")


def test_aborted_request_is_dropped():
    store = _store()
    _step(store, ["a"], [4], [0], seed=0)
    store.finish("a", aborted=True)
    with pytest.raises(KeyError, match="aborted"):
        store.take("a")
    assert store.counters["aborted_records_dropped"] == 1 and store.stats()["capture_bytes"] == 0


def test_forward_without_step_is_counted_not_attributed():
    store = _store()
    x = torch.randn(2, 32)
    store.put(0, "moe_fc1_in", trace_kernels.quantize(x, trace_kernels.row_amax(x)))
    store.put_routing(0, torch.zeros(2, 2, dtype=torch.int64))
    assert store.counters["unattributed_layer_calls"] == 1 and not store.live


def test_static_activation_amax_is_used():
    from trace_vllm_plugin import activations

    store = _store()
    store.config = TraceConfig(activation_scale="static", static_activation_amax={"1.k": 3.0}, capture=False)
    x = torch.randn(5, 2, 16)
    _, q = activations.quantize_input(store, x, 1, "k")
    expect = trace_kernels.quantize(x, torch.tensor([3.0]))
    assert torch.equal(q.codes, expect.codes) and torch.equal(q.scales, expect.scales)
    with pytest.raises(KeyError, match="0.v"):
        activations.quantize_input(store, x, 0, "v")


def test_prefix_cache_hit_is_served_from_a_running_or_cached_prompt():
    store = _store()
    store.serve_prefix_hits, store.block_size = True, 4
    prompt = list(range(10))
    # "a" prefills its 10-token prompt in three chunks; "b" (same prompt) hits the cache at 4 tokens
    # while "a" is still in its prefill: served from a's rows in flight.
    store.begin_step(StepLayout(["a"], [0, 6], [0], prompt_ids=[prompt]))
    _fill(store, 6, seed=0)
    store.end_step()
    store.begin_step(StepLayout(["a", "b"], [0, 2, 8], [6, 4], prompt_ids=[prompt, prompt]))
    _fill(store, 8, seed=1)
    store.end_step()
    store.begin_step(StepLayout(["a"], [0, 2], [8], prompt_ids=[prompt]))  # a's prompt completes
    _fill(store, 2, seed=4)
    store.end_step()
    a, b = encode(store.take("a", 10), store), encode(store.take("b", 10), store)  # b: prompt + 1 token
    from trace_kernels import GuidanceRecord

    ra, rb = GuidanceRecord.from_bytes(a), GuidanceRecord.from_bytes(b)
    for name, t in ra.tensors.items():
        assert torch.equal(rb.tensors[name][:4], t[:4]), name
        if name.endswith("codes"):  # b computed its own rows from 4 on
            assert not torch.equal(rb.tensors[name][4:], t[4:]), name
    assert store.counters["prefix_hits_served_from_running"] == 1
    # "c" hits 8 tokens after "a" finished: served from the registered prompt rows.
    store.begin_step(StepLayout(["c"], [0, 2], [8], prompt_ids=[prompt]))
    _fill(store, 2, seed=2)
    store.end_step()
    rc = GuidanceRecord.from_bytes(encode(store.take("c", 10), store))
    for name, t in ra.tensors.items():
        assert torch.equal(rc.tensors[name][:8], t[:8]), name
    assert store.counters["prefix_hits_served"] == 2
    # A hit nobody can serve (another prompt) makes that record fail with the reason.
    store.begin_step(StepLayout(["d"], [0, 2], [8], prompt_ids=[list(range(50, 60))]))
    _fill(store, 2, seed=3)
    store.end_step()
    with pytest.raises(ValueError, match="prefix-cache hit of 8 tokens that the prefix-rows cache cannot serve"):
        encode(store.take("d", 10), store)


def _fill(store, N, seed):
    g = torch.Generator().manual_seed(seed)
    for layer in range(SHAPE.num_layers):
        for site in ("moe_fc1_in", "moe_fc2_in", "k", "v"):
            x = torch.randn(N, *SHAPE.row_shape(site), generator=g)
            store.put(layer, site, trace_kernels.quantize(x, trace_kernels.row_amax(x)))
        store.put_routing(layer, torch.randint(0, 4, (N, 2), generator=g))


def test_repeated_writes_and_reads_are_the_checked_ones():
    """The second write of T rows to a key (and a read of the same keys and rows) skips the checks of
    the first (StepBuffers._fast_writes, _read_plans): the buffers, stamps and host rows are the same
    as the first's, a scalar amax after per-row ones still goes through the checked path, and an op's
    own buffers (allocate_moe_layer) are kept apart from the store's."""
    from trace_kernels.engine.step_buffers import StepBuffers

    bufs = StepBuffers(8)
    g = torch.Generator().manual_seed(3)
    for step in range(1, 4):
        bufs.begin(step)
        x = torch.randn(3, 32, generator=g)
        q = trace_kernels.quantize(x, trace_kernels.row_amax(x))
        ids = torch.randint(0, 4, (3, 2), generator=g)
        assert bufs.write_site(0, "moe_fc1_in", q) and bufs.write_routing(0, ids)
        rows = bufs.read([(0, "moe_fc1_in"), ("routing", 0)], 0, 3)
        assert torch.equal(rows[(0, "moe_fc1_in")].codes, q.codes) and torch.equal(rows[(0, "moe_fc1_in")].scales, q.scales)
        assert torch.equal(rows[(0, "moe_fc1_in")].global_amax, q.global_amax)
        assert torch.equal(rows[("routing", 0)], ids.to(torch.int16))
        assert bufs.missing(step, [(0, "moe_fc1_in"), ("routing", 0)], 3) == []
    # A scalar amax (a static one) after per-row ones: expanded to every row, as the first write would.
    x = torch.randn(3, 32, generator=g)
    q = trace_kernels.quantize(x, torch.tensor(4.0))
    assert bufs.write_site(0, "moe_fc1_in", q)
    assert bufs.read([(0, "moe_fc1_in")], 0, 3)[(0, "moe_fc1_in")].global_amax.tolist() == [4.0] * 3
    # An op's operands for layer 1: written through them, read by key.
    ops = bufs.allocate_moe_layer(1, 32, 16, 2, True, "cpu")
    into = ((ops[1], ops[2], ops[3]), ops[7][1], ops[8])
    for _ in range(2):
        x = torch.randn(3, 32, generator=g)
        q = trace_kernels.quantize(x, trace_kernels.row_amax(x))
        assert bufs.write_site(1, "moe_fc1_in", q, into)
        assert torch.equal(ops[1][:3], q.codes) and ops[7][1].tolist() == [3, 3]
    assert torch.equal(bufs.read([(1, "moe_fc1_in")], 0, 3)[(1, "moe_fc1_in")].codes, q.codes)


def _owned_steps(host_rows: bool, skip=None):
    """Three steps (a prefill of 3 + 5 rows, two decodes) with every site put by `put_owned` and the routed
    ids by `put_routing`, on a store with or without the native engine's host rows; `skip`: a key the
    last step's forward does not write. Returns (the store, each request's record bytes or the error)."""
    store = _store()
    store.host_rows = host_rows
    g = torch.Generator().manual_seed(3)
    for i, (ids, lengths, starts) in enumerate(((["a", "b"], [3, 5], [0, 0]), (["b", "a"], [1, 1], [5, 3]),
                                                (["a", "b"], [1, 1], [4, 6]))):
        N = sum(lengths)
        store.begin_step(StepLayout(ids, [0, lengths[0], N], starts))
        for layer in range(SHAPE.num_layers):
            for site in ("moe_fc1_in", "moe_fc2_in", "k", "v"):
                x = torch.randn(N, *SHAPE.row_shape(site), generator=g)
                if (i, layer, site) != skip:
                    store.put_owned(layer, site, trace_kernels.quantize(x, trace_kernels.row_amax(x)))
            t = torch.arange(N) + i
            store.put_routing(layer, torch.stack([t % 4, (t + 1) % 4], dim=1))
        store.end_step()
    out = {}
    for r, n in (("a", 5), ("b", 7)):
        store.finish(r)
        cap = store.take(r, n)
        out[r] = cap.error if cap.error is not None else encode(cap, store)
    return store, out


def test_the_native_engines_host_rows_make_the_buffers_records():
    """The native CPU engine's step keeps the kernels' own tensors (put_owned, no buffer copies or clones):
    the same record bytes as the static buffers give; a key its forward did not write still fails the
    step's requests by name; the first write of a key (the buffers not made yet) goes through them."""
    buffered, host = _owned_steps(False), _owned_steps(True)
    assert host[1] == buffered[1] and all(isinstance(v, bytes) for v in host[1].values())
    assert not host[0]._host_rows  # a step's kept rows go with the step
    # Rows of the later steps never reached the buffers (step 1 wrote them there; steps 2, 3 kept their own).
    assert host[0].buffers.stamps[(0, "k")][0].item() == 1 and buffered[0].buffers.stamps[(0, "k")][0].item() == 3
    _, missing = _owned_steps(True, skip=(2, 1, "v"))
    assert all("did not write the capture of 1.v" in missing[r] for r in ("a", "b"))
