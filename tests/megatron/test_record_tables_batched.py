"""The record tables built in batches (records/site_batch.py: every sparse (layer, site) of a micro-batch
in a few numba calls; audits read as numpy) must equal what one GuidanceRecord.site_of_all / .audit per
(layer, site) gives, on records a real capture made; where the batch is not the native path's case it
must leave the sites to site_of_all (same tables), and a damaged payload must still be refused naming the
record, layer and site. feeding's module walk must find the modules Module.modules() finds, in order."""

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("numba")
import megatron_cpu as mc  # noqa: E402

mc.init_parallel()

import trace_megatron  # noqa: E402
from trace_kernels import GuidanceRecord, RecordError, TraceConfig  # noqa: E402
from trace_kernels.records.layout import tensor_name  # noqa: E402
from trace_kernels.records.site_batch import sparse_sites_of_all  # noqa: E402
from trace_megatron import feeding  # noqa: E402
from trace_megatron.record_tables import RecordTables  # noqa: E402

SPARSE = TraceConfig(guidance="sparse", guided_layers="all", sparse_audit=0.25)  # audits enough rows to compare
LENGTHS, SEQ = [16, 11, 16], 16


def noisy_engine(x):
    xf = x.float()
    noise = torch.frac(torch.sin(xf * 12345.678) * 43758.5453) - 0.5
    return (xf * (1 + 2.0**-7 * noise)).to(x.dtype)


@pytest.fixture(scope="module")
def captured():
    cfg = mc.tiny_config(params_dtype=torch.bfloat16, bf16=True)
    model = mc.tiny_model(cfg, trace_config=SPARSE, seed=5)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    with torch.no_grad(), trace_megatron.capture(model, layout, perturb=noisy_engine) as cap:
        model(*mc.padded_batch(LENGTHS, SEQ, seed=2))
    return model, layout, cap.build_records(SPARSE)


def _keys(records):
    shape = records[0].shape
    return [(layer, site) for layer in range(shape.num_layers) for site in shape.layer_sites(layer)]


def _same_guide(a, b):
    assert type(a) is type(b)
    for x, y in zip((a.syndromes, a.scale_syndromes, a.row_header), (b.syndromes, b.scale_syndromes, b.row_header)):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_batched_sites_equal_site_of_all(monkeypatch, captured):
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "native")
    _, _, records = captured
    keys = _keys(records)
    batched = sparse_sites_of_all(records, keys)
    assert batched is not None and sorted(batched) == sorted(keys)
    for layer, site in keys:
        _same_guide(batched[(layer, site)], GuidanceRecord.site_of_all(records, layer, site))
    # the batch holds rows of every record: not a one-record special case
    assert batched[keys[0]].syndromes.shape[0] == sum(r.num_tokens for r in records)


def test_not_the_native_case_leaves_sites_to_site_of_all(monkeypatch, captured):
    _, _, records = captured
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "eager")
    assert sparse_sites_of_all(records, _keys(records)) is None
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "native")
    assert sparse_sites_of_all(records[:1], _keys(records)) is None  # one record: site_of_all's own path


def test_tables_equal_per_site_reads(monkeypatch, captured):
    """Every table build_all makes from batched sites and numpy audits, against site_of_all and audit read
    one (layer, site) at a time."""
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "native")
    model, layout, records = captured
    _, shape, config = feeding._model_info(model)
    tables = RecordTables(shape, config, layout, records, torch.device("cpu")).build_all()
    audited = 0
    offsets = np.cumsum([0] + [r.num_tokens for r in records])
    row_of = tables.record_rows(torch.arange(layout.num_positions))
    for layer, site in _keys(records):
        _same_guide(tables.site_table(layer, site), GuidanceRecord.site_of_all(records, layer, site))
        by_pos, codes = tables.audit_by_position(layer, site)
        parts = [r.audit(layer, site) for r in records]
        assert torch.equal(codes, torch.cat([q for _, q in parts]))
        # position p reads audit row j where its record row is the j-th audited row, in record order
        flat = torch.cat([torch.as_tensor(off) + rows for (rows, _), off in zip(parts, offsets[:-1])])
        expect = torch.full_like(by_pos, -1)
        for j, row in enumerate(flat.tolist()):
            expect[row_of == row] = j
        assert torch.equal(by_pos, expect)
        audited += flat.numel()
    assert audited > 0  # 25% of the rows: something was compared


def test_damaged_payload_is_refused_naming_the_record(monkeypatch, captured):
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "native")
    model, layout, records = captured
    name = tensor_name(1, "v", "sparse")
    broken = GuidanceRecord(records[1].shape, records[1].config, records[1].num_tokens, records[1].modes,
                            {**records[1].tensors, name: records[1].tensors[name][:-1]}, records[1].identity)
    batch = [records[0], broken, records[2]]
    assert sparse_sites_of_all(batch, _keys(records)) is None
    _, shape, config = feeding._model_info(model)
    tables = RecordTables(shape, config, layout, batch, torch.device("cpu"))
    _same_guide(tables.site_table(0, "k"), GuidanceRecord.site_of_all(records, 0, "k"))  # the good sites read
    with pytest.raises(RecordError, match=r"layer 1, site v: record 1.*bytes"):
        tables.site_table(1, "v")


def test_damaged_audit_is_refused_naming_layer_and_site(monkeypatch, captured):
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "native")
    model, layout, records = captured
    name = tensor_name(0, "k", "audit")
    blob = records[0].tensors[name].clone()
    assert blob.numel() >= 2 * (blob.numel() // 2)
    n = records[0].audit(0, "k")[0].numel()
    assert n >= 2
    blob[:4] = blob[4:8]  # the first row repeated: rows no longer increasing
    bad = GuidanceRecord(records[0].shape, records[0].config, records[0].num_tokens, records[0].modes,
                         {**records[0].tensors, name: blob}, records[0].identity)
    _, shape, config = feeding._model_info(model)
    tables = RecordTables(shape, config, layout, [bad] + records[1:], torch.device("cpu"))
    with pytest.raises(RecordError, match=r"layer 0, site k: audit rows must be increasing"):
        tables.audit_by_position(0, "k")


def test_module_walk_is_modules_order(captured):
    model = captured[0]
    shared = torch.nn.Linear(2, 2)
    net = torch.nn.Sequential(shared, torch.nn.Sequential(shared, torch.nn.ReLU()), shared)
    net.add_module("empty", None)
    for m in (model, [model, net], net):
        roots = m if isinstance(m, list) else [m]
        expect = [x for r in roots for x in r.modules()]
        got = feeding._modules(m)
        assert len(got) == len(expect) and all(a is b for a, b in zip(got, expect))
    assert len(feeding.trace_modules(model)) == sum(
        isinstance(x, tuple(type(t) for t in feeding.trace_modules(model))) for x in model.modules())


@pytest.mark.parametrize("audit", [0.25, 0.0025])
def test_audit_host_equals_from_parts_host_empty_audits_included(audit):
    """audit_host answers an empty audit without from_parts_host (most sites of a step at the default
    0.25%): its rows and codes must be from_parts_host's (values, dtype, shape) for every record, layer and
    site, empty and not, and a damaged empty audit (not uint8) must still be refused naming layer and site."""
    from trace_kernels.guides.sparse.audit import from_parts_host

    config = TraceConfig(guidance="sparse", guided_layers="all", sparse_audit=audit)
    cfg = mc.tiny_config(params_dtype=torch.bfloat16, bf16=True)
    model = mc.tiny_model(cfg, trace_config=config, seed=5)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    with torch.no_grad(), trace_megatron.capture(model, layout, perturb=noisy_engine) as cap:
        model(*mc.padded_batch(LENGTHS, SEQ, seed=2))
    records = cap.build_records(config)
    seen = {"empty": 0, "rows": 0}
    for rec in records:
        for layer, site in _keys(records):
            got, want = rec.audit_host(layer, site), from_parts_host(*rec._audit_parts(layer, site))
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)
            seen["empty" if want[0].size == 0 else "rows"] += 1
    assert (seen["rows"] if audit > 0.01 else seen["empty"]), seen  # both paths reached over the two rates
    rec = records[0]
    name = tensor_name(0, "k", "audit")
    rec.tensors[name] = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(RecordError, match="layer 0, site k: audit tensor is torch.int32"):
        rec.audit_host(0, "k")
