"""The serial grouped GEMM (grouped_mm_serial: what the native MoE kernel runs when its launch has one numba
thread, as in the CPU engine) gives the parallel kernel's bits, output and capture rows, on ragged experts with
empty ones, gathered rows, capture destinations, NaN / zero / huge rows and M = 0; and engine_call gives the
same output and captures whichever of the two its launch picks."""

import numba
import numpy as np
import pytest
import torch

from trace_kernels.cpu_native import grouped_mm as gmm
from trace_kernels.cpu_native import parallel_launch
from trace_kernels.cpu_native import routed_experts as rex
from trace_kernels.cpu_native.quantize import NUMERATOR, tables
from trace_kernels.grouped_mm import PackedExperts


def _experts(E, N, K, g):
    w = PackedExperts.empty(E, N, K)
    for e in range(E):
        w.quantize_expert_(e, torch.randn(N, K, generator=g) * torch.logspace(-3, 2, K // 16).repeat_interleave(16))
    return w


def _run(kernel, a_codes, a_scales, a_amax, src, dest, w, offs, M, N, Rc):
    nib, sv = tables()
    cap_codes = np.full((Rc, a_codes.shape[1]), 0xAB, np.uint8)
    cap_scales = np.full((Rc, a_scales.shape[1]), 0xAB, np.uint8)
    out = np.full((M, N), 7.0, np.float32)
    kernel(a_codes, a_scales, a_amax, src, dest, cap_codes, cap_scales, w.codes.numpy(), w.scales.numpy(),
           w.amax.numpy(), offs, np.empty((0, 0), np.float32), False, NUMERATOR["6"], nib, sv, out)
    return out.view(np.uint32), cap_codes, cap_scales


@pytest.mark.parametrize("seed", range(6))
def test_serial_equals_parallel(seed):
    g = torch.Generator().manual_seed(seed)
    E, N, K = 6, 48, 64
    Ra = int(torch.randint(1, 20, (1,), generator=g))
    counts = torch.randint(0, 5, (E,), generator=g)
    counts[seed % E] = 0  # an expert with no rows
    if seed == 5:
        counts[:] = 0  # M = 0: only the capture copy runs
    M = int(counts.sum())
    offs = np.cumsum(counts.numpy()).astype(np.int32)
    src = torch.randint(0, Ra, (M,), generator=g).numpy().astype(np.int64)
    dest = np.where(np.arange(M) % 3 == 0, -1, np.arange(M)).astype(np.int64)  # some rows captured, some not
    a_codes = torch.randint(0, 256, (Ra, K // 2), generator=g, dtype=torch.uint8).numpy()
    a_scales = torch.randint(0, 127, (Ra, K // 16), generator=g, dtype=torch.uint8).numpy()
    a_scales[0, 0] = 0x7F  # a NaN block scale
    a_amax = (torch.rand(Ra, generator=g) * 100).numpy()
    a_amax[-1] = 0.0
    w = _experts(E, N, K, g)
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    par = _run(gmm.grouped_mm_kernel, a_codes, a_scales, a_amax, src, dest, w, offs, M, N, max(M, 1))
    ser = _run(gmm.grouped_mm_serial, a_codes, a_scales, a_amax, src, dest, w, offs, M, N, max(M, 1))
    for p, s in zip(par, ser):
        assert np.array_equal(p, s)
    if M:
        assert not np.array_equal(par[0], np.full_like(par[0], np.float32(7.0).view(np.uint32)))


def test_engine_call_same_bits_serial_or_parallel(monkeypatch):
    g = torch.Generator().manual_seed(3)
    E, H, I, T, k = 8, 64, 32, 16, 2
    w13, w2 = _experts(E, 2 * I, H, g), _experts(E, H, I, g)
    x = (torch.randn(T, H, generator=g) * 3).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32)
    tw = torch.rand(T, k, generator=g)
    seen = []
    kernel = rex.moe_kernel_at

    def forced(serial):
        def call(*a):
            seen.append(a[-1])
            return kernel(*a[:-1], serial)
        return call

    results = []
    for serial in (True, False):
        monkeypatch.setattr(rex, "moe_kernel_at", forced(serial))
        out, q1, q2 = rex.engine_call(x, tw, ids, w13, w2, True)
        results.append([out.view(torch.int16), q1.codes, q1.scales, q1.global_amax.view(torch.int32), q2.codes,
                        q2.scales, q2.global_amax.view(torch.int32)])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    # the launch's own pick: serial exactly when it runs one numba thread
    with parallel_launch() as launch:
        threads = launch.threads
    assert seen == [threads == 1, threads == 1]
