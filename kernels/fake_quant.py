"""Straight-through fake quantization for the trainer.

Forward: the dequantized NVFP4 value (round-to-nearest, or guided toward a rollout record).
Backward: identity (straight-through estimator). The quantized codes are returned on request so the
trainer can measure codeword agreement without quantizing twice.
"""

import torch

from .api import Backend, quantize_dequantize
from .backend import dequantize
from .guides.compact import CompactGuide
from .tensor import NVFP4Tensor


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, x_quantized):
        return x_quantized

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quantize(
    x: torch.Tensor,
    *,
    global_amax: torch.Tensor | None = None,
    guide: NVFP4Tensor | CompactGuide | None = None,
    backend: Backend = "auto",
    return_quantized: bool = False,
    block_scale: str = "6",
):
    """Fake-quantize `x` to NVFP4 with a straight-through gradient.

    Without a guide, `global_amax` defaults to the per-row amax of `x` (the engines' per-token mode).
    Returns the fake-quantized tensor (dtype of `x`), and the `NVFP4Tensor` if `return_quantized`.
    """
    with torch.no_grad():
        xq, q = quantize_dequantize(
            x.detach(), global_amax=global_amax, guide=guide, capture=return_quantized, backend=backend,
            block_scale=block_scale,
        )
    out = _StraightThrough.apply(x, xq)
    return (out, q) if return_quantized else out


def fake_dequantize(x: torch.Tensor, q: NVFP4Tensor, *, backend: Backend = "auto", block_scale: str = "6") -> torch.Tensor:
    """`x`'s straight-through stand-in whose value is `q` dequantized (dtype of `x`), for a `q` that is
    already `x`'s rounding: a sparse guide's decode ends with the guided rounding of `x` itself, so
    `fake_quantize(x, guide=decoded)` would only round `x` toward its own codes a second time and get
    the same codes (guided rounding picks the neighbour equal to the target)."""
    if tuple(q.shape) != tuple(x.shape):
        raise ValueError(f"q covers shape {tuple(q.shape)} but x has shape {tuple(x.shape)}")
    with torch.no_grad():
        xq = dequantize(q, x.dtype, backend=backend, block_scale=block_scale)
    return _StraightThrough.apply(x, xq)


def straight_through(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (x's quantized stand-in, same shape and dtype) in the forward, identity gradient to `x`."""
    if value.shape != x.shape or value.dtype != x.dtype:
        raise ValueError(f"straight-through value {tuple(value.shape)} {value.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    return _StraightThrough.apply(x, value.detach())
