"""What happened to a micro-batch's rows, per layer and site, and the flat metrics a logger takes."""

import torch

from .stats import SiteStats


class BatchCounters:
    def __init__(self):
        self.stats: dict[tuple[int, str], SiteStats] = {}
        self.routing: dict[int, list[int]] = {}  # layer -> [tokens routed by the record, tokens in total]
        # Identity checks of the records (set by trace_megatron.guidance): how many were checked, how
        # many had their tokens checked, how many came from an older weights version (accept_stale).
        self.record_counts: dict[str, int] = {}

    def count_routing(self, layer: int, replayed: int, total: int) -> None:
        c = self.routing.setdefault(layer, [0, 0])
        c[0] += replayed
        c[1] += total

    def site_stats(self, layer: int, site: str) -> SiteStats:
        return self.stats.setdefault((layer, site), SiteStats())

    def metrics(self, prefix: str = "trace", group=None, spec_fallbacks: dict[str, int] | None = None) -> dict[str, float]:
        """Flat dict for a logger. Per layer and site: mismatch rates (RTN vs record, guided vs record,
        over the guided elements), guided and fallback row counts; plus totals per site. With `group`,
        counts are summed over that process group first (e.g. the expert-parallel group)."""
        keys = sorted(self.stats)
        if group is not None:
            # Every rank must contribute the same keys: take the union of (layer, site) pairs.
            all_keys = [None] * torch.distributed.get_world_size(group)
            torch.distributed.all_gather_object(all_keys, keys, group=group)
            keys = sorted({k for ks in all_keys for k in ks})
            width = len(SiteStats().as_tensor())
            t = torch.stack([self.stats.get(k, SiteStats()).as_tensor() for k in keys]) if keys else torch.zeros(0, width, dtype=torch.float64)
            torch.distributed.all_reduce(t, group=group)
            stats = {k: SiteStats.from_tensor(t[i]) for i, k in enumerate(keys)}
        else:
            stats = dict(self.stats)
        out: dict[str, float] = {}
        totals: dict[str, SiteStats] = {}
        for (layer, site) in keys:
            s = stats[(layer, site)]
            totals.setdefault(site, SiteStats()).add(s)
            out.update(_flat(f"{prefix}/layer{layer}/{site}", s))
        for site, s in totals.items():
            out.update(_flat(f"{prefix}/all/{site}", s))
        routing = self.routing
        if group is not None:
            layers = [None] * torch.distributed.get_world_size(group)
            torch.distributed.all_gather_object(layers, sorted(routing), group=group)
            layers = sorted({l for ls in layers for l in ls})
            t = torch.tensor([routing.get(l, [0, 0]) for l in layers], dtype=torch.float64).reshape(-1, 2)
            torch.distributed.all_reduce(t, group=group)
            routing = {l: t[i].tolist() for i, l in enumerate(layers)}
        counts = dict(self.record_counts)
        if group is not None and counts:
            t = torch.tensor([counts[k] for k in sorted(counts)], dtype=torch.float64)
            torch.distributed.all_reduce(t, group=group)
            counts = dict(zip(sorted(counts), t.tolist()))
        for key, value in sorted(counts.items()):
            out[f"{prefix}/records/{key}"] = float(value)
        for name, n in sorted((spec_fallbacks or {}).items()):
            out[f"{prefix}/spec/{name}"] = float(n)
        for layer in sorted(routing):
            replayed, total = routing[layer]
            # Tokens without a record (padding, the last sampled token) keep the router's own choice.
            out[f"{prefix}/layer{layer}/routing/replayed_rows"] = float(replayed)
            out[f"{prefix}/layer{layer}/routing/fallback_rows"] = float(total - replayed)
        return out


def _flat(name: str, s: SiteStats) -> dict[str, float]:
    denom = max(s.guided_elements, 1)
    return {
        f"{name}/mismatch_rtn": s.mismatch_rtn / denom,
        f"{name}/mismatch_guided": s.mismatch_guided / denom,
        f"{name}/guided_rows": float(s.guided_rows),
        f"{name}/fallback_rows": float(s.fallback_rows),
        f"{name}/fallback_no_record": float(s.fallback_no_record),
        f"{name}/fallback_not_guided": float(s.fallback_not_guided),
        f"{name}/fallback_route_mismatch": float(s.fallback_route_mismatch),
        f"{name}/guided_elements": float(s.guided_elements),
        f"{name}/saturated_values": float(s.saturated_values),
        f"{name}/sparse_unresolved_code_segments": float(s.sparse_unresolved_code_segments),
        f"{name}/sparse_unresolved_scale_segments": float(s.sparse_unresolved_scale_segments),
        f"{name}/sparse_segments": float(s.sparse_segments),
        f"{name}/sparse_code_flips": float(s.sparse_code_flips),
        f"{name}/sparse_amax_list_rows": float(s.sparse_amax_list_rows),
        f"{name}/expert_gemm_bf16": float(s.expert_gemm_bf16),
        # the audited residual: mismatches left after guidance, over the audited values (what the rate
        # controller acts on), beside the trainer's own RTN flip density on the same values
        f"{name}/audit_residual": s.audit_mismatch / max(s.audit_values, 1),
        f"{name}/audit_rtn_flips": s.audit_mismatch_rtn / max(s.audit_values, 1),
        f"{name}/audit_rows": float(s.audit_rows),
        f"{name}/audit_values": float(s.audit_values),
        f"{name}/audit_mismatch": float(s.audit_mismatch),
        f"{name}/audit_mismatch_rtn": float(s.audit_mismatch_rtn),
        f"{name}/audit_skipped_rows": float(s.audit_skipped_rows),
    }
