"""The CUDA check of the NVFP4 kernels, as one prepared script (under 8 minutes on one H200).

    python bench/gpu_check.py [--skip-tests] [--skip-engine | --only-engine] [--json FILE]
    python bench/gpu_check.py --dry-run    # on any machine: checks and prints the plan, runs nothing on a GPU

Runs from a plain checkout too (a device machine gets the working tree, not our .venv): without an
installed trace-fp4 it maps the import names onto the source folders itself (`_import_path`).

1. Bit-exactness, compiled: the Triton tests' CUDA cases (tests/kernels/test_grouped_mm.py,
   tests/kernels/test_kernels_triton.py: compiled kernel == torch reference on random and adversarial data;
   tests/kernels/test_packed_kv_attention.py: the packed-KV page decode bit for bit, decode attention
   within one BF16 ulp of the reference; tests/kernels/test_sparse_triton.py: the sparse encode, search
   and decode kernels == the torch reference on the same device).
2. Quantize + capture bandwidth: `trace_kernels.quantize` (Triton) on bf16 [16384, 2048]; bytes read
   and written per second against the HBM peak (--hbm-peak, default H200 4.8 TB/s).
3. The MoE layer of Qwen3-30B-A3B (128 experts, hidden 2048, moe_intermediate 768, top-8) at decode
   batch sizes 1-64 and prefill 4096: `trace_kernels.routed_experts(..., backend="triton")` (sort,
   fc1 with input quantization + capture, activation, fc2 with input quantization + capture) against
   vLLM's BF16 `fused_experts` (its fused_moe Triton kernel) where vLLM is importable, else against
   BF16 `torch._grouped_mm` on the same sorted rows (and it says which). Also times the op inside a
   CUDA graph, which fails loudly if anything in it synchronises with the host.
4. End to end (`bench/gpu_engine.py`): the tiny Qwen3-MoE in vLLM with trace_fp4 and capture, CUDA
   graphs on (vLLM's default cudagraph_mode) against the same compiled model without graphs, against
   eager (enforce_eager), graphs without capture, and graphs with the packed KV cache on TRITON_ATTN
   (Triton decode read): tok/s, the capture overhead, whether the records of graph replay equal the run
   without graphs (the exit status), and how many equal eager's. Five engine starts, about 5 minutes. Skipped (and said so) where vLLM is not importable; --skip-engine
   skips it, --only-engine runs only it.

Without CUDA it exits with status 2 and says so. `--dry-run` runs on any machine: it builds the tiny
model, checks every arm's configuration (trace_fp4 and vLLM's CompilationConfig), prints the plan of all
four steps and exits 0; nothing is timed. Figures go in docs/measurements.md with the command. First
run on a GPU: an H200 (Triton 3.6, no vLLM there, so steps 1-3), docs/measurements.md "The compiled Triton
kernels on an H200".
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _import_path() -> str:
    """A folder whose entries are the package import names (trace_kernels -> kernels/, ...), first on
    sys.path here and on PYTHONPATH for the test subprocess, so this checkout's code is what runs."""
    import tempfile

    shim = Path(tempfile.mkdtemp(prefix="trace_fp4_import_"))
    for name, folder in (("trace_kernels", "kernels"), ("trace_fp4_patches", "patches")):
        (shim / name).symlink_to(REPO / folder)
    sys.path.insert(0, str(shim))
    sys.path.insert(1, str(REPO))
    return f"{shim}:{REPO}"


IMPORT_PATH = _import_path()


def _time_cuda(fn, warmup=3, iters=20) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e-3  # seconds


TEST_FILES = ("tests/kernels/test_grouped_mm.py", "tests/kernels/test_kernels_triton.py",
              "tests/kernels/test_packed_kv_attention.py", "tests/kernels/test_sparse_triton.py")


def run_tests(log_path: str | None = None, timeout: float = 300) -> dict:
    """Step 1. No -x: a one-off run on a lent GPU should show every failing case, not the first. A run past
    `timeout` is reported (and the later steps still run), not raised."""
    env = dict(os.environ, PYTHONPATH=f"{IMPORT_PATH}:{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-k", "cuda", "-p", "no:cacheprovider", *TEST_FILES]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        text, returncode = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        text, returncode = out + f"\nTIMEOUT: the CUDA tests ran past {timeout} s", "timeout"
    if log_path:
        Path(log_path).write_text(text)
    tail = text.strip().splitlines()[-15:]
    print("\n".join(tail))
    return {"returncode": returncode, "seconds": round(time.time() - t0, 1), "summary": tail[-1] if tail else ""}


def quantize_bandwidth(hbm_peak: float) -> dict:
    import torch

    import trace_kernels as tk

    x = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16)
    amax = tk.row_amax(x)
    t = _time_cuda(lambda: tk.quantize(x, amax, backend="triton"))
    moved = x.numel() * 2 + x.numel() // 2 + x.numel() // 16 + amax.numel() * 4  # read bf16, write codes + scales
    gbs = moved / t / 1e9
    out = {"shape": list(x.shape), "seconds": t, "GB_s": gbs, "fraction_of_hbm_peak": gbs * 1e9 / hbm_peak}
    print(f"quantize+capture bf16 {tuple(x.shape)}: {t * 1e6:.1f} us, {gbs:.0f} GB/s = {out['fraction_of_hbm_peak']:.1%} of HBM peak")
    return out


def _bf16_baseline():
    """vLLM's BF16 fused_experts if importable, else torch._grouped_mm; returns (name, fn)."""
    import torch

    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

        def vllm_bf16(x, w13, w2, topk_weights, topk_ids):
            return fused_experts(x, w13, w2, topk_weights, topk_ids)

        return "vllm fused_experts (BF16 Triton)", vllm_bf16
    except Exception as e:  # noqa: BLE001  (reported, not hidden)
        reason = f"{type(e).__name__}: {e}"

    def grouped_bf16(x, w13, w2, topk_weights, topk_ids):
        T, k = topk_ids.shape
        E, I = w13.shape[0], w2.shape[2]
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        a = x[order // k]
        gu = torch._grouped_mm(a, w13.transpose(1, 2), offs=offs)
        h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
        down = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
        out = torch.empty_like(down).index_copy_(0, order, down).view(T, k, -1)
        return (out * topk_weights[..., None]).sum(1)

    return f"torch._grouped_mm BF16 (vLLM not importable here: {reason})", grouped_bf16


def moe_layer(batches) -> dict:
    import torch

    from trace_kernels.grouped_mm import PackedExperts
    from trace_kernels.routed_experts import routed_experts

    E, H, I, k = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    w13_bf16 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).to(torch.bfloat16)
    w2_bf16 = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).to(torch.bfloat16)
    w13, w2 = PackedExperts.empty(E, 2 * I, H, device="cuda"), PackedExperts.empty(E, H, I, device="cuda")
    for e in range(E):
        w13.quantize_expert_(e, w13_bf16[e])
        w2.quantize_expert_(e, w2_bf16[e])
    name, baseline = _bf16_baseline()
    print(f"MoE layer E={E} H={H} I={I} top-{k}; NVFP4 weights {w13.nbytes() + w2.nbytes()} B vs BF16 "
          f"{2 * (w13_bf16.numel() + w2_bf16.numel())} B; baseline: {name}")
    rows = []
    for T in batches:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        logits = torch.randn(T, E, device="cuda", generator=g)
        topk_weights, topk_ids = torch.softmax(logits, -1).topk(k, -1)
        topk_ids = topk_ids.to(torch.int32)

        def fp4(capture):
            return lambda: routed_experts(x, topk_weights, topk_ids, w13, w2, "silu", capture=capture, backend="triton")

        t_fp4 = _time_cuda(fp4(False))
        t_cap = _time_cuda(fp4(True))
        t_bf16 = _time_cuda(lambda: baseline(x, w13_bf16, w2_bf16, topk_weights, topk_ids))
        graph = "ok"
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                fp4(False)()
            torch.cuda.synchronize()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                fp4(False)()
            t_graph = _time_cuda(cg.replay)
        except Exception as e:  # noqa: BLE001
            graph, t_graph = f"FAILED: {type(e).__name__}: {e}", float("nan")
        r = {"tokens": T, "fp4_s": t_fp4, "fp4_capture_s": t_cap, "fp4_graph_s": t_graph, "bf16_s": t_bf16,
             "fp4_vs_bf16": t_fp4 / t_bf16, "capture_overhead": t_cap / t_fp4 - 1, "cuda_graph": graph}
        rows.append(r)
        print(f"  T={T:5d}: fp4 {t_fp4 * 1e6:9.1f} us (graph {t_graph * 1e6:9.1f}), +capture {r['capture_overhead']:+.1%}, "
              f"bf16 {t_bf16 * 1e6:9.1f} us -> fp4/bf16 time {r['fp4_vs_bf16']:.2f}x; cuda graph {graph}")
    return {"baseline": name, "rows": rows}


def engine_check(args) -> dict:
    """Step 4, where vLLM is importable (a device machine may have only torch and Triton)."""
    print("== end to end: tiny Qwen3-MoE in vLLM, trace_fp4 + capture, CUDA graphs vs none")
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        print(f"  skipped: vLLM is not importable ({e})")
        return {"skipped": f"vLLM is not importable ({e})"}
    from gpu_engine import engine_run

    try:
        return engine_run(args.model_dir, args.engine_requests, args.engine_tokens, repeats=args.engine_repeats)
    except Exception as e:  # noqa: BLE001  (reported, the other figures still count)
        print(f"  FAILED: {type(e).__name__}: {e}")
        return {"failed": f"{type(e).__name__}: {e}"}


def dry_run(args) -> dict:
    """The plan of every step, checked where it can be without a GPU; nothing is timed."""
    from gpu_engine import plan

    out = {"dry_run": True}
    if not (args.skip_tests or args.only_engine):
        missing = [t for t in TEST_FILES if not (REPO / t).is_file()]
        if missing:
            raise FileNotFoundError(f"step 1 test files missing: {missing}")
        out["tests"] = {"files": list(TEST_FILES), "select": "-k cuda"}
    if not args.only_engine:
        out["quantize"] = {"shape": [16384, 2048], "hbm_peak": args.hbm_peak}
        out["moe"] = {"batches": [int(b) for b in args.batches.split(",")]}
    if not args.skip_engine:
        out["engine"] = plan(args.model_dir, args.engine_requests, args.engine_tokens, args.engine_repeats)
    print(json.dumps(out, indent=2))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="check and print the plan; needs no GPU")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--hbm-peak", type=float, default=4.8e12, help="bytes/s (H200: 4.8e12)")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,4096")
    ap.add_argument("--json", default=None)
    ap.add_argument("--test-log", default=None, help="write step 1's whole pytest output here")
    ap.add_argument("--skip-engine", action="store_true", help="skip the end-to-end vLLM run")
    ap.add_argument("--only-engine", action="store_true", help="run only the end-to-end vLLM run (step 4)")
    ap.add_argument("--engine-requests", type=int, default=16)
    ap.add_argument("--engine-tokens", type=int, default=64)
    ap.add_argument("--engine-repeats", type=int, default=2)
    ap.add_argument("--model-dir", default="/tmp/trace_fp4_gpu_check_model")
    args = ap.parse_args(argv)
    if args.skip_engine and args.only_engine:
        ap.error("--skip-engine and --only-engine exclude each other")
    if args.dry_run:
        report = dry_run(args)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return 0
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not importable", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); this script measures the compiled "
              "Triton kernels and needs a CUDA GPU. On a CPU run the tests instead (interpreter).", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    import triton

    print(f"triton {triton.__version__}")
    report = {"device": torch.cuda.get_device_name()}
    t0 = time.time()
    if not (args.skip_tests or args.only_engine):
        report["tests"] = run_tests(args.test_log)
    if not args.only_engine:
        # Each step reported on its own: a failure in one (printed with its traceback, marked in the JSON)
        # must not cost the figures of the others on a lent machine.
        for key, step in (("quantize", lambda: quantize_bandwidth(args.hbm_peak)),
                          ("moe", lambda: moe_layer([int(b) for b in args.batches.split(",")]))):
            try:
                report[key] = step()
            except Exception as e:  # noqa: BLE001  (printed and marked failed, exit status 1)
                import traceback

                traceback.print_exc()
                report[key] = {"failed": f"{type(e).__name__}: {e}"}
    if not args.skip_engine:
        report["engine"] = engine_check(args)
    report["seconds"] = round(time.time() - t0, 1)
    print(f"total {report['seconds']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    engine_ok = report.get("engine", {}).get("records_identical", True) is not False
    steps_ok = not any("failed" in report.get(key, {}) for key in ("quantize", "moe"))
    return 0 if report.get("tests", {}).get("returncode", 0) == 0 and engine_ok and steps_ok else 1


if __name__ == "__main__":
    sys.exit(main())
