"""End-to-end engine run for bench/gpu_check.py: the tiny Qwen3-MoE in vLLM with trace_fp4 and capture,
CUDA graphs on (vLLM's default cudagraph_mode) against the same compiled model without graphs, plus graphs without capture for the
capture overhead. Reports tok/s per arm, the capture overhead (graphs + capture against graphs without
capture, same prompts, best of `repeats`), and whether every record of the graph-replay run equals the
run without graphs, tensor for tensor. Goal (docs/engines.md): records identical, capture within 3% of decode.

Needs CUDA and vLLM; the parts that need neither (`compare_records`, `summarize`, the arms) are
tested on a CPU (tests/vllm/test_vllm_graph_capture_bench.py).
"""

import gc
import os
import time

CAPTURE = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}
NO_CAPTURE = {"quant_method": "trace_fp4", "capture": False}

# (label, quant config, compilation_config, take records). All three run vLLM's compiled model, so
# the arm without CUDA graphs computes the same numbers as the replay (enforce_eager=True would
# skip torch.compile, whose fusions round the BF16 ops around the experts differently).
ARMS = (
    ("no graphs + capture", CAPTURE, {"cudagraph_mode": "NONE"}, True),
    ("graphs + capture", CAPTURE, {}, True),
    ("graphs, no capture", NO_CAPTURE, {}, False),
)


def compare_records(a: list, b: list) -> dict:
    """Records of the same requests from two runs: how many are identical (every tensor equal, same
    tensor names), and the first difference found."""
    import torch

    if len(a) != len(b):
        return {"records": max(len(a), len(b)), "identical": 0, "first_difference": f"{len(a)} vs {len(b)} records"}
    same, first = 0, None
    for i, (ra, rb) in enumerate(zip(a, b)):
        if set(ra.tensors) != set(rb.tensors):
            first = first or f"record {i}: tensor names differ ({sorted(set(ra.tensors) ^ set(rb.tensors))[:3]})"
            continue
        diff = next((n for n, t in ra.tensors.items() if not torch.equal(t, rb.tensors[n])), None)
        if diff is None:
            same += 1
        else:
            first = first or f"record {i}: {diff} differs"
    return {"records": len(a), "identical": same, "first_difference": first}


def summarize(rows: dict, records: dict) -> dict:
    """rows: label -> {"tok_s", "seconds"}; the figures gpu_check reports."""
    out = {"arms": rows}
    g, n = rows.get("graphs + capture"), rows.get("graphs, no capture")
    e = rows.get("no graphs + capture")
    if g and n:
        out["capture_overhead"] = g["seconds"] / n["seconds"] - 1
    if g and e:
        out["graphs_vs_no_graphs_tok_s"] = g["tok_s"] / e["tok_s"]
    out["records"] = records
    out["records_identical"] = records.get("records", 0) > 0 and records.get("identical") == records.get("records")
    return out


def _run_arm(model, quant_config, compilation_config, take, prompts, tokens, repeats):
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    import trace_vllm_plugin as tvp

    llm = LLM(model=str(model), dtype="bfloat16", compilation_config=compilation_config, gpu_memory_utilization=0.25,
              max_model_len=1024, max_num_seqs=len(prompts), seed=0, enable_prefix_caching=False,
              hf_overrides={"quantization_config": quant_config})
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        if take:
            tvp.discard_records(llm)
        best, records, counters = None, [], {}
        for _ in range(repeats):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            if take:
                records = tvp.get_records(llm, outs)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        if take:
            counters = tvp.stats(llm)["counters"]
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    keep = ("cuda_graphs_kept_for_capture", "cuda_graphs_disabled_for_capture", "steps_missing_capture",
            "capture_buffer_overflow_steps", "kv_cache_dequantized_fallback")
    return {"tok_s": generated / best, "seconds": best,
            "counters": {k: counters[k] for k in keep if k in counters}}, records


def engine_run(model_dir: str, requests: int = 16, tokens: int = 64, repeats: int = 3) -> dict:
    """The three arms one after another in this process (one engine at a time)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from trace_fp4.tiny_model import build_tiny_qwen3_moe

    model = build_tiny_qwen3_moe(model_dir)
    prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog " * (1 + i % 3) for i in range(requests)]
    rows, recs = {}, {}
    for label, qc, comp, take in ARMS:
        rows[label], recs[label] = _run_arm(model, qc, comp, take, prompts, tokens, repeats)
        print(f"  {label:20s}: {rows[label]['tok_s']:9.1f} tok/s  {rows[label]['counters']}")
    out = summarize(rows, compare_records(recs["no graphs + capture"], recs["graphs + capture"]))
    print(f"  capture overhead (graphs): {out.get('capture_overhead', float('nan')):+.1%}; records identical "
          f"graphs vs no graphs: {out['records_identical']} ({out['records']})")
    return out
