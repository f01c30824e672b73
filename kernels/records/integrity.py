"""A record's integrity: the on-disk format's name and versions, a SHA-256 per tensor and one over the
metadata, and the checks that refuse a damaged, edited or foreign record by layer and site."""

import functools
import hashlib
import json
import struct

import torch

from ..config import TraceConfig
from ..errors import RecordError
from ..identity import RecordIdentity
from ..model_shape import ModelShape
from .layout import ENCODINGS, expected_tensors, where
from .safetensors_bytes import digest, numpy_view

FORMAT_NAME = "trace-fp4-guidance"
FORMAT_VERSION = 3
# Version 2 records (every layer MoE with standard K/V) read as they are: their model_shape has none of
# version 3's per-layer fields, whose defaults say exactly that.
READABLE_VERSIONS = ("2", "3")


def tensor_digest(t: torch.Tensor) -> str:
    if not t.numel():
        data = None
    elif t.dim() and numpy_view(t):
        # the bytes hashed where they are (the driver verifies every tensor of every record it takes:
        # three torch ops and a copy per tensor were a third of reading a record back)
        data = t.numpy().data.cast("B")
    else:
        data = t.contiguous().view(torch.uint8).numpy().tobytes()
    return digest(t.dtype, t.shape, data)


def canonical_header(data: bytes) -> bytes:
    """safetensors writes `__metadata__` from a hash map (key order varies between calls): rewrite the
    header with sorted metadata keys, padded to 8 bytes as safetensors does (offsets are relative to the
    end of the header, so the tensor bytes stay as they are)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", None)
    ordered = ({"__metadata__": dict(sorted(meta.items()))} if meta is not None else {}) | header
    text = json.dumps(ordered, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


def read_metadata(data: bytes, source: str) -> dict[str, str]:
    return read_header(data, source)[0]


def read_header(data: bytes, source: str) -> tuple[dict[str, str], object, int]:
    """(the checked metadata, the whole parsed header, its length n): read_metadata's checks, and what
    a reader needs to find the tensors without parsing the header again (safetensors_bytes.load_plain)."""
    if len(data) < 8:
        raise RecordError(f"{source}: truncated ({len(data)} bytes), not a guidance record")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise RecordError(f"{source}: truncated (header says {n} bytes, file has {len(data) - 8})")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:  # UnicodeDecodeError included
        raise RecordError(f"{source}: damaged header ({e})") from e
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        meta = {}
    if meta.get("format") != FORMAT_NAME:
        raise RecordError(f"{source}: not a trace-fp4 guidance record (format {meta.get('format')!r})")
    if meta.get("version") == "1":
        raise RecordError(
            f"{source}: guidance format version 1 (records without identity: no token digest, no weights "
            f"version); this trace-fp4 reads version {FORMAT_VERSION}: re-capture the record"
        )
    if meta.get("version") not in READABLE_VERSIONS:
        raise RecordError(
            f"{source}: guidance format version {meta.get('version')!r}, this trace-fp4 reads versions "
            f"{', '.join(READABLE_VERSIONS)}"
        )
    # The tensors have their own checksums; this one covers the metadata itself (shape, config, modes,
    # identity, the tensor checksums), so a changed header is never read as another valid record.
    if meta.get("metadata_checksum") != metadata_digest(meta):
        raise RecordError(f"{source}: metadata checksum mismatch (damaged or edited header)")
    return meta, header, n


def metadata_digest(meta: dict[str, str]) -> str:
    body = {k: v for k, v in meta.items() if k != "metadata_checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def signed_metadata_json(meta: dict[str, str]) -> tuple[str, str]:
    """(metadata_digest(meta), the compact JSON text, keys sorted, of `meta` with that digest as its
    "metadata_checksum": what the written header holds as "__metadata__"), every key and value (all
    str) escaped once for both texts.

    Why: `to_bytes` made the digest's text (`json.dumps(..., sort_keys=True)`) and then the header's
    (`json.dumps` of the whole header), escaping each value twice, the ~3 KB checksums text included.
    The texts are what those calls write: a JSON object of str keys and values is its escaped pairs
    joined, "key: value" by ", " for the digest and "key:value" by "," for the header."""
    esc = json.encoder.encode_basestring_ascii  # what json.dumps writes for a str (ensure_ascii)
    pairs = sorted((k, esc(k), esc(v)) for k, v in meta.items() if k != "metadata_checksum")
    checksum = hashlib.sha256(("{" + ", ".join(f"{ek}: {ev}" for _, ek, ev in pairs) + "}").encode()).hexdigest()
    pairs = sorted(pairs + [("metadata_checksum", '"metadata_checksum"', esc(checksum))])
    return checksum, "{" + ",".join(f"{ek}:{ev}" for _, ek, ev in pairs) + "}"


def parse_metadata(meta: dict[str, str], source: str):
    try:
        shape = _shape_of(meta["version"], meta["model_shape"])
        config = _config_of(meta["config"])
        num_tokens = int(meta["num_tokens"])
        modes = json.loads(meta["layer_modes"])
        checksums = json.loads(meta["checksums"])
        identity = RecordIdentity.from_dict(json.loads(meta["identity"]))
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise RecordError(f"{source}: damaged metadata ({e!r})") from e
    if not isinstance(checksums, dict) or not isinstance(modes, list):
        raise RecordError(f"{source}: damaged metadata (checksums / layer_modes of the wrong type)")
    if len(modes) != shape.num_layers or any(m not in (*ENCODINGS, None) for m in modes):
        raise RecordError(f"{source}: layer_modes {modes!r} do not fit {shape.num_layers} layers")
    return shape, config, num_tokens, modes, checksums, identity


# The driver reads back a take's records, all of one model shape and config: each text is parsed once
# (the objects are frozen dataclasses, shared as the records of one take already share them); a text
# that does not parse raises every time (lru_cache keeps only results).
@functools.lru_cache(maxsize=64)
def _shape_of(version: str, text: str) -> ModelShape:
    shape_fields = json.loads(text)
    if version == "2" and set(shape_fields) & {"moe_layers", "kv_layers", "kv_kind"}:
        raise ValueError("a version-2 record with version-3 shape fields")
    return ModelShape(**shape_fields)


@functools.lru_cache(maxsize=64)
def _config_of(text: str) -> TraceConfig:
    return TraceConfig.from_dict(json.loads(text))


@functools.lru_cache(maxsize=256)
def _expected(shape: ModelShape, T: int, modes: tuple) -> dict:
    """layout.expected_tensors, once per (shape, token count, modes): read only by `verify`."""
    return expected_tensors(shape, T, modes)


def verify(record, checksums: dict[str, str], source: str, digests: dict[str, str] | None = None) -> None:
    """Refuse `record` unless its tensors are the expected ones, each of its shape and dtype and with
    its checksum. `digests`: each tensor's tensor_digest where the reader already hashed its bytes
    (safetensors_bytes.load_plain), else each is computed here."""
    _verify(record, source, checksums, digests)


def verify_layout(record, source: str) -> None:
    """`verify` WITHOUT the checksums: refuse `record` unless its tensors are the expected ones, each of
    its shape and dtype (the same refusals, by tensor name). Only for the record read back from the very
    bytes object this process wrote and kept (records/written.py's trust rule: the writer hashed the
    immutable body it joined into those bytes); every other read (a copy, a store, a file, bytes from
    another process) goes through `verify` and its checksums.

    Why: the kept read-back compared the writer's checksums with themselves (`verify(record,
    kept.checksums, source, kept.checksums)`), a lookup of each in two dicts that could never differ."""
    _verify(record, source, None, None)


def _verify(record, source: str, checksums: dict | None, digests: dict | None) -> None:
    """`verify` (checksums: the record's written checksums) or `verify_layout` (checksums None)."""
    expected = _expected(record.shape, record.num_tokens, tuple(record.modes))
    tensors = record.tensors
    for name, (shape, dtype) in expected.items():
        t = tensors.get(name)
        if t is None:
            raise RecordError(f"{source}: {where(name)}: tensor {name} is missing")
        size = t.shape  # a torch.Size compares as its tuple (no tuple made per tensor, 576 a take)
        if shape is None:  # a variable-length payload: 1-D here, its length is checked when decoded
            shape = size if len(size) == 1 else ("n",)
        if size != shape or t.dtype != dtype:
            raise RecordError(
                f"{source}: {where(name)}: tensor {name} is {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}"
            )
        if checksums is not None and checksums.get(name) != (tensor_digest(t) if digests is None else digests[name]):
            raise RecordError(f"{source}: {where(name)}: checksum mismatch in tensor {name} (damaged data)")
    # Optional tensors: a sparse site's audit (records made without one decode as before); checksummed
    # like every other, their shapes are checked when the audit is read (GuidanceRecord.audit).
    others = record.tensors.keys() - expected.keys()  # one set difference: most records' only audits
    modes = record.modes
    optional = [n for n in record.tensors if n in others and _audit_layer(n) < len(modes)
                and modes[_audit_layer(n)] == "sparse"] if others else []
    for name in optional if checksums is not None else ():
        if checksums.get(name) != (tensor_digest(record.tensors[name]) if digests is None else digests[name]):
            raise RecordError(f"{source}: {where(name)}: checksum mismatch in tensor {name} (damaged data)")
    extra = sorted(others - set(optional))
    if extra:
        raise RecordError(f"{source}: unexpected tensors {extra}")


@functools.lru_cache(maxsize=4096)
def _audit_layer(name: str) -> int:
    """The layer of an audit part's name (`layer.<i>.<site>.<part>`), or a huge number for any other name
    (`verify`'s test for optional tensors, once per name: a take's records share their names)."""
    from .sparse_parts import is_audit_part

    field = name.split(".")[1] if name.count(".") else ""
    return int(field) if is_audit_part(name) and field.isdigit() else 1 << 62
