"""NVFP4 grouped GEMM of the routed experts: torch reference (`reference.py`), Triton kernel
(`triton_jit.py`, launched by `launch.py`), resident packed weights (`weights.py`)."""

from .api import grouped_mm, quantized_mm
from .weights import ExpertWeightStream, PackedExperts, install_packed_experts, resident_bytes

__all__ = ["ExpertWeightStream", "PackedExperts", "grouped_mm", "quantized_mm", "install_packed_experts", "resident_bytes"]
