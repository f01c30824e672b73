"""Record stores: guidance records travel by handle (docs/architecture.md).

    store = trace_kernels.stores.open_store("file:/shared/records")   # or a plain path, or "ray:<ns>"
    handle = store.put(record)                                         # in the rollout worker
    record = trace_kernels.stores.get(handle)                          # in the trainer rank, consumed once

Engine- and trainer-independent: the engines return handles when a store is configured, and anything
holding a handle resolves it with `get` (the handle names its store).
"""

import os
import threading

from .. import envs
from ..records import RecordError
from .base import HANDLE_PREFIX, RecordStore, make_handle, parse_handle
from .local import LocalStore

STORE_ENV = "TRACE_FP4_RECORD_STORE"  # engines put records here and return handles when it is set

_open: dict[str, RecordStore] = {}
_lock = threading.Lock()


def open_store(spec) -> RecordStore:
    """`"file:/abs/dir"` or a plain path -> LocalStore; `"ray:<namespace>"` -> RayStore. Cached per spec
    in this process (so counters accumulate)."""
    if isinstance(spec, RecordStore):
        return spec
    spec = str(spec)
    if spec.startswith("ray:"):
        key = spec
    else:
        path = spec[len("file:"):] if spec.startswith("file:") else spec
        if not path:
            raise ValueError(f"record store {spec!r}: no directory")
        key = f"file:{os.path.abspath(path)}"
    with _lock:
        store = _open.get(key)
        if store is None:
            if key.startswith("ray:"):
                from .ray_store import RayStore

                store = RayStore(key[len("ray:"):])
            else:
                store = LocalStore(key[len("file:"):])
            _open[key] = store
        return store


def store_from_env() -> RecordStore | None:
    spec = envs.read(STORE_ENV)
    return open_store(spec) if spec else None


def store_of(handle: str) -> RecordStore:
    spec, _ = parse_handle(handle)
    return open_store(spec)


def get(handle: str, *, consume: bool = True):
    """The GuidanceRecord behind `handle`, from whichever store it names (consumed by default)."""
    return store_of(handle).get(handle, consume=consume)


def delete(handle: str) -> None:
    store_of(handle).delete(handle)


def is_handle(value) -> bool:
    return isinstance(value, str) and value.startswith(HANDLE_PREFIX)


__all__ = [
    "HANDLE_PREFIX",
    "LocalStore",
    "RecordError",
    "RecordStore",
    "STORE_ENV",
    "delete",
    "get",
    "is_handle",
    "make_handle",
    "open_store",
    "parse_handle",
    "store_from_env",
    "store_of",
]
