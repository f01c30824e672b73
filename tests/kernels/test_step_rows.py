"""A request's chunks as the vLLM capture store keeps them (StepRows: its rows of each step's host copy)
join into the same rows, and the same record bytes, as per-request copies; chunks that do not join are
handed to the builder one by one, which names what is wrong."""

import pytest
import torch
from record_factory import SHAPE

import trace_kernels as tk
from trace_kernels.engine import assemble_record
from trace_kernels.engine.captured_rows import (ChunkJoiner, RequestCapture, StepCapture, StepChunks, StepRows, chunk_nbytes,
                                                copy_rows, join_chunks)

REQUESTS, PROMPT, DECODE = 3, 4, 5


def steps(seed=0):
    """Per step: ({layer: ids}, {(layer, site): rows}) of every request, request i's rows at i * n."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in [PROMPT] + [1] * DECODE:
        T = n * REQUESTS
        routing = {layer: torch.randint(0, SHAPE.num_experts, (T, SHAPE.top_k), generator=g).to(torch.int16)
                   for layer in range(SHAPE.num_layers)}
        sites = {}
        for layer in range(SHAPE.num_layers):
            for site in SHAPE.layer_sites(layer):
                x = torch.randn(T, *SHAPE.row_shape(site), generator=g)
                sites[(layer, site)] = tk.quantize(x, tk.row_amax(x))
        out.append((n, routing, sites))
    return out


def captures(step_list):
    """(StepRows chunks, per-request copies) of every request."""
    lazy, copies = [[] for _ in range(REQUESTS)], [[] for _ in range(REQUESTS)]
    for n, routing, sites in step_list:
        rb, sb = StepRows.row_bytes(routing), StepRows.row_bytes(sites)
        for i in range(REQUESTS):
            a, b = i * n, (i + 1) * n
            lazy[i].append((StepRows(routing, a, b, rb), StepRows(sites, a, b, sb)))
            copies[i].append(({k: v[a:b].clone() for k, v in routing.items()},
                              {k: copy_rows(q, a, b) for k, q in sites.items()}))
    return lazy, copies


def test_step_rows_read_as_the_requests_rows_and_count_its_bytes():
    n, routing, sites = steps()[0]
    rows = StepRows(sites, n, 2 * n, StepRows.row_bytes(sites))
    ids = StepRows(routing, n, 2 * n, StepRows.row_bytes(routing))
    q = rows[(0, "k")]
    assert torch.equal(q.codes, sites[(0, "k")].codes[n : 2 * n]) and q.global_amax.shape == q.codes.shape[:-1]
    assert set(rows) == set(sites) and len(ids) == SHAPE.num_layers
    assert chunk_nbytes(rows, ids) == chunk_nbytes(dict(rows), dict(ids))


def test_records_from_step_rows_equal_records_from_copies():
    lazy, copies = captures(steps())
    joiner = ChunkJoiner()  # shared, as one take of every request
    for mine, theirs in zip(lazy, copies):
        want = assemble_record(SHAPE, tk.TraceConfig(), theirs).to_bytes()
        assert assemble_record(SHAPE, tk.TraceConfig(), mine, joiner=joiner).to_bytes() == want
        assert assemble_record(SHAPE, tk.TraceConfig(), mine).to_bytes() == want
    assert len(joiner._steps) == 2  # the steps' routing and sites, joined once for the second and third


def test_truncated_capture_mixes_copies_and_step_rows():
    lazy, copies = captures(steps(1))
    cap = RequestCapture()
    for r, s in lazy[1]:
        cap.append(next(iter(s.values())).codes.shape[0], s, r)
    cap.truncate(PROMPT + 2)  # the last chunk kept becomes a copy (a plain dict)
    want = assemble_record(SHAPE, tk.TraceConfig(), copies[1][:3]).to_bytes()
    assert assemble_record(SHAPE, tk.TraceConfig(), cap.record_chunks()).to_bytes() == want


def test_rows_that_do_not_join_are_refused_by_name():
    lazy, _ = captures(steps(2))
    chunks = list(lazy[0])
    r, s = chunks[-1]
    bad = dict(s)
    q = bad[(2, "moe_fc1_in")]
    bad[(2, "moe_fc1_in")] = tk.NVFP4Tensor(q.codes[:, :16], q.scales[:, :2], q.global_amax)  # rows of 32, not 64
    chunks[-1] = (r, bad)
    with pytest.raises(ValueError, match="layer 2, site moe_fc1_in: rows of shape"):
        assemble_record(SHAPE, tk.TraceConfig(), chunks)


def test_chunks_with_other_keys_join_key_by_key():
    # a chunk that lacks a key the others have (as many keys, one different): joined per key, and the
    # missing rows make the record refuse that site by name
    lazy, copies = captures(steps(3))
    chunks = [(r, dict(s)) for r, s in lazy[2]]
    r, s = chunks[1]
    q = s.pop((3, "v"))
    s[(3, "x")] = q
    with pytest.raises(ValueError, match="unknown site .x."):
        assemble_record(SHAPE, tk.TraceConfig(), chunks)


def test_the_joiner_holds_whole_steps_only_for_requests_that_share_them():
    lazy, copies = captures(steps(4))
    joiner = ChunkJoiner()
    want = assemble_record(SHAPE, tk.TraceConfig(), copies[0]).to_bytes()
    # one request of three in the steps: its own rows only, nothing kept
    assert assemble_record(SHAPE, tk.TraceConfig(), lazy[0], joiner=joiner).to_bytes() == want
    assert not joiner._steps
    # the second brings the rows seen to two thirds of the steps': joined whole, kept for the third
    for i in (1, 2):
        want = assemble_record(SHAPE, tk.TraceConfig(), copies[i]).to_bytes()
        assert assemble_record(SHAPE, tk.TraceConfig(), lazy[i], joiner=joiner).to_bytes() == want
    assert len(joiner._steps) == 2


def test_an_announced_take_gathers_every_request_at_once_with_the_same_bytes():
    # a take announces its requests (expect), then each key's rows of all of them are gathered by one
    # index and each request is a slice of it; taken in another order, and one request of the steps
    # not announced (indexed on its own): every record as from per-request copies
    lazy, copies = captures(steps(5))
    joiner = ChunkJoiner()
    for i in (0, 2):
        joiner.expect(r for r, _ in lazy[i])
        joiner.expect(s for _, s in lazy[i])
    for i in (2, 1, 0):
        want = assemble_record(SHAPE, tk.TraceConfig(), copies[i]).to_bytes()
        assert assemble_record(SHAPE, tk.TraceConfig(), lazy[i], joiner=joiner).to_bytes() == want
    # routing and sites, each with its rows per step (the prompt's and the decode steps')
    assert len(joiner._batched) == 2
    assert all(len(offsets) == 2 for _, offsets in joiner._batched.values())


def appended(step_list, i, prefix=None):
    """Request i's capture as the capture store appends it: each step's one StepCapture and its rows
    (after `prefix`, a plain chunk of copies, when given)."""
    cap = RequestCapture()
    if prefix is not None:
        r, s = prefix
        cap.append(next(iter(r.values())).shape[0], s, r)
    for n, routing, sites in step_list:
        step = StepCapture(sites, routing, StepRows.row_bytes(sites), StepRows.row_bytes(routing))
        cap.append_step(step, i * n, (i + 1) * n)
    return cap


def test_appended_steps_are_the_step_rows_chunks_and_the_same_record():
    # append_step keeps a reference and a row range per step; read as chunks, or taken as a StepChunks
    # layout, the rows, bytes and record are those of StepRows pairs (and of per-request copies)
    step_list = steps(6)
    lazy, copies = captures(step_list)
    want = assemble_record(SHAPE, tk.TraceConfig(), copies[1]).to_bytes()
    cap = appended(step_list, 1)
    mine = cap.record_chunks()
    assert isinstance(mine, StepChunks) and len(mine) == len(lazy[1]) and mine.rows() == cap.num_rows
    assert cap.nbytes == sum(chunk_nbytes(s, r) for r, s in lazy[1])
    for (r, s), (r2, s2) in zip(mine, lazy[1]):
        assert (r.step, r.start, r.stop, s.step, s.start, s.stop) == (r2.step, r2.start, r2.stop, s2.step, s2.start, s2.stop)
    assert assemble_record(SHAPE, tk.TraceConfig(), mine).to_bytes() == want
    # read as chunks (truncate, prefix rows, rank parts): the same StepRows, in token order
    assert [(n, s.start, s.stop) for n, s, _ in cap.chunks] == [(s.stop - s.start, s.start, s.stop) for _, s in lazy[1]]
    assert assemble_record(SHAPE, tk.TraceConfig(), cap.record_chunks()).to_bytes() == want
    # a plain chunk first (a prefix-served one): chunks in order, no StepChunks
    first = copies[0][0]
    cap = appended(step_list[1:], 1, prefix=first)
    assert not isinstance(cap.record_chunks(), StepChunks)
    assert cap.chunks[0][1] is first[1] and len(cap.chunks) == len(step_list)


def test_a_take_gathers_step_chunks_by_their_layout_with_the_same_bytes():
    step_list = steps(7)
    _, copies = captures(step_list)
    chunks = [appended(step_list, i).record_chunks() for i in range(REQUESTS)]
    joiner = ChunkJoiner()
    for c in chunks:
        joiner.expect_chunks(c)
    routing = joiner.gather_layouts([(c.routing, c.ranges) for c in chunks])
    sites = joiner.gather_layouts([(c.sites, c.ranges) for c in chunks])
    T = [c.rows() for c in chunks]
    for i, c in enumerate(chunks):
        a, b = sum(T[:i]), sum(T[: i + 1])
        theirs = join_chunks(r for r, _ in copies[i]), join_chunks(s for _, s in copies[i])
        assert all(torch.equal(routing[k][a:b], v) for k, v in theirs[0].items())
        assert all(torch.equal(getattr(sites[k], f)[a:b], getattr(v, f)) for k, v in theirs[1].items()
                   for f in ("codes", "scales", "global_amax"))
    assert all(c._pairs is None for c in chunks)  # gathered without a StepRows pair per step
