"""TRACE counters in verl's metrics dict, named like verl's own `rollout_corr/*`: `trace_fp4/*`.

Per micro-batch (verl collects them per micro-batch and averages / gathers over data-parallel ranks):
  trace_fp4/<site>/mismatch_guided   share of guided values whose codeword differs from the rollout's
  trace_fp4/<site>/mismatch_rtn      the same for the trainer's own round-to-nearest (what TRACE removes)
  trace_fp4/fallback_rows            rows that ran round-to-nearest (no record, layer not guided, route)
  trace_fp4/routing_fallback_rows    tokens whose route was not replayed from a record
  trace_fp4/guidance_bytes           payload bytes of the records guiding this micro-batch
  trace_fp4/records_missing          samples that came without a record (aborted requests)
  trace_fp4/resolve_seconds          time this rank spent fetching records from the store
  trace_fp4/records/staleness_mean   weights versions between the trainer and the records it was
  trace_fp4/records/staleness_max    guided by (0 on-policy; off-policy with accept_stale), per record
                                     by its oldest rows
  trace_fp4/records/stale_tokens     token rows made by older weights than the trainer's (whole stale
                                     records, and a partial rollout's tokens from before its weight update)
"""

SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")


def verl_metrics(trace_metrics: dict[str, float], records: list, resolve: dict, *, staleness=(),
                 stale_tokens: int | None = None) -> dict[str, float]:
    out = {}
    for site in SITES:
        for name in ("mismatch_guided", "mismatch_rtn"):
            key = f"trace/all/{site}/{name}"
            if key in trace_metrics:
                out[f"trace_fp4/{site}/{name}"] = float(trace_metrics[key])
    out["trace_fp4/fallback_rows"] = float(
        sum(v for k, v in trace_metrics.items() if k.startswith("trace/all/") and k.endswith("/fallback_rows"))
    )
    out["trace_fp4/routing_fallback_rows"] = float(
        sum(v for k, v in trace_metrics.items() if k.endswith("/routing/fallback_rows"))
    )
    out["trace_fp4/guidance_bytes"] = float(sum(r.nbytes for r in records if r is not None))
    out["trace_fp4/records_missing"] = float(resolve.get("records_missing", 0))
    out["trace_fp4/resolve_seconds"] = float(resolve.get("resolve_seconds", 0.0))
    if staleness:
        out["trace_fp4/records/staleness_mean"] = float(sum(staleness)) / len(staleness)
        out["trace_fp4/records/staleness_max"] = float(max(staleness))
    if stale_tokens is not None and staleness:
        out["trace_fp4/records/stale_tokens"] = float(stale_tokens)
    return out
