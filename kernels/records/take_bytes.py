"""The bytes of a take's records written together: for each record exactly what `GuidanceRecord.to_bytes`
writes (the format's definition; tests/kernels/test_take_bytes.py compares every byte).

Why: the vLLM worker's take writes ~16 records of ~36 small tensors each (a body of ~4 KB, a header of
~6 KB), and `to_bytes` paid per record what the records of one take share: the file order, every
header entry's text, the metadata's constant values escaped, the checksums' JSON keys escaped and
sorted. Here those are made once per take (`_Layout`: per name set and dtypes, kept across takes) and
each record fills in only what is its own, each piece by one C call where it can:
  - the body: one join of its tensors' numpy views (as `safetensors_bytes.record_body`);
  - each tensor's digest (integrity.tensor_digest: its "dtype|shape|" prefix, then its bytes) hashed
    from the very array joined into the body; an empty tensor's digest is its prefix's, made once;
  - the header's tensor entries: each one's text up to its shape made once, then one f-string a record;
  - the checksums' JSON, escaped as the header and the metadata digest hold it: one `str.format` of a
    template of the sorted names (a hex digest needs no escaping; escaping is per character, so the
    escaped whole is the escaped pieces joined);
  - the metadata digest's text and the header's metadata text: constants joined around the record's
    checksums, identity and token count (integrity.signed_metadata_json's texts, byte for byte).

The trust rule of records/written.py holds as in `record_body`: each digest is hashed from the
immutable body where the tensor's bytes lie, and the file is that body behind the header.

A record this writer does not handle (another shape, config or modes than the take's first, other
names or dtypes than the take's layout, a tensor numpy will not join as it lies, a tensor named
`__metadata__`) is written by its own `to_bytes`: the same bytes, counted in
cpu_native.FALLBACKS["take_bytes:per_record"], never silent.
"""

import hashlib
import json
import operator
import struct

import torch

from . import safetensors_bytes, written

_ESC = json.encoder.encode_basestring_ascii  # what json.dumps writes for a str (ensure_ascii)


def write_take(records: list, keep_for_reader: bool = False) -> list[bytes]:
    """[record.to_bytes(keep_for_reader) for record in records], the records of one take written
    together (same bytes, same kept entries: records/written.py)."""
    if not records:
        return []
    first = records[0]
    meta = _MetaTexts(first)
    empties: dict = {}  # the read-back's empty tensors, one of each (dtype, shape) for the take (written.Kept)
    out = []
    for r in records:
        data = None
        if r.shape is first.shape or r.shape == first.shape:
            if r.config is first.config and r.modes == first.modes:
                data = _write(r, meta, keep_for_reader, empties)
        if data is None:
            from .. import cpu_native

            cpu_native.FALLBACKS["take_bytes:per_record"] += 1
            data = r.to_bytes(keep_for_reader)
        out.append(data)
    return out


class _MetaTexts:
    """The metadata texts a take's records share (their shape, config and modes: the first record's),
    escaped once: the metadata digest's text and the header's metadata text around each record's
    checksums, identity and token count. Keys sorted: checksums, config, format, identity,
    layer_modes, (metadata_checksum,) model_shape, num_tokens, version."""

    __slots__ = ("d0", "d1", "d2", "d3", "h0", "h1", "h2", "h3", "h4")

    def __init__(self, record):
        fields = record._metadata_fields({})  # the record's own texts of every field (checksums replaced below)
        if set(fields) != _KEYS:
            raise AssertionError(f"the record metadata's keys changed: {sorted(fields)}; update take_bytes._MetaTexts")
        e = {k: _ESC(v) for k, v in fields.items()}
        # the digest's text: '{"key": value, ...}' without metadata_checksum (integrity.signed_metadata_json)
        self.d0 = '{"checksums": '
        self.d1 = f', "config": {e["config"]}, "format": {e["format"]}, "identity": '
        self.d2 = f', "layer_modes": {e["layer_modes"]}, "model_shape": {e["model_shape"]}, "num_tokens": '
        self.d3 = f', "version": {e["version"]}}}'
        # the header's metadata text: '{"key":value,...}' with metadata_checksum
        self.h0 = '{"checksums":'
        self.h1 = f',"config":{e["config"]},"format":{e["format"]},"identity":'
        self.h2 = f',"layer_modes":{e["layer_modes"]},"metadata_checksum":"'
        self.h3 = f'","model_shape":{e["model_shape"]},"num_tokens":'
        self.h4 = f',"version":{e["version"]}}}'


_KEYS = {"format", "version", "model_shape", "config", "num_tokens", "layer_modes", "identity", "checksums"}


def _write(record, meta: _MetaTexts, keep_for_reader: bool, empties: dict) -> bytes | None:
    """`record.to_bytes(keep_for_reader)` by the take's layout, or None where the layout does not apply."""
    tensors = record.tensors
    layout = _layout(tensors)
    if layout is None:
        return None
    ts = layout.values_of(tensors)
    # the take's own tensors (uint8, as an all-uint8 layout says: GuidanceRecord.host_bytes' contract) need
    # no dtype read each (~8 us a record)
    raw = _host_bytes(record, layout, ts)
    if raw is None and tuple([t.dtype for t in ts]) != layout.dtypes:  # these names with other dtypes: their own layout
        layout = _layout(tensors, renew=True)
        if layout is None:
            return None
        ts = layout.values_of(tensors)
        raw = _host_bytes(record, layout, ts)
    if raw is not None:  # the take's own uint8 views and their bytes (GuidanceRecord.host_bytes)
        sizes = list(map(len, raw))
        shapes = [(n,) for n in sizes]  # 1-D uint8: its shape is its byte count
        body = b"".join(raw)
    else:
        sizes = [t.nbytes for t in ts]
        try:
            # an empty tensor adds no bytes: no numpy view made for it (~0.8 us each, ~12 a record; its shape
            # is read from the tensor, and its bytes are b"" in every dtype and device, as in `to_bytes`)
            arrays = [t.numpy() for t, n in zip(ts, sizes) if n]
            body = b"".join(arrays)  # refuses a strided array (TypeError / BufferError)
        except (TypeError, RuntimeError, ValueError, BufferError):
            return None
        # a tuple of ints: a numpy view has its tensor's shape
        nonempty = iter(arrays)
        shapes = [next(nonempty).shape if n else tuple(t.shape) for t, n in zip(ts, sizes)]
    # one pass over the tensors in file order: each one's offsets, its digest hashed where its bytes lie
    # in the immutable body (an empty one's is its prefix's, made once), its header entry's text
    view = memoryview(body)
    hexes, texts, entries = [], [], []
    a = 0
    for head, dtype, shape, n in zip(layout.heads, layout.dtypes, shapes, sizes):
        b = a + n
        key = (dtype, shape)
        if n:
            h = _PREFIX.get(key)
            if h is None:
                h = _prefix(key)
            h = h.copy()
            h.update(view[a:b])
            hexes.append(h.hexdigest())
        else:
            hexes.append(_EMPTY.get(key) or _empty(key))
        texts.append(f'{head}{_SHAPE_TEXT.get(shape) or _shape_text(shape)}],"data_offsets":[{a},{b}]}}')
        entries.append((a, b, shape))
        a = b
    checksums_esc = layout.checksums_fmt.format(*hexes)
    identity_esc = _ESC(json.dumps(record.identity.to_dict(), sort_keys=True))
    tokens_esc = _ESC(str(record.num_tokens))
    digest_text = "".join([meta.d0, checksums_esc, meta.d1, identity_esc, meta.d2, tokens_esc, meta.d3])
    checksum = hashlib.sha256(digest_text.encode()).hexdigest()
    text = "".join(['{"__metadata__":', meta.h0, checksums_esc, meta.h1, identity_esc, meta.h2, checksum, meta.h3,
                    tokens_esc, meta.h4, *texts, "}"]).encode()
    text += b" " * (-len(text) % 8)
    n = len(text)
    data = b"".join([struct.pack("<Q", n), text, body])
    if keep_for_reader:
        entries = [(a, b, name, dtype_name, shape) for (a, b, shape), name, dtype_name
                   in zip(entries, layout.order, layout.dtype_names)]
        written.keep(data, written.Kept(record, dict(zip(layout.order, hexes)), n, entries, empties))
    return data


def _host_bytes(record, layout, ts) -> list | None:
    """The bytes of `ts` (the record's tensors in file order) as the record's maker handed them
    (GuidanceRecord.host_bytes: the engine's take, every tensor a 1-D uint8 view of one of its kernel
    outputs, beside a memoryview of the same bytes), or None where they do not apply: no such bytes, a
    layout not all uint8, a name without them, or a tensor that is not the very one they were made with
    (the dict changed since). The take's tensors are fresh views nothing else holds; the worker writes
    them right after the take made them (trace_fp4_take_records)."""
    held = record.host_bytes
    if held is None or not layout.all_uint8 or len(held) != len(ts):
        return None
    try:
        pairs = layout.values_of(held)
    except KeyError:
        return None
    if not all(map(operator.is_, ts, [p[0] for p in pairs])):
        return None
    return [p[1] for p in pairs]


class _LayoutOf:
    """What a take's records of one name set (in dict order) and dtypes share: the file order, a getter
    of the tensors in it, their dtypes, each header entry's text up to its shape, and the template of
    the escaped checksums JSON (the digests, by file position, in the names' sorted order)."""

    __slots__ = ("order", "getter", "dtypes", "dtype_names", "heads", "checksums_fmt", "all_uint8")

    def __init__(self, order: list, dtypes: tuple):
        self.order = order
        self.getter = operator.itemgetter(*order)
        self.dtypes = dtypes
        self.all_uint8 = all(d is torch.uint8 for d in dtypes)  # where a maker's host bytes may stand for them
        self.dtype_names = [safetensors_bytes._ORDER[d][0] for d in dtypes]
        # each entry's text up to its shape (an f-string a record fills in: faster than one str.format)
        self.heads = [f',{safetensors_bytes._name_json(name)}:{{"dtype":"{dtype_name}","shape":['
                      for name, dtype_name in zip(order, self.dtype_names)]
        # json.dumps(checksums, sort_keys=True) escaped as a str (_ESC): '"{\"name\": \"hex\", ...}"'
        position = {name: i for i, name in enumerate(order)}
        pieces = ['"', _braces(_inner("{"))]
        for j, name in enumerate(sorted(order)):
            pieces.append(_braces(_inner(("" if not j else ", ") + json.dumps(name) + ': "')))
            pieces.append(f"{{{position[name]}}}")
            pieces.append(_braces(_inner('"')))
        pieces.append(_braces(_inner("}")) + '"')
        self.checksums_fmt = "".join(pieces)

    def values_of(self, d: dict) -> tuple:
        """d's values of the layout's names, in file order (a 1-tuple for one name: an itemgetter of one key
        returns the bare value)."""
        got = self.getter(d)
        return (got,) if len(self.order) == 1 else got


def _braces(text: str) -> str:
    """`text` as a str.format template's literal."""
    return text.replace("{", "{{").replace("}", "}}")


def _inner(text: str) -> str:
    """`text` escaped as _ESC escapes it inside a JSON string (without the quotes around it)."""
    return _ESC(text)[1:-1]


def _layout(tensors: dict, renew: bool = False) -> _LayoutOf | None:
    """The layout of `tensors`' names (made once per name set, in dict order; `renew`: made again for
    these tensors' dtypes), or None where the writer does not write them (`_write` gives them to
    `to_bytes`): no tensor, a tensor named like the metadata, a dtype outside safetensors_bytes._ORDER."""
    names = tuple(tensors)
    found = None if renew else _LAYOUTS.get(names)
    if found is None:
        if "__metadata__" in tensors or not names or not safetensors_bytes.writable(tensors):
            return None
        order = sorted(tensors, key=lambda k: (-safetensors_bytes._ORDER[tensors[k].dtype][1], k))
        if len(_LAYOUTS) > 64:
            _LAYOUTS.clear()
        found = _LAYOUTS[names] = _LayoutOf(order, tuple(tensors[k].dtype for k in order))
    return found


def _prefix(key):
    """The sha256 of integrity.tensor_digest's "dtype|shape|" prefix (safetensors_bytes._prefix's)."""
    if len(_PREFIX) > 4096:
        _PREFIX.clear()
    h = _PREFIX[key] = safetensors_bytes._prefix(*key)
    return h


def _empty(key) -> str:
    """The digest of an empty tensor of (dtype, shape): its prefix's alone."""
    if len(_EMPTY) > 4096:
        _EMPTY.clear()
    text = _EMPTY[key] = safetensors_bytes._prefix(*key).hexdigest()
    return text


def _shape_text(shape: tuple) -> str:
    if len(_SHAPE_TEXT) > 16384:
        _SHAPE_TEXT.clear()
    text = _SHAPE_TEXT[shape] = ",".join(map(str, shape))
    return text


_LAYOUTS: dict = {}  # names tuple -> _LayoutOf (its dtypes checked per record)
_PREFIX: dict = {}  # (torch dtype, shape tuple) -> sha256 of the digest's prefix
_EMPTY: dict = {}  # (torch dtype, shape tuple) -> the digest of an empty tensor
_SHAPE_TEXT: dict = {}  # shape tuple -> "a,b,c"
