"""The engine take hands each record's bytes to the writer (GuidanceRecord.host_bytes: engine/take.py's
`_pieces`, read by records/take_bytes.py instead of a `.numpy()` per tensor): every tensor of an arena
take's record has them, they are that very tensor's bytes, and the written bytes are the record's own
`to_bytes` with them, without them, after a tensor's bytes changed in place, and after a tensor was
replaced in the dict (then they are not used for that record)."""

import pytest
import torch

from trace_kernels import TraceConfig, cpu_native
from trace_kernels.records import GuidanceRecord, take_bytes, written


def _take(seed, config):
    import test_host_arena as tha
    from trace_kernels.engine import take
    from trace_kernels.engine.captured_rows import ChunkJoiner

    subs = tha.decode_take(seed)
    out = take.assemble_take(tha.SHAPE, config, [(c, (1, "ab" * 32), None) for c in subs], ChunkJoiner())
    assert all(r is not None for r in out)
    return out


def _written(records, monkeypatch):
    """write_take's bytes, and how many records the writer read by host_bytes (its `_host_bytes` answers)."""
    used = []
    real = take_bytes._host_bytes
    monkeypatch.setattr(take_bytes, "_host_bytes", lambda *a: used.append(real(*a) is not None) or real(*a))
    before = cpu_native.FALLBACKS["take_bytes:per_record"]
    got = take_bytes.write_take(records)
    assert cpu_native.FALLBACKS["take_bytes:per_record"] == before  # every record by the layout
    return got, sum(used)


@pytest.mark.parametrize("seed", [3, 11, 29])
@pytest.mark.parametrize("audit", [0.0, 0.5, 1.0])
def test_every_tensor_of_an_arena_take_has_its_own_bytes_and_writes_its_to_bytes(monkeypatch, seed, audit):
    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "native")
    records = _take(seed, TraceConfig(sparse_audit=audit))
    for r in records:
        assert r.host_bytes is not None and set(r.host_bytes) == set(r.tensors)
        for name, (t, raw) in r.host_bytes.items():
            assert t is r.tensors[name] and t.dtype == torch.uint8 and t.dim() == 1
            assert bytes(raw) == t.numpy().tobytes(), name
    got, used = _written(records, monkeypatch)
    assert used == len(records)
    assert got == [r.to_bytes() for r in records]
    for r in records:  # the same bytes without them (the general path)
        r.host_bytes = None
    assert take_bytes.write_take(records) == got


def test_a_tensor_changed_in_place_is_written_as_it_is_now(monkeypatch):
    # the bytes handed over are the tensor's memory, not a copy made at the take
    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "native")
    records = _take(5, TraceConfig())
    t = records[1].tensors["layer.1.k.sparse"]
    t[-1] ^= 0xFF
    got, used = _written(records, monkeypatch)
    assert used == len(records)
    assert got == [r.to_bytes() for r in records]


def test_a_tensor_replaced_after_the_take_is_read_from_the_tensor(monkeypatch):
    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "native")
    records = _take(7, TraceConfig())
    name = "layer.1.moe_fc1_in.sparse"
    old = records[0].tensors[name]
    records[0].tensors[name] = old.clone() ^ 0x5A  # same name, size and dtype, other bytes
    del records[1].host_bytes["layer.0.routed_packed"]  # a name without bytes: that record by its tensors
    got, used = _written(records, monkeypatch)
    assert used == 0
    assert got == [r.to_bytes() for r in records]
    assert got[0] != GuidanceRecord(records[0].shape, records[0].config, records[0].num_tokens, records[0].modes,
                                    {**records[0].tensors, name: old}, records[0].identity).to_bytes()


def test_an_unguided_layer_int16_ids_leave_the_record_to_its_tensors(monkeypatch):
    # guided_layers=[1]: the other layers' ids are int16 rows gathered by numpy, not cut from a take output
    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "native")
    records = _take(13, TraceConfig(guided_layers=[1]))
    assert all(r.host_bytes is None for r in records)
    got, used = _written(records, monkeypatch)
    assert used == 0 and got == [r.to_bytes() for r in records]


def test_kept_read_back_of_host_bytes_is_the_parsed_record(monkeypatch):
    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "native")
    records = _take(17, TraceConfig(sparse_audit=0.5))
    written.clear()
    got = take_bytes.write_take(records, keep_for_reader=True)
    for r, data in zip(records, got):
        kept = GuidanceRecord.from_bytes(data)  # the kept read-back (same object)
        parsed = GuidanceRecord.from_bytes(bytes(bytearray(data)))  # equal bytes: parsed and verified
        assert list(kept.tensors) == list(parsed.tensors) and set(parsed.tensors) == set(r.tensors)
        for name, t in parsed.tensors.items():
            assert torch.equal(kept.tensors[name], t) and torch.equal(t, r.tensors[name]), name


def test_a_layout_kept_with_other_dtypes_is_made_again_and_the_bytes_still_used(monkeypatch):
    # the writer keeps one layout per name set; a record of the same names with an int16 tensor made it first
    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "native")
    records = _take(19, TraceConfig())
    r = records[0]
    name = "layer.0.moe_fc1_in.audit"  # an empty audit: int16 of the same (zero) size
    odd = GuidanceRecord(r.shape, r.config, r.num_tokens, r.modes, {**r.tensors, name: torch.empty(0, dtype=torch.int16)},
                         r.identity)
    assert take_bytes.write_take([odd]) == [odd.to_bytes()]
    assert not take_bytes._layout(odd.tensors).all_uint8  # the layout kept for these names
    got, used = _written(records, monkeypatch)
    assert used == len(records)
    assert got == [x.to_bytes() for x in records]
    assert take_bytes._layout(r.tensors).all_uint8


def test_a_take_record_pickles_and_its_copy_writes_the_same_bytes(monkeypatch):
    # host_bytes holds memoryviews, which do not pickle: a copy leaves them behind and its tensors say the same
    import pickle

    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "native")
    records = _take(7, TraceConfig())
    copies = pickle.loads(pickle.dumps(records))
    assert all(r.host_bytes is not None for r in records) and all(c.host_bytes is None for c in copies)
    assert [c.to_bytes() for c in copies] == [r.to_bytes() for r in records]
