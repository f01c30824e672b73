"""Where the compiled NVFP4 grouped GEMM spends its time: the kernel timed with one stage left out at a time.

    python3 bench/gpu_grouped_ablation.py [--json FILE]      # on a CUDA GPU, about 1 minute
    python bench/gpu_grouped_ablation.py --cpu-smoke          # anywhere: every variant compiles for sm_90, the exact ones are exact

Why: on an H200 the kernel took 494 us at one token for the fc1 shape of Qwen3-30B-A3B's MoE layer
(E 128, N 1536, K 2048, top-8): ~3.9 us per 16-wide K step per program, while BF16 grouped_mm took the
whole layer in ~0.3 ms; unrolling the K loop changed nothing (docs/measurements.md, "The compiled Triton
kernels on an H200"). Without hardware counters on every machine, the next step is time differences:
each variant below changes one thing in the kernel's source (`kernels/grouped_mm/triton_jit.py`) or its
launch flags, and the table prints its time beside the kernel's at T = 1, 8, 64, 4096 tokens.

Variants (exact: computes the same bits as the kernel, checked on the test cases; timing only: wrong
results on purpose, it shows what the left-out stage costs):
  kernel       the kernel as it is (exact)
  no_capture   CAPTURE=False: no code / scale stores (exact outputs, no capture)
  plain_add    PTX_ADD=False: `a + b` instead of inline PTX add.rn (the compiler may fuse: timing only)
  unroll2      the K loop unrolled by 2 blocks with tl.static_range (exact)
  walk_only    the K loop removed: the expert walk, the prologue and the epilogue alone (timing only)
  no_a_quant   A's quantization (and capture) left out: A's bf16 values go straight to the dot (timing only)
  no_dot       the fp16 tl.dot replaced by row and column sums of the decoded tiles (timing only)
A source change that no longer matches a variant's anchor text is an error naming the variant, not a
silent skip: update the variant with the kernel.
"""

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNEL = REPO / "kernels/grouped_mm/triton_jit.py"

K_LOOP = "        for kb in range(0, K // 16):\n"
K_LOOP_END = "            acc = _add_rn(acc, partial, PTX_ADD)\n"
A_BLOCK = "            # ---- A block"
W_BLOCK = "            # ---- W block"
DOT = "partial = tl.dot(a_val.to(tl.float16), tl.trans(w_val.to(tl.float16)), out_dtype=tl.float32)"


def _anchor(src: str, text: str, variant: str) -> int:
    i = src.find(text)
    if i < 0:
        raise ValueError(f"variant {variant!r}: its anchor {text.strip()[:60]!r} is no longer in {KERNEL.name}; "
                         "update the variant with the kernel")
    return i


def unroll(src: str, u: int) -> str:
    i = _anchor(src, K_LOOP, f"unroll{u}")
    j = _anchor(src[i:], K_LOOP_END, f"unroll{u}") + i + len(K_LOOP_END)
    body = src[i + len(K_LOOP):j]
    indented = "".join(("    " + line if line.strip() else line) for line in body.splitlines(True))
    return (src[:i] + f"        for kb_u in range(0, K // {16 * u}):\n            for sub in tl.static_range({u}):\n"
            f"                kb = kb_u * {u} + sub\n" + indented + f"        for kb in range((K // {16 * u}) * {u}, K // 16):\n"
            + body + src[j:])


def walk_only(src: str) -> str:
    _anchor(src, K_LOOP, "walk_only")
    return src.replace(K_LOOP, "        for kb in range(0, (K // 16) * 0):\n", 1)


def no_a_quant(src: str) -> str:
    i = _anchor(src, A_BLOCK, "no_a_quant")
    j = _anchor(src, W_BLOCK, "no_a_quant")
    a = ("            x = tl.load(a_ptr + src[:, None] * K + kb * 16 + j[None, :], mask=m_ok[:, None], other=0.0)\n"
         "            a_val = x.to(tl.float32)\n")
    return src[:i] + a + src[j:]


def no_dot(src: str) -> str:
    _anchor(src, DOT, "no_dot")
    return src.replace(DOT, "partial = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32) + tl.sum(a_val, 1)[:, None] "
                            "+ tl.sum(w_val, 1)[None, :]", 1)


# name -> (source transform, launch flags, exact)
VARIANTS = {
    "kernel": (lambda s: s, {}, True),
    "no_capture": (lambda s: s, {"CAPTURE": False}, True),
    "plain_add": (lambda s: s, {"PTX_ADD": False}, False),
    "unroll2": (lambda s: unroll(s, 2), {}, True),
    "walk_only": (walk_only, {}, False),
    "no_a_quant": (no_a_quant, {}, False),
    "no_dot": (no_dot, {}, False),
}


def _import_path():
    shim = Path(tempfile.mkdtemp(prefix="trace_fp4_ablation_"))
    (shim / "trace_kernels").symlink_to(REPO / "kernels")
    sys.path[:0] = [str(shim), str(REPO)]
    return shim


def load(name: str, src: str, shim: Path, cuda: bool):
    path = shim / f"grouped_ablation_{name}.py"
    path.write_text(src)
    if cuda:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    from trace_kernels import triton_kernels

    return triton_kernels.import_interpreted(path.stem, path, {"trace_kernels.triton_jit": triton_kernels._interpreted_module()})


def launch(module, flags, a, a_amax, a_rows, w, offs, dest, cap_codes, cap_scales, out):
    """The kernel's launch as `trace_kernels.grouped_mm.launch.grouped_mm` makes it, with `flags` overriding."""
    import triton

    from trace_kernels.grouped_mm import launch as grouped_launch

    E, N, K = w.codes.shape[0], w.codes.shape[1], w.codes.shape[2] * 2
    M = out.shape[0]
    cuda = a.is_cuda
    block_m, block_n = grouped_launch._tiles(M, N, cuda)
    dummy = a.new_empty(1, dtype=a.dtype).view(-1)
    kw = dict(GATHER=a_rows is not None, CAPTURE=True, BIAS=False, PTX_ADD=cuda, BLOCK_M=block_m, BLOCK_N=block_n,
              FOUR6=False)
    kw.update(flags)
    if not cuda:
        kw["PTX_ADD"] = False  # the interpreter has no inline PTX
    module._grouped_mm_kernel[(triton.cdiv(M, block_m) + E, triton.cdiv(N, block_n))](
        a, a_rows if a_rows is not None else dummy, a_amax, w.codes, w.scales, w.amax, offs, out, dest, cap_codes,
        cap_scales, dummy, N, K, E, **kw)


# The kernel's argument kinds, as tests/kernels/test_triton_cuda_compile.py compiles it without a GPU.
SIGNATURE = dict(a_ptr="*bf16", a_rows_ptr="*i64", a_amax_ptr="*fp32", w_codes_ptr="*u8", w_scales_ptr="*u8",
                 w_amax_ptr="*fp32", offs_ptr="*i32", out_ptr="*fp32", cap_rows_ptr="*i64", cap_codes_ptr="*u8",
                 cap_scales_ptr="*u8", bias_ptr="*fp32", N="i32", K="i32", E="i32")


def compiles_for_cuda(name: str, src: str, shim: Path, flags: dict) -> bool:
    """The variant through Triton's CUDA pipeline for sm_90 (PTX and cubin), no GPU needed: a source that only
    the compiler refuses shows here, not in a lent machine's minutes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = load(f"{name}_compiled", src, shim, cuda=True)
    constexprs = dict(GATHER=True, CAPTURE=True, BIAS=False, PTX_ADD=True, BLOCK_M=16, BLOCK_N=64, FOUR6=False)
    constexprs.update(flags)
    sig = {**SIGNATURE, **{k: "constexpr" for k in constexprs}}
    compiled = triton.compile(ASTSource(fn=module._grouped_mm_kernel, signature=sig, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    return bool(compiled.asm["ptx"] and compiled.asm["cubin"])


def _same(ref, got) -> bool:
    import torch

    return all(bool(((r.view(torch.int32) == g.view(torch.int32)) | (r.isnan() & g.isnan())).all()) if r.is_floating_point()
               else torch.equal(r, g) for r, g in zip(ref, got))


def exact_on_cases(module, flags, device: str, small: bool) -> bool:
    """The variant against the torch reference on ragged experts with gathered rows and on a uniform case."""
    import torch

    import trace_kernels as tk
    from trace_kernels.grouped_mm import PackedExperts, reference

    g = torch.Generator().manual_seed(0)
    ok = True
    for counts, K in (([3, 0, 5, 2, 0], 96),) if small else (([3, 0, 70, 2, 0], 96), ([1, 2, 0, 9, 4], 160)):
        E, N, Ra = len(counts), 16 if small else 40, 9
        w = PackedExperts.empty(E, N, K)
        for e in range(E):
            w.quantize_expert_(e, torch.randn(N, K, generator=g) * (e + 1))
        a = torch.randn(Ra, K, generator=g).to(torch.bfloat16)
        rows = torch.randint(0, Ra, (sum(counts),), generator=g)
        offs = torch.tensor(counts).cumsum(0).to(torch.int32)
        dest = torch.full((len(rows),), -1, dtype=torch.int64)
        first = {}
        for m, r in enumerate(rows.tolist()):
            first.setdefault(r, m)
        dest[list(first.values())] = torch.tensor(list(first.keys()))
        amax = tk.row_amax(a)
        want = (torch.zeros((Ra, K // 2), dtype=torch.uint8), torch.zeros((Ra, K // 16), dtype=torch.uint8))
        out_ref = reference.grouped_mm(a, amax, rows, w.codes, w.scales, w.amax, offs, (dest, *want))
        got = (torch.zeros((Ra, K // 2), dtype=torch.uint8, device=device),
               torch.zeros((Ra, K // 16), dtype=torch.uint8, device=device))
        out = torch.empty((len(rows), N), dtype=torch.float32, device=device)
        wd = PackedExperts(w.codes.to(device), w.scales.to(device), w.amax.to(device))
        launch(module, flags, a.to(device), amax.to(device), rows.to(device), wd, offs.to(device), dest.to(device), *got, out)
        captured = flags.get("CAPTURE", True)
        ok &= _same((out_ref, *(want if captured else ())), (out.cpu(), *((t.cpu() for t in got) if captured else ())))
    return ok


def timings(modules: dict, tokens) -> dict:
    """Each variant at the fc1 shape of Qwen3-30B-A3B's MoE layer, CUDA events, mean of 20 launches after 3."""
    import torch

    import trace_kernels as tk
    from trace_kernels.grouped_mm import PackedExperts

    E, N, K, k = 128, 1536, 2048, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    w = PackedExperts.empty(E, N, K, device="cuda")
    for e in range(E):
        w.quantize_expert_(e, (torch.randn(N, K, device="cuda", generator=g) / K**0.5).to(torch.bfloat16))
    table = {}
    for T in tokens:
        M = T * k
        a = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.randint(0, E, (M,), device="cuda", generator=g)
        order = torch.argsort(ids, stable=True)
        rows, offs = order // k, torch.cumsum(torch.bincount(ids, minlength=E), 0).to(torch.int32)
        dest = torch.full((M,), -1, dtype=torch.int64, device="cuda")
        dest[:T] = torch.arange(T, device="cuda")  # a capture to write, as in the engine
        cap = (torch.zeros((T, K // 2), dtype=torch.uint8, device="cuda"), torch.zeros((T, K // 16), dtype=torch.uint8, device="cuda"))
        out = torch.empty((M, N), dtype=torch.float32, device="cuda")
        amax = tk.row_amax(a)
        row = {}
        for name, (module, flags) in modules.items():
            def run():
                launch(module, flags, a, amax, rows, w, offs, dest, *cap, out)

            for _ in range(3):
                run()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(20):
                run()
            end.record()
            torch.cuda.synchronize()
            row[name] = start.elapsed_time(end) / 20 * 1e3  # us
        table[T] = row
        print(f"T={T:5d}: " + ", ".join(f"{n} {v:8.1f} us ({v / row['kernel']:.2f}x)" for n, v in row.items()), flush=True)
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: build every variant, check the exact ones")
    ap.add_argument("--tokens", default="1,8,64,4096")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    shim = _import_path()
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("gpu_grouped_ablation: no CUDA device; --cpu-smoke checks the variants on the interpreter", file=sys.stderr)
        return 2
    src = KERNEL.read_text()
    report, modules = {}, {}
    for name, (transform, flags, exact) in VARIANTS.items():
        t0 = time.time()
        module = load(name, transform(src), shim, cuda)
        modules[name] = (module, flags)
        if exact:  # timing-only variants are wrong on purpose; the interpreter runs the exact ones only
            report[name] = {"exact": exact_on_cases(module, flags, "cuda" if cuda else "cpu", small=not cuda)}
        else:
            report[name] = {"exact": None}
        if not cuda:
            report[name]["compiles_for_cuda"] = compiles_for_cuda(name, transform(src), shim, flags)
        report[name]["seconds"] = round(time.time() - t0, 1)
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in report[name].items()), flush=True)
    if cuda:
        report["timing_us"] = timings(modules, [int(t) for t in args.tokens.split(",")])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    failed = [n for n, r in report.items() if n in VARIANTS and (r["exact"] is False or r.get("compiles_for_cuda") is False)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
