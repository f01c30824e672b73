"""Record stores: guidance records travel by handle (docs/architecture.md).

    store = trace_kernels.stores.open_store("file:/shared/records")   # or a plain path, or "ray:<ns>"
    handle = store.put(record)                                         # in the rollout worker
    record = trace_kernels.stores.get(handle)                          # in the trainer rank, consumed once

Engine- and trainer-independent: the engines return handles when a store is configured, and anything
holding a handle resolves it with `get`. Handles are untrusted input (trust.py): `get` and `delete`
open only an allowed store, which is one this process opened with `open_store`, the one
TRACE_FP4_RECORD_STORE names, those TRACE_FP4_ALLOWED_STORES lists, those passed to `allow`, or
those the caller passes as `allowed=`. `peek` (`trace-fp4 inspect`) reads any store, read-only.
"""

import os
import threading

from .. import envs
from ..records import RecordError
from .base import HANDLE_PREFIX, RecordStore, make_handle, parse_handle
from .local import LocalStore
from .trust import check_allowed, remember, remembered

STORE_ENV = "TRACE_FP4_RECORD_STORE"  # engines put records here and return handles when it is set
ALLOWED_ENV = "TRACE_FP4_ALLOWED_STORES"  # a trainer's further allowed stores, comma-separated

_open: dict[str, RecordStore] = {}
_lock = threading.Lock()


def canonical_spec(spec) -> str:
    """`"file:/abs/dir"`, a plain path or `"ray:<namespace>"` -> the spec its handles carry (no I/O
    beyond resolving the path's symlinks; nothing is created)."""
    if isinstance(spec, RecordStore):
        return spec.spec
    spec = str(spec)
    if "\0" in spec:
        raise ValueError(f"record store {spec!r}: NUL in the spec")
    if spec.startswith("ray:"):
        return spec
    path = spec[len("file:"):] if spec.startswith("file:") else spec
    if not path:
        raise ValueError(f"record store {spec!r}: no directory")
    return f"file:{os.path.realpath(path)}"


def _make(spec: str, **kw) -> RecordStore:
    if spec.startswith("ray:"):
        from .ray_store import RayStore

        return RayStore(spec[len("ray:"):], **kw)
    return LocalStore(spec[len("file:"):], **kw)


def open_store(spec, *, create: bool = True) -> RecordStore:
    """`"file:/abs/dir"` or a plain path -> LocalStore; `"ray:<namespace>"` -> RayStore. Cached per spec
    in this process (so counters accumulate). A store opened here (or constructed to write) is one this
    process configured, so its handles are allowed (`get`). `create=False` opens without making its directory (or actor)."""
    if isinstance(spec, RecordStore):
        remember(spec.spec)
        return spec
    key = canonical_spec(spec)
    store = _cached(key, create=create)
    remember(key)
    return store


def _cached(key: str, *, create: bool) -> RecordStore:
    with _lock:
        store = _open.get(key)
        if store is None:
            store = _make(key, create=create)
            _open[key] = store
        elif create:
            store.ensure_writable()
        return store


def allow(*specs) -> None:
    """Allow handles of these stores in this process (a trainer that only reads a store it did not open)."""
    for spec in [canonical_spec(s) for s in specs]:
        remember(spec)


def allowed_stores() -> frozenset[str]:
    """The stores whose handles `get` / `delete` resolve by default: those opened or allowed in this
    process, TRACE_FP4_RECORD_STORE's, and TRACE_FP4_ALLOWED_STORES's."""
    env = [envs.read(STORE_ENV) or ""] + (envs.read(ALLOWED_ENV) or "").split(",")
    return remembered() | {canonical_spec(s.strip()) for s in env if s.strip()}


def store_from_env() -> RecordStore | None:
    spec = envs.read(STORE_ENV)
    return open_store(spec) if spec else None


def store_of(handle: str, *, allowed=None) -> RecordStore:
    """The store of `handle`, if it is an allowed one (RecordError naming the handle and the allowed
    stores otherwise). Opened without creating anything."""
    spec, _ = parse_handle(handle)
    specs = allowed_stores() if allowed is None else frozenset(canonical_spec(s) for s in allowed)
    check_allowed(handle, spec, specs)
    return _cached(spec, create=False)


def get(handle: str, *, consume: bool = True, allowed=None):
    """The GuidanceRecord behind `handle`, from its store if that store is allowed (consumed by default).
    `allowed`: the stores (specs or RecordStores) to accept instead of `allowed_stores()`."""
    return store_of(handle, allowed=allowed).get(handle, consume=consume)


def delete(handle: str, *, allowed=None) -> None:
    store_of(handle, allowed=allowed).delete(handle)


def peek(handle: str):
    """The record behind `handle` in whatever store it names, read-only: nothing is created, taken or
    deleted (`trace-fp4 inspect`, where a user names the store by hand)."""
    spec, _ = parse_handle(handle)
    return _make(spec, read_only=True, create=False).get(handle, consume=False)


def is_handle(value) -> bool:
    return isinstance(value, str) and value.startswith(HANDLE_PREFIX)


__all__ = [
    "ALLOWED_ENV",
    "HANDLE_PREFIX",
    "LocalStore",
    "RecordError",
    "RecordStore",
    "STORE_ENV",
    "allow",
    "allowed_stores",
    "canonical_spec",
    "delete",
    "get",
    "is_handle",
    "make_handle",
    "open_store",
    "parse_handle",
    "peek",
    "store_from_env",
    "store_of",
]
