"""The 4-over-6 block scale's cost, side by side with the default rule in one run: fake-quant with
capture, the grouped-GEMM MoE layer, and (on a GPU) the compiled kernels' bit-exactness against the
torch reference. Also its quantization error on the same values. Not a test.

    .venv/bin/python bench/four_over_six.py [--rows N --cols K]
"""

import argparse
import time

import torch

import trace_kernels as tk
from trace_kernels.grouped_mm import PackedExperts
from trace_kernels.routed_experts import routed_experts

RULES = ("6", "4over6")


def _best(fns: dict, device, rounds=5, min_time=0.3) -> dict:
    """Best of `rounds` timings of each fn, the fns alternating within every round so that a shared
    machine's load falls on all of them alike (CPU: wall time, one thread; GPU: wall time)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns.values():
        fn()
    sync()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            n, start = 0, time.perf_counter()
            while True:
                fn()
                sync()
                n += 1
                if time.perf_counter() - start >= min_time:
                    break
            best[name] = min(best[name], (time.perf_counter() - start) / n)
    return best


def elementwise(device, backend, rows, cols):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)).to(torch.bfloat16).to(device)
    amax = tk.row_amax(x)
    t = _best({rule: (lambda rule=rule: tk.quantize_dequantize(x, global_amax=amax, backend=backend, block_scale=rule))
               for rule in RULES}, device)
    err = {}
    for rule in RULES:
        out, _ = tk.quantize_dequantize(x, global_amax=amax, backend=backend, block_scale=rule)
        err[rule] = float(((out.float() - x.float()) ** 2).sum() / (x.float() ** 2).sum())
    print(f"{device.type}/{backend} fake-quant + capture, {rows}x{cols} bf16: 6 {t['6'] * 1e3:.3f} ms, "
          f"4over6 {t['4over6'] * 1e3:.3f} ms ({t['4over6'] / t['6']:.2f}x); relative squared error "
          f"6 {err['6']:.4%}, 4over6 {err['4over6']:.4%} ({err['4over6'] / err['6']:.3f}x)")
    if backend == "triton":
        for rule in RULES:
            ref_out, ref_q = tk.quantize_dequantize(x.cpu(), global_amax=amax.cpu(), backend="torch", block_scale=rule)
            out, q = tk.quantize_dequantize(x, global_amax=amax, backend="triton", block_scale=rule)
            exact = (torch.equal(q.codes.cpu(), ref_q.codes) and torch.equal(q.scales.cpu(), ref_q.scales)
                     and torch.equal(out.cpu(), ref_out))
            print(f"  {rule}: bit-exact vs torch reference: {exact}")


def moe(device, backend, T, H, I, E, k):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device)
    wts = torch.rand(T, k, generator=g).to(device)
    w1, w2 = [torch.randn(2 * I, H, generator=g) for _ in range(E)], [torch.randn(H, I, generator=g) for _ in range(E)]
    packed = {}
    for rule in RULES:
        w13, w2p = PackedExperts.empty(E, 2 * I, H, device, rule), PackedExperts.empty(E, H, I, device, rule)
        for e in range(E):
            w13.quantize_expert_(e, w1[e].to(device))
            w2p.quantize_expert_(e, w2[e].to(device))
        packed[rule] = (w13, w2p)
    t = _best({rule: (lambda rule=rule: routed_experts(x, wts, ids, *packed[rule], "silu", capture=True, backend=backend))
               for rule in RULES}, device)
    print(f"{device.type}/{backend} MoE layer with capture T={T} H={H} I={I} E={E} top-{k}: 6 {t['6'] * 1e3:.3f} ms, "
          f"4over6 {t['4over6'] * 1e3:.3f} ms ({t['4over6'] / t['6']:.2f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--cols", type=int, default=2048)
    args = ap.parse_args()
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        elementwise(dev, "triton", args.rows or 16384, args.cols)
        moe(dev, "triton", T=64, H=2048, I=768, E=128, k=8)
    else:
        torch.set_num_threads(1)  # a shared 2-core machine: one thread, so the load moves both rules alike
        dev = torch.device("cpu")
        elementwise(dev, "torch", args.rows or 1024, args.cols)
        moe(dev, "torch", T=16, H=64, I=32, E=8, k=2)  # the tiny model's MoE layer, one decode step of 16


if __name__ == "__main__":
    main()
