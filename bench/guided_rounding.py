"""Trainer-side guided rounding on a CPU: the torch reference (eager) beside the native numba kernel
(kernels/cpu_native/guided.py), what `fake_quantize(x, guide=...)` runs at every guided site and step
(codes, scales and the dequantized values in x's dtype). One run, side by side, checked bit-identical in
the run; wall time per call, median of --repeats after a warm-up (which also loads or compiles the
numba kernel), 1 torch thread. Beside them the RTN fake quantization under the 4over6 block scale
(kernels/cpu_native/quantize.py's quantize_4over6_kernel against the reference's select_4over6), the
other piece that ran torch on the native path before.

Shapes: the Megatron bench's sites (bench/megatron_step.py defaults: 4 x 64 tokens, hidden 128: the
attention input [256, 128], the routed experts' fc1 input [512, 128] (top-2) and fc2 input [512, 64]),
and a larger model's site [2048, 1024].

    .venv/bin/python bench/guided_rounding.py [--repeats 50] [--json FILE]
"""

import argparse
import statistics
import time

import torch

import trace_kernels as tk
from results_io import add_json_arg, write_results

SHAPES = ((256, 128), (512, 128), (512, 64), (2048, 1024))


def _time(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=50)
    add_json_arg(ap, "guided_rounding")
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'site [R, K]':>14} {'piece':>10} {'eager ms':>9} {'native ms':>10} {'eager / native':>15}")
    for R, K in SHAPES:
        x = (torch.randn(R, K, generator=g) * 3).to(torch.bfloat16)
        rollout = tk.quantize(x.float() * (1 + 0.01 * torch.randn(R, K, generator=g)), tk.row_amax(x), backend="torch")
        for name, kw in (("full", dict(guide=rollout)), ("compact", dict(guide=tk.compact(rollout))),
                         ("rtn_4over6", dict(block_scale="4over6"))):
            e = tk.quantize_dequantize(x, backend="torch", **kw)
            n = tk.quantize_dequantize(x, backend="native", **kw)
            if not (torch.equal(e[0].view(torch.int16), n[0].view(torch.int16)) and torch.equal(e[1].codes, n[1].codes)
                    and torch.equal(e[1].scales, n[1].scales)):
                raise SystemExit(f"native differs from eager at [{R}, {K}] {name}")
            te = _time(lambda: tk.quantize_dequantize(x, backend="torch", **kw), args.repeats)
            tn = _time(lambda: tk.quantize_dequantize(x, backend="native", **kw), args.repeats)
            rows.append({"R": R, "K": K, "piece": name, "eager_ms": te * 1e3, "native_ms": tn * 1e3, "ratio": te / tn})
            print(f"{f'[{R}, {K}]':>14} {name:>10} {te * 1e3:9.3f} {tn * 1e3:10.3f} {te / tn:14.1f}x")
    write_results(args.json, "guided_rounding", {"repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
