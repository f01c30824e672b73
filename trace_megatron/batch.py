"""TraceBatch: one micro-batch's guidance records, where its tokens are, and what happened to them.

Made by `trace_megatron.guidance(...)` / `trace_megatron.capture(...)`. Layers ask it for the guide rows
of their tokens (by flat position, see layout.py; record_tables.py), report counters back
(counters.py) and, in capture mode, the codes they computed (capture_buffer.py).
"""

import torch
from trace_kernels import Guide, GuidanceRecord, ModelShape, NVFP4Tensor, TraceConfig

from .capture_buffer import CaptureBuffer
from .counters import BatchCounters
from .layout import TokenLayout
from .record_tables import RecordTables
from .spec_fallbacks import SpecFallbacks
from .stats import SiteStats


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
        spec_fallbacks: dict[str, int] | None = None,
        tables: RecordTables | None = None,
    ):
        self.shape, self.config, self.layout = shape, config, layout
        self.records = records
        self.capture = capture
        self.device = torch.device(device)
        # Spec-time substitutions of the model this batch runs (reported with the metrics).
        self.spec_fallbacks = spec_fallbacks if spec_fallbacks is not None else SpecFallbacks()
        self.counters = BatchCounters()
        # `tables`: built ahead for these records and this layout (trace_megatron.prepare), reused as they are
        if tables is not None and (records is None or tables.records != records):
            raise ValueError("trace_megatron: prepared tables of other records than this batch's")
        if tables is None and records is not None:
            tables = RecordTables(shape, config, layout, records, self.device)
        self.tables = tables
        self.captures = CaptureBuffer(shape, config, layout, keep_values=keep_values, perturb=perturb, device=self.device)
        self._bindings_used: list = []

    # ---- records --------------------------------------------------------------------------------
    def layer_guide_type(self, layer: int) -> type[Guide] | None:
        """The Guide type of `layer`'s encoding, None where it is not guided (or there are no records)."""
        return self.tables.guide_type(layer) if self.tables is not None else None

    def record_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Row in the concatenated records of each flat position (-1: no record)."""
        if self.tables is None:
            return torch.full_like(positions, -1)
        return self.tables.record_rows(positions)

    def site_table(self, layer: int, site: str) -> Guide | None:
        """All samples' guide rows of (layer, site), concatenated, or None where the layer is not guided."""
        return self.tables.site_table(layer, site) if self.tables is not None else None

    def audit_by_position(self, layer: int, site: str):
        """(audit row per flat token position, audited packed codes) of (layer, site), or None."""
        return self.tables.audit_by_position(layer, site) if self.tables is not None else None

    def position_rows(self, layer: int, site: str):
        """(flat positions with a record row, their guide rows) of a site over every position (K / V, the
        MLA latent), or None where the layer is not guided."""
        return self.tables.position_rows(layer, site) if self.tables is not None else None

    def payload_bytes(self, layer: int):
        """(fc1, fc2 per record slot) guide rows of a guided MoE layer as payload bytes (token_rows.py)."""
        return self.tables.payload_bytes(layer)

    def routing_table(self, layer: int) -> torch.Tensor:
        return self.tables.routing_table(layer)

    def routing_target(self, layer: int, positions: torch.Tensor) -> torch.Tensor | None:
        """int64 [n, top_k]: the record's expert ids per position, -1 rows where there is no record."""
        return self.tables.routing_target(layer, positions) if self.tables is not None else None

    # ---- counters ---------------------------------------------------------------------------------
    @property
    def stats(self) -> dict[tuple[int, str], SiteStats]:
        return self.counters.stats

    @property
    def routing(self) -> dict[int, list[int]]:
        return self.counters.routing

    @property
    def record_counts(self) -> dict[str, int]:
        return self.counters.record_counts

    def count_routing(self, layer: int, replayed: int, total: int) -> None:
        self.counters.count_routing(layer, replayed, total)

    def site_stats(self, layer: int, site: str) -> SiteStats:
        return self.counters.site_stats(layer, site)

    def metrics(self, prefix: str = "trace", group=None) -> dict[str, float]:
        """Flat dict for a logger (counters.py). With `group`, counts are summed over that process group
        first (e.g. the expert-parallel group)."""
        return self.counters.metrics(prefix, group, self.spec_fallbacks)

    # ---- capture (test / debug) ---------------------------------------------------------------
    @property
    def keep_values(self) -> bool:
        return self.captures.keep_values

    @property
    def perturb(self):
        return self.captures.perturb

    def capture_rows(self, layer: int, site: str, positions: torch.Tensor, q: NVFP4Tensor, slots=None, values=None) -> None:
        self.captures.capture_rows(layer, site, positions, q, slots, values)

    def capture_routing(self, layer: int, positions: torch.Tensor, ids: torch.Tensor) -> None:
        self.captures.capture_routing(layer, positions, ids)

    def perturbed_quantize(self, x: torch.Tensor) -> NVFP4Tensor:
        return self.captures.perturbed_quantize(x)

    def build_records(self, config: TraceConfig | None = None, *, token_ids=None, weights_version=None,
                      weights_digest: str | None = None) -> list[GuidanceRecord]:
        """One record per sample from what was captured (capture_buffer.py)."""
        if not self.capture:
            raise RuntimeError("build_records needs a batch made by trace_megatron.capture(...)")
        return self.captures.build_records(config, token_ids=token_ids, weights_version=weights_version,
                                           weights_digest=weights_digest)

    def captured(self, layer: int, site: str) -> NVFP4Tensor:
        return self.captures.captured(layer, site)

    def captured_routing(self, layer: int) -> torch.Tensor:
        return self.captures.captured_routing(layer)

    def captured_values(self, layer: int, site: str) -> torch.Tensor:
        return self.captures.captured_values(layer, site)

    def close(self, *, will_recompute: bool) -> None:
        if not will_recompute:
            for binding in self._bindings_used:
                binding.discard(self)
        self._bindings_used = []
