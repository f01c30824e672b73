"""A token's codes must not depend on which other tokens share its batch."""

import pytest
import torch

import trace_kernels as tk


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_row_codes_do_not_depend_on_the_batch(backend):
    g = torch.Generator().manual_seed(5)
    batch = torch.randn(37, 96, generator=g) * torch.logspace(-3, 3, 37)[:, None]
    whole = tk.quantize(batch, tk.row_amax(batch), backend=backend)
    for size in (1, 2, 5, 16):
        for start in range(0, 37 - size + 1, 9):
            part = batch[start : start + size]
            q = tk.quantize(part, tk.row_amax(part), backend=backend)
            assert torch.equal(q.codes, whole.codes[start : start + size])
            assert torch.equal(q.scales, whole.scales[start : start + size])
    # a row among very different neighbours (a per-tensor amax would change its codes)
    mixed = torch.cat([batch[:1], batch[1:2] * 1e4, batch[2:3] * 0])
    q = tk.quantize(mixed, tk.row_amax(mixed), backend=backend)
    assert torch.equal(q.codes[0], whole.codes[0])


def test_per_tensor_amax_is_not_batch_invariant():
    """Why the engines default to per-token amax: the per-tensor one does change a row's codes."""
    g = torch.Generator().manual_seed(6)
    a = torch.randn(4, 64, generator=g)
    alone = tk.quantize(a[:1], tk.tensor_amax(a[:1]))
    together = tk.quantize(a, tk.tensor_amax(torch.cat([a, a * 7])))
    assert not torch.equal(alone.codes, together.codes[:1])
