"""The record store, by the spec in the config (trace_kernels.stores: "file:/dir" or "ray:<namespace>")."""

from .settings import TraceConfigError


def open_configured_store(spec: str, *, where: str):
    try:
        from trace_kernels import stores
    except ImportError as e:  # records-travel: trace_kernels.stores
        raise RuntimeError("trace_verl needs trace_kernels.stores (records by handle); this trace-fp4 has none") from e
    try:
        return stores.open_store(spec)
    except Exception as e:  # noqa: BLE001 - the store names what is wrong; say which key set it
        raise TraceConfigError(f"{where}: cannot open the TRACE record store {spec!r}: {e}") from e
