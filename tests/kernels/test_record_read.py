"""The driver's direct read of a record (safetensors_bytes.load_plain) gives what safetensors' load gives:
the same tensors (dtype, shape, bytes, each its own storage) and each one's integrity.tensor_digest; a
file it does not read as written (a duplicated field, another header form, a truncated file) is left to
safetensors, which refuses it as before."""

import pytest
import torch
from safetensors.torch import load as st_load

import trace_kernels as tk
from trace_kernels import cpu_native
from record_factory import captured_builder
from trace_kernels.records import GuidanceRecord, RecordError
from trace_kernels.records.integrity import read_header, tensor_digest
from trace_kernels.records.safetensors_bytes import load_plain

CONFIGS = [tk.TraceConfig(guided_layers="all", guidance="full"), tk.PAPER_CONFIG,
           tk.TraceConfig(guidance="sparse", guided_layers="all", sparse_audit=0.5)]


@pytest.mark.parametrize("config", CONFIGS)
def test_direct_read_equals_safetensors_load(config):
    data = captured_builder(config).build().to_bytes()
    _, header, n = read_header(data, "r")
    tensors, digests = load_plain(data, header, n)
    want = st_load(data)
    assert tensors.keys() == want.keys()
    for k, t in want.items():
        got = tensors[k]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
        assert digests[k] == tensor_digest(t)
        if t.numel():
            assert got.untyped_storage().nbytes() == t.numel() * t.element_size()  # its own storage


def test_a_header_read_otherwise_is_left_to_safetensors():
    data = captured_builder(CONFIGS[1]).build().to_bytes()
    _, header, n = read_header(data, "r")
    assert load_plain(data[:-1], header, n) is None
    # a field named twice in one entry: Python's json keeps the last, safetensors refuses it
    head = data[8 : 8 + n]
    i = head.index(b'"dtype":')
    doubled = head[:i] + b'"dtype":"U8",' + head[i:]
    assert load_plain(data[:8] + doubled + data[8 + n :], header, n + len(b'"dtype":"U8",')) is None


def test_a_damaged_tensor_is_still_refused_by_name():
    data = bytearray(captured_builder(CONFIGS[2]).build().to_bytes())
    data[-3] ^= 1
    with pytest.raises(RecordError, match="r.safetensors: layer .*checksum mismatch in tensor"):
        GuidanceRecord.from_bytes(bytes(data), source="r.safetensors")


def test_a_record_read_by_safetensors_is_counted():
    data = captured_builder(CONFIGS[1]).build().to_bytes()
    key = "safetensors_load:record_read"
    before = cpu_native.fallbacks().get(key, 0)
    GuidanceRecord.from_bytes(data, source="r.safetensors")  # as to_bytes wrote it: the direct read
    assert cpu_native.fallbacks().get(key, 0) == before
    _, _, n = read_header(data, "r")
    head = data[8 : 8 + n]
    i = head.index(b'"dtype":')
    doubled = head[:i] + b'"dtype":"U8",' + head[i:]
    doubled += b" " * (-len(doubled) % 8)
    bad = len(doubled).to_bytes(8, "little") + doubled + data[8 + n :]
    with pytest.raises(RecordError, match="damaged safetensors data"):
        GuidanceRecord.from_bytes(bad, source="r.safetensors")
    assert cpu_native.fallbacks().get(key, 0) == before + 1


@pytest.mark.parametrize("field,value", [("dtype", ["U8"]), ("dtype", {"U8": 1}), ("shape", [2, True]),
                                         ("shape", [-1]), ("data_offsets", [0, 1.0]), ("data_offsets", [0])])
def test_an_entry_of_the_wrong_types_is_refused_as_damaged(field, value):
    """An entry whose field has another type (a crafted header: the metadata checksum does not cover the
    entries) is left to safetensors, which refuses it: a RecordError, never a TypeError of the direct read
    (a list as the dtype was looked up in a dict and raised one before lane bytes10)."""
    import json
    import struct

    data = captured_builder(CONFIGS[2]).build().to_bytes()
    _, header, n = read_header(data, "r")
    name = next(k for k in header if k != "__metadata__")
    header[name][field] = value
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    bad = struct.pack("<Q", len(text)) + text + data[8 + n :]
    assert load_plain(bad, json.loads(text), len(text)) is None
    with pytest.raises(RecordError, match="r.safetensors: damaged safetensors data"):
        GuidanceRecord.from_bytes(bad, source="r.safetensors")
