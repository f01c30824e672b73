"""The record-store interface: records travel by handle, not by value.

    handle = store.put(record)      # a short string, picklable, names the store and the key
    record = store.get(handle)      # consumed once by default (consume=False leaves it there)
    store.delete(handle)            # drop a record nobody will take
    store.stats()                   # put / taken / deleted / outstanding: a leak counter to log

Handles look like `trace-fp4:<scheme>:<location>#<key>`, so `trace_kernels.stores.get(handle)` opens
the right store from the handle alone, in any process (trainer ranks only receive handle strings).

A store keeps bytes; what the bytes are is `prefix.py`'s business: a record whose identity names its
prompt length is stored as a prompt part (content-addressed, shared by every sample of the group) plus
the rest. `get` reassembles it; the result's `to_bytes()` is byte-identical to the inline record's.
"""

import threading
import uuid
from collections import Counter

from ..records import GuidanceRecord, RecordError
from . import prefix as _prefix
from .trust import MAX_HANDLE_CHARS, check_key, check_prompt_key, check_spec, shown

HANDLE_PREFIX = "trace-fp4:"


def make_handle(spec: str, key: str) -> str:
    return f"{HANDLE_PREFIX}{spec}#{key}"


def parse_handle(handle) -> tuple[str, str]:
    """(store spec, key) of a handle; RecordError naming it if it is not one. Only syntax: which stores a
    handle may open is `stores.get`'s business (trust.py)."""
    if not isinstance(handle, str) or not handle.startswith(HANDLE_PREFIX) or "#" not in handle:
        raise RecordError(f"{shown(handle)}: not a trace-fp4 record handle (expected '{HANDLE_PREFIX}<store>#<key>')")
    if len(handle) > MAX_HANDLE_CHARS:
        raise RecordError(f"{shown(handle)}: record handle too long ({len(handle)} chars, at most {MAX_HANDLE_CHARS})")
    spec, key = handle[len(HANDLE_PREFIX):].rsplit("#", 1)
    check_key(key, handle)
    check_spec(spec, handle)
    return spec, key


class RecordStore:
    """Base class: subclasses move bytes (`_write`, `_read`, `_remove`, prefix parts, `_outstanding`)."""

    spec: str  # "file:/abs/dir" or "ray:<namespace>"

    def __init__(self, *, share_prefixes: bool = True, read_only: bool = False):
        self.share_prefixes = share_prefixes
        # A read-only store (`trace-fp4 inspect`, any store a user names) never writes, takes or deletes.
        self.read_only = read_only
        self._lock = threading.Lock()
        # This process's counts (each process that puts or takes has its own); `outstanding` in
        # stats() is the store's own view, over every process.
        self.counters: Counter = Counter()

    # ---- interface -----------------------------------------------------------------------------
    def put(self, record: GuidanceRecord) -> str:
        if not isinstance(record, GuidanceRecord):
            raise TypeError(f"RecordStore.put needs a trace_kernels.GuidanceRecord, got {type(record).__name__}")
        self._writable("put a record")
        return self._put_as(uuid.uuid4().hex, record)

    def replace(self, handle: str, record: GuidanceRecord) -> str:
        """Put `record` under an existing handle, dropping the record it held: a multi-turn trajectory's
        record grows by a turn while its handle already travels (verl keeps the first turn's)."""
        if not isinstance(record, GuidanceRecord):
            raise TypeError(f"RecordStore.replace needs a trace_kernels.GuidanceRecord, got {type(record).__name__}")
        key = self._key(handle)
        self.delete(handle)
        self._count(replaced=1)
        return self._put_as(key, record)

    def _put_as(self, key: str, record: GuidanceRecord) -> str:
        parts = _prefix.split(record) if self.share_prefixes else None
        if parts is None:
            data = record.to_bytes()
            self._write(key, data)
            self._count(put=1, bytes_put=len(data))
        else:
            prefix_key, prefix_data, rest = parts
            reused = self._put_prefix(prefix_key, prefix_data, key)
            self._write(key, rest)
            self._count(put=1, bytes_put=len(rest) + (0 if reused else len(prefix_data)),
                        prefix_parts_put=0 if reused else 1, prefix_parts_reused=1 if reused else 0)
        return make_handle(self.spec, key)

    def get(self, handle: str, consume: bool = True) -> GuidanceRecord:
        key = self._key(handle)
        if consume:
            self._writable(f"take {handle}")
        data = self._read(key, handle, consume=consume)
        record = self._assemble(data, key, handle, release=consume)
        self._count(taken=1 if consume else 0, peeked=0 if consume else 1)
        return record

    def delete(self, handle: str) -> None:
        key = self._key(handle)
        self._writable(f"delete {handle}")
        data = self._read(key, handle, consume=True)
        prefix_key = self._reference(data, handle)
        if prefix_key is not None:
            self._release_prefix(prefix_key, key)
        self._count(deleted=1)

    def stats(self) -> dict:
        with self._lock:
            out = {k: self.counters.get(k, 0) for k in ("put", "taken", "deleted", "bytes_put")}
            out.update({k: v for k, v in self.counters.items() if k not in out})
        out["outstanding"] = self._outstanding()
        return out

    def ensure_writable(self) -> None:
        """Make what `put` needs (a directory, an owner actor); a store opened only to read has none."""

    # ---- helpers -------------------------------------------------------------------------------
    def _count(self, **kv) -> None:
        with self._lock:
            for k, v in kv.items():
                if v:
                    self.counters[k] += v

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise RecordError(f"{what}: store {self.spec!r} is open read-only (nothing is moved or deleted)")

    def _reference(self, data: bytes, handle: str) -> str | None:
        """The stored record's prompt-part key, checked like a key: it names a part of this store only."""
        prefix_key = _prefix.reference(data, handle)
        return None if prefix_key is None else check_prompt_key(prefix_key, handle)

    def _key(self, handle: str) -> str:
        spec, key = parse_handle(handle)
        if spec != self.spec:
            raise RecordError(f"{handle}: handle of store {spec!r}, not of this store {self.spec!r}")
        return key

    def _assemble(self, data: bytes, key: str, handle: str, *, release: bool) -> GuidanceRecord:
        prefix_key = self._reference(data, handle)
        if prefix_key is None:
            return GuidanceRecord.from_bytes(data, source=handle)
        prefix_data = self._read_prefix(prefix_key, handle)
        record = _prefix.join(data, prefix_data, handle)
        if release:
            self._release_prefix(prefix_key, key)
        return record

    # ---- subclass hooks ------------------------------------------------------------------------
    def _write(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def _read(self, key: str, handle: str, *, consume: bool) -> bytes:
        raise NotImplementedError

    def _put_prefix(self, prefix_key: str, data: bytes, record_key: str) -> bool:
        """Store a prompt part once and note that `record_key` uses it; True if it was there already."""
        raise NotImplementedError

    def _read_prefix(self, prefix_key: str, handle: str) -> bytes:
        raise NotImplementedError

    def _release_prefix(self, prefix_key: str, record_key: str) -> None:
        """`record_key` no longer uses the prompt part; the last user removes it."""
        raise NotImplementedError

    def _outstanding(self) -> int:
        raise NotImplementedError
