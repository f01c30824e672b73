"""User-facing API: get the guidance record of each request next to its RequestOutput.

    outputs = llm.generate(prompts, params)
    records = trace_vllm_plugin.get_records(llm, outputs)                 # GuidanceRecords, inline
    handles = trace_vllm_plugin.get_records(llm, outputs, store="file:/shared/records")   # handles

One record per completion, in output order (outputs, then each output's completions: SamplingParams(n>1)
gives n records per output). Works with `vllm.LLM` in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and
with the multiprocess engine: the records are taken from the worker with `llm.collective_rpc` (RPC
methods installed by the plugin). Taking a record frees its capture memory in the worker.

Store: `store=` (a spec such as "file:/dir" or "ray:<namespace>", or a trace_kernels RecordStore), else
the TRACE_FP4_RECORD_STORE environment variable of the calling process; with one, the worker puts each
record there and the call returns handles (`trace_kernels.stores.get(handle)` on the trainer side).
`store=False` forces inline records.

Tensor parallel: every rank captures its part (fc2 inputs by intermediate slice, K/V by KV head, the
replicated sites once, checked by digest) and this call assembles one record per request laid out as a
single-rank record; a part missing or present twice is refused naming the rank and the site.

Identity: each record carries the digest of its token ids (prompt + generated, without the last
sampled token) computed from the RequestOutput, and the engine's weights version and digest.
"""

import os
from collections import deque

from trace_kernels import GuidanceRecord, stores, token_digest


class RecordUnavailable(RuntimeError):
    """The worker has no usable record for a request (unknown, still running, dropped, incomplete)."""


def _requests(items):
    """(external ids, expected rows, identities, token ids) per completion, in output order."""
    ids, expected, identities, tokens = [], [], [], []
    for item in items:
        if isinstance(item, str):
            ids.append(item)
            expected.append(None)
            identities.append(None)
            tokens.append(None)
            continue
        prompt = list(item.prompt_token_ids)
        for completion in item.outputs:
            # n > 1: vLLM fans a request out into children named "<index>_<request id>".
            ids.append(item.request_id if len(item.outputs) == 1 else f"{completion.index}_{item.request_id}")
            seq = prompt + list(completion.token_ids)
            T = len(seq) - 1  # every token that entered the model = prompt + generated - 1
            expected.append(T)
            identities.append({"token_digest": token_digest(seq[:T]), "num_prompt_tokens": len(prompt)})
            tokens.append(seq)
    return ids, expected, identities, tokens


def _store_spec(store):
    if store is False:
        return None
    if store is None:
        s = stores.store_from_env()
        return None if s is None else s.spec
    return store.spec if isinstance(store, stores.RecordStore) else stores.open_store(store).spec


def _decode(replies, ids, expected, store_spec=None, identities=None):
    if len(replies) > 1:
        return _assemble(replies, ids, expected, store_spec, identities)
    if len(replies) != 1:
        raise RuntimeError(f"trace_fp4: expected one worker, got {len(replies)} replies")
    reply = replies[0]
    out = []
    for rid, want in zip(ids, expected):
        entry = reply[rid]
        if "error" in entry:
            raise RecordUnavailable(f"trace_fp4: {entry['error']}")
        if want is not None and entry["num_tokens"] != want:
            raise RecordUnavailable(
                f"trace_fp4: request {rid}: record has {entry['num_tokens']} token rows, the output "
                f"implies {want} (prompt + generated - 1)"
            )
        if "handle" in entry:
            out.append(entry["handle"])
        else:
            out.append(GuidanceRecord.from_bytes(entry["record"], source=f"request {rid}"))
    return out


# Seconds the driver spent assembling tensor-parallel parts, per record, the latest ones (bench/ reads it).
ASSEMBLY_SECONDS: deque = deque(maxlen=4096)


def _assemble(replies, ids, expected, store_spec, identities):
    """Tensor parallel: one reply per rank, each holding its part of every record; the driver
    assembles each request's record (trace_kernels.engine.rank_parts) and stores it if asked."""
    from trace_kernels.engine.rank_parts import assemble_rank_parts

    target = stores.open_store(store_spec) if store_spec else None
    out = []
    for i, (rid, want) in enumerate(zip(ids, expected)):
        entries = [reply[rid] for reply in replies]
        for rank, entry in enumerate(entries):
            if "error" in entry:
                raise RecordUnavailable(f"trace_fp4: worker {rank}: {entry['error']}")
        for entry in entries:
            if want is not None and entry["num_tokens"] != want:
                raise RecordUnavailable(
                    f"trace_fp4: request {rid}: rank {entry['part']['rank']} has {entry['num_tokens']} token rows, "
                    f"the output implies {want} (prompt + generated - 1)"
                )
        ident = identities[i] if identities else None
        record, seconds = assemble_rank_parts([e["part"] for e in entries], identity=ident, where=f"trace_fp4: request {rid}")
        ASSEMBLY_SECONDS.append(seconds)
        out.append(target.put(record) if target is not None else record)
    return out


def _args(outputs, store):
    ids, expected, identities, tokens = _requests(outputs)
    rows = [-1 if e is None else e for e in expected]
    # The token ids let the worker keep a finished request's rows for prefix-cache hits of a later
    # request that continues it (the next turn of a multi-turn trajectory).
    # Our pid: a worker in this same process keeps each record's bytes with what it knew of them, so
    # that reading them back here does not parse them again (trace_kernels.records.written).
    return ids, expected, (ids, rows, identities, _store_spec(store), tokens, os.getpid())


def get_records(llm, outputs, store=None) -> list:
    """Records (or handles, with a store) for finished `outputs` (RequestOutputs or request ids), one
    per completion in order; frees them in the worker.

    Pass RequestOutputs where possible: their tokens give the records' identity and let the worker
    check (and trim) the rows. A bare request id gives a record without a token digest."""
    ids, expected, args = _args(outputs, store)
    return _decode(llm.collective_rpc("trace_fp4_take_records", args=args), ids, expected, args[3], args[2])


def get_record(llm, output, store=None):
    records = get_records(llm, [output], store)
    if len(records) != 1:
        raise ValueError(f"{len(records)} completions in this output; use get_records")
    return records[0]


async def get_records_async(engine, outputs, store=None) -> list:
    """The same for `vllm.AsyncLLM` (its collective_rpc is a coroutine)."""
    ids, expected, args = _args(outputs, store)
    return _decode(await engine.collective_rpc("trace_fp4_take_records", args=args), ids, expected, args[3], args[2])


def discard_records(llm, request_ids=None) -> int:
    """Free finished records nobody will take (all, or those of `request_ids`)."""
    # Every tensor-parallel rank drops its part of the same records: count them once.
    return llm.collective_rpc("trace_fp4_discard_records", args=(request_ids,))[0]


def set_weights_version(llm, version) -> None:
    """Name the weights now in the engine (e.g. the trainer's step after a weight sync); records made
    from now on carry it. The next weight update clears it (the update counter takes over, counted)."""
    llm.collective_rpc("trace_fp4_set_weights_version", args=(version,))


def set_rates(llm, config) -> None:
    """Hand the engine the rate controller's TraceConfig (new sparse rates, rates_version + 1) with a
    weight sync: records built from then on use those rates and say so. Only the rate keys may differ
    from the engine's config (ValueError names any other)."""
    llm.collective_rpc("trace_fp4_set_rates", args=(config.to_json(),))


def stats(llm) -> dict:
    """Worker counters: MoE/KV calls per layer, captured rows, evictions, fallbacks; memory in use
    (of rank 0; `stats_per_rank` gives every rank's). Under pipeline parallelism each stage counts only
    its own layers: the per-layer counts (`moe_calls.layerN`, `kv_calls.layerN`) of every stage's first
    rank are merged into rank 0's counters, and `pipeline_stages` holds each stage's own stats."""
    return merge_pipeline_stages(llm.collective_rpc("trace_fp4_stats"))


PER_LAYER_COUNTERS = ("moe_calls.layer", "kv_calls.layer")


def merge_pipeline_stages(per_rank: list[dict]) -> dict:
    """Rank 0's stats with the other pipeline stages' per-layer counters merged in (their layers are
    disjoint from rank 0's; a layer counted by two stages is an error, not a sum)."""
    out = dict(per_rank[0])
    if out.get("pp_size", 1) == 1:
        return out
    stages = {}
    for s in per_rank:  # vLLM's rank order: the first rank of each stage comes first
        stages.setdefault(s["pp_rank"], s)
    if sorted(stages) != list(range(out["pp_size"])):
        raise RuntimeError(f"trace_fp4 stats: pipeline stages {sorted(stages)} answered, expected 0..{out['pp_size'] - 1}")
    counters = dict(out["counters"])
    for rank, s in sorted(stages.items()):
        if rank == 0:
            continue
        for key, n in s["counters"].items():
            if key.startswith(PER_LAYER_COUNTERS):
                if key in counters:
                    raise RuntimeError(f"trace_fp4 stats: {key} counted by pipeline stages 0 and {rank}")
                counters[key] = n
    out["counters"] = counters
    out["pipeline_stages"] = [stages[r] for r in sorted(stages)]
    return out


def stats_per_rank(llm) -> list[dict]:
    """`stats` of every worker, in rank order."""
    return llm.collective_rpc("trace_fp4_stats")
