"""Fuzzing record decoding: whatever bytes arrive, `GuidanceRecord.from_bytes` either raises RecordError
(naming the source) or returns a record whose content is exactly the original's. No other exception
type, no crash, and never a changed record that loads as valid."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trace_kernels as tk
from record_factory import captured_builder

CONFIG = tk.TraceConfig(guidance="compact", guided_layers=[1, 3], full_layers=[3], activation_scale="static",
                        static_activation_amax={f"{i}.{s}": 2.0 + i for i in range(4) for s in ("moe_fc1_in", "moe_fc2_in", "k", "v")})
VALID = captured_builder(CONFIG, steps=(3, 1)).build().to_bytes()
ORIGINAL = tk.GuidanceRecord.from_bytes(VALID)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def _same(a: tk.GuidanceRecord, b: tk.GuidanceRecord) -> bool:
    return (
        a.shape == b.shape and a.config == b.config and a.num_tokens == b.num_tokens and a.modes == b.modes
        and getattr(a, "identity", None) == getattr(b, "identity", None)
        and a.tensors.keys() == b.tensors.keys()
        and all(a.tensors[k].dtype == b.tensors[k].dtype and torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    )


def _decode(data: bytes):
    try:
        return tk.GuidanceRecord.from_bytes(data, source="fuzzed")
    except tk.RecordError as e:
        assert "fuzzed" in str(e)
        return None


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_are_refused_with_record_error(data):
    assert _decode(data) is None


@FUZZ
@given(st.binary(max_size=64))
def test_random_bytes_behind_a_plausible_header_length(tail):
    # a header length that fits, so decoding reaches the JSON / safetensors layers
    data = len(tail).to_bytes(8, "little") + tail
    assert _decode(data) is None


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(1, 255)), min_size=1, max_size=4))
def test_mutated_records_never_load_changed(flips):
    data = bytearray(VALID)
    for pos, xor in flips:
        data[pos] ^= xor
    record = _decode(bytes(data))
    assert record is None or _same(record, ORIGINAL), f"a mutated record loaded with other content: {flips}"


@FUZZ
@given(st.integers(0, len(VALID) - 1), st.binary(min_size=0, max_size=8))
def test_truncated_or_spliced_records(cut, insert):
    record = _decode(VALID[:cut] + insert + VALID[cut + len(insert):] if insert else VALID[:cut])
    assert record is None or _same(record, ORIGINAL)


def test_the_unmutated_record_loads():
    assert _same(tk.GuidanceRecord.from_bytes(VALID), ORIGINAL)
