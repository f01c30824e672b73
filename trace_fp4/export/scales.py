"""The fp32 global scales an NVFP4 checkpoint stores, computed by the contract's own step 1.

`trace_kernels.reference.global_scales` gives g_enc = 2688 / amax (clamped as the contract says) and
g_dec = 1 / g_enc, both float32. compressed-tensors stores the encode scale (`weight_global_scale`,
`input_global_scale`; its loaders divide by it), ModelOpt the decode scale (`weight_scale_2`,
`input_scale`; its loaders multiply by it). Storing the contract's own float32 values means a loader
that multiplies by g_dec reproduces our dequantization exactly; one that divides by g_enc may differ
in the last float32 bit of the block multiplier (measured in tests/jobs/test_export_compressed_tensors.py).

With TraceConfig.block_scale="4over6" the weights' global scale is 1536 / amax (6 * 256) and each block
scale already holds its 4-or-6 choice, so a stock loader, which only reads the stored scales, dequantizes
4over6 weights unchanged. Activation input scales keep the default rule (2688 / amax): a stock engine
quantizes activations with its own 6-rule quantizer, for which that is the scale that uses E4M3's range.
"""

import torch

from trace_kernels import reference


def encode_scale(amax: torch.Tensor, block_scale: str = "6") -> torch.Tensor:
    """float32 g_enc for a one-element (or per-row) global amax."""
    return reference.global_scales(amax.to(torch.float32), block_scale)[0]


def decode_scale(amax: torch.Tensor, block_scale: str = "6") -> torch.Tensor:
    return reference.global_scales(amax.to(torch.float32), block_scale)[1]
