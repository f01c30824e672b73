"""trace_megatron: Megatron-Core specs that train on the rollout's FP4 execution path (TRACE).

    spec = trace_megatron.get_gpt_decoder_block_with_trace_spec(config)   # instead of Megatron's
    with trace_megatron.guidance(model, records, layout) as batch:        # around each forward
        ...
    batch.metrics()                                                        # per layer / site

All FP4 numerics come from `trace_kernels`. See README.md.
"""

from .batch import TraceBatch
from .feeding import capture, clear_pending, guidance, prepare, trace_modules
from .prepared import PreparedRecords
from .layout import TokenLayout
from .spec_fallbacks import SpecFallbacks, spec_fallbacks_of
from .specs import (
    get_gpt_decoder_block_with_trace_spec,
    get_gpt_layer_with_trace_spec,
    model_shape,
    to_trace_block_spec,
    to_trace_layer_spec,
)
from .stats import SiteStats

__all__ = [
    "PreparedRecords",
    "SiteStats",
    "SpecFallbacks",
    "TokenLayout",
    "TraceBatch",
    "capture",
    "clear_pending",
    "get_gpt_decoder_block_with_trace_spec",
    "get_gpt_layer_with_trace_spec",
    "guidance",
    "model_shape",
    "prepare",
    "spec_fallbacks_of",
    "to_trace_block_spec",
    "to_trace_layer_spec",
    "trace_modules",
]
