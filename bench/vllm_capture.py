"""Generation throughput on the tiny Qwen3-MoE: BF16 vs trace_fp4 without capture vs with capture.

Runs the three engines one after another in this process (same prompts, greedy, ignore_eos) and
prints tokens/s side by side plus the ratios; with capture it also takes every record (the cost a
rollout pays) and reports the record size per token. Not a test.

    python bench/vllm_capture.py [--requests 16 --tokens 64] [--compile] [--cpu-compiled] [--cpu-native]
        [--native-scratch-read] [--rounds N] [--paired N] [--json FILE]

The JSON's `data.tok_s` holds tokens/s (wall, best of --repeats) of bf16, fp4 (trace_fp4 without
capture) and fp4_capture (the default: sparse records at every layer, every record taken); with
--cpu-compiled / --cpu-native also fp4_<backend> and fp4_capture_<backend>; `--capture-native-records`
adds fp4_capture_native_records (the sparse capture with TRACE_FP4_RECORD_BACKEND=native: the numba
record encoder, layers eager); `--native-scratch-read` adds fp4_native_scratch (the native engine with the
scratch KV read instead of attention from the packed pages). `data.cpu_s` holds every row's process CPU seconds by the same keys.
`--paired N` adds `data.paired`: BF16, native FP4 and native FP4 with capture alive at once, N interleaved
passes, `native_vs_bf16_tok_s` and `capture_overhead_wall` / `_cpu` as the median of the ratios within each
pass (bench/vllm_paired.py says why).
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# One OpenMP thread by default: the fake-quant path is many small ops, and on a small shared machine
# a preempted second thread makes every parallel region spin (10x swings between runs).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _resident(model):
    """(bytes held by the routed-expert layers, bytes of the same expert weights in BF16), summed."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from trace_kernels.grouped_mm import resident_bytes

    pairs = [resident_bytes(m) for m in model.modules() if isinstance(m, RoutedExperts)]
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def _threads() -> str:
    """The threads the engine's kernels ran on: torch's, numba's (the native kernels) and the CPU affinity."""
    import sys

    import torch

    out = f"torch {torch.get_num_threads()}"
    numba = sys.modules.get("numba")
    if numba is not None:
        try:
            layer = numba.threading_layer()
        except ValueError:  # no parallel kernel launched yet
            layer = None
        # numba.get_num_threads() launches numba's pool when none is, and that launch sets this thread's
        # OpenMP count, torch's included (1 -> 2): asking would change the threads the next engine runs on.
        out += f", numba {numba.get_num_threads()} ({layer})" if layer else ", numba not launched"
    return out + f", cores {sorted(os.sched_getaffinity(0))}"


def _engine_kwargs(model, args) -> dict:
    return dict(
        model=str(model), dtype="bfloat16", enforce_eager=not args.compile, kv_cache_memory_bytes=256 << 20,
        max_model_len=1024, max_num_seqs=args.requests, seed=0,
        # Capture turns prefix caching off; turn it off everywhere so repeats do the same work.
        enable_prefix_caching=False,
    )


def _workload(args):
    """The prompts and sampling every engine of this bench runs: greedy, ignore_eos, fixed lengths."""
    from vllm import SamplingParams

    prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog " * (1 + i % 3) for i in range(args.requests)]
    return prompts, SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)


def run(model, label, quant_config, args, take_records):
    import gc

    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    import trace_vllm_plugin as tvp

    kwargs = _engine_kwargs(model, args)
    if quant_config is not None:
        kwargs["hf_overrides"] = {"quantization_config": quant_config}
    llm = LLM(**kwargs)
    prompts, params = _workload(args)
    warm = llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    held, bf16 = llm.apply_model(_resident)[0]
    if take_records:
        tvp.get_records(llm, warm)  # the record path warmed too (the native encoder loads its kernel once)
        tvp.discard_records(llm)
    best, best_cpu, best_take, record_bytes, record_tokens = None, None, None, 0, 0
    all_s, all_cpu = [], []  # every repeat, for the run's noise (the table takes the best)
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if take_records:
            c1 = time.process_time()
            records = tvp.get_records(llm, outs)
            take = time.process_time() - c1  # the records' part of the capture cost, alone
            best_take = take if best_take is None else min(best_take, take)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        all_s.append(dt)
        all_cpu.append(dc)
        best = dt if best is None else min(best, dt)
        best_cpu = dc if best_cpu is None else min(best_cpu, dc)
        if take_records:
            record_bytes = sum(r.nbytes for r in records)
            record_tokens = sum(r.num_tokens for r in records)
    if args.profile and quant_config is not None and args.profile_label in label:
        from torch.profiler import profile

        with profile() as prof:
            outs = llm.generate(prompts, params, use_tqdm=False)
            if take_records:
                tvp.get_records(llm, outs)
        print(f"\n== torch.profiler, {label}: top ops by self CPU time (one generate call)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=int(os.environ.get("PROFILE_ROWS", 15))))
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    threads = _threads()
    engine = llm.llm_engine
    engine.engine_core.shutdown()
    del llm, engine
    gc.collect()
    cleanup_dist_env_and_memory()
    return {
        "label": label, "seconds": best, "tok_s": generated / best, "cpu_s": best_cpu,
        "threads": threads, "take_cpu_s": best_take, "repeat_s": all_s, "repeat_cpu_s": all_cpu, "record_bytes": record_bytes,
        "record_tokens": record_tokens, "expert_bytes": held, "expert_bf16_bytes": bf16,
    }


def _merge(row, again) -> None:
    """Fold another round of the same engine into `row`: the best over both, every repeat kept."""
    generated = row["tok_s"] * row["seconds"]
    for key in ("seconds", "cpu_s", "take_cpu_s"):
        if row[key] is not None:
            row[key] = min(row[key], again[key])
    row["tok_s"] = generated / row["seconds"]
    row["repeat_s"] += again["repeat_s"]
    row["repeat_cpu_s"] += again["repeat_cpu_s"]
    row["rounds"] = row.get("rounds", 1) + 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile instead of eager")
    p.add_argument("--model-dir", default="/tmp/trace_fp4_bench_model")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of the trace_fp4 (no capture) run")
    p.add_argument("--profile-label", default="", help="with --profile: only the engines whose label holds this")
    p.add_argument("--cpu-compiled", action="store_true",
                   help="also run trace_fp4 without and with capture on the compiled CPU path "
                   "(TRACE_FP4_CPU_BACKEND=compiled), after the others, in the same run")
    p.add_argument("--cpu-native", action="store_true",
                   help="also run trace_fp4 without and with capture on the native CPU path (numba kernels, "
                   "TRACE_FP4_CPU_BACKEND=native), after the others, in the same run")
    p.add_argument("--native-scratch-read", action="store_true",
                   help="with --cpu-native: also run trace_fp4 native with the scratch KV read "
                   "(TRACE_FP4_KV_DECODE_ATTENTION=scratch), beside the default native attention from the packed pages")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --cpu-native: run BF16, native FP4 and native FP4 with capture this many times in turn "
                   "(fresh engines), each row the best over its rounds: ratios that a drifting host moves less")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="with --cpu-native: also start BF16, native FP4 and native FP4 with capture at once and run N "
                   "passes of one generate each, interleaved; the ratios within each pass, their median (vllm_paired.py)")
    p.add_argument("--capture-native-records", action="store_true",
                   help="also run the sparse capture with the records encoded by the native (numba) encoder "
                   "(TRACE_FP4_RECORD_BACKEND=native), layers eager, in the same run")
    from results_io import add_json_arg, write_results

    add_json_arg(p, "vllm_capture")
    args = p.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from trace_fp4.tiny_model import build_tiny_qwen3_moe

    model = build_tiny_qwen3_moe(args.model_dir)
    base = {"quant_method": "trace_fp4"}
    paper = {**base, "guidance": "compact", "guided_layers": "deeper_half"}  # the paper's default, beside the sparse one
    rows = [
        run(model, "bf16", None, args, False),
        run(model, "trace_fp4 (no capture)", {**base, "capture": False}, args, False),
        run(model, "+ capture, compact half", paper, args, True),
        run(model, "+ capture, sparse (default)", base, args, True),  # sparse encode in the engine
    ]
    extra = {}  # CPU backend -> (row without capture, row with sparse capture)
    scratch_read = None
    for flag, backend in ((args.cpu_compiled, "compiled"), (args.cpu_native, "native")):
        if not flag:
            continue
        # Read by the in-process engine at every call: these two engines run that backend's pieces.
        os.environ["TRACE_FP4_CPU_BACKEND"] = backend
        extra[backend] = (run(model, f"trace_fp4 {backend}", {**base, "capture": False}, args, False),
                          run(model, f"+ capture, sparse, {backend}", base, args, True))
        rows += list(extra[backend])
        if backend == "native" and args.native_scratch_read:
            # The read before cpu_native.attention: used blocks dequantized into a scratch, vLLM's kernel.
            os.environ["TRACE_FP4_KV_DECODE_ATTENTION"] = "scratch"
            scratch_read = run(model, "trace_fp4 native, scratch", {**base, "capture": False}, args, False)
            os.environ.pop("TRACE_FP4_KV_DECODE_ATTENTION")
            rows.append(scratch_read)
        os.environ.pop("TRACE_FP4_CPU_BACKEND")
    if args.rounds > 1:
        # The host's speed drifts by tens of percent over a minute, more than the ratios the goals need, and
        # the engines run one after another: run BF16, native FP4 and native FP4 with capture again, round by
        # round in turn (a fresh engine each), and keep each row's best, so each had the same quiet windows.
        if not args.cpu_native:
            raise SystemExit("--rounds repeats the native rows: pass --cpu-native with it")
        native, captured = extra["native"]
        os.environ["TRACE_FP4_CPU_BACKEND"] = "native"
        for _ in range(args.rounds - 1):
            _merge(rows[0], run(model, "bf16", None, args, False))
            _merge(native, run(model, "trace_fp4 native", {**base, "capture": False}, args, False))
            _merge(captured, run(model, "+ capture, sparse, native", base, args, True))
        os.environ.pop("TRACE_FP4_CPU_BACKEND")
    paired = None
    if args.paired:
        if not args.cpu_native:
            raise SystemExit("--paired runs the native rows' engines: pass --cpu-native with it")
        from vllm_paired import paired as run_paired, report

        os.environ["TRACE_FP4_CPU_BACKEND"] = "native"
        prompts, params = _workload(args)
        paired = run_paired(model, args, _engine_kwargs(model, args), prompts, params, base)
        os.environ.pop("TRACE_FP4_CPU_BACKEND")
    if args.cpu_native:
        from trace_kernels import cpu_native

        # Pieces that ran torch on the native path (per call), with why: the native rows' uncovered work.
        print(f"\nnative path, torch fallbacks: {cpu_native.fallbacks() or 'none'}; reasons: {cpu_native.NOT_NATIVE or '-'}")
    records_native = None
    if args.capture_native_records:
        # The records' encoder alone on the native path (numba); the layers stay eager.
        os.environ["TRACE_FP4_RECORD_BACKEND"] = "native"
        records_native = run(model, "+ capture, sparse, native records", base, args, True)
        rows.append(records_native)
        os.environ.pop("TRACE_FP4_RECORD_BACKEND")
    print(f"\n{args.requests} requests x {args.tokens} tokens, best of {args.repeats}" + (f" x {args.rounds} rounds (bf16 and native rows)" if args.rounds > 1 else "") + ", "
          f"{'compiled' if args.compile else 'eager'}, torch threads={os.environ.get('OMP_NUM_THREADS', 'default')}")
    # Process CPU time too: the in-process engine runs in this process, and CPU time is not inflated
    # by other jobs sharing the machine (wall time is).
    print(f"{'engine':<26}{'wall s':>8}{'tok/s':>10}{'vs bf16':>9}{'cpu s':>8}{'cpu vs bf16':>12}{'expert bytes':>14}{'vs bf16':>9}")
    for r in rows:
        print(
            f"{r['label']:<26}{r['seconds']:>8.3f}{r['tok_s']:>10.1f}{r['tok_s'] / rows[0]['tok_s']:>9.3f}"
            f"{r['cpu_s']:>8.3f}{r['cpu_s'] / rows[0]['cpu_s']:>12.3f}"
            f"{r['expert_bytes']:>14d}{r['expert_bytes'] / r['expert_bf16_bytes']:>9.3f}"
        )
    # Noise: how far each row's repeats spread (worst over best); a capture overhead smaller than the
    # spread of its two rows is not resolved by this run.
    print("repeats' spread (max / min - 1), wall and CPU: " + "; ".join(
        f"{r['label']} {max(r['repeat_s']) / min(r['repeat_s']) - 1:.1%}, {max(r['repeat_cpu_s']) / min(r['repeat_cpu_s']) - 1:.1%}"
        for r in rows))
    print("threads after each engine: " + "; ".join(f"{r['label']}: {r['threads']}" for r in rows))
    for r in rows[2:]:
        ref = rows[1]
        for without, with_capture in extra.values():
            if r is with_capture:
                ref = without
        if r is scratch_read:
            native = extra["native"][0]
            print(f"trace_fp4 native (attention from the packed pages) vs its scratch read: tok/s "
                  f"{native['tok_s'] / r['tok_s']:.2f}x, cpu {native['cpu_s'] / r['cpu_s'] - 1:+.1%}")
            continue
        if any(r is without for without, _ in extra.values()):
            print(f"{r['label']}: vs trace_fp4 eager: wall {r['seconds'] / rows[1]['seconds'] - 1:+.1%}, "
                  f"cpu {r['cpu_s'] / rows[1]['cpu_s'] - 1:+.1%}")
            continue
        print(f"{r['label']}: capture overhead vs {ref['label']}: wall {r['seconds'] / ref['seconds'] - 1:+.1%}, "
              f"cpu {r['cpu_s'] / ref['cpu_s'] - 1:+.1%}"
              + (f"; record size {r['record_bytes'] / r['record_tokens']:.0f} bytes/token" if r["record_tokens"] else "")
              + (f"; taking the records: {r['take_cpu_s'] * 1e3:.0f} ms CPU ({r['take_cpu_s'] / ref['cpu_s']:.1%})"
                 if r.get("take_cpu_s") is not None else ""))
    if paired is not None:
        print(report(paired))
    write_results(args.json, "vllm_capture", {
        "requests": args.requests, "tokens": args.tokens, "repeats": args.repeats, "rounds": args.rounds, "compiled": args.compile,
        "threads": os.environ.get("OMP_NUM_THREADS"), "rows": rows, **({"paired": paired} if paired else {}),
        "tok_s": {"bf16": rows[0]["tok_s"], "fp4": rows[1]["tok_s"], "fp4_capture": rows[3]["tok_s"],
                  **{f"fp4_{b}": r[0]["tok_s"] for b, r in extra.items()},
                  **{f"fp4_capture_{b}": r[1]["tok_s"] for b, r in extra.items()},
                  **({"fp4_capture_native_records": records_native["tok_s"]} if records_native else {}),
                  **({"fp4_native_scratch": scratch_read["tok_s"]} if scratch_read else {})},
        "cpu_s": {"bf16": rows[0]["cpu_s"], "fp4": rows[1]["cpu_s"], "fp4_capture": rows[3]["cpu_s"],
                  **{f"fp4_{b}": r[0]["cpu_s"] for b, r in extra.items()},
                  **{f"fp4_capture_{b}": r[1]["cpu_s"] for b, r in extra.items()},
                  **({"fp4_capture_native_records": records_native["cpu_s"]} if records_native else {}),
                  **({"fp4_native_scratch": scratch_read["cpu_s"]} if scratch_read else {})},
    })


if __name__ == "__main__":
    main()
