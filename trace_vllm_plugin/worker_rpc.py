"""Worker-side RPC handlers (installed on vLLM's WorkerWrapperBase; `self` is the wrapper).

Results travel back as plain dicts of str / int / bytes, which vLLM's msgpack IPC carries without
VLLM_ALLOW_INSECURE_SERIALIZATION.
"""

from trace_kernels import RecordBuilder

from .capture import STORE, RequestCapture


def encode(cap: RequestCapture, store=STORE) -> bytes:
    """Encode one request's capture as a GuidanceRecord (safetensors bytes)."""
    if cap.error is not None:
        raise ValueError(cap.error)
    builder = RecordBuilder(store.shape, store.config)
    for _, sites, routing in cap.chunks:
        for layer in sorted(routing):
            builder.add_routing(layer, routing[layer])
        for (layer, site), q in sorted(sites.items()):
            builder.add(layer, site, q)
    return builder.build().to_bytes()


def trace_fp4_take_records(self, external_ids: list[str], num_rows: list[int] | None = None) -> dict:
    """Take (and free) the records of finished requests, by the ids the user saw.

    `num_rows[i]` (or -1): the token rows the output implies (prompt + generated - 1).
    Returns {external_id: {"request_id": internal_id, "num_tokens": T, "record": bytes}} or
    {external_id: {"error": message}}.
    """
    out = {}
    num_rows = num_rows or [-1] * len(external_ids)
    # No forward attributed to requests yet although the layers ran: a runner we do not hook.
    hint = ""
    if not STORE.counters["steps"] and STORE.counters["moe_calls"]:
        hint = " (no forward pass was attributed to requests: is this vLLM's Model Runner V2? unsupported)"
    for ext, rows in zip(external_ids, num_rows):
        matches = STORE.find(ext)
        if len(matches) != 1:
            what = "no request" if not matches else f"{len(matches)} requests ({matches})"
            out[ext] = {"error": f"request {ext!r}: {what} with this id in the capture store{hint}"}
            continue
        try:
            cap = STORE.take(matches[0], None if rows < 0 else rows)
            out[ext] = {"request_id": matches[0], "num_tokens": cap.num_rows, "record": encode(cap)}
            STORE.count("records_taken")
        except (KeyError, ValueError) as e:
            out[ext] = {"error": f"request {ext!r}: {e.args[0] if e.args else e}"}
    return out


def trace_fp4_stats(self) -> dict:
    return STORE.stats()


def trace_fp4_discard_records(self, external_ids: list[str] | None = None) -> int:
    ids = None if external_ids is None else [r for ext in external_ids for r in STORE.find(ext)]
    return STORE.discard(ids)
