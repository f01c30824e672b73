"""A take's records built together (engine/take.py: one native encoder call per layer and site for every
request) are byte for byte the records built one at a time (`assemble_record`); a request the batch
cannot take is left to the per-record build and counted, never dropped or silently rebuilt."""

import hashlib

import pytest
import torch
from record_factory import SHAPE

import trace_kernels as tk
from trace_kernels import cpu_native
from trace_kernels.engine import assemble_record
from trace_kernels.engine.captured_rows import ChunkJoiner, StepRows
from trace_kernels.engine.take import assemble_take, batches

REQUESTS, PROMPT, DECODE = 4, 5, 6


@pytest.fixture(autouse=True)
def native_records(monkeypatch):
    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "native")


def steps(seed=0, requests=REQUESTS, amax=None):
    """Per step: (n, {layer: ids}, {(layer, site): rows}), request i's rows at i * n."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in [PROMPT] + [1] * DECODE:
        T = n * requests
        routing = {layer: torch.randint(0, SHAPE.num_experts, (T, SHAPE.top_k), generator=g).to(torch.int16)
                   for layer in SHAPE.moe_layer_list()}
        sites = {}
        for layer in range(SHAPE.num_layers):
            for site in SHAPE.layer_sites(layer):
                x = torch.randn(T, *SHAPE.row_shape(site), generator=g)
                a = tk.row_amax(x) if amax is None else amax(x)
                sites[(layer, site)] = tk.quantize(x, a)
                if sites[(layer, site)].global_amax.numel() == 1:  # a static amax, per row as the store keeps it
                    q = sites[(layer, site)]
                    sites[(layer, site)] = tk.NVFP4Tensor(q.codes, q.scales, q.global_amax.reshape(1).expand(q.codes.shape[:-1]).contiguous())
        out.append((n, routing, sites))
    return out


def chunks_of(step_list, requests=REQUESTS, first_step=None):
    """Every request's chunks (routing StepRows, sites StepRows); request i starts at step first_step[i]."""
    first_step = first_step or [0] * requests
    out = [[] for _ in range(requests)]
    for s, (n, routing, sites) in enumerate(step_list):
        rb, sb = StepRows.row_bytes(routing), StepRows.row_bytes(sites)
        for i in range(requests):
            if s >= first_step[i]:
                out[i].append((StepRows(routing, i * n, (i + 1) * n, rb), StepRows(sites, i * n, (i + 1) * n, sb)))
    return out


def one_at_a_time(config, chunks, identities):
    joiner = ChunkJoiner()
    for c in chunks:
        joiner.expect(r for r, _ in c)
        joiner.expect(s for _, s in c)
    return [assemble_record(SHAPE, config, c, weights=(3, "ab" * 32), identity=ident, joiner=joiner).to_bytes()
            for c, ident in zip(chunks, identities)]


def together(config, chunks, identities):
    joiner = ChunkJoiner()
    for c in chunks:
        joiner.expect(r for r, _ in c)
        joiner.expect(s for _, s in c)
    return assemble_take(SHAPE, config, [(c, (3, "ab" * 32), ident) for c, ident in zip(chunks, identities)], joiner)


IDENTITIES = [{"token_digest": f"{i:064x}", "num_prompt_tokens": PROMPT} for i in range(REQUESTS)]


@pytest.mark.parametrize("config", [tk.TraceConfig(), tk.TraceConfig(sparse_audit=0.0), tk.TraceConfig(sparse_audit=0.5), tk.TraceConfig(guided_layers="deeper_half")],
                         ids=["default", "no-audit", "half-audited", "deeper-half"])
def test_a_take_built_together_is_byte_for_byte_the_records_built_alone(config):
    assert batches(SHAPE, config)
    chunks = chunks_of(steps(1))
    before = dict(cpu_native.FALLBACKS)
    records = together(config, chunks, IDENTITIES)
    assert all(r is not None for r in records) and dict(cpu_native.FALLBACKS) == before
    got = [r.to_bytes() for r in records]
    assert got == one_at_a_time(config, chunks, IDENTITIES)
    for b in got:  # and they read back, checksums verified
        tk.GuidanceRecord.from_bytes(b)


def test_requests_of_different_lengths_and_no_identity():
    # continuous batching: request i joined at step i (its prompt is then a decode step's one row)
    chunks = chunks_of(steps(2), first_step=[0, 1, 2, 0])
    idents = [None, {"token_digest": "cd" * 32}, None, {"num_prompt_tokens": 2}]
    records = together(tk.TraceConfig(), chunks, idents)
    assert [r.to_bytes() for r in records] == one_at_a_time(tk.TraceConfig(), chunks, idents)


def test_static_and_bf16_amax_rows_keep_their_payload_headers():
    # every row of a record sharing one amax (the static header) and bf16 amaxes (the shift-16 key)
    for amax in (lambda x: torch.tensor(3.0), lambda x: tk.row_amax(x).to(torch.bfloat16).to(torch.float32)):
        chunks = chunks_of(steps(3, amax=amax))
        records = together(tk.TraceConfig(), chunks, IDENTITIES)
        assert [r.to_bytes() for r in records] == one_at_a_time(tk.TraceConfig(), chunks, IDENTITIES)


def test_a_request_the_batch_cannot_take_is_left_to_the_record_builder_and_counted():
    chunks = chunks_of(steps(4))
    bad = [({**dict(r)}, {k: v for k, v in dict(s).items() if k != (1, "k")}) for r, s in chunks[1]]  # a site missing
    chunks[1] = bad
    idents = list(IDENTITIES)
    idents[2] = {"token_ids": [1, 2, 3]}  # token ids that do not fit its rows: the builder's refusal
    before = cpu_native.FALLBACKS["per_record:take"]
    records = together(tk.TraceConfig(), chunks, idents)
    assert [r is None for r in records] == [False, True, True, False]
    assert cpu_native.FALLBACKS["per_record:take"] == before + 2
    want = one_at_a_time(tk.TraceConfig(), [chunks[0], chunks[3]], [idents[0], idents[3]])
    assert [records[0].to_bytes(), records[3].to_bytes()] == want
    with pytest.raises(ValueError, match="site k"):
        assemble_record(SHAPE, tk.TraceConfig(), chunks[1])
    with pytest.raises(ValueError, match="token ids"):
        assemble_record(SHAPE, tk.TraceConfig(), chunks[2], identity=idents[2])


def test_only_sparse_records_on_the_native_encoder_are_batched(monkeypatch):
    assert not batches(SHAPE, tk.TraceConfig(guidance="full"))
    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "eager")
    assert not batches(SHAPE, tk.TraceConfig())


def test_the_worker_take_is_the_same_bytes_batched_or_not(monkeypatch):
    # the vLLM worker's RPC over a capture store (no engine): a take's 16-record SHA-256 is the same with
    # the batched build as with the per-record one (the check bench/record_encode.py's figures rely on)
    from record_factory import worker_take
    from trace_vllm_plugin import worker_rpc
    from trace_vllm_plugin.capture import CaptureStore, StepLayout

    ids = [f"r{i}" for i in range(REQUESTS)]
    step_list = steps(5)

    def take(batched: bool):
        monkeypatch.setattr(worker_rpc, "batches", lambda shape, config: batched)
        store = CaptureStore(SHAPE, tk.TraceConfig(), capacity=PROMPT * REQUESTS)
        pos = 0
        for n, routing, sites in step_list:
            store.begin_step(StepLayout(ids, [i * n for i in range(REQUESTS + 1)], [pos] * REQUESTS))
            for layer, t in routing.items():
                store.put_routing(layer, t)
            for (layer, site), q in sites.items():
                store.put(layer, site, q)
            store.end_step()
            pos += n
        for r in ids:
            store.finish(r)
        out = worker_take(store, ids + ["missing"], identities=IDENTITIES + [None])
        assert list(out) == ids + ["missing"] and "error" in out["missing"]
        return hashlib.sha256(b"".join(out[r]["record"] for r in ids)).hexdigest()

    assert take(True) == take(False)


def test_a_bad_identity_in_a_gathered_take_leaves_only_that_request(monkeypatch):
    # every request announced and sharing its steps (the joiner's one gather per key), one identity that
    # does not fit its rows: the others are built together, that one left to the builder (counted)
    from trace_kernels.engine.captured_rows import ChunkJoiner as Joiner

    gathers = []
    real = Joiner.gather
    monkeypatch.setattr(Joiner, "gather", lambda self, r: gathers.append(real(self, r)) or gathers[-1])
    chunks = chunks_of(steps(6))
    idents = list(IDENTITIES)
    idents[1] = {"token_ids": [1, 2, 3]}
    before = cpu_native.FALLBACKS["per_record:take"]
    records = together(tk.TraceConfig(), chunks, idents)
    assert gathers and all(g is not None for g in gathers)
    assert [r is None for r in records] == [False, True, False, False]
    assert cpu_native.FALLBACKS["per_record:take"] == before + 1
    keep = [0, 2, 3]
    assert [records[i].to_bytes() for i in keep] == one_at_a_time(tk.TraceConfig(), [chunks[i] for i in keep],
                                                                  [idents[i] for i in keep])


def test_audit_blobs_are_the_per_record_blobs():
    # a take whose every row is drawn (fraction 1.0) and one at half: every record's audit blob of every site
    # is audit_blob_numpy of its drawn rows (the rows audit_row_list draws per record and site)
    import numpy as np

    from trace_kernels.guides.sparse.audit import audit_blob_numpy, audit_row_list
    from trace_kernels.records.layout import tensor_name

    chunks = chunks_of(steps(5), first_step=[0, 1, 3, 0])
    idents = [{"token_digest": f"{i:064x}"} for i in range(REQUESTS)]  # ragged: no prompt length fits them all
    joiner = ChunkJoiner()
    for fraction in (1.0, 0.5):
        config = tk.TraceConfig(sparse_audit=fraction)
        records = together(config, chunks, idents)
        assert all(r is not None for r in records)
        for c, ident, record in zip(chunks, idents, records):
            sites = joiner.join(s for _, s in c)
            T = record.num_tokens
            for (layer, site), q in sites.items():
                rows = audit_row_list(T, layer, site, fraction, ident["token_digest"])
                want = audit_blob_numpy(np.array(rows, dtype=np.int64), q.codes.numpy())
                got = record.tensors[tensor_name(layer, site, "audit")]
                assert got.dtype == torch.uint8 and torch.equal(got, want), (layer, site)
                assert rows or got.numel() == 0
