"""Feeding guidance to a model built with the trace spec: one `with` block per micro-batch forward.

    with trace_megatron.guidance(model, records, layout) as batch:
        output = model(input_ids, position_ids, attention_mask)      # unchanged forward
    loss.backward()                                                   # recompute reuses `batch`
    logger.log(batch.metrics())

`records` holds one `trace_kernels.GuidanceRecord` per sample of this rank's micro-batch; `layout`
(`TokenLayout.padded(...)` or `.packed(...)`) says where each sample's tokens are. `capture(...)` runs the
same forward in round-to-nearest and keeps the codes it computed (tests, debugging, or a trainer-side
reference); `batch.build_records()` turns them into records.
"""

from contextlib import contextmanager

import torch
from trace_kernels import GuidanceRecord

from .batch import TraceBatch
from .binding import pop_active, push_active
from .layout import TokenLayout
from .specs import model_shape


def _modules(model):
    models = model if isinstance(model, (list, tuple)) else [model]
    for m in models:
        yield from m.modules()


def trace_modules(model) -> list:
    from .attention import KVQuantMixin
    from .moe_layer import TraceMoELayer

    return [m for m in _modules(model) if isinstance(m, (TraceMoELayer, KVQuantMixin))]


def _model_info(model):
    mods = trace_modules(model)
    if not mods:
        raise ValueError("trace_megatron: this model has no trace modules; build it with get_gpt_*_with_trace_spec")
    config = mods[0].trace_config
    if any(m.trace_config != config for m in mods):
        raise ValueError("trace_megatron: the model's layers were built with different TraceConfigs")
    return mods, model_shape(mods[0].config), config


def _device(model):
    for m in _modules(model):
        for p in m.parameters(recurse=False):
            return p.device
    return torch.device("cpu")


@contextmanager
def _open(model, batch: TraceBatch):
    will_recompute = torch.is_grad_enabled() and any(
        getattr(getattr(m, "config", None), "recompute_granularity", None) for m in trace_modules(model)
    )
    push_active(batch)
    try:
        yield batch
    finally:
        pop_active(batch)
        batch.close(will_recompute=will_recompute)


def guidance(model, records: list[GuidanceRecord], layout: TokenLayout):
    """Guide this micro-batch's forward by `records` (one per sample, in layout order).

    Records that do not fit the model (shape), the spec's TraceConfig or the layout raise ValueError
    (`trace_kernels.RecordError` for shape / config) naming the sample and the mismatch."""
    _, shape, config = _model_info(model)
    if not isinstance(records, (list, tuple)) or not all(isinstance(r, GuidanceRecord) for r in records):
        raise TypeError("trace_megatron.guidance needs a list of trace_kernels.GuidanceRecord, one per sample")
    batch = TraceBatch(shape, config, layout, list(records), device=_device(model))
    return _open(model, batch)


def capture(model, layout: TokenLayout, *, perturb=None, records: list[GuidanceRecord] | None = None,
            keep_values: bool = False):
    """Run the forward and keep, per layer and site, the codes it computed by token position.

    Without `records` that is round-to-nearest (what an engine with the same weights captures). With
    `records` it is the guided result. `perturb(x) -> x'` captures RTN(x') instead (a second engine's
    slightly different numerics, for tests). `batch.build_records(config)` encodes per-sample records.
    `keep_values` also keeps each row's unquantized input (`batch.captured_values`), so an analysis
    can ask which rollout codewords were within reach (`trace_kernels.adjacent`)."""
    _, shape, config = _model_info(model)
    batch = TraceBatch(shape, config, layout, list(records) if records else None, capture=True,
                       keep_values=keep_values, perturb=perturb, device=_device(model))
    return _open(model, batch)


def clear_pending(model) -> None:
    """Forget guidance kept for recompute (e.g. after a forward whose backward never ran)."""
    for m in trace_modules(model):
        m.binding.clear()
