"""Kernel-level timing of the native routed experts on the tiny Qwen3-MoE's shapes (H 64, I 32, 8
experts, top-2): the whole `routed_experts(backend="native")` call (what an engine layer call pays,
Python around the kernels included), its two numba kernels alone, and the native KV write
(`quantize_write`, 2 KV heads x 32), against the torch backend. Not a test.

    python bench/routed_experts_native.py [--tokens 16 256] [--repeats 200] [--threads 1]
"""

import argparse
import time

import torch


def _best(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 256])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=32)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads; the native kernels use as many")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from trace_kernels.cpu_native import kv as native_kv
    from trace_kernels.grouped_mm import PackedExperts
    from trace_kernels.kv_layout import packed_row_bytes
    from trace_kernels.routed_experts import routed_experts

    E, H, I, k = args.experts, args.hidden, args.intermediate, args.top_k
    g = torch.Generator().manual_seed(0)
    w13, w2 = PackedExperts.empty(E, 2 * I, H), PackedExperts.empty(E, H, I)
    for e in range(E):
        w13.quantize_expert_(e, torch.randn(2 * I, H, generator=g) * 3 / H**0.5)
        w2.quantize_expert_(e, torch.randn(H, I, generator=g) / I**0.5)
    print(f"E {E}, H {H}, I {I}, top-{k}; torch threads {torch.get_num_threads()}; best of 5 x {args.repeats}")
    print(f"{'T':>5} {'piece':<34} {'us/call':>9}")
    for T in args.tokens:
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        w = torch.softmax(torch.randn(T, k, generator=g), -1)
        rows = {}
        for backend in ("torch", "native"):
            for cap in (False, True):
                f = lambda: routed_experts(x, w, ids, w13, w2, "silu", capture=cap, backend=backend)  # noqa: E731
                rows[(backend, cap)] = _best(f, max(1, args.repeats // (20 if backend == "torch" else 1)))
                print(f"{T:>5} {'routed_experts ' + backend + (' +capture' if cap else ''):<34} {rows[(backend, cap)] * 1e6:>9.1f}")
        # the native KV write: 2 KV heads x 32, 32-token blocks
        KVH, D = 2, 32
        cache = torch.zeros((64, KVH, 32, 2 * packed_row_bytes(D)), dtype=torch.uint8)
        key = torch.randn(T, KVH, D, generator=g).to(torch.bfloat16)
        val = torch.randn(T, KVH, D, generator=g).to(torch.bfloat16)
        ka = key.float().abs().amax(-1)
        va = val.float().abs().amax(-1)
        slots = torch.randperm(64 * 32, generator=g)[:T]
        t = _best(lambda: native_kv.quantize_write(cache, slots, key, val, ka, va), args.repeats)
        print(f"{T:>5} {'kv quantize_write native':<34} {t * 1e6:>9.1f}")
        print(f"{T:>5} {'routed native / torch':<34} {rows[('native', False)] / rows[('torch', False)]:>9.3f}")


if __name__ == "__main__":
    main()
