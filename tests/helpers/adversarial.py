"""Adversarial NVFP4 inputs (exact ties, zero blocks, saturation, subnormal scales, +-0), shared by the reference and Triton tests.

Each case is (name, x float32 [R, K], global_amax float32 [1] or [R]).
"""

import numpy as np
import torch

MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _ulp_around(values):
    v = np.array(values, dtype=np.float32)
    return np.concatenate([v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf))])


def midpoint_rows() -> torch.Tensor:
    """Rows whose blocks scale exactly by 1: global amax 2688 gives g_enc = 1, and a block amax of 6
    gives s = 6 * fp32(1/6) = 1.0, so y == x and every E2M1 midpoint is hit exactly and one ulp off."""
    vals = np.concatenate([_ulp_around(MIDPOINTS), _ulp_around(GRID[1:-1]), [6.0, np.nextafter(np.float32(6), np.float32(0))]])
    vals = np.concatenate([vals, -vals])
    blocks = []
    for i in range(0, len(vals), 15):
        chunk = vals[i : i + 15]
        chunk = np.pad(chunk, (0, 15 - len(chunk)))
        blocks.append(np.concatenate([[6.0], chunk]).astype(np.float32))
    return torch.from_numpy(np.stack(blocks).reshape(-1, 64 if len(blocks) % 4 == 0 else 16))


def cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    x = midpoint_rows()
    out.append(("e2m1_midpoints_and_ulps", x, torch.tensor([2688.0])))

    # E4M3 ties: global amax 448 gives g_enc * fp32(1/6) == 1, so s == block amax. Block amaxes on
    # E4M3 midpoints (normal and subnormal) and one ulp either side.
    e4m3_mids = [1.0625, 1.1875, 3.75, 13.0, 240.0, 416.0, 0.017578125, 2.0**-10, 3 * 2.0**-10, 0.0146484375]
    amaxes = _ulp_around(e4m3_mids)
    rows = torch.rand(len(amaxes), 16, generator=g) * 2 - 1
    rows = rows * torch.from_numpy(amaxes)[:, None]
    rows[:, 3] = torch.from_numpy(amaxes)
    out.append(("e4m3_scale_ties", rows.reshape(-1, 32) if len(amaxes) % 2 == 0 else rows, torch.tensor([448.0])))

    # Zero blocks next to non-zero ones; an all-zero row (per-row amax 0).
    z = torch.randn(4, 64, generator=g)
    z[0, :16] = 0
    z[1, 16:48] = 0
    z[3] = 0
    out.append(("zero_blocks_per_row", z, z.abs().amax(-1)))

    # Tiny blocks beside a large one: subnormal E4M3 block scales (s < 2^-6).
    t = torch.randn(8, 64, generator=g) * torch.logspace(-6, -1, 8)[:, None]
    t[:, :16] = torch.randn(8, 16, generator=g) * 50
    out.append(("subnormal_block_scales", t, t.abs().amax(-1)))

    # Saturation: a static amax far below the data: block scales clamp at 448, values clamp at 6 x scale.
    s = torch.randn(4, 64, generator=g) * 1000
    out.append(("saturation_static_amax", s, torch.tensor([1.0])))

    # Signed zeros and negatives that round to zero.
    pz = torch.tensor([[6.0, 0.0, -0.0, -0.1, 0.1, -0.25, 0.25, -1e-30] + [0.0, -0.0] * 4] * 2)
    out.append(("signed_zeros", pz, torch.tensor([2688.0])))

    # Heavy tails and wide dynamic range, per tensor and per row.
    h = torch.distributions.StudentT(2.0).sample((16, 128)) * 3
    out.append(("student_t_per_tensor", h, h.abs().amax().reshape(1)))
    out.append(("student_t_per_row", h, h.abs().amax(-1)))
    ln = torch.exp(torch.randn(16, 64, generator=g) * 4) * torch.sign(torch.randn(16, 64, generator=g))
    out.append(("lognormal_wide_range", ln, ln.abs().amax(-1)))
    u = torch.rand(8, 256, generator=g) * 2 - 1
    out.append(("uniform", u, u.abs().amax(-1)))
    return out


def bad_value_rows() -> tuple[str, torch.Tensor, torch.Tensor]:
    """NaN / Inf inside blocks (the contract marks those blocks' scales NaN, 0x7F, and zeroes their
    codes); rows whose global amax is NaN, +Inf, 0, tiny or huge; subnormal inputs under their own amax."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 64, generator=g) * 3
    x[0, 5] = float("nan")
    x[1, 20] = float("inf")
    x[2, 40] = -float("inf")
    amax = x.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).amax(-1)
    amax[3] = float("nan")
    amax[4] = float("inf")
    amax[5] = 0.0
    amax[6] = 1e-38
    amax[7] = 3.3e38
    x[8] = x[8] * 1e-40
    amax[8] = x[8].abs().amax()
    return "nan_inf_amax_extremes", x, amax


def ragged_expert_rows(E_counts, Ra: int, K: int, dtype=torch.bfloat16, seed: int = 1):
    """A grouped GEMM's ragged input: `Ra` source rows [Ra, K] (block magnitudes spread over three
    decades), the gathered row of each (expert-sorted) pair with repeats, offsets from the per-expert
    counts `E_counts` (zeros allowed), and the capture destination that takes each source row from its
    first use only (-1 elsewhere). Returns (a, rows, offs, dest, generator)."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(Ra, K, generator=g) * torch.logspace(-2, 1, K // 16).repeat_interleave(16)).to(dtype)
    rows = torch.randint(0, Ra, (sum(E_counts),), generator=g)
    offs = torch.tensor(E_counts).cumsum(0).to(torch.int32)
    dest = torch.full((sum(E_counts),), -1, dtype=torch.int64)
    first = {}
    for m, r in enumerate(rows.tolist()):
        first.setdefault(r, m)
    for r, m in first.items():
        dest[m] = r
    return a, rows, offs, dest, g
