"""trace_kernels: the NVFP4 numerics shared by the rollout engines and the trainer.

The only place in trace-fp4 where FP4 numbers are computed (DESIGN.md sections 3-5).
"""

from .analysis import adjacent, codewords
from .api import dequantize, quantize, quantize_dequantize, quantize_guided, row_amax, tensor_amax
from .config import TraceConfig
from .fake_quant import fake_quantize
from .format import BLOCK_SIZE, E2M1_GRID
from .records import GuidanceRecord, ModelShape, RecordBuilder, RecordError
from .site_scale import SaturationCounter, count_saturated, site_amax
from .tensor import CompactGuide, NVFP4Tensor, compact

__all__ = [
    "adjacent",
    "codewords",
    "BLOCK_SIZE",
    "CompactGuide",
    "E2M1_GRID",
    "GuidanceRecord",
    "ModelShape",
    "RecordBuilder",
    "RecordError",
    "SaturationCounter",
    "count_saturated",
    "site_amax",
    "NVFP4Tensor",
    "TraceConfig",
    "compact",
    "dequantize",
    "fake_quantize",
    "quantize",
    "quantize_dequantize",
    "quantize_guided",
    "row_amax",
    "tensor_amax",
]
