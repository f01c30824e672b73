"""Worker-side RPC handlers (installed on vLLM's WorkerWrapperBase; `self` is the wrapper).

Each handler works on the capture store of the wrapper's engine (its TraceFP4Config's `capture_store`).
Results travel back as plain dicts of str / int / bytes, which vLLM's msgpack IPC carries without
VLLM_ALLOW_INSECURE_SERIALIZATION. With a record store, the worker puts the record there itself and
returns only its handle (the bytes never cross the engine's IPC).

Tensor / pipeline parallel: each rank returns its part of the record (`trace_kernels.engine.rank_parts`;
under PP its stage's layers, with their weight digests) and the driver assembles the one record (and
puts it in the store, if any).
"""

import os

from trace_kernels import GuidanceRecord, stores
from trace_kernels.engine import assemble_record
from trace_kernels.engine.captured_rows import ChunkJoiner
from trace_kernels.engine.rank_parts import rank_part
from trace_kernels.engine.take import assemble_take, batches
from trace_kernels.records import take_bytes, written

from .capture import CaptureStore, RequestCapture


def store_of(wrapper) -> CaptureStore:
    """The capture store of the engine this worker runs (an empty one when it is not trace_fp4's)."""
    runner = getattr(getattr(wrapper, "worker", None), "model_runner", None)
    vllm_config = getattr(runner, "vllm_config", None) or getattr(wrapper, "vllm_config", None)
    store = getattr(getattr(vllm_config, "quant_config", None), "capture_store", None)
    return store if store is not None else CaptureStore()


def build(cap: RequestCapture, store: CaptureStore, identity: dict | None = None, joiner=None,
          chunks=None) -> GuidanceRecord:
    """One request's capture as a GuidanceRecord, with its identity (token digest from the caller,
    weights version / digest from when its rows were captured). `joiner`: a ChunkJoiner shared by the
    requests taken together (their shared steps' rows are joined once); `chunks`: cap.record_chunks(),
    when the caller made them already."""
    if cap.error is not None:
        raise ValueError(cap.error)
    chunks = cap.record_chunks() if chunks is None else chunks
    return assemble_record(store.shape, store.config, chunks, weights=cap.newest_weights(),
                           identity=_identity(cap, identity), joiner=joiner)


def _identity(cap: RequestCapture, identity: dict | None) -> dict | None:
    """The record's identity keywords: the caller's, plus the version ranges when rows of several weights
    versions made it (the newest names the record, each range its rows)."""
    ranges = cap.version_ranges()
    return identity if ranges is None else {**(identity or {}), "version_ranges": ranges}


def encode(cap: RequestCapture, store: CaptureStore, identity: dict | None = None) -> bytes:
    """Encode one request's capture as a GuidanceRecord (safetensors bytes)."""
    return build(cap, store, identity).to_bytes()


def trace_fp4_take_records(self, external_ids: list[str], num_rows: list[int] | None = None,
                           identities: list | None = None, store_spec: str | None = None,
                           token_ids: list | None = None, reader_pid: int | None = None) -> dict:
    """Take (and free) the records of finished requests, by the ids the user saw.

    `num_rows[i]` (or -1): the token rows the output implies (prompt + generated - 1).
    `identities[i]`: {"token_digest": ..., "num_prompt_tokens": ...} from the RequestOutput, or None.
    `store_spec`: put each record in that store and return its handle instead of the bytes.
    `token_ids[i]`: the request's prompt + generated ids, or None; with prefix-cache hits served, its
    rows are kept for a later request that continues it (a multi-turn trajectory's next turn).
    `reader_pid`: the process id of the driver that will read the records; when it is this process (an
    in-process engine), each record's bytes are kept with what the writer knew, so the driver's
    `from_bytes` of those very bytes does not parse them back (trace_kernels.records.written).
    Returns {external_id: {"request_id": internal_id, "num_tokens": T, "record": bytes | "handle": str}}
    or {external_id: {"error": message}}.
    """
    store = store_of(self)
    written.clear()  # a previous take's bytes its driver did not read back
    keep_for_reader = reader_pid == os.getpid()
    out = {}
    num_rows = num_rows or [-1] * len(external_ids)
    identities = identities or [None] * len(external_ids)
    tp_size, pp_size = getattr(store, "tp_size", 1), getattr(store, "pp_size", 1)
    # With several ranks no worker holds a whole record: the driver assembles it and stores it.
    parts = tp_size > 1 or pp_size > 1
    target = stores.open_store(store_spec) if store_spec and not parts else None
    token_ids = token_ids or [None] * len(external_ids)
    joiner = ChunkJoiner()  # for this take only: it holds the joined rows of the steps these requests shared
    # No forward attributed to requests yet although the layers ran: a runner we do not hook.
    hint = ""
    if not store.counters["steps"] and store.counters["moe_calls"]:
        hint = " (no forward pass was attributed to requests: is this vLLM's Model Runner V2? unsupported)"
    taken = []  # (ext, entry, capture, identity) of the requests whose record is built here
    for ext, rows, ident, seq in zip(external_ids, num_rows, identities, token_ids):
        matches = store.find(ext)
        if len(matches) != 1:
            what = "no request" if not matches else f"{len(matches)} requests ({matches})"
            out[ext] = {"error": f"request {ext!r}: {what} with this id in the capture store{hint}"}
            continue
        try:
            cap = store.take(matches[0], None if rows < 0 else rows)
            if seq is not None:
                store.keep_sequence_rows(cap, seq)
            entry = {"request_id": matches[0], "num_tokens": cap.num_rows}
            if parts:
                if cap.error is not None:
                    raise ValueError(cap.error)
                if cap.version_ranges() is not None:
                    # Not assembled across ranks yet: refused rather than a record naming one version.
                    raise ValueError(
                        f"the request ran through a weight update (rows by versions {cap.version_ranges()}); "
                        "under tensor / pipeline parallel its per-row versions are not assembled: abort and "
                        "resume it (a partial rollout) instead"
                    )
                entry["part"] = _part(cap, store, tp_size, pp_size)
                out[ext] = entry
                store.count("record_parts_taken")
                continue
            if cap.error is not None:
                raise ValueError(cap.error)
            taken.append((ext, entry, cap, ident))
        except (KeyError, ValueError) as e:
            out[ext] = {"error": f"request {ext!r}: {e.args[0] if e.args else e}"}
    # Each request's chunks as the record takes them, made once (after the take trimmed them), and every
    # request announced before any is joined, so the first request of a batch joins the shared steps whole.
    chunks = [cap.record_chunks() for _, _, cap, _ in taken]
    for c in chunks:
        joiner.expect_chunks(c)
    # Every record of the take built together where it can be (take.py: one encoder call per layer and
    # site for all of them); a request it leaves (None) is built alone, which names what is wrong with it.
    batched = [None] * len(taken)
    if taken and batches(store.shape, store.config):
        batched = assemble_take(store.shape, store.config,
                                [(c, cap.newest_weights(), _identity(cap, ident)) for c, (_, _, cap, ident) in zip(chunks, taken)],
                                joiner)
    replies = []  # (ext, entry, record) whose bytes go back in the reply: written together below
    for (ext, entry, cap, ident), c, record in zip(taken, chunks, batched):
        try:
            if record is None:
                record = build(cap, store, identity=ident, joiner=joiner, chunks=c)
            if target is not None:
                entry["handle"] = target.put(record)
                store.count("records_put_in_store")
            else:
                replies.append((ext, entry, record))
                continue
            out[ext] = entry
            store.count("records_taken")
        except (KeyError, ValueError) as e:
            out[ext] = {"error": f"request {ext!r}: {e.args[0] if e.args else e}"}
    _write_replies(replies, keep_for_reader, out, store)
    return {ext: out[ext] for ext in external_ids if ext in out}


def _write_replies(replies: list, keep_for_reader: bool, out: dict, store: CaptureStore) -> None:
    """Each reply's record bytes, the take's records written together (records/take_bytes.py: each
    record's `to_bytes`, byte for byte, what the records share made once). Where that raises, each
    record is written alone, so the refusal names its own request (as before the batched writer)."""
    try:
        blobs = take_bytes.write_take([record for _, _, record in replies], keep_for_reader)
    except (KeyError, ValueError):
        blobs = None
    for i, (ext, entry, record) in enumerate(replies):
        try:
            entry["record"] = record.to_bytes(keep_for_reader) if blobs is None else blobs[i]
            out[ext] = entry
            store.count("records_taken")
        except (KeyError, ValueError) as e:
            out[ext] = {"error": f"request {ext!r}: {e.args[0] if e.args else e}"}


def _part(cap: RequestCapture, store: CaptureStore, tp_size: int, pp_size: int) -> dict:
    """This rank's part of a request's record (rank_parts); under PP its stage's layers and the layer
    digests behind the weights digest the request's rows were captured with."""
    pp = {}
    if pp_size > 1:
        layer_digests = store.weights.layers_of(cap.weights[1])
        if cap.weights[1] is not None and layer_digests is None:
            raise ValueError(f"the layer digests of weights {cap.weights[1][:12]} are no longer known on this stage")
        pp = dict(pp_rank=store.pp_rank, pp_size=pp_size, layers=sorted(store.stage_layers), layer_digests=layer_digests)
    return rank_part(cap.chunks, cap.num_rows, rank=getattr(store, "tp_rank", 0), tp_size=tp_size, shape=store.shape,
                     config=store.config, weights=cap.weights, experts=getattr(store, "ep_experts", None), **pp)


def trace_fp4_stats(self) -> dict:
    return store_of(self).stats()


def trace_fp4_discard_records(self, external_ids: list[str] | None = None) -> int:
    store = store_of(self)
    ids = None if external_ids is None else [r for ext in external_ids for r in store.find(ext)]
    return store.discard(ids)


def trace_fp4_set_weights_version(self, version) -> None:
    store_of(self).set_weights_version(version)


def trace_fp4_set_rates(self, config_json: str) -> None:
    from trace_kernels import TraceConfig
    import json

    store_of(self).set_rates(TraceConfig.from_dict(json.loads(config_json)))


RPC_METHODS = {
    f.__name__: f
    for f in (trace_fp4_take_records, trace_fp4_stats, trace_fp4_discard_records, trace_fp4_set_weights_version,
              trace_fp4_set_rates)
}
