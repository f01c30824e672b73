"""A record's safetensors bytes written directly: what `canonical_header(safetensors.torch.save(...))`
writes, byte for byte, without safetensors' per-tensor checks and numpy round trips and without
parsing its header back to sort the metadata.

Why: a record is ~40 small tensors; safetensors' save costs about 0.5 ms per record of Python around
its Rust writer, then `canonical_header` parses and rewrites the header: together a fifth of what
taking a record costs in the engine. The format is simple: an 8-byte little-endian header length, a
JSON header ({"__metadata__": sorted metadata} then one entry per tensor), padded with spaces to 8
bytes, then the tensors' bytes in the header's order. safetensors orders the tensors by dtype (larger
alignment first, `_ORDER`) then by name; tests/kernels/test_records.py checks the bytes equal
safetensors' for every dtype here. A dtype not listed is written by safetensors itself.
"""

import hashlib
import json
import struct

import numpy as np
import torch

# safetensors' name of each dtype and its rank in safetensors' file order (highest first), as
# safetensors 0.8's serializer sorts them (its Dtype enum order, descending).
_ORDER = {
    torch.int64: ("I64", 9), torch.float64: ("F64", 8), torch.float32: ("F32", 7), torch.int32: ("I32", 6),
    torch.bfloat16: ("BF16", 5), torch.float16: ("F16", 4), torch.int16: ("I16", 3), torch.int8: ("I8", 2),
    torch.uint8: ("U8", 1), torch.bool: ("BOOL", 0),
}


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in memory order (little endian on every host torch runs on)."""
    if not t.numel():
        return b""
    if numpy_view(t):  # the usual record tensor: one numpy view, not five torch ops (36 per record)
        return t.numpy().tobytes()
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def digest(dtype: torch.dtype, shape, data) -> str:
    """A tensor's SHA-256 as records checksum it (integrity.tensor_digest): its dtype and shape, then its
    bytes in memory order (`data`: a buffer, or None for an empty tensor)."""
    h = _prefix(dtype, shape)
    if data is not None:
        h.update(data)
    return h.hexdigest()


def _prefix(dtype: torch.dtype, shape):
    """A new sha256 that has hashed `digest`'s "dtype|shape|" prefix: a copy of one made once per (dtype,
    shape), since a take's records share their shapes (~36 tensors a record, 576 for 16 records)."""
    key = (dtype, tuple(shape))
    h = _PREFIXES.get(key)
    if h is None:
        if len(_PREFIXES) > 4096:  # a record's shapes repeat; never grow without bound
            _PREFIXES.clear()
        h = _PREFIXES[key] = hashlib.sha256(f"{dtype}|{key[1]}|".encode())
    return h.copy()


_PREFIXES: dict = {}  # (dtype, shape tuple) -> sha256 holding digest()'s prefix of that dtype and shape


def numpy_view(t: torch.Tensor) -> bool:
    """Whether `t.numpy()` is its bytes as they are: a contiguous host tensor of a dtype numpy has."""
    # `is_cpu` rather than `device.type == "cpu"`: ~0.1 us against ~0.8 us, and a take asks it of 576 tensors
    return t.is_cpu and t.dtype != torch.bfloat16 and not t.requires_grad and t.is_contiguous()


def writable(tensors: dict) -> bool:
    return all(t.dtype in _ORDER for t in tensors.values())


def bytes_and_digests(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """({name: the tensor's bytes in memory order (`raw_bytes`)}, {name: integrity.tensor_digest of
    them}), each tensor read once for both. The digest is of that immutable copy, and `save_layout`
    joins those same objects into the file: the file holds exactly the bytes its checksums were made
    of, whatever touches the tensors meanwhile (what lets this process trust its own kept bytes
    unhashed: records/written.py).

    Why: a take writes ~36 tensors a record, 576 for 16 records: the digest's "dtype|shape|" prefix is
    hashed once per (dtype, shape) (`_prefix`) and copied."""
    raws, digests = {}, {}
    for name, t in tensors.items():
        raw = raw_bytes(t)
        h = _prefix(t.dtype, t.shape)
        h.update(raw)  # an empty tensor's b"" hashes as `digest`'s None: nothing added
        raws[name], digests[name] = raw, h.hexdigest()
    return raws, digests


def record_body(tensors: dict[str, torch.Tensor]):
    """(body, entries, entry texts, {name: integrity.tensor_digest}) of `tensors` (no tensor named
    `__metadata__`: see `save_layout`), or None where a dtype is not one of `_ORDER` (`writable`): the body is the file's tensor bytes,
    back to back in safetensors' order, as ONE immutable `bytes` joined straight from the tensors' own
    memory (no bytes object per tensor); each digest is hashed from that body where its bytes lie;
    entries [(start, stop, name, dtype name, shape)] as `save_layout` gives them; entry texts each
    tensor's `,"name":{...}` of the header (`with_header` writes the file).

    Why: `to_bytes` of a take's 16 records is 576 tensors: a `bytes` per tensor, then a join of those,
    and the header's text formatted per tensor were most of its ~4 ms. A take's records share their
    names, dtypes and shapes (not all their offsets: a sparse payload's length varies): the order is
    made once per name set, and each entry's text up to its offsets and its digest prefix once per
    (name, dtype, shape). The trust rule of records/written.py holds as before: the digests are of the immutable
    body, and the file is that body's bytes behind the header."""
    found = _order(tensors)
    if found is None:
        return None
    order, dtypes = found
    ts = [tensors[name] for name in order]
    texts, entries, prefixes = [], [], []
    offset = 0
    for name, dtype, t in zip(order, dtypes, ts):
        if t.dtype is not dtype:  # the cached order was made for other dtypes of these names
            _ORDERS.pop(tuple(tensors), None)
            return record_body(tensors)
        entry = _ENTRIES.get((name, dtype, t.shape))  # torch.Size hashes and compares as its tuple
        if entry is None:
            entry = _entry(name, t)
        head, n, dtype_name, shape, prefix = entry
        stop = offset + n
        texts.append(f"{head}{offset},{stop}]}}")
        entries.append((offset, stop, name, dtype_name, shape))
        prefixes.append(prefix)
        offset = stop
    body = _join(ts)
    view = memoryview(body)
    digests = {}
    for (a, b, name, _, _), prefix in zip(entries, prefixes):
        h = prefix.copy()
        h.update(view[a:b])  # an empty tensor adds nothing: `digest`'s None
        digests[name] = h.hexdigest()
    return body, entries, texts, digests


def _join(ts: list) -> bytes:
    """The tensors' bytes in memory order, back to back: one join of their numpy views (no copy each).
    numpy refuses what it does not export as the bytes lie (a bf16, device or grad-requiring tensor:
    TypeError / RuntimeError; a strided one is no C-contiguous buffer, which the join refuses with a
    TypeError; ValueError / BufferError where a numpy version says so instead), and then every
    tensor goes `numpy_view`'s checked way (`raw_bytes` copies the others): the same bytes either way,
    the check (~0.4 us a tensor, 576 a take) paid only where a tensor needs it. A record's tensors
    (uint8, int16, int64, float32, contiguous, on the host) never do."""
    try:
        return b"".join([t.numpy() for t in ts])
    except (TypeError, RuntimeError, ValueError, BufferError):
        return b"".join([t.numpy() if numpy_view(t) else raw_bytes(t) for t in ts])


def with_header(body: bytes, texts: list, metadata_json: str) -> tuple[bytes, int]:
    """(the file, n the header's length) of `record_body`'s body and entry texts under the metadata's
    compact JSON text with sorted keys (integrity.signed_metadata_json): what `save_layout` writes."""
    text = "".join(['{"__metadata__":', metadata_json, *texts, "}"]).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, body]), len(text)


def _order(tensors: dict) -> tuple[list, tuple] | None:
    """(the names in safetensors' file order, their dtypes in that order), made once per name set (in
    dict order); `record_body` checks the dtypes and makes it again where they differ. None where a
    dtype is not one of `_ORDER` (so the cached dtypes, which `record_body` checks, are all writable)."""
    names = tuple(tensors)
    found = _ORDERS.get(names)
    if found is None:
        if not writable(tensors):
            return None
        if len(_ORDERS) > 256:
            _ORDERS.clear()
        order = sorted(tensors, key=lambda k: (-_ORDER[tensors[k].dtype][1], k))
        found = _ORDERS[names] = (order, tuple(tensors[k].dtype for k in order))
    return found


def _entry(name: str, t: torch.Tensor) -> tuple:
    """(the header's text of one tensor up to its offsets, its byte count, its dtype's name, its shape, the
    sha256 of its digest's prefix): what a take's records share (a sparse payload's length varies, and
    with it the offsets of every tensor after it: those are written per record)."""
    if len(_ENTRIES) > 16384:  # a take's records repeat their entries; never grow without bound
        _ENTRIES.clear()
    dtype, shape = _ORDER[t.dtype][0], tuple(t.shape)  # a tuple: the entry is shared by the records' Kept
    head = f',{_name_json(name)}:{{"dtype":"{dtype}","shape":[{",".join(map(str, shape))}],"data_offsets":['
    entry = _ENTRIES[(name, t.dtype, t.shape)] = (head, t.nbytes, dtype, shape, _prefix(t.dtype, t.shape))
    return entry


_ORDERS: dict = {}  # names tuple -> (file order, dtypes in that order)
_ENTRIES: dict = {}  # (name, dtype, shape) -> (header text to the offsets, bytes, dtype name, shape, digest prefix)


def save_layout(tensors: dict[str, torch.Tensor], raw: dict, metadata: dict[str, str], metadata_json: str | None = None):
    """The safetensors file of `tensors` (dtypes of `_ORDER` only: see `writable`) whose bytes are
    `raw[name]` (`bytes_and_digests`), with `metadata`, its
    header as integrity.canonical_header writes it; with where it put each tensor: (the file, n, entries),
    n the header's length and entries [(start, stop, name, dtype name, shape)] in file order, offsets
    after the header (8 + n), as `load_plain` finds them (what `read_tensors` takes). `metadata_json`:
    the metadata's compact JSON text with sorted keys when the caller made it already
    (integrity.signed_metadata_json), else made here from `metadata`.

    The header is written as text (what `json.dumps` of the header dict gives, byte for byte: the
    metadata's JSON, then each entry's escaped name and its numbers), not built as a dict and dumped:
    ~0.1 ms a record, every record of every take."""
    order = sorted(tensors, key=lambda k: (-_ORDER[tensors[k].dtype][1], k))
    if "__metadata__" in tensors:  # a tensor named like the metadata replaces it in the header dict
        return _save_layout_dict(tensors, raw, metadata, order)
    if metadata_json is None:
        metadata_json = json.dumps(dict(sorted(metadata.items())), separators=(",", ":"))
    parts = ['{"__metadata__":', metadata_json]
    entries = []
    offset = 0
    for name in order:
        t = tensors[name]
        n = len(raw[name])
        dtype, shape = _ORDER[t.dtype][0], list(t.shape)
        parts.append(f',{_name_json(name)}:{{"dtype":"{dtype}","shape":[{",".join(map(str, shape))}],'
                     f'"data_offsets":[{offset},{offset + n}]}}')
        entries.append((offset, offset + n, name, dtype, shape))
        offset += n
    parts.append("}")
    text = "".join(parts).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *(raw[name] for name in order)]), len(text), entries


def _name_json(name: str) -> str:
    """`json.dumps(name)`: a tensor name as the header's key (made once per name)."""
    text = _NAMES.get(name)
    if text is None:
        if len(_NAMES) > 16384:
            _NAMES.clear()
        text = _NAMES[name] = json.dumps(name)
    return text


_NAMES: dict = {}


def _save_layout_dict(tensors: dict, raw: dict, metadata: dict, order: list):
    """save_layout through the header dict (`json.dumps`), for names the text path does not write alike."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    entries = []
    offset = 0
    for name in order:
        t = tensors[name]
        n = len(raw[name])
        dtype, shape = _ORDER[t.dtype][0], list(t.shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        entries.append((offset, offset + n, name, dtype, shape))
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *(raw[name] for name in order)]), len(text), entries


# the reader's side: safetensors' dtype name -> (torch dtype, numpy dtype of its bytes, bytes each); the
# bytes are little endian, as the writer above assumes (every host torch runs on)
_READ = {
    "I64": (torch.int64, np.int64, 8), "F64": (torch.float64, np.float64, 8), "F32": (torch.float32, np.float32, 4),
    "I32": (torch.int32, np.int32, 4), "BF16": (torch.bfloat16, np.uint16, 2), "F16": (torch.float16, np.float16, 2),
    "I16": (torch.int16, np.int16, 2), "I8": (torch.int8, np.int8, 1), "U8": (torch.uint8, np.uint8, 1),
    "BOOL": (torch.bool, np.bool_, 1),
}
_FIELDS = {"dtype", "shape", "data_offsets"}


def load_plain(data: bytes, header: dict, n: int) -> tuple[dict, dict] | None:
    """({name: tensor}, {name: integrity.tensor_digest of it}) of a safetensors file `data` whose header
    (8 + n bytes) parsed to `header`, read without safetensors' per-tensor Python: each tensor a copy of
    its bytes (its own storage, as safetensors' load gives), its digest hashed from the file's bytes
    where they lie. None unless the file is one `save_layout` could write: a header both parsers read
    alike (below), dtypes of `_ORDER`, entries of exactly dtype / shape / data_offsets, every tensor's
    bytes its shape's, back to back from 0 to the file's end (safetensors' own checks). The caller
    loads anything else with safetensors, which accepts or refuses it as before.

    Why: the driver reads back every record of every take; safetensors' load cost ~0.2 ms of Python per
    record (a tensor from each buffer, reshaped), the checksums another 0.1 ms (a tensor's bytes read
    again per tensor)."""
    head = data[8 : 8 + n]
    # Where Python's json and safetensors' (serde) parser could read the same text differently: a
    # duplicate field in a tensor's entry (serde refuses it, Python keeps the last), a lone surrogate
    # escape (serde refuses it), another encoding or a leading space (json detects / skips them). A
    # header of ASCII without escapes, starting `{"`, each field name once per entry, has none.
    entries_n = len(header) - 1
    if (n > 100_000_000 or not head.startswith(b'{"') or not head.isascii() or b"\\u" in head
            or head.count(b'"dtype":') != entries_n or head.count(b'"shape":') != entries_n
            or head.count(b'"data_offsets":') != entries_n):
        return None
    entries = []
    # each entry checked in one pass: its fields' types, its shape's size against its byte count (no
    # generator per shape and per offsets: ~36 entries a record, every record the driver parses)
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if type(e) is not dict or e.keys() != _FIELDS:
            return None
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        # `type(dtype) is str` first: a list or dict there is no key of _READ (it raised TypeError, not a refusal)
        if type(dtype) is not str or dtype not in _READ or type(shape) is not list or type(offsets) is not list \
                or len(offsets) != 2:
            return None
        a, b = offsets
        if type(a) is not int or type(b) is not int:
            return None
        count = 1
        for d in shape:
            if type(d) is not int or d < 0:
                return None
            count *= d
        if b - a != count * _READ[dtype][2]:
            return None
        entries.append((a, b, name, dtype, shape))
    entries.sort()
    base, end = 8 + n, 0
    if (entries[-1][1] if entries else 0) != len(data) - base:  # the last tensor ends where the file does
        return None
    for a, b, _, _, _ in entries:  # back to back from 0 (each one's size was checked above)
        if a != end:
            return None
        end = b
    return read_tensors(data, base, entries)


def read_tensors(data: bytes, base: int, entries: list) -> tuple[dict, dict]:
    """({name: tensor}, {name: integrity.tensor_digest of it}) of the tensors of `data` at `entries`
    [(start, stop, name, dtype name, shape)] (offsets after the header, which ends at `base`), already
    checked to lie back to back with their shapes' sizes (`load_plain`). Each tensor a copy of its
    bytes (its own storage, as safetensors' load gives), its digest hashed from the file's bytes where
    they lie."""
    view = memoryview(data)
    digests = {name: digest(_READ[dtype][0], shape, view[base + a : base + b] if b > a else None)
               for a, b, name, dtype, shape in entries}
    return copy_tensors(data, base, entries), digests


def copy_tensors(data: bytes, base: int, entries: list, empties: dict | None = None) -> dict:
    """{name: tensor} of the tensors of `data` at `entries` (as `read_tensors`), each a copy of its bytes
    (its own storage), not hashed: what `read_tensors` gives without the digests, for bytes whose
    digests the reader already has from the writer itself (records/written.py: this process's own
    bytes object, read back by the driver of an in-process engine).
    `empties`: {(dtype name, shape): tensor} shared by the records of one take (written.Kept.empties):
    an empty tensor is made once for them all (~0.8 us each, 12 a record), as the take shares its own."""
    view = memoryview(data)
    tensors = {}
    for a, b, name, dtype, shape in entries:
        dt, np_dt, size = _READ[dtype]
        count = (b - a) // size
        if not count:  # an int size where 1-D (most empties: a site's unused audit parts): ~0.6 us less
            if empties is None:
                tensors[name] = torch.empty(shape[0] if len(shape) == 1 else shape, dtype=dt)
                continue
            t = empties.get((dtype, shape))
            if t is None:
                t = empties[(dtype, shape)] = torch.empty(shape[0] if len(shape) == 1 else shape, dtype=dt)
            tensors[name] = t
        elif len(shape) == 1:  # most of a record (payloads, audits, packed routing): its own bytes, as is
            tensors[name] = torch.frombuffer(bytearray(view[base + a : base + b]), dtype=dt)
        else:  # shaped by numpy (a torch reshape costs as much as the rest)
            t = torch.from_numpy(np.frombuffer(view, dtype=np_dt, count=count, offset=base + a).reshape(shape).copy())
            tensors[name] = t.view(dt) if dtype == "BF16" else t
    return tensors
