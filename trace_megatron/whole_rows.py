"""The straight-through output of a site whose every row is guided, without copying its rows first.

A site with guided rows `idx` computes `straight_through(x.index_select(0, idx), values)`. When `idx` is
every row (0..n-1, the usual case), the index_select is a copy of x in the forward and, in the backward,
`zeros.index_add_(0, idx, g)`: a fresh zero tensor plus one add per row, i.e. `0 + g` elementwise. That
sum is g itself except for -0, which becomes +0, and the trainer's gradient bytes keep that. This
function gives the same forward value (`values`) and the same gradient (`g + 0`, one elementwise op: -0
+ +0 is +0, every other value unchanged) in one autograd node and without either copy.
"""

import torch


class _WholeRowsStraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, values):
        return values

    @staticmethod
    def backward(ctx, grad):
        # index_select's backward of all rows: zeros + grad (so -0 -> +0), the bits it gave before
        return grad + 0, None


def whole_rows_straight_through(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`straight_through(x.index_select(0, arange(n)), values)`'s value and gradient bytes, in one step.
    `values`: x's quantized stand-in, same shape and dtype (checked, as straight_through does)."""
    if values.shape != x.shape or values.dtype != x.dtype:
        raise ValueError(f"straight-through value {tuple(values.shape)} {values.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    return _WholeRowsStraightThrough.apply(x, values.detach())
