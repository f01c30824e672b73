"""Guidance records: exact round trip, self-description, and refusal of anything damaged or foreign."""

import json
import struct

import pytest
import torch

import trace_kernels as tk
from record_factory import SHAPE, captured_builder
from trace_kernels.config import SITES
from trace_kernels.records import GuidanceRecord, RecordError

FULL = tk.TraceConfig(guided_layers="all", guidance="full")
MIXED = tk.TraceConfig(guidance="compact", guided_layers="all", full_layers=(0, 1))  # compact elsewhere
DEFAULT = tk.PAPER_CONFIG  # compact, deeper half


@pytest.mark.parametrize("config", [FULL, MIXED, DEFAULT], ids=["full", "mixed", "default"])
def test_round_trip_is_exact(config, tmp_path):
    builder = captured_builder(config)
    record = builder.build()
    size = record.save(tmp_path / "r.safetensors")
    loaded = GuidanceRecord.load(tmp_path / "r.safetensors", expect_shape=SHAPE, expect_config=config)
    assert size == (tmp_path / "r.safetensors").stat().st_size
    assert loaded.num_tokens == record.num_tokens == 7
    assert loaded.modes == record.modes == tuple(config.layer_modes(4))
    assert loaded.tensors.keys() == record.tensors.keys()
    for k in record.tensors:
        assert torch.equal(loaded.tensors[k], record.tensors[k]), k


def test_record_holds_what_was_captured():
    builder = captured_builder(MIXED)
    record = builder.build()
    # rebuild the expected layer-2 k guide (compact) and layer-0 fc2 guide (full) from the captures
    k_parts = builder._rows[(2, "k")]
    expected_k = tk.compact(tk.NVFP4Tensor(*(torch.cat([getattr(p, f) for p in k_parts]) for f in ("codes", "scales", "global_amax"))))
    got = record.site(2, "k")
    assert isinstance(got, tk.CompactGuide) and torch.equal(got.mbits, expected_k.mbits)
    fc2 = record.site(0, "moe_fc2_in")
    assert isinstance(fc2, tk.NVFP4Tensor) and tuple(fc2.shape) == (7, 2, 32)
    assert torch.equal(fc2.codes, torch.cat([p.codes for p in builder._rows[(0, "moe_fc2_in")]]))
    assert record.routed_experts(3).shape == (7, 2)
    assert DEFAULT.layer_modes(4) == [None, None, "compact", "compact"]
    assert captured_builder(DEFAULT).build().site(0, "k") is None


def test_byte_size_is_exact_and_compact_is_smaller():
    full = captured_builder(FULL).build()
    per_token_full = 0
    for site in SITES:
        row = SHAPE.row_shape(site)
        n_rows = 1 if len(row) == 1 else row[0]
        per_token_full += n_rows * (row[-1] // 2 + row[-1] // 16 + 4)
    routing = 2 * SHAPE.top_k
    assert full.nbytes == 7 * SHAPE.num_layers * (per_token_full + routing)
    compact_all = captured_builder(FULL).build(tk.TraceConfig(guidance="compact", guided_layers="all"))
    assert compact_all.nbytes < full.nbytes
    assert sum(compact_all.size_by_site().values()) == compact_all.nbytes


def _tamper(data: bytes, fn) -> bytes:
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    fn(header)
    new = json.dumps(header).encode()
    return struct.pack("<Q", len(new)) + new + data[8 + n :]


def test_flipped_bit_is_refused_naming_layer_and_site():
    data = bytearray(captured_builder(FULL).build().to_bytes())
    n = struct.unpack("<Q", bytes(data[:8]))[0]
    header = json.loads(bytes(data[8 : 8 + n]))
    begin, _ = header["layer.2.v.codes"]["data_offsets"]
    data[8 + n + begin] ^= 0x10
    with pytest.raises(RecordError, match=r"layer 2, site v: checksum mismatch"):
        GuidanceRecord.from_bytes(bytes(data), source="r.safetensors")


@pytest.mark.parametrize("cut", [4, 100, -1])
def test_truncated_record_is_refused(cut):
    data = captured_builder(FULL).build().to_bytes()
    with pytest.raises(RecordError, match="r.safetensors: (truncated|damaged)"):
        GuidanceRecord.from_bytes(data[:cut], source="r.safetensors")


def test_wrong_shape_model_and_config_are_refused(tmp_path):
    record = captured_builder(MIXED).build()
    record.save(tmp_path / "r.safetensors")
    other = tk.ModelShape(**{**SHAPE.__dict__, "head_dim": 64})
    with pytest.raises(RecordError, match=r"r.safetensors: made for another model shape \(head_dim: record 32 vs model 64\)"):
        GuidanceRecord.load(tmp_path / "r.safetensors", expect_shape=other)
    with pytest.raises(RecordError, match=r"another TRACE config \(guidance: record 'compact' vs expected 'full'"):
        GuidanceRecord.load(tmp_path / "r.safetensors", expect_config=tk.TraceConfig(guided_layers="all", full_layers=(0, 1), guidance="full"))


def test_tensor_of_wrong_shape_is_refused_by_layer_and_site():
    record = captured_builder(FULL).build()
    record.tensors["layer.1.moe_fc1_in.scales"] = record.tensors["layer.1.moe_fc1_in.scales"][:, :2].contiguous()
    with pytest.raises(RecordError, match=r"layer 1, site moe_fc1_in: tensor layer.1.moe_fc1_in.scales is torch.uint8\[7, 2\], expected torch.uint8\[7, 4\]"):
        GuidanceRecord.from_bytes(record.to_bytes())


def test_missing_tensor_and_foreign_files_are_refused(tmp_path):
    record = captured_builder(FULL).build()
    del record.tensors["layer.3.routed_experts"]
    with pytest.raises(RecordError, match="layer 3, routing ids: tensor layer.3.routed_experts is missing"):
        GuidanceRecord.from_bytes(record.to_bytes())
    good = captured_builder(FULL).build().to_bytes()
    with pytest.raises(RecordError, match="format version '99'"):
        GuidanceRecord.from_bytes(_tamper(good, lambda h: h["__metadata__"].update(version="99")))
    with pytest.raises(RecordError, match="not a trace-fp4 guidance record"):
        GuidanceRecord.from_bytes(_tamper(good, lambda h: h.pop("__metadata__")))
    # An edited header is refused by its own checksum; re-signed, the bad config is still refused.
    with pytest.raises(RecordError, match="metadata checksum mismatch"):
        GuidanceRecord.from_bytes(_tamper(good, lambda h: h["__metadata__"].update(config="{")))
    from trace_kernels.records import metadata_digest

    def bad_config(h):
        h["__metadata__"].update(config="{")
        h["__metadata__"]["metadata_checksum"] = metadata_digest(h["__metadata__"])

    with pytest.raises(RecordError, match="damaged metadata"):
        GuidanceRecord.from_bytes(_tamper(good, bad_config))
    with pytest.raises(RecordError, match="cannot read guidance record"):
        GuidanceRecord.load(tmp_path / "absent.safetensors")


def test_builder_rejects_rows_that_do_not_fit():
    b = tk.RecordBuilder(SHAPE, FULL)
    x = torch.randn(3, 48)
    with pytest.raises(ValueError, match=r"layer 0, site moe_fc1_in: rows of shape \(48,\), expected \(64,\)"):
        b.add(0, "moe_fc1_in", tk.quantize(x, tk.row_amax(x)))
    with pytest.raises(ValueError, match="layer 9 out of range"):
        b.add_routing(9, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"routing ids outside \[0, 8\)"):
        b.add_routing(0, torch.full((3, 2), 8))
    with pytest.raises(ValueError, match="unknown site 'q'"):
        SHAPE.row_shape("q")
    partial = captured_builder(FULL, steps=(3,))
    partial._rows[(1, "k")].append(partial._rows[(1, "k")][0])  # one step too many at one site
    with pytest.raises(ValueError, match="layer 1, site k: 6 token rows, but layer 0's routing has 3"):
        partial.build()


def test_reencode_full_to_compact_equals_building_compact():
    builder = captured_builder(FULL)
    direct = builder.build(DEFAULT)
    converted = builder.build().reencode(DEFAULT)
    assert converted.modes == direct.modes and converted.tensors.keys() == direct.tensors.keys()
    for k in direct.tensors:
        assert torch.equal(converted.tensors[k], direct.tensors[k]), k
    with pytest.raises(RecordError, match="layer 0 was recorded as unguided, cannot serve full"):
        direct.reencode(FULL)
    with pytest.raises(RecordError, match="layer 2 was recorded as compact, cannot serve full"):
        direct.reencode(tk.TraceConfig(guided_layers=[2], guidance="full"))


# ---- identity (format version 2) --------------------------------------------------------------------
def test_identity_round_trips_and_is_covered_by_the_format():
    ids = list(range(100, 108))  # prompt 5 + generated 3; the record covers the first 7 (5, 1, 1 rows)
    b = captured_builder(FULL)
    b.set_identity(token_ids=ids, weights_version=3, weights_digest="ab" * 32, num_prompt_tokens=5)
    record = b.build()
    assert record.identity == tk.RecordIdentity(
        token_digest=tk.token_digest(ids[:7]), num_tokens=7, weights_version=3, weights_digest="ab" * 32, num_prompt_tokens=5
    )
    back = GuidanceRecord.from_bytes(record.to_bytes())
    assert back.identity == record.identity
    assert back.reencode(tk.TraceConfig()).identity == record.identity
    # The digest is of int64 little-endian ids, whatever container they come in.
    assert tk.token_digest(torch.tensor(ids[:7], dtype=torch.int32)) == record.identity.token_digest
    assert tk.token_digest(ids[:6]) != record.identity.token_digest


def test_builder_refuses_token_ids_of_another_length():
    b = captured_builder(FULL)
    b.set_identity(token_ids=list(range(12)))
    with pytest.raises(ValueError, match="12 token ids for a record of 7 token rows"):
        b.build()


def test_version_1_record_is_refused_saying_so():
    good = captured_builder(FULL).build().to_bytes()
    old = _tamper(good, lambda h: (h["__metadata__"].update(version="1"), h["__metadata__"].pop("identity")))
    with pytest.raises(RecordError, match="format version 1 .*re-capture"):
        GuidanceRecord.from_bytes(old, source="old.safetensors")


def test_check_identity_names_the_field_that_differs():
    ids = list(range(100, 108))
    b = captured_builder(FULL)
    b.set_identity(token_ids=ids, weights_version=3)
    record = b.build()
    assert tk.check_identity(record, source="s0", token_ids=ids, weights_version=3) is None
    assert tk.check_identity(record, source="s0", token_ids=ids[:7]) is None
    with pytest.raises(RecordError, match="s0: tokens differ"):
        tk.check_identity(record, source="s0", token_ids=ids[:6] + [7, 8])
    with pytest.raises(RecordError, match="s0: length differs: the record holds 7 token rows, the trainer runs 12"):
        tk.check_identity(record, source="s0", token_ids=list(range(12)))
    with pytest.raises(RecordError, match="weights version 3, the trainer expects 4"):
        tk.check_identity(record, source="s0", weights_version=4)
    assert tk.check_identity(record, source="s0", weights_version=4, accept_stale=True) == "stale"
    with pytest.raises(RecordError, match="newer"):
        tk.check_identity(record, source="s0", weights_version=2, accept_stale=True)


@pytest.mark.parametrize("config", [tk.TraceConfig(), tk.TraceConfig(guidance="full", guided_layers="all"),
                                    tk.TraceConfig(guidance="compact")], ids=["sparse", "full", "compact"])
def test_record_bytes_are_safetensors_own(config):
    """to_bytes writes the file itself (records/safetensors_bytes.py): the bytes must be what
    safetensors' save writes with the header canonicalised, the way records were written before."""
    from safetensors.torch import save

    from trace_kernels.records.integrity import canonical_header

    record = captured_builder(config).build()
    tensors = {k: v.contiguous() for k, v in record.tensors.items()}
    assert record.to_bytes() == canonical_header(save(tensors, metadata=record._metadata()))


def test_direct_safetensors_bytes_match_safetensors_for_every_dtype_and_name_order():
    from safetensors.torch import save

    from trace_kernels.records import safetensors_bytes as sb
    from trace_kernels.records.integrity import canonical_header, tensor_digest

    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i, dtype in enumerate(sb._ORDER):  # two of each dtype, names out of dtype order, one empty
        for j, shape in enumerate([(3, 2), (0,) if i == 1 else (5,)]):
            t = torch.randint(-100, 100, shape, generator=g).to(dtype)
            tensors[f"{'zyx'[j]}.{9 - i}"] = t
    raw = {k: sb.raw_bytes(v) for k, v in tensors.items()}
    meta = {"b": "2", "a": "1", "checksums": "{}"}
    want = canonical_header(save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta))
    assert sb.save_layout(tensors, raw, meta)[0] == want
    # to_bytes' writer (one body joined from the tensors, its entries cached): the same file, also from
    # its caches (second pass) and with a strided tensor (numpy cannot join it as it lies)
    meta_json = json.dumps(dict(sorted(meta.items())), separators=(",", ":"))
    for case in (tensors, tensors, {**tensors, "z.9": tensors["z.9"].reshape(3, 2).t()}):
        body, entries, texts, digests = sb.record_body(case)
        want = canonical_header(save({k: v.contiguous() for k, v in case.items()}, metadata=meta))
        assert sb.with_header(body, texts, meta_json)[0] == want
        assert digests == {k: tensor_digest(v) for k, v in case.items()}
    # a dtype it does not write: None (to_bytes then writes with safetensors itself), also for a name set
    # it has cached with writable dtypes
    assert sb.record_body({"a": torch.zeros(2, dtype=torch.complex64)}) is None
    assert sb.record_body({**tensors, "z.9": tensors["z.9"].to(torch.complex64)}) is None
