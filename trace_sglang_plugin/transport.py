"""How a finished request's guidance record reaches the caller: `meta_info["trace_fp4"]`.

The payload is a small JSON-safe dict (so the HTTP server can return it too):
  record        base64 of `GuidanceRecord.to_bytes()` (inline transport, the default), or None
  path          where the record was written (file transport), or None
  num_tokens    rows in the record = prompt + generated - 1
  nbytes        size of the serialized record
  counters      the scheduler process's trace_fp4 counters at that moment (see counters.py)
  weight_digest SHA-256 over all layers' expert-weight codes (changes with every weight update)
The record itself holds the routed expert ids of every layer (`record.routed_experts(layer)`).

  handle        the record's handle in a record store (store transport), or None

Transport: inline by default. With TRACE_FP4_RECORD_STORE=<spec> in the engine's environment
("file:/dir" or "ray:<namespace>", see trace_kernels.stores) the scheduler puts the record in that
store and returns only its handle: `trace_kernels.stores.get(payload["handle"])` on the trainer side
(`record_from_meta_info` resolves it too). TRACE_FP4_SGLANG_RECORD_DIR=<dir> (older) writes
`<dir>/<request id>.trace.safetensors` and returns the path.
The record carries its identity (token digest, weights version and digest; trace_kernels.RecordIdentity).
"""

import base64
from pathlib import Path

from trace_kernels import GuidanceRecord, envs, stores

META_KEY = "trace_fp4"
RECORD_DIR_ENV = "TRACE_FP4_SGLANG_RECORD_DIR"


def encode(record: GuidanceRecord, rid: str, counters: dict, weights_digest: str | None) -> dict:
    """The payload of one finished request (`weights_digest`: the engine's expert-weights digest now)."""
    data = record.to_bytes()
    payload = {
        "record": None,
        "path": None,
        "handle": None,
        "num_tokens": record.num_tokens,
        "nbytes": len(data),
        "counters": counters,
        "weight_digest": weights_digest,
        "weights_version": record.identity.weights_version,
    }
    out_dir = envs.read(RECORD_DIR_ENV)
    store = stores.store_from_env()
    if store is not None:
        payload["handle"] = store.put(record)
    elif out_dir:
        path = Path(out_dir) / f"{rid}.trace.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        payload["path"] = str(path)
    else:
        payload["record"] = base64.b64encode(data).decode("ascii")
    return payload


def payload_from_meta_info(meta_info: dict) -> dict:
    """The trace_fp4 payload of one response's meta_info (SGLang wraps request-level values in a list)."""
    if META_KEY not in meta_info:
        raise KeyError(
            f"meta_info has no {META_KEY!r}: the request did not finish normally, or the engine does not run "
            "--quantization trace_fp4 with capture enabled"
        )
    value = meta_info[META_KEY]
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"meta_info[{META_KEY!r}] holds {len(value)} payloads, expected 1")
        value = value[0]
    return value


def record_from_meta_info(meta_info: dict, **expect) -> GuidanceRecord:
    """Decode the GuidanceRecord of one response (`expect_shape=` / `expect_config=` are checked)."""
    payload = payload_from_meta_info(meta_info)
    if payload.get("handle") is not None:
        record = stores.get(payload["handle"])
        if expect:
            record.check_compatible(expect.get("expect_shape") or record.shape, expect.get("expect_config"),
                                    source=payload["handle"])
        return record
    if payload.get("record") is not None:
        data = base64.b64decode(payload["record"])
        return GuidanceRecord.from_bytes(data, source=f"meta_info[{META_KEY!r}]", **expect)
    return GuidanceRecord.load(payload["path"], **expect)
