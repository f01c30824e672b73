"""SGLang throughput: BF16 vs trace_fp4 without capture vs trace_fp4 with capture, in one run.

    .venv/bin/python bench/sglang_capture.py [--prompts 16] [--new-tokens 64]

Three engines on the same tiny Qwen3-MoE (same weights), all started first and warmed up; then the same
batch of greedy requests (ignore_eos, so every engine generates the same number of tokens) is timed on
each in turn, for a few alternating rounds, and the best round of each counts (on a shared 2-core
machine the best round is the least disturbed one). Prints tokens/s and the ratios to BF16. On a CPU the FP4 paths are fake quantization
(dequantized GEMMs), so this measures the overhead of quantization and capture, not FP4 speed-ups.

Uses the test driver tests/helpers/sglang_helpers.py, i.e. the test-only `sgl_kernel` / `torchvision` stand-ins
of tests/helpers/sglang_stubs on a CPU machine. Not a test.
"""

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))

from sglang_helpers import EngineProcess, base_engine_kwargs, write_quantization_config  # noqa: E402
from trace_fp4.tiny_model import build_tiny_qwen3_moe  # noqa: E402

VARIANTS = {
    "bf16": None,
    "trace_fp4 (no capture)": {"quant_method": "trace_fp4", "capture": False},
    "trace_fp4 (capture)": {"quant_method": "trace_fp4", "guidance": "compact", "guided_layers": "deeper_half"},  # the paper's default
    "trace_fp4 (capture, sparse default)": {"quant_method": "trace_fp4"},
}
WORDS = "the engine records which codeword each value became and the trainer follows that choice".split()


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[i % len(WORDS) :] + WORDS[: i % len(WORDS)])[: 40 + 7 * i] for i in range(n)]


def timed_batch(eng, n_prompts: int, new_tokens: int) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    eng.call("flush_cache")
    t0 = time.perf_counter()
    outs = eng.generate(prompts(n_prompts), params)
    dt = time.perf_counter() - t0
    gen = sum(o["meta_info"]["completion_tokens"] for o in outs)
    rec = sum(o["meta_info"]["trace_fp4"][0]["nbytes"] for o in outs if "trace_fp4" in o["meta_info"])
    counters = next((o["meta_info"]["trace_fp4"][0].get("counters", {}) for o in outs if "trace_fp4" in o["meta_info"]), {})
    held = sum(v for k, v in counters.items() if k.startswith("expert_resident_bytes."))
    bf16 = sum(v for k, v in counters.items() if k.startswith("expert_bf16_bytes."))
    return {"seconds": dt, "tokens": gen, "tok_s": gen / dt, "record_bytes": rec, "expert_bytes": held, "expert_bf16_bytes": bf16}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    from results_io import add_json_arg, write_results

    add_json_arg(ap, "sglang_capture")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        engines = {}
        for name, qcfg in VARIANTS.items():
            d = build_tiny_qwen3_moe(
                Path(tmp) / name.replace(" ", "_").replace("(", "").replace(")", ""),
                hidden_size=args.hidden,
                moe_intermediate_size=args.intermediate,
            )
            write_quantization_config(d, qcfg)
            kw = base_engine_kwargs(d, max_running_requests=args.prompts)
            engines[name] = stack.enter_context(EngineProcess(kw, log_path=Path(tmp) / f"{d.name}.log"))
            engines[name].generate("warm up", {"temperature": 0.0, "max_new_tokens": 4})
        for _ in range(args.rounds):
            for name, eng in engines.items():
                r = timed_batch(eng, args.prompts, args.new_tokens)
                if name not in results or r["seconds"] < results[name]["seconds"]:
                    results[name] = r
    for name, r in results.items():
        print(f"{name:24s} {r['tokens']:5d} tokens in {r['seconds']:7.2f} s = {r['tok_s']:8.1f} tok/s"
              + (f", records {r['record_bytes'] / 1024:.0f} KiB" if r["record_bytes"] else ""))
    base = results["bf16"]["tok_s"]
    print("\nthroughput relative to BF16 (higher is better):")
    for name, r in results.items():
        print(f"  {name:24s} {r['tok_s'] / base:6.3f}x")
    nc, c = results["trace_fp4 (no capture)"]["tok_s"], results["trace_fp4 (capture)"]["tok_s"]
    print(f"  capture overhead over trace_fp4 without capture: {(nc / c - 1) * 100:+.1f}% time per token")
    cap = results["trace_fp4 (capture)"]
    if cap["expert_bf16_bytes"]:
        print(f"routed-expert bytes held in the engine: {cap['expert_bytes']} vs {cap['expert_bf16_bytes']} in BF16 = "
              f"{cap['expert_bytes'] / cap['expert_bf16_bytes']:.3f}")
    write_results(args.json, "sglang_capture", {
        "prompts": args.prompts, "new_tokens": args.new_tokens, "hidden": args.hidden,
        "intermediate": args.intermediate, "rounds": args.rounds, "variants": results,
    })


if __name__ == "__main__":
    main()
