"""A take of requests that ran in different steps (continuous batching: requests that end at different
lengths, or join later) is gathered per key in one concatenation and one index (step_gather.py): the
same rows as each request's own join, the same record bytes as records built one at a time, and no
gather where it does not apply (the per-request join then names what is wrong)."""

import pytest
import torch
from record_factory import SHAPE

import trace_kernels as tk
from trace_kernels import cpu_native
from trace_kernels.engine import assemble_record
from trace_kernels.engine.captured_rows import ChunkJoiner, RequestCapture, StepCapture, StepRows, copy_rows, join_chunks
from trace_kernels.engine.step_gather import gather_step_chunks
from trace_kernels.engine.take import assemble_take

# request: (first step, last step + 1, prefill rows); requests end at different steps, one joins late
SPANS = [(0, 9, 5), (0, 4, 3), (2, 7, 1), (0, 9, 2), (5, 6, 4)]


@pytest.fixture(autouse=True)
def native_records(monkeypatch):
    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "native")


def ragged(seed=0, spans=SPANS, extra_rows=0):
    """(every request's capture as the store appends it, every request's per-step copies): each step
    holds the running requests' rows back to back (a request's first step its prefill, then one row),
    plus `extra_rows` rows of requests not taken."""
    g = torch.Generator().manual_seed(seed)
    caps = [RequestCapture() for _ in spans]
    copies = [[] for _ in spans]
    for s in range(max(b for _, b, _ in spans)):
        running = [(i, p if s == a else 1) for i, (a, b, p) in enumerate(spans) if a <= s < b]
        T = sum(n for _, n in running) + extra_rows
        routing = {layer: torch.randint(0, SHAPE.num_experts, (T, SHAPE.top_k), generator=g).to(torch.int16)
                   for layer in SHAPE.moe_layer_list()}
        sites = {}
        for layer in range(SHAPE.num_layers):
            for site in SHAPE.layer_sites(layer):
                x = torch.randn(T, *SHAPE.row_shape(site), generator=g)
                sites[(layer, site)] = tk.quantize(x, tk.row_amax(x))
        step = StepCapture(sites, routing, StepRows.row_bytes(sites), StepRows.row_bytes(routing))
        at = extra_rows // 2  # rows of other requests before and after the taken ones
        for i, n in running:
            caps[i].append_step(step, at, at + n)
            copies[i].append(({k: v[at : at + n].clone() for k, v in routing.items()},
                              {k: copy_rows(q, at, at + n) for k, q in sites.items()}))
            at += n
    return caps, copies


def test_requests_of_different_steps_gather_into_their_own_rows():
    caps, copies = ragged(1)
    chunks = [c.record_chunks() for c in caps]
    got = gather_step_chunks(chunks)
    assert got is not None
    routing, sites = got
    T = [c.rows() for c in chunks]
    assert T == [p + (b - a - 1) for a, b, p in SPANS]
    for i in range(len(SPANS)):
        a, b = sum(T[:i]), sum(T[: i + 1])
        want_r, want_s = join_chunks(r for r, _ in copies[i]), join_chunks(s for _, s in copies[i])
        assert all(torch.equal(routing[k][a:b], v) for k, v in want_r.items())
        assert all(torch.equal(getattr(sites[k], f)[a:b], getattr(v, f)) for k, v in want_s.items()
                   for f in ("codes", "scales", "global_amax"))
    assert routing[SHAPE.moe_layer_list()[0]].shape[0] == sum(T)
    assert all(c._pairs is None for c in chunks)  # gathered without a StepRows pair per step


def test_a_take_of_different_steps_is_built_together_byte_for_byte(monkeypatch):
    import trace_kernels.engine.take as take

    gathered = []
    monkeypatch.setattr(take, "gather_step_chunks", lambda c: gathered.append(gather_step_chunks(c)) or gathered[-1])
    caps, copies = ragged(2)
    idents = [{"token_digest": f"{i:064x}", "num_prompt_tokens": p} for i, (_, _, p) in enumerate(SPANS)]
    chunks = [c.record_chunks() for c in caps]
    joiner = ChunkJoiner()
    for c in chunks:
        joiner.expect_chunks(c)
    before = dict(cpu_native.FALLBACKS)
    records = assemble_take(SHAPE, tk.TraceConfig(), [(c, (3, "ab" * 32), ident) for c, ident in zip(chunks, idents)], joiner)
    assert all(r is not None for r in records) and dict(cpu_native.FALLBACKS) == before
    assert len(gathered) == 1 and gathered[0] is not None  # one gather for the take, not a join per request
    for r, mine, ident in zip(records, copies, idents):
        alone = assemble_record(SHAPE, tk.TraceConfig(), mine, weights=(3, "ab" * 32), identity=ident)
        assert r.to_bytes() == alone.to_bytes()


def test_no_gather_where_it_does_not_apply():
    caps, _ = ragged(3)
    chunks = [c.record_chunks() for c in caps]
    # a few requests of many running: concatenating every step's rows would be more than twice theirs
    few, _ = ragged(3, extra_rows=40)
    assert gather_step_chunks([c.record_chunks() for c in few]) is None
    assert gather_step_chunks([c.record_chunks() for c in few[:1]] * 0) is None  # nothing to take
    # a range past its step's rows: the per-request join names it
    bad = [c.record_chunks() for c in caps]
    bad[1].ranges[-1] = (bad[1].ranges[-1][0], bad[1].ranges[-1][1] + 50)
    assert gather_step_chunks(bad) is None
    # a step without a key the first step has
    step = chunks[0].steps[3]
    key = next(iter(step.sites))
    kept = step.sites.pop(key)
    try:
        assert gather_step_chunks(chunks) is None
    finally:
        step.sites[key] = kept
    assert gather_step_chunks(chunks) is not None
