"""Kernel timings side by side: quantize-with-capture vs plain fake-quant, guided vs round-to-nearest.

Runs on whatever is present: on a CUDA GPU the compiled Triton kernels (with achieved bandwidth in GB/s
and a bit-exactness check against the torch reference); on a CPU the torch reference and, on a small
shape, the Triton interpreter. Not a test.

    .venv/bin/python bench/kernels.py [--rows N --cols K]
"""

import argparse
import time

import torch

import trace_kernels as tk


FIGURES = {}  # what main() writes to --json, filled by run() and run_moe()


def _timeit(fn, device, min_time=0.5, clock=time.perf_counter):
    fn()  # warm-up (compilation on a GPU)
    if device.type == "cuda":
        torch.cuda.synchronize()
    n, start = 0, clock()
    while True:
        fn()
        n += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = clock() - start
        if elapsed >= min_time:
            return elapsed / n


def _bytes_moved(x, capture, guided, compact=False):
    R, K = x.shape
    moved = 2 * x.numel() * x.element_size() + 4 * R  # read x, write fake-quant output, amax
    if capture:
        moved += R * K // 2 + R * K // 16
    if guided:
        moved += (R * K // 8 if compact else R * K // 2) + R * K // 16
    return moved


def run(device, backend, rows, cols, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g).to(dtype).to(device)
    xt = (x.float() * (1 + 2**-8 * torch.randn(rows, cols, generator=g).to(device))).to(dtype)
    amax = tk.row_amax(x)
    _, rollout = tk.quantize_dequantize(x, global_amax=amax, backend=backend)
    compact = tk.compact(rollout)
    cases = {
        "fake-quant RTN, no capture": (lambda: tk.quantize_dequantize(x, global_amax=amax, capture=False, backend=backend), False, False, False),
        "fake-quant RTN + capture": (lambda: tk.quantize_dequantize(x, global_amax=amax, backend=backend), True, False, False),
        "guided full (trainer)": (lambda: tk.quantize_dequantize(xt, guide=rollout, capture=False, backend=backend), False, True, False),
        "guided compact (trainer)": (lambda: tk.quantize_dequantize(xt, guide=compact, capture=False, backend=backend), False, True, True),
    }
    times = {}
    FIGURES.setdefault("elementwise", {})[f"{device.type}/{backend}"] = {"rows": rows, "cols": cols, "ms": times}
    print(f"\n{device.type} / {backend}: x {rows}x{cols} {str(dtype).removeprefix('torch.')}")
    for name, (fn, capture, guided, is_compact) in cases.items():
        t = _timeit(fn, device)
        times[name] = t * 1e3
        gbs = _bytes_moved(x, capture, guided, is_compact) / t / 1e9
        FIGURES["elementwise"][f"{device.type}/{backend}"].setdefault("gb_s", {})[name] = gbs
        print(f"  {name:<28} {t * 1e3:10.3f} ms   {gbs:8.2f} GB/s")
    base = times["fake-quant RTN, no capture"]
    print(f"  capture overhead: {times['fake-quant RTN + capture'] / base:.3f}x   "
          f"guided full / RTN: {times['guided full (trainer)'] / base:.3f}x   "
          f"guided compact / RTN: {times['guided compact (trainer)'] / base:.3f}x")
    if backend == "triton":
        ref_out, ref_q = tk.quantize_dequantize(x.cpu(), global_amax=amax.cpu(), backend="torch")
        out, q = tk.quantize_dequantize(x, global_amax=amax, backend="triton")
        exact = torch.equal(q.codes.cpu(), ref_q.codes) and torch.equal(q.scales.cpu(), ref_q.scales) and torch.equal(out.cpu(), ref_out)
        FIGURES["elementwise"][f"{device.type}/{backend}"]["bit_exact_vs_torch"] = bool(exact)
        print(f"  bit-exact vs torch reference: {exact}")


def run_moe(device, backend, T, H, I, E, k, min_time=0.5):
    """The routed-expert computation on packed weights (NVFP4 grouped GEMM, both projections), with
    and without capture; the capture is written by the GEMM that quantizes."""
    from trace_kernels.grouped_mm import PackedExperts
    from trace_kernels.routed_experts import routed_experts

    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    w13, w2 = PackedExperts.empty(E, 2 * I, H, device), PackedExperts.empty(E, H, I, device)
    for e in range(E):
        w13.quantize_expert_(e, torch.randn(2 * I, H, generator=g).to(device))
        w2.quantize_expert_(e, torch.randn(H, I, generator=g).to(device))
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device)
    wts = torch.rand(T, k, generator=g).to(device)
    t = {}
    # On a (shared) CPU: process CPU time, best of 3 alternating rounds (wall time swings with load).
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    for _ in range(3 if device.type == "cpu" else 1):
        for capture in (False, True):
            dt = _timeit(lambda: routed_experts(x, wts, ids, w13, w2, "silu", capture=capture, backend=backend), device, min_time, clock)
            t[capture] = min(t.get(capture, dt), dt)
    print(f"\n{device.type} / {backend}: MoE layer T={T} H={H} I={I} E={E} top-{k}: "
          f"{t[False] * 1e3:.3f} ms, + capture {t[True] * 1e3:.3f} ms ({t[True] / t[False] - 1:+.1%})")
    FIGURES.setdefault("moe_layer", {})[f"{device.type}/{backend}"] = {
        "T": T, "H": H, "I": I, "E": E, "top_k": k, "clock": "process" if device.type == "cpu" else "wall",
        "ms": t[False] * 1e3, "ms_with_capture": t[True] * 1e3}
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--cols", type=int, default=2048)
    from results_io import add_json_arg, write_results

    add_json_arg(ap, "kernels")
    args = ap.parse_args()
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        rows = args.rows or 16384
        for dtype in (torch.bfloat16,):
            run(dev, "triton", rows, args.cols, dtype)
            run(dev, "torch", rows, args.cols, dtype)
    else:
        dev = torch.device("cpu")
        run(dev, "torch", args.rows or 1024, args.cols, torch.bfloat16)
        run(dev, "triton", 64, 256, torch.bfloat16)  # interpreter: seconds per launch grid, keep small
        moe = dict(T=16, H=64, I=32, E=8, k=2)  # the tiny model's MoE layer, one decode step of 16 requests
        ref = run_moe(dev, "torch", **moe)
        interp = run_moe(dev, "triton", **moe, min_time=0.05)
        print(f"  Triton interpreter / torch backend (same bits): {interp[False] / ref[False]:.0f}x")
    write_results(args.json, "kernels", FIGURES)


if __name__ == "__main__":
    main()
