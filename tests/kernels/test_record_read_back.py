"""A record read back by the process that wrote it (records/written.py: the vLLM worker's take for an
in-process driver) is the record `from_bytes` parses from the same bytes: the same tensors (each its own
storage), metadata objects and identity; not hashed again (the writer hashed the bytes it joined into that
very object) but its layout still verified, counted; anything but that very bytes object (a copy, a tampered
copy) is parsed and hashed as before."""

import pytest
import torch

import trace_kernels as tk
from record_factory import captured_builder
from trace_kernels.records import GuidanceRecord, RecordError, written

CONFIGS = [tk.TraceConfig(guided_layers="all", guidance="full"), tk.PAPER_CONFIG,
           tk.TraceConfig(guidance="sparse", guided_layers="all", sparse_audit=0.5)]


def _same(a: GuidanceRecord, b: GuidanceRecord):
    assert (a.shape, a.config, a.num_tokens, a.modes, a.identity) == (b.shape, b.config, b.num_tokens, b.modes, b.identity)
    assert a.tensors.keys() == b.tensors.keys()
    for k, t in b.tensors.items():
        got = a.tensors[k]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
        if t.numel():
            assert got.untyped_storage().nbytes() == t.numel() * t.element_size()  # its own storage


@pytest.mark.parametrize("config", CONFIGS)
def test_kept_bytes_read_back_as_parsed(config):
    record = captured_builder(config).build()
    plain = record.to_bytes()
    data = record.to_bytes(keep_for_reader=True)
    assert data == plain  # keeping changes nothing in the bytes
    before = written.READ_BACK["same_process"]
    got = GuidanceRecord.from_bytes(data, source="kept")
    assert written.READ_BACK["same_process"] == before + 1
    assert got.origin == "kept"
    _same(got, GuidanceRecord.from_bytes(plain, source="parsed"))
    # read once: the same object read again is parsed (and not counted)
    _same(GuidanceRecord.from_bytes(data), got)
    assert written.READ_BACK["same_process"] == before + 1


def test_equal_bytes_of_another_object_are_parsed():
    record = captured_builder(CONFIGS[2]).build()
    data = record.to_bytes(keep_for_reader=True)
    copy = bytes(bytearray(data))
    before = written.READ_BACK["same_process"]
    GuidanceRecord.from_bytes(copy)
    assert written.READ_BACK["same_process"] == before
    written.clear()
    GuidanceRecord.from_bytes(data)  # cleared: parsed
    assert written.READ_BACK["same_process"] == before


def test_a_kept_record_is_not_hashed_again_but_its_layout_is_checked(monkeypatch):
    """The trust rule (records/written.py): the kept bytes object is read without one digest (the writer
    hashed the very bytes it joined into it), and `verify` still refuses a layout that does not fit."""
    from trace_kernels.records import safetensors_bytes

    record = captured_builder(CONFIGS[2]).build()
    data = record.to_bytes(keep_for_reader=True)
    copy = bytes(bytearray(data))
    hashed = []
    real = safetensors_bytes.digest
    monkeypatch.setattr(safetensors_bytes, "digest", lambda *a: hashed.append(a[0]) or real(*a))
    _same(GuidanceRecord.from_bytes(data), record)
    assert not hashed  # the kept read: no tensor hashed
    GuidanceRecord.from_bytes(copy)
    assert len(hashed) == len(record.tensors)  # equal bytes of another object: every tensor hashed

    data = record.to_bytes(keep_for_reader=True)
    kept = written._KEPT[id(data)][1]
    i = next(i for i, e in enumerate(kept.entries) if e[2].endswith(".sparse"))  # a payload: U8 [n]
    a, b, name, _, shape = kept.entries[i]
    kept.entries = [*kept.entries[:i], (a, b, name, "I8", shape), *kept.entries[i + 1:]]  # a writer's wrong layout
    with pytest.raises(RecordError, match=f"r.safetensors: .*tensor {name} is torch.int8"):
        GuidanceRecord.from_bytes(data, source="r.safetensors")


def test_verify_layout_checks_the_layout_and_never_the_checksums():
    """`verify_layout` (the kept read-back's check) refuses what `verify` refuses by layout, by the same
    tensor name, but reads no checksum: said plainly, a wrong checksum passes it and only `verify`
    (every read but the kept object's) refuses it."""
    from trace_kernels.records.integrity import tensor_digest, verify, verify_layout

    record = captured_builder(CONFIGS[2]).build()
    checksums = {k: tensor_digest(v) for k, v in record.tensors.items()}
    verify_layout(record, "r")
    verify(record, checksums, "r")
    name = next(k for k in record.tensors if k.endswith(".sparse"))
    wrong = {**checksums, name: "0" * 64}
    verify_layout(record, "r")  # no checksum read
    with pytest.raises(RecordError, match=f"r: .*checksum mismatch in tensor {name}"):
        verify(record, wrong, "r")
    for change, match in [(lambda t: t.pop(name), f"tensor {name} is missing"),
                          (lambda t: t.__setitem__(name, t[name].view(torch.int8)), f"tensor {name} is torch.int8"),
                          (lambda t: t.__setitem__("layer.0.k.extra", torch.zeros(1)), "unexpected tensors")]:
        tensors = dict(record.tensors)
        change(tensors)
        bad = GuidanceRecord(record.shape, record.config, record.num_tokens, record.modes, tensors, record.identity)
        with pytest.raises(RecordError, match=match):
            verify_layout(bad, "r")
        with pytest.raises(RecordError, match=match):
            verify(bad, checksums, "r")


def test_a_kept_object_with_a_tampered_layout_is_refused():
    """The trusted kept object is still checked: a Kept whose entries lost a tensor or changed one's
    shape (a writer's bug) is refused by name, as a parsed record of that layout would be."""
    record = captured_builder(CONFIGS[2]).build()
    data = record.to_bytes(keep_for_reader=True)
    kept = written._KEPT[id(data)][1]
    i = next(i for i, e in enumerate(kept.entries) if e[2].endswith(".routed_packed"))  # not optional
    name = kept.entries[i][2]
    kept.entries = kept.entries[:i] + kept.entries[i + 1:]
    with pytest.raises(RecordError, match=f"r: .*tensor {name} is missing"):
        GuidanceRecord.from_bytes(data, source="r")
    # the same bytes (another object, so parsed) read back whole
    _same(GuidanceRecord.from_bytes(bytes(bytearray(data))), record)


@pytest.mark.parametrize("where", ["tensor", "header"])
def test_tampered_bytes_of_a_kept_record_are_still_refused(where):
    """Only the very kept object is trusted: the same bytes with one bit flipped (a copy that crossed a
    process, a store, a file) are hashed and refused, and the kept object itself still reads back."""
    record = captured_builder(CONFIGS[2]).build()
    data = record.to_bytes(keep_for_reader=True)
    (n,) = __import__("struct").unpack("<Q", data[:8])
    bad = bytearray(data)
    bad[len(data) - 1 if where == "tensor" else 8 + n // 2] ^= 0x04
    before = written.READ_BACK["same_process"]
    with pytest.raises(RecordError, match="checksum mismatch" if where == "tensor" else "damaged|checksum"):
        GuidanceRecord.from_bytes(bytes(bad), source="r.safetensors")
    assert written.READ_BACK["same_process"] == before
    _same(GuidanceRecord.from_bytes(data), record)
    assert written.READ_BACK["same_process"] == before + 1


def test_expected_shape_and_config_still_checked():
    record = captured_builder(CONFIGS[1]).build()
    data = record.to_bytes(keep_for_reader=True)
    with pytest.raises(RecordError, match="another TRACE config"):
        GuidanceRecord.from_bytes(data, source="r", expect_config=CONFIGS[0])


def test_the_worker_keeps_its_takes_bytes_only_for_a_reader_in_its_process():
    import os

    from record_factory import SHAPE, worker_take
    from trace_vllm_plugin.capture import CaptureStore, StepLayout

    ids = ["a", "b"]
    g = torch.Generator().manual_seed(0)

    def take(reader_pid):
        store = CaptureStore(SHAPE, tk.TraceConfig(), capacity=8)
        pos = 0
        for n in (3, 1, 1):
            store.begin_step(StepLayout(ids, [0, n, 2 * n], [pos, pos]))
            for layer in SHAPE.moe_layer_list():
                store.put_routing(layer, torch.randint(0, SHAPE.num_experts, (2 * n, SHAPE.top_k), generator=g).to(torch.int16))
            for layer in range(SHAPE.num_layers):
                for site in SHAPE.layer_sites(layer):
                    x = torch.randn(2 * n, *SHAPE.row_shape(site), generator=g)
                    store.put(layer, site, tk.quantize(x, tk.row_amax(x)))
            store.end_step()
            pos += n
        for r in ids:
            store.finish(r)
        return worker_take(store, ids, reader_pid=reader_pid)

    other = take(os.getpid() + 1)  # a driver in another process: nothing kept
    assert not written._KEPT
    mine = take(os.getpid())
    assert [other[r]["record"] for r in ids] != [mine[r]["record"] for r in ids]  # other random rows
    assert len(written._KEPT) == 2
    before = written.READ_BACK["same_process"]
    for r in ids:
        _same(GuidanceRecord.from_bytes(mine[r]["record"]), GuidanceRecord.from_bytes(bytes(bytearray(mine[r]["record"]))))
    assert written.READ_BACK["same_process"] == before + 2 and not written._KEPT
