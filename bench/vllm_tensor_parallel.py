"""Tensor-parallel rollouts on the tiny Qwen3-MoE: TP=2 against TP=1, with and without capture.

Each configuration runs in its own process (vLLM's TP workers are spawned; one engine per process
keeps the measurements apart), one after another, on the same prompts (greedy, ignore_eos). Prints
side by side: generated tokens/s, the routed-expert bytes each rank holds, and with capture the time
the driver spends assembling a record from the ranks' parts, then the ratios TP=2 / TP=1. Not a test.

    python bench/vllm_tensor_parallel.py [--requests 8 --tokens 32]
"""

import argparse
import json
import os
import subprocess
import sys
import time

CAPTURE = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}
NO_CAPTURE = {"quant_method": "trace_fp4", "capture": False}


def one(tp: int, capture: bool, requests: int, tokens: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    import torch

    torch.cpu._init_amx()
    from vllm import LLM, SamplingParams

    import trace_vllm_plugin as tvp
    from trace_fp4.tiny_model import build_tiny_qwen3_moe

    if tp > 1:
        tvp.bind_cpu_threads(tp)
    model = build_tiny_qwen3_moe("/tmp/trace_fp4_test_models/moe")
    llm = LLM(model=str(model), dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              max_model_len=512, max_num_seqs=requests, seed=0, tensor_parallel_size=tp,
              hf_overrides={"quantization_config": CAPTURE if capture else NO_CAPTURE})
    prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog" for i in range(requests)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    if capture:
        tvp.get_records(llm, llm.generate(prompts[:1], SamplingParams(max_tokens=2)))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    out = {"tp": tp, "capture": capture, "tok_s": requests * tokens / gen_s}
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
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "tp,capture": run one configuration
    args = ap.parse_args()
    if args.one:
        tp, cap = (int(x) for x in args.one.split(","))
        print("RESULT " + json.dumps(one(tp, bool(cap), args.requests, args.tokens)), flush=True)
        return
    results = {}
    for tp in (1, 2):
        for cap in (0, 1):
            proc = subprocess.run([sys.executable, __file__, "--one", f"{tp},{cap}", "--requests", str(args.requests),
                                   "--tokens", str(args.tokens)], capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.exit(f"tp={tp} capture={cap} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            results[(tp, cap)] = json.loads(line[0][7:])
    print(f"{'tp':>3} {'capture':>8} {'tok/s':>8} {'expert bytes/rank':>18} {'assembly ms/record':>19}")
    for (tp, cap), r in results.items():
        asm = f"{r['assembly_ms_per_record']:.2f}" if cap and tp > 1 else "-"
        print(f"{tp:>3} {cap:>8} {r['tok_s']:>8.1f} {r['expert_bytes_per_rank'][0]:>18} {asm:>19}")
    for cap in (0, 1):
        print(f"TP=2 / TP=1 tok/s, capture={cap}: {results[(2, cap)]['tok_s'] / results[(1, cap)]['tok_s']:.2f}")
    print(f"capture / no capture tok/s: TP=1 {results[(1, 1)]['tok_s'] / results[(1, 0)]['tok_s']:.2f}, "
          f"TP=2 {results[(2, 1)]['tok_s'] / results[(2, 0)]['tok_s']:.2f}")
    print(f"expert bytes per rank, TP=2 / TP=1: {results[(2, 1)]['expert_bytes_per_rank'][0] / results[(1, 1)]['expert_bytes_per_rank'][0]:.3f}")


if __name__ == "__main__":
    main()
