"""`--custom-generate-function-path trace_slime.generate`: slime's SGLang generate, plus the record handle.

It runs slime's own `slime.rollout.sglang_rollout.generate` (same request, same Sample updates) and
reads the handle the trace_fp4 SGLang server returned in the response's `meta_info["trace_fp4"]`
(the server put the record in TRACE_FP4_RECORD_STORE). The handle goes on the Sample (handles.py),
which carries it through slime's `_convert_samples_to_train_data` and DP split to the model call.
"""

import logging

from trace_fp4_patches import slime_rollout_response

from .handles import handle_of, set_handle
from .settings import ROLLOUT_HOW, TraceSlimeError, check_args

logger = logging.getLogger(__name__)

# Per rollout-manager process: records put by the servers and handed on, samples without one, records
# superseded by a resumed sample's, and evaluation samples' records (deleted at once).
STATS = {"records": 0, "record_bytes": 0, "records_missing": 0, "records_replaced": 0, "records_discarded_eval": 0}
_checked: dict[int, object] = {}


def _settings(args):
    key = id(args)
    if key not in _checked:
        trace = check_args(args)
        if trace is None:
            raise TraceSlimeError(
                "--custom-generate-function-path trace_slime.generate without TRACE: set "
                f"{ROLLOUT_HOW} (and the trainer flags, see the README)"
            )
        from trace_verl.store import open_configured_store

        open_configured_store(trace.store, where="TRACE_FP4_RECORD_STORE")  # refused here if it cannot open
        logger.info("trace_slime: TRACE rollout, records in %s, %s", trace.store, trace.trace_config.to_dict())
        _checked[key] = trace
    return _checked[key]


def _payload(response: dict, sample) -> dict | None:
    from trace_sglang_plugin.transport import META_KEY, payload_from_meta_info

    meta = response.get("meta_info", {})
    if META_KEY not in meta:
        if (meta.get("finish_reason") or {}).get("type") == "abort":
            return None  # aborted: no record; the trainer counts the sample as records_missing
        raise TraceSlimeError(
            f"sample {sample.index}: the SGLang server returned no {META_KEY!r} record: it does not run "
            f"{ROLLOUT_HOW} (or trace_sglang_plugin is not installed in its environment)"
        )
    payload = payload_from_meta_info(meta)
    if payload.get("handle") is None:
        raise TraceSlimeError(
            f"sample {sample.index}: the SGLang server returned the record inline, not a handle: set "
            "TRACE_FP4_RECORD_STORE in the SGLang servers' environment too (Ray's runtime env)"
        )
    return payload


async def generate(args, sample, sampling_params, evaluation: bool = False):
    trace = _settings(args)
    sglang_rollout = slime_rollout_response.install()
    old = handle_of(sample)
    with slime_rollout_response.capture_responses() as responses:
        sample = await sglang_rollout.generate(args, sample, sampling_params)
    if not responses:  # nothing generated (max_new_tokens already used up): the sample keeps its record
        return sample
    payload = _payload(responses[-1], sample)
    handle = None if payload is None else payload["handle"]
    if evaluation:  # no trainer step reads an evaluation sample's record: free it now
        if handle is not None:
            from trace_kernels import stores

            stores.delete(handle, allowed=[trace.store])
            STATS["records_discarded_eval"] += 1
        return sample
    if old is not None and old != handle:
        # A resumed sample (partial rollout) was generated again from prompt + its earlier response:
        # the new record covers all of it, the old one is superseded.
        from trace_kernels import stores

        stores.delete(old, allowed=[trace.store])
        STATS["records_replaced"] += 1
    set_handle(sample, handle)
    if handle is None:
        STATS["records_missing"] += 1
    else:
        STATS["records"] += 1
        STATS["record_bytes"] += int(payload.get("nbytes") or 0)
    return sample


def rollout_stats() -> dict:
    return dict(STATS)
