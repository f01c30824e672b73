"""Parallel rollouts on the tiny Qwen3-MoE: TP=2 and PP=2 against TP=1, with and without capture.

Each configuration runs in its own process (vLLM's workers are spawned; one engine per process keeps
the measurements apart), one after another, on the same prompts (greedy, ignore_eos). Prints side by
side: generated tokens/s, the routed-expert bytes each rank holds, and with capture the time the driver
spends assembling a record from the ranks' parts, then the ratios against TP=1. Writes
bench/results/vllm_tensor_parallel.json. Not a test.

    python bench/vllm_tensor_parallel.py [--requests 8 --tokens 32] [--layouts tp1,tp2,pp2]
"""

import argparse
import json
import os
import subprocess
import sys
import time

from results_io import add_json_arg, write_results

CAPTURE = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}
NO_CAPTURE = {"quant_method": "trace_fp4", "capture": False}


LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}  # (tensor, pipeline) parallel size


def one(tp: int, capture: bool, requests: int, tokens: int, pp: int = 1) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    import torch

    torch.cpu._init_amx()
    from vllm import LLM, SamplingParams

    import trace_vllm_plugin as tvp
    from trace_fp4.tiny_model import build_tiny_qwen3_moe

    if tp * pp > 1:
        tvp.bind_cpu_threads(tp * pp)
    model = build_tiny_qwen3_moe("/tmp/trace_fp4_test_models/moe")
    llm = LLM(model=str(model), dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              max_model_len=512, max_num_seqs=requests, seed=0, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              hf_overrides={"quantization_config": CAPTURE if capture else NO_CAPTURE})
    prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog" for i in range(requests)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    if capture:
        tvp.get_records(llm, llm.generate(prompts[:1], SamplingParams(max_tokens=2)))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    out = {"tp": tp, "pp": pp, "capture": capture, "tok_s": requests * tokens / gen_s}
    if capture:
        tvp.api.ASSEMBLY_SECONDS.clear()
        t0 = time.perf_counter()
        records = tvp.get_records(llm, outs)
        out["take_s_per_record"] = (time.perf_counter() - t0) / len(records)
        asm = tvp.api.ASSEMBLY_SECONDS
        out["assembly_ms_per_record"] = 1000 * sum(asm) / len(asm) if asm else 0.0
    per_rank = tvp.stats_per_rank(llm)
    out["expert_bytes_per_rank"] = [
        sum(v for k, v in s["counters"].items() if k.startswith("expert_resident_bytes.")) for s in per_rank
    ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--layouts", default="tp1,tp2,pp2", help=f"comma-separated, of {sorted(LAYOUTS)}; tp1 first")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "tp,pp,capture": run one configuration
    add_json_arg(ap, "vllm_tensor_parallel")
    args = ap.parse_args()
    if args.one:
        tp, pp, cap = (int(x) for x in args.one.split(","))
        print("RESULT " + json.dumps(one(tp, bool(cap), args.requests, args.tokens, pp)), flush=True)
        return
    layouts = args.layouts.split(",")
    if layouts[0] != "tp1" or any(x not in LAYOUTS for x in layouts):
        sys.exit(f"--layouts: start with tp1, then any of {sorted(LAYOUTS)}; got {args.layouts!r}")
    results = {}
    for name in layouts:
        tp, pp = LAYOUTS[name]
        for cap in (0, 1):
            proc = subprocess.run([sys.executable, __file__, "--one", f"{tp},{pp},{cap}", "--requests", str(args.requests),
                                   "--tokens", str(args.tokens)], capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.exit(f"{name} capture={cap} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            results[(name, cap)] = json.loads(line[0][7:])
    print(f"{'layout':>7} {'capture':>8} {'tok/s':>8} {'expert bytes/rank':>26} {'assembly ms/record':>19}")
    for (name, cap), r in results.items():
        asm = f"{r['assembly_ms_per_record']:.2f}" if cap and name != "tp1" else "-"
        print(f"{name:>7} {cap:>8} {r['tok_s']:>8.1f} {str(r['expert_bytes_per_rank']):>26} {asm:>19}")
    ratios = {}
    base = results[("tp1", 1)]["expert_bytes_per_rank"][0]
    for name in layouts[1:]:
        for cap in (0, 1):
            ratios[f"{name}_vs_tp1_tok_s_capture{cap}"] = results[(name, cap)]["tok_s"] / results[("tp1", cap)]["tok_s"]
            print(f"{name} / tp1 tok/s, capture={cap}: {ratios[f'{name}_vs_tp1_tok_s_capture{cap}']:.2f}")
        ratios[f"{name}_expert_bytes_max_rank_vs_tp1"] = max(results[(name, 1)]["expert_bytes_per_rank"]) / base
        print(f"expert bytes of the fullest rank, {name} / tp1: {ratios[f'{name}_expert_bytes_max_rank_vs_tp1']:.3f}")
    for name in layouts:
        ratios[f"{name}_capture_vs_no_capture_tok_s"] = results[(name, 1)]["tok_s"] / results[(name, 0)]["tok_s"]
    print("capture / no capture tok/s: " + ", ".join(f"{n} {ratios[f'{n}_capture_vs_no_capture_tok_s']:.2f}" for n in layouts))
    write_results(args.json, "vllm_tensor_parallel", {
        "requests": args.requests, "tokens": args.tokens, "layouts": layouts,
        "runs": [{"layout": name, **r} for (name, _), r in results.items()], "ratios": ratios,
    })


if __name__ == "__main__":
    main()
