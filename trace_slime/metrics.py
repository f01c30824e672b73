"""TRACE counters named like slime's own (`train/train_rollout_logprob_abs_diff`): flat snake_case keys,
under the phase that ran them: `log_probs/` (the actor's log-prob forward) or `train/` (training steps).

  <phase>/trace_fp4_<site>_mismatch_guided   share of guided values whose FP4 codeword differs from the rollout's
  <phase>/trace_fp4_<site>_mismatch_rtn      the same for the trainer's own round-to-nearest (what TRACE removes)
  <phase>/trace_fp4_fallback_rows            rows that ran round-to-nearest (no record, layer not guided, padding)
  <phase>/trace_fp4_routing_fallback_rows    tokens whose route was not replayed from a record
  <phase>/trace_fp4_guidance_bytes           payload bytes of the records that guided the phase
  <phase>/trace_fp4_records_missing          samples that came without a record (aborted requests)
  <phase>/trace_fp4_resolve_seconds          time spent fetching records from the store
<site> is moe_fc1_in, moe_fc2_in, k or v. The per-micro-batch values come from trace_verl's
`verl_metrics` (the same counters verl logs as `trace_fp4/*`); a phase reports the largest mismatch
share of its micro-batches and the sum of the counts.
"""

from trace_verl.metrics import verl_metrics

_MAX = ("mismatch_guided", "mismatch_rtn")


def slime_name(verl_key: str) -> str:
    """`trace_fp4/moe_fc1_in/mismatch_guided` -> `trace_fp4_moe_fc1_in_mismatch_guided`."""
    return verl_key.replace("/", "_")


def micro_batch_metrics(trace_metrics: dict, records: list, resolve: dict) -> dict[str, float]:
    return {slime_name(k): v for k, v in verl_metrics(trace_metrics, records, resolve).items()}


def phase_metrics(phase: str, per_micro_batch: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in per_micro_batch:
        for k, v in m.items():
            key = f"{phase}/{k}"
            if k.endswith(_MAX):
                out[key] = max(out.get(key, 0.0), v)
            else:
                out[key] = out.get(key, 0.0) + v
    return out
