"""TraceBatch: one micro-batch's guidance records, where its tokens are, and what happened to them.

Made by `trace_megatron.guidance(...)` / `trace_megatron.capture(...)`. Layers ask it for the guide rows
of their tokens (by flat position, see layout.py) and report back counters and, in capture mode, the
codes they computed.
"""

import torch
from trace_kernels import (
    CompactGuide, GuidanceRecord, ModelShape, NVFP4Tensor, RecordBuilder, RecordError, TraceConfig, quantize, row_amax,
)

from trace_kernels.identity import describe

from .layout import TokenLayout
from .stats import SiteStats


def _cat_guides(parts):
    if isinstance(parts[0], NVFP4Tensor):
        return NVFP4Tensor(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "global_amax")))
    # CompactGuide and SparseGuide: the same three per-row fields
    return type(parts[0])(*(torch.cat([getattr(p, f) for p in parts]) for f in ("mbits", "scales", "global_amax")))


class TraceBatch:
    def __init__(
        self,
        shape: ModelShape,
        config: TraceConfig,
        layout: TokenLayout,
        records: list[GuidanceRecord] | None = None,
        *,
        capture: bool = False,
        keep_values: bool = False,
        perturb=None,
        device: torch.device | str = "cpu",
    ):
        self.shape, self.config, self.layout = shape, config, layout
        self.records = records
        self.capture = capture
        self.keep_values = keep_values  # capture only: also keep each row's unquantized input (analysis)
        self.perturb = perturb  # capture only: x -> x' quantized instead of x (a second engine's numerics)
        self.device = torch.device(device)
        self.stats: dict[tuple[int, str], SiteStats] = {}
        self._guides: dict[tuple[int, str], object] = {}  # lazily concatenated record tables
        self._captured: dict[tuple[int, str], dict] = {}
        self._routing_captured: dict[int, torch.Tensor] = {}
        self._bindings_used: list = []
        self.routing: dict[int, list[int]] = {}  # layer -> [tokens routed by the record, tokens in total]
        # Identity checks of the records (set by trace_megatron.guidance): how many were checked, how
        # many had their tokens checked, how many came from an older weights version (accept_stale).
        self.record_counts: dict[str, int] = {}
        if records is not None:
            self._check_records()
            counts = torch.tensor([r.num_tokens for r in records], dtype=torch.int64)
            offsets = torch.cumsum(counts, 0) - counts
            has = (self.layout.sample >= 0)
            has &= self.layout.token < counts[self.layout.sample.clamp(min=0)]
            row = offsets[self.layout.sample.clamp(min=0)] + self.layout.token
            self._row_of = torch.where(has, row, -1).to(self.device)  # [N]: row in the concatenated records

    # ---- records --------------------------------------------------------------------------------
    def _check_records(self) -> None:
        n = self.layout.num_samples
        if len(self.records) != n:
            raise ValueError(f"{len(self.records)} guidance records for a micro-batch of {n} samples (one per sample)")
        lengths = self.layout.sample_lengths()
        for i, rec in enumerate(self.records):
            name = describe(rec, f"record of sample {i}")
            rec.check_compatible(self.shape, self.config, source=name)
            if rec.num_tokens > lengths[i]:
                raise RecordError(
                    f"{name}: length differs: it covers {rec.num_tokens} tokens but the micro-batch "
                    f"holds {lengths[i]} tokens of that sample"
                )
            if rec.num_tokens < lengths[i] - 1:
                # Every token but the last sampled one went through the rollout model, so a record has
                # T rows for a sample of T or T + 1 tokens; fewer rows belong to another sample.
                raise RecordError(
                    f"{name}: length differs: it covers {rec.num_tokens} tokens but the micro-batch "
                    f"holds {lengths[i]} tokens of that sample (expected {lengths[i] - 1} or {lengths[i]})"
                )

    def layer_mode(self, layer: int):
        """Guidance mode of `layer`: "full", "compact", "sparse" or None (not guided); every record agrees (equal configs)."""
        return self.records[0].modes[layer] if self.records else None

    def record_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Row in the concatenated records of each flat position (-1: no record)."""
        if self.records is None:
            return torch.full_like(positions, -1)
        return self._row_of[positions]

    def site_table(self, layer: int, site: str):
        """All samples' guide rows of (layer, site), concatenated: [sum T, *row shape], or None where the
        layer is not guided."""
        key = (layer, site)
        if key not in self._guides:
            parts = [r.site(layer, site) for r in self.records or []]
            if not parts or parts[0] is None:
                self._guides[key] = None
            else:
                table = _cat_guides(parts)
                data = table.codes if isinstance(table, NVFP4Tensor) else table.mbits
                self._guides[key] = type(table)(*(t.to(self.device) for t in (data, table.scales, table.global_amax)))
        return self._guides[key]

    def routing_table(self, layer: int) -> torch.Tensor:
        key = (layer, "routing")
        if key not in self._guides:
            self._guides[key] = torch.cat([r.routed_experts(layer) for r in self.records]).to(self.device)
        return self._guides[key]

    def routing_target(self, layer: int, positions: torch.Tensor) -> torch.Tensor | None:
        """int64 [n, top_k]: the record's expert ids per position, -1 rows where there is no record."""
        if self.records is None:
            return None
        rows = self.record_rows(positions)
        table = self.routing_table(layer)
        ids = table[rows.clamp(min=0)]
        return torch.where((rows >= 0)[:, None], ids, -1)

    # ---- counters ---------------------------------------------------------------------------------
    def count_routing(self, layer: int, replayed: int, total: int) -> None:
        c = self.routing.setdefault(layer, [0, 0])
        c[0] += replayed
        c[1] += total

    def site_stats(self, layer: int, site: str) -> SiteStats:
        return self.stats.setdefault((layer, site), SiteStats())

    def metrics(self, prefix: str = "trace", group=None) -> dict[str, float]:
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
        from .specs import SPEC_FALLBACKS  # process-wide, counted when specs are built

        for name, n in sorted(SPEC_FALLBACKS.items()):
            out[f"{prefix}/spec/{name}"] = float(n)
        for layer in sorted(routing):
            replayed, total = routing[layer]
            # Tokens without a record (padding, the last sampled token) keep the router's own choice.
            out[f"{prefix}/layer{layer}/routing/replayed_rows"] = float(replayed)
            out[f"{prefix}/layer{layer}/routing/fallback_rows"] = float(total - replayed)
        return out

    # ---- capture (test / debug): the codes this forward computed, by flat position ---------------
    def capture_rows(self, layer: int, site: str, positions: torch.Tensor, q: NVFP4Tensor, slots=None, values=None) -> None:
        key = (layer, site)
        buf = self._captured.get(key)
        N = self.layout.num_positions
        lead = (N, self.shape.top_k) if site == "moe_fc2_in" else (N,)
        if buf is None:
            buf = {
                "codes": torch.zeros(*lead, *q.codes.shape[1:], dtype=torch.uint8, device=q.codes.device),
                "scales": torch.zeros(*lead, *q.scales.shape[1:], dtype=torch.uint8, device=q.codes.device),
                "amax": torch.zeros(*lead, *q.codes.shape[1:-1], dtype=torch.float32, device=q.codes.device),
                "filled": torch.zeros(*lead, dtype=torch.bool, device=q.codes.device),
            }
            self._captured[key] = buf
        amax = q.global_amax if q.global_amax.numel() != 1 else q.global_amax.expand(q.codes.shape[:-1])
        index = (positions,) if slots is None else (positions, slots)
        # A token's moe_fc1_in row reaches each of its experts; the engine quantizes it once, so every
        # copy must carry the same codes.
        again = buf["filled"][index]
        if bool(again.any()) and not torch.equal(buf["codes"][index][again], q.codes[again]):
            raise RuntimeError(f"capture: layer {layer}, site {site}: one token row was quantized to different codes")
        buf["codes"][index] = q.codes
        buf["scales"][index] = q.scales
        buf["amax"][index] = amax.to(torch.float32)
        buf["filled"][index] = True
        if self.keep_values and values is not None:
            if "values" not in buf:
                buf["values"] = torch.zeros(
                    *lead, *q.codes.shape[1:-1], values.shape[-1], dtype=torch.float32, device=values.device
                )
            buf["values"][index] = values.detach().to(torch.float32).reshape(buf["values"][index].shape)

    def capture_routing(self, layer: int, positions: torch.Tensor, ids: torch.Tensor) -> None:
        buf = self._routing_captured.setdefault(
            layer, torch.full((self.layout.num_positions, ids.shape[1]), -1, dtype=torch.int64, device=ids.device)
        )
        buf[positions] = ids.to(torch.int64)

    def perturbed_quantize(self, x: torch.Tensor) -> NVFP4Tensor:
        """What a second engine would have captured: RTN of perturb(x), per-row amax."""
        xp = self.perturb(x.detach())
        return quantize(xp, row_amax(xp))

    def build_records(self, config: TraceConfig | None = None, *, token_ids=None, weights_version=None,
                      weights_digest: str | None = None) -> list[GuidanceRecord]:
        """One record per sample from what was captured, covering every token of the sample.

        `token_ids` (one sequence per sample, the ids this forward ran) and the weights fields become
        the records' identity (see trace_kernels.RecordIdentity)."""
        if not self.capture:
            raise RuntimeError("build_records needs a batch made by trace_megatron.capture(...)")
        config = config or self.config
        modes = config.layer_modes(self.shape.num_layers)
        records = []
        for i in range(self.layout.num_samples):
            pos = self.layout.positions_of(i).to(self.device)
            builder = RecordBuilder(self.shape, config, token_ids=None if token_ids is None else token_ids[i],
                                    weights_version=weights_version, weights_digest=weights_digest)
            for layer in range(self.shape.num_layers):
                if self.shape.has_moe(layer):  # dense-MLP layers have no routing (and no moe sites)
                    if layer not in self._routing_captured:
                        raise RuntimeError(f"layer {layer}: no routing was captured (is it an MoE layer of a trace spec?)")
                    builder.add_routing(layer, self._routing_captured[layer][pos].cpu())
                if modes[layer] is None:
                    continue
                for site in self.shape.layer_sites(layer):
                    buf = self._captured.get((layer, site))
                    if buf is None or not bool(buf["filled"][pos].all()):
                        raise RuntimeError(f"layer {layer}, site {site}: not every row of sample {i} was captured")
                    builder.add(layer, site, NVFP4Tensor(buf["codes"][pos].cpu(), buf["scales"][pos].cpu(), buf["amax"][pos].cpu()))
            records.append(builder.build())
        return records

    def captured(self, layer: int, site: str) -> NVFP4Tensor:
        """The captured rows of (layer, site) by flat position ([N, ...]; fc2: [N, top_k, ...])."""
        buf = self._captured[(layer, site)]
        return NVFP4Tensor(buf["codes"], buf["scales"], buf["amax"])

    def captured_values(self, layer: int, site: str) -> torch.Tensor:
        """The unquantized inputs of (layer, site) by flat position, float32 (capture with keep_values)."""
        buf = self._captured[(layer, site)]
        if "values" not in buf:
            raise RuntimeError("captured_values needs trace_megatron.capture(..., keep_values=True)")
        return buf["values"]

    def close(self, *, will_recompute: bool) -> None:
        if not will_recompute:
            for binding in self._bindings_used:
                binding.discard(self)
        self._bindings_used = []


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
    }
