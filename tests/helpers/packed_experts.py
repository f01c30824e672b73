"""Random packed FP4 experts for the MoE kernel tests (test helper): fc1 (gate and up, 2*I x H) and fc2
(H x I) of every expert quantized from a seeded normal draw, scaled as the tiny models' weights are."""

import torch

from trace_kernels.grouped_mm import PackedExperts


def random_packed_experts(E: int, H: int, I: int, seed: int) -> tuple[PackedExperts, PackedExperts]:
    """w13, w2 of E experts; the same seed gives the same bits (both draws from one generator)."""
    g = torch.Generator().manual_seed(seed)
    w13, w2 = PackedExperts.empty(E, 2 * I, H), PackedExperts.empty(E, H, I)
    for e in range(E):
        # fc1's rows 3x wider than unit variance: the activation reaches the FP4 grid's upper codewords.
        w13.quantize_expert_(e, torch.randn(2 * I, H, generator=g) * 3 / H**0.5)
        w2.quantize_expert_(e, torch.randn(H, I, generator=g) / I**0.5)
    return w13, w2
