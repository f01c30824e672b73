"""The step's shortcuts give the bits of the lines they replace: the whole-rows straight-through
(index_select's gradient, -0 -> +0) and LayerExpertRows' numpy row bookkeeping."""

import numpy as np
import pytest
import torch
from trace_kernels.fake_quant import straight_through

pytest.importorskip("megatron.core")
from trace_megatron import expert_rows_host  # noqa: E402
from trace_megatron.whole_rows import whole_rows_straight_through  # noqa: E402


def _grad_bytes(fn, x, values, g):
    x = x.clone().requires_grad_(True)
    out = fn(x, values)
    out.backward(g)
    return out.detach().view(torch.int16).numpy().tobytes(), x.grad.view(torch.int16).numpy().tobytes()


def test_whole_rows_straight_through_is_index_select_then_straight_through_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=gen).to(torch.bfloat16)
    values = torch.randn(37, 64, generator=gen).to(torch.bfloat16)
    g = torch.randn(37, 64, generator=gen).to(torch.bfloat16)
    g[::3, ::5] = -0.0  # the values whose bits differ from g itself: index_select's backward gives +0
    g[1, :4] = torch.tensor([float("inf"), -float("inf"), 0.0, 1e-40])
    idx = torch.arange(37)
    before = _grad_bytes(lambda a, v: straight_through(a.index_select(0, idx), v), x, values, g)
    after = _grad_bytes(whole_rows_straight_through, x, values, g)
    assert after == before
    assert after[1] != g.view(torch.int16).numpy().tobytes()  # the -0s did become +0


def test_whole_rows_straight_through_refuses_other_shapes():
    with pytest.raises(ValueError, match="does not match"):
        whole_rows_straight_through(torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(2, 16))


def test_expert_rows_host_matches_the_torch_lines():
    rng = np.random.default_rng(0)
    for _ in range(50):
        E = int(rng.integers(1, 9))
        counts = rng.integers(0, 12, E).tolist()
        N = sum(counts)
        if N == 0:
            continue
        has = rng.random(N) < 0.8
        fc2 = rng.random(N) < 0.7
        local_np = expert_rows_host.local_expert_of_rows(counts, N)
        idx1, idx2, row_in_expert, per = expert_rows_host.guided_rows(local_np, counts, has.astype(np.uint8), fc2)
        # the torch lines of expert_rows.LayerExpertRows
        c = torch.tensor(counts, dtype=torch.int64)
        local = torch.repeat_interleave(torch.arange(E), c, output_size=N)
        h, f = torch.from_numpy(has), torch.from_numpy(fc2)
        assert torch.equal(torch.from_numpy(local_np), local)
        assert torch.equal(idx1, torch.nonzero(h).flatten()) and idx1.dtype == torch.int64
        assert torch.equal(idx2, torch.nonzero(h & f).flatten()) and idx2.dtype == torch.int64
        assert torch.equal(row_in_expert, torch.arange(N) - (torch.cumsum(c, 0) - c)[local])
        kind = torch.where(h, (~f).to(torch.int64), 2)
        assert per == torch.bincount(local * 3 + kind, minlength=3 * E).reshape(E, 3).t().tolist()
