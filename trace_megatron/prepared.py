"""Prepared records: a micro-batch's guidance tables, built once before its forwards.

    prepared = trace_megatron.prepare(model, records, layout)        # e.g. in the data loader
    with trace_megatron.guidance(model, prepared, layout) as batch:   # old log-probs
        ...
    with trace_megatron.guidance(model, prepared, layout) as batch:   # the update (every PPO epoch)
        ...

What is prepared depends on the records and the layout only: every (layer, site)'s guide rows of all
samples unpacked and concatenated, the audit map, the routing ids, the guided rows of K / V and the
payload bytes the token dispatcher carries (record_tables.py, `RecordTables.build_all`). The sparse
decode is not: it depends on the trainer's own values, which move with the weights, so every forward
decodes again. A prepared object is refused by `guidance` for another model shape, TraceConfig or
layout than it was made for, naming what differs.
"""

from dataclasses import dataclass

import torch
from trace_kernels import GuidanceRecord, ModelShape, TraceConfig

from .layout import TokenLayout
from .record_tables import RecordTables


@dataclass(frozen=True)
class PreparedRecords:
    records: tuple[GuidanceRecord, ...]
    layout: TokenLayout
    shape: ModelShape
    config: TraceConfig
    tables: RecordTables

    def check_batch(self, shape: ModelShape, config: TraceConfig, layout: TokenLayout, device: torch.device) -> None:
        """Raise ValueError unless these tables were made for this model (shape, config), layout and device."""
        if shape != self.shape:
            raise ValueError(f"trace_megatron: records prepared for a model of another shape ({self.shape}), "
                             f"this model is {shape}")
        if config != self.config:
            raise ValueError("trace_megatron: records prepared for another TraceConfig than this model's "
                             f"({self.config} vs {config})")
        if not same_layout(layout, self.layout):
            raise ValueError(
                "trace_megatron: records prepared for another token layout than this forward's "
                f"(seq_len x batch {self.layout.seq_len} x {self.layout.batch_size}, sample lengths "
                f"{self.layout.sample_lengths()}; this forward: {layout.seq_len} x {layout.batch_size}, "
                f"{layout.sample_lengths()})")
        if torch.device(device) != self.tables.device:
            raise ValueError(f"trace_megatron: records prepared on {self.tables.device}, the model is on {device}")


def same_layout(a: TokenLayout, b: TokenLayout) -> bool:
    """Whether two layouts put the same tokens at the same flat positions (TokenLayout holds tensors, so
    its dataclass equality cannot be used)."""
    if a is b:
        return True
    return (a.seq_len == b.seq_len and a.batch_size == b.batch_size and a.whole_lengths == b.whole_lengths
            and torch.equal(a.sample, b.sample) and torch.equal(a.token, b.token))


def prepare_tables(shape: ModelShape, config: TraceConfig, layout: TokenLayout, records: list[GuidanceRecord],
                   device: torch.device) -> PreparedRecords:
    """Check `records` against the shape, config and layout (as `guidance` does) and build every table."""
    tables = RecordTables(shape, config, layout, list(records), device).build_all()
    return PreparedRecords(tuple(records), layout, shape, config, tables)
