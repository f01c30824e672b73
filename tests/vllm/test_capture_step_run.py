"""The capture store's run of an unchanged batch (kernels/engine/step_run.py): steps in which the same
requests ran with the same rows are appended once for all of them, and each request's rows, counters and
budget are what one append per request and step gave. Every event that changes what a step appends
(a preemption, a take of a running request, a finish, a weight update, an eviction) ends the run at
that step. No engine: the store driven as the runner hook drives it, each request's rows checked against
the rows the test put for it."""

import math

import torch

import trace_kernels
from trace_kernels import ModelShape, TraceConfig
from trace_kernels.engine.captured_rows import ChunkJoiner, chunk_nbytes
from trace_vllm_plugin.capture import CaptureStore, StepLayout

SHAPE = ModelShape(num_layers=2, hidden_size=32, moe_intermediate_size=16, num_experts=4, top_k=2, num_kv_heads=1, head_dim=16)
CONFIG = TraceConfig(guidance="full", guided_layers="all")
SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")


class Driver:
    """Steps of random rows through a store (put_owned, the native engine's host rows), remembering each
    request's rows of every key at each position: what its capture must hold."""

    def __init__(self, store, seed=0):
        self.store, self.g = store, torch.Generator().manual_seed(seed)
        self.rows: dict = {}  # request -> {position: {key: one row}}

    def step(self, ids, lengths, starts):
        qsl = [0]
        for n in lengths:
            qsl.append(qsl[-1] + n)
        N = qsl[-1]
        self.store.begin_step(StepLayout(list(ids), qsl, list(starts)))
        put = {}
        for layer in range(SHAPE.num_layers):
            ids_t = torch.randint(0, 4, (N, 2), generator=self.g)
            self.store.put_routing(layer, ids_t)
            put[("routing", layer)] = ids_t.to(torch.int16)
            for site in SITES:
                x = torch.randn(N, *SHAPE.row_shape(site), generator=self.g)
                q = trace_kernels.quantize(x, trace_kernels.row_amax(x))
                self.store.put_owned(layer, site, q)
                put[(layer, site)] = q.codes
        self.store.end_step()
        for r, a, b, s in zip(ids, qsl, qsl[1:], starts):
            per = self.rows.setdefault(r, {})
            for j in range(b - a):
                per[s + j] = {k: v[a + j] for k, v in put.items()}

    def check(self, cap, r, rows):
        """`cap` holds `rows` rows: request r's rows at positions 0..rows-1, as the test put them."""
        assert cap.num_rows == rows
        chunks = cap.record_chunks()
        joiner = ChunkJoiner()
        routing = joiner.join([x for x, _ in chunks])
        sites = joiner.join([s for _, s in chunks])
        for layer in range(SHAPE.num_layers):
            want = torch.stack([self.rows[r][p][("routing", layer)] for p in range(rows)])
            assert torch.equal(routing[layer], want)
            for site in SITES:
                want = torch.stack([self.rows[r][p][(layer, site)] for p in range(rows)])
                assert torch.equal(sites[(layer, site)].codes, want)
        # bytes as the per-step appends counted them: every chunk's rows times its step's row bytes
        assert cap.nbytes == sum(chunk_nbytes(s, r) for _, s, r in cap.chunks)


def _store():
    store = CaptureStore(SHAPE, CONFIG)
    store.host_rows = True
    store.max_bytes = 1 << 30
    return store


def test_an_unchanged_batch_is_one_run_and_each_request_gets_its_rows():
    store = _store()
    d = Driver(store)
    ids = ["a", "b", "c"]
    d.step(ids, [3, 2, 4], [0, 0, 0])  # prefill: appended request by request, a run starts
    for t in range(6):
        d.step(ids, [1, 1, 1], [3 + t, 2 + t, 4 + t])
    run = store._run.run
    # The first decode step (a new batch shape) starts the run, each request joining it with its rows;
    # the five after it are appended once each, to the run.
    assert len(run.steps) == 6
    assert store.counters["captured_rows"] == 9 + 18
    for r, n in zip(ids, (9, 8, 10)):
        cap = store.take(r, n)
        d.check(cap, r, n)


def test_events_inside_a_run_end_it_at_that_step():
    store = _store()
    d = Driver(store, seed=1)
    pos = {"a": 0, "b": 0, "c": 0}

    def step(ids, lengths=None):
        lengths = lengths or [1] * len(ids)
        d.step(ids, lengths, [pos[r] for r in ids])
        for r, n in zip(ids, lengths):
            pos[r] += n

    step(["a", "b", "c"], [2, 3, 2])
    step(["a", "b", "c"])
    step(["a", "b", "c"])
    # Preempted: "b" recomputed from position 1 within the same batch order.
    pos["b"] = 1
    first_run = store._run.run
    step(["a", "b", "c"], [1, 3, 1])
    assert store._run.run is not first_run and store.counters["recomputed_rows"] == 4
    step(["a", "b", "c"])
    # A weight update: the next step is appended per request, the record says which rows are new.
    store.weights.updated(0, "digest-1")
    step(["a", "b", "c"])
    step(["a", "b", "c"])
    assert store.live["a"].weight_changes == [(pos["a"] - 2, store.current_weights())]
    # "c" taken while running (before the engine saw it finish): later steps do not give it rows.
    cap_c = store.take("c", pos["c"])
    d.check(cap_c, "c", pos["c"])
    step(["a", "b", "c"])
    step(["a", "b", "c"])
    assert store.requests.taken == {"c"} and cap_c.num_rows == pos["c"] - 2
    # The budget lowered to below what the captures hold: the step evicts the largest live one.
    store.max_bytes = store.requests.total_bytes()
    step(["a", "b"])
    evicted = {"a", "b"} - set(store.live)
    assert store.counters["evicted_live_records"] == 1 and len(evicted) == 1
    (gone,), (kept,) = evicted, {"a", "b"} - evicted
    step(["a", "b"])  # the evicted one again: a new capture that misses its first rows, by name
    assert "never computed" in store.live[gone].error
    store.max_bytes = 1 << 30
    store.finish(kept)
    d.check(store.take(kept, pos[kept]), kept, pos[kept])


def test_a_step_of_no_rows_does_not_zero_the_next_steps_bytes():
    """A step with no rows (every request of its layout at zero rows) measures 0 bytes a row (row_bytes
    divides by the rows); the store keeps a step's row bytes for the next steps of the same keys, so it
    must not keep that 0: the steps after it would count their rows as 0 bytes against the budget."""
    store = _store()
    d = Driver(store)
    d.step(["a"], [3], [0])
    d.step(["a"], [0], [3])  # the request scheduled with no rows this step
    d.step([], [], [])  # and a step of no request at all
    d.step(["a"], [1], [3])
    cap = store.requests.live["a"]
    d.check(cap, "a", 4)
    assert cap.nbytes > 0 and cap.nbytes == sum(chunk_nbytes(s, r) for _, s, r in cap.chunks)
    # one row of every key: each site's codes, block scales and float32 amax per row; top_k int16 routing ids
    per_row = 0
    for site in SITES:
        *inner, K = SHAPE.row_shape(site)
        per_row += math.prod(inner) * (K // 2 + K // 16 + 4)
    per_row = SHAPE.num_layers * (per_row + 2 * SHAPE.top_k)
    assert cap.nbytes == 4 * per_row
