"""trace_kernels: the NVFP4 numerics shared by the rollout engines and the trainer.

The only place in trace-fp4 where FP4 numbers are computed (docs/architecture.md).
"""

from .analysis import adjacent, codewords
from .api import dequantize, quantize, quantize_dequantize, quantize_guided, row_amax, tensor_amax
from .config import ALL_SITES, PAPER_CONFIG, SITES, TraceConfig
from .fake_quant import fake_dequantize, fake_quantize
from .format import BLOCK_SCALES, BLOCK_SIZE, E2M1_GRID
from .errors import RecordError, SparseError
from .guides import Guide
from .guides.compact import CompactGuide, compact
from .identity import RecordIdentity, check_identity, token_digest
from .model_shape import ModelShape
from .records import GuidanceRecord, RecordBuilder
from .hf_shape import model_shape_from_hf
from .site_scale import SaturationCounter, count_saturated, site_amax
from .tensor import NVFP4Tensor
from .weight_digest import model_digest as weights_digest
from . import stores  # noqa: E402  (records by handle; ray is imported only by the ray store)

__all__ = [
    "BLOCK_SCALES",
    "adjacent",
    "codewords",
    "BLOCK_SIZE",
    "CompactGuide",
    "E2M1_GRID",
    "Guide",
    "GuidanceRecord",
    "ModelShape",
    "RecordBuilder",
    "RecordError",
    "SparseError",
    "RecordIdentity",
    "check_identity",
    "token_digest",
    "weights_digest",
    "SaturationCounter",
    "count_saturated",
    "site_amax",
    "NVFP4Tensor",
    "TraceConfig",
    "PAPER_CONFIG",
    "SITES",
    "ALL_SITES",
    "model_shape_from_hf",
    "compact",
    "stores",
    "dequantize",
    "fake_dequantize",
    "fake_quantize",
    "quantize",
    "quantize_dequantize",
    "quantize_guided",
    "row_amax",
    "tensor_amax",
]
