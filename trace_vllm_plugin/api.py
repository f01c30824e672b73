"""User-facing API: get the guidance record of each request next to its RequestOutput.

    outputs = llm.generate(prompts, params)
    records = trace_vllm_plugin.get_records(llm, outputs)     # one GuidanceRecord per output

Works with `vllm.LLM` in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and with the multiprocess engine:
the records are taken from the worker with `llm.collective_rpc` (RPC methods installed by the plugin),
as safetensors bytes. Taking a record frees its capture memory in the worker.
"""

from trace_kernels import GuidanceRecord


class RecordUnavailable(RuntimeError):
    """The worker has no usable record for a request (unknown, still running, dropped, incomplete)."""


def _ids_and_expected(items):
    ids, expected = [], []
    for item in items:
        if isinstance(item, str):
            ids.append(item)
            expected.append(None)
            continue
        # A RequestOutput: every token that entered the model = prompt + generated - 1.
        if len(item.outputs) != 1:
            raise ValueError(f"request {item.request_id}: n={len(item.outputs)} samples; use n=1")
        ids.append(item.request_id)
        expected.append(len(item.prompt_token_ids) + len(item.outputs[0].token_ids) - 1)
    return ids, expected


def _decode(replies, ids, expected) -> list[GuidanceRecord]:
    if len(replies) != 1:
        raise RuntimeError(f"trace_fp4: expected one worker, got {len(replies)} replies")
    reply = replies[0]
    records = []
    for rid, want in zip(ids, expected):
        entry = reply[rid]
        if "error" in entry:
            raise RecordUnavailable(f"trace_fp4: {entry['error']}")
        record = GuidanceRecord.from_bytes(entry["record"], source=f"request {rid}")
        if want is not None and record.num_tokens != want:
            raise RecordUnavailable(
                f"trace_fp4: request {rid}: record has {record.num_tokens} token rows, the output "
                f"implies {want} (prompt + generated - 1)"
            )
        records.append(record)
    return records


def get_records(llm, outputs) -> list[GuidanceRecord]:
    """Records for finished `outputs` (RequestOutputs or request ids), in order; frees them.

    Pass RequestOutputs where possible: their token counts let the worker check (and trim) the rows.
    """
    ids, expected = _ids_and_expected(outputs)
    rows = [-1 if e is None else e for e in expected]
    return _decode(llm.collective_rpc("trace_fp4_take_records", args=(ids, rows)), ids, expected)


def get_record(llm, output) -> GuidanceRecord:
    return get_records(llm, [output])[0]


async def get_records_async(engine, outputs) -> list[GuidanceRecord]:
    """The same for `vllm.AsyncLLM` (its collective_rpc is a coroutine)."""
    ids, expected = _ids_and_expected(outputs)
    rows = [-1 if e is None else e for e in expected]
    return _decode(await engine.collective_rpc("trace_fp4_take_records", args=(ids, rows)), ids, expected)


def discard_records(llm, request_ids=None) -> int:
    """Free finished records nobody will take (all, or those of `request_ids`)."""
    return sum(llm.collective_rpc("trace_fp4_discard_records", args=(request_ids,)))


def stats(llm) -> dict:
    """Worker counters: MoE/KV calls per layer, captured rows, evictions, fallbacks; memory in use."""
    return llm.collective_rpc("trace_fp4_stats")[0]
