"""The take's batched record writer (records/take_bytes.py) writes, for every record, exactly the bytes of
its own `to_bytes` (the format's definition), keeps what `to_bytes(keep_for_reader=True)` keeps (the kept
read-back gives the parsed record), and hands every record it does not write by its layout to
`to_bytes`, counted in cpu_native.FALLBACKS["take_bytes:per_record"]."""

import random

import pytest
import torch

import trace_kernels as tk
from record_factory import captured_builder
from trace_kernels import cpu_native
from trace_kernels.records import GuidanceRecord, take_bytes, written

SPARSE = tk.TraceConfig(guidance="sparse", guided_layers="all", sparse_audit=0.5)
CONFIGS = [tk.TraceConfig(guided_layers="all", guidance="full"), tk.PAPER_CONFIG, SPARSE,
           tk.TraceConfig(guidance="sparse", guided_layers="all", sparse_audit=0.0)]


def _take(config, n: int, seed: int) -> list:
    """n records of one config, ragged (each its own prefill and decode steps), as a take holds them:
    one config object and one config text for all."""
    rng = random.Random(seed)
    records = [captured_builder(config, steps=(rng.randint(1, 9),) + (1,) * rng.randint(0, 6), seed=seed * 100 + i)
               .build() for i in range(n)]
    text = (config, config.to_json())
    for r in records:
        r.config_text = text
    return records


def _random_identity(record, rng):
    return record.with_identity(weights_version=rng.choice([None, 0, 7, 2**40]),
                                weights_digest=rng.choice([None, "", "ab" * 32, "ünï\"cødé\\"]))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seed", range(3))
def test_each_record_is_its_own_to_bytes(config, seed):
    rng = random.Random(seed)
    records = [_random_identity(r, rng) for r in _take(config, rng.randint(1, 12), seed)]
    for r in records:
        r.config_text = records[0].config_text = (config, config.to_json())
    if config.guidance == "sparse":  # empty audits as the take makes them: one empty tensor shared by records
        empty = torch.empty(0, dtype=torch.uint8)
        for r in records:
            for name, t in r.tensors.items():
                if name.endswith(".audit") and rng.random() < 0.5:
                    r.tensors[name] = empty
    before = cpu_native.FALLBACKS["take_bytes:per_record"]
    got = take_bytes.write_take(records)
    assert got == [r.to_bytes() for r in records]
    assert cpu_native.FALLBACKS["take_bytes:per_record"] == before  # every record written by the layout


def test_kept_bytes_read_back_as_the_parsed_record():
    records = _take(SPARSE, 5, 11)
    written.clear()
    got = take_bytes.write_take(records, keep_for_reader=True)
    before = written.READ_BACK["same_process"]
    for r, data in zip(records, got):
        assert data == r.to_bytes()
        kept = GuidanceRecord.from_bytes(data, source="kept")
        parsed = GuidanceRecord.from_bytes(bytes(bytearray(data)), source="parsed")
        assert (kept.shape, kept.config, kept.num_tokens, kept.modes, kept.identity) == \
            (parsed.shape, parsed.config, parsed.num_tokens, parsed.modes, parsed.identity)
        assert kept.tensors.keys() == parsed.tensors.keys()
        for k, t in parsed.tensors.items():
            assert kept.tensors[k].dtype == t.dtype and torch.equal(kept.tensors[k], t)
    assert written.READ_BACK["same_process"] == before + len(records)


def _odd(record, name: str, tensor) -> GuidanceRecord:
    tensors = dict(record.tensors)
    tensors[name] = tensor
    out = GuidanceRecord(record.shape, record.config, record.num_tokens, record.modes, tensors, record.identity)
    out.config_text = record.config_text
    return out


@pytest.mark.parametrize("odd", ["bf16", "complex", "strided", "grad", "metadata_name", "other_config",
                                 "other_dtype_same_name", "empty_bf16", "empty_grad"])
def test_a_record_the_layout_does_not_write_is_its_own_to_bytes_and_counted(odd):
    records = _take(SPARSE, 4, 3)
    r = records[2]
    name = next(n for n in r.tensors if n.endswith(".sparse"))
    t = r.tensors[name]
    if odd == "bf16":
        r = _odd(r, "layer.0.extra", torch.ones(3, dtype=torch.bfloat16))
    elif odd == "complex":  # a dtype the direct writer does not write: safetensors' own (to_bytes refuses or writes it)
        r = _odd(r, name, torch.ones(2, dtype=torch.complex64))
    elif odd == "strided":
        r = _odd(r, name, torch.arange(2 * t.numel(), dtype=torch.uint8)[::2])
    elif odd == "grad":
        r = _odd(r, "layer.0.extra", torch.ones(3, requires_grad=True))
    elif odd == "metadata_name":
        r = _odd(r, "__metadata__", torch.ones(2, dtype=torch.uint8))
    elif odd == "other_config":
        other = tk.TraceConfig(guidance="sparse", guided_layers="all", sparse_audit=0.5)
        r = GuidanceRecord(r.shape, other, r.num_tokens, r.modes, r.tensors, r.identity)
    elif odd == "empty_bf16":  # no bytes to view: written by the layout (b"" as to_bytes writes it)
        r = _odd(r, "layer.0.extra", torch.empty(0, 3, dtype=torch.bfloat16))
    elif odd == "empty_grad":
        r = _odd(r, "layer.0.extra", torch.empty(0, requires_grad=True))
    elif odd == "other_dtype_same_name":  # these names with another dtype: written by a layout of their own
        r = _odd(r, name, t.to(torch.int16))
    records[2] = r
    try:
        want = [x.to_bytes() for x in records]
    except Exception as e:  # what to_bytes refuses, the batched writer refuses alike
        with pytest.raises(type(e)):
            take_bytes.write_take(records)
        return
    before = cpu_native.FALLBACKS["take_bytes:per_record"]
    assert take_bytes.write_take(records) == want
    counted = cpu_native.FALLBACKS["take_bytes:per_record"] - before
    assert counted == (0 if odd in ("other_dtype_same_name", "empty_bf16", "empty_grad") else 1)


def test_metadata_texts_refuse_a_changed_key_set(monkeypatch):
    records = _take(SPARSE, 1, 0)
    fields = GuidanceRecord._metadata_fields
    monkeypatch.setattr(GuidanceRecord, "_metadata_fields", lambda self, c=None: {**fields(self, c), "new": "x"})
    with pytest.raises(AssertionError, match="keys changed"):
        take_bytes.write_take(records)


def test_a_takes_read_back_makes_each_empty_tensor_once():
    """The kept read-back of a take written together gives each (dtype, shape) of empty tensor once for
    all its records (as the take shares its empty audits); a record written alone gets its own."""
    records = _take(SPARSE, 3, 5)
    for r in records:  # no row drawn: each audit an empty blob, as the take gives a record it did not draw
        r.tensors.update({n: torch.empty(0, dtype=torch.uint8) for n in r.tensors if n.endswith(".audit")})
    written.clear()
    got = [GuidanceRecord.from_bytes(d) for d in take_bytes.write_take(records, keep_for_reader=True)]
    empty = [n for n, t in got[0].tensors.items() if not t.numel()]
    assert empty
    for n in empty:
        assert got[1].tensors[n] is got[0].tensors[n] and got[2].tensors[n] is got[0].tensors[n]
        assert got[0].tensors[n].shape == records[0].tensors[n].shape
    alone = [GuidanceRecord.from_bytes(r.to_bytes(keep_for_reader=True)) for r in records[:2]]
    assert alone[0].tensors[empty[0]] is not alone[1].tensors[empty[0]]
