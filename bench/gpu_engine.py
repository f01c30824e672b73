"""End-to-end engine run for bench/gpu_check.py: the tiny Qwen3-MoE in vLLM with trace_fp4 and capture,
CUDA graphs on (vLLM's default cudagraph_mode) against the same compiled model without graphs and against
eager (enforce_eager), plus graphs without capture for the capture overhead.

A fifth arm keeps the packed NVFP4 KV cache on TRITON_ATTN with the Triton decode read
(TRACE_FP4_KV_DECODE_ATTENTION=triton: written and tested on a CPU, never yet run on a GPU): that it runs,
its tok/s and counters. Reports tok/s per arm, the capture overhead (graphs + capture against graphs without capture, same
prompts, best of `repeats`), and whether every record of the graph-replay run equals the run without
graphs, tensor for tensor. Goal (docs/engines.md): records identical, capture within 3% of decode.

Why "without graphs" is the compiled model: eager mode runs vLLM's CUDA custom ops where the compiled
model runs inductor's code for the norms, RoPE and residual adds, so their BF16 values differ by
rounding and free-running tokens diverge (measured on vLLM-CPU: tests/vllm/test_vllm_compile.py). The
eager arm is reported for its tok/s and for how many of its records equal graph replay's (only requests
whose tokens agree are compared). Graph arms capture exactly `requests` decode tokens
(`cudagraph_capture_sizes`), and every run decodes all `requests` sequences together (same prompts
lengths do not matter: ignore_eos, one max_tokens), so decode batches are never padded and the graph and
no-graph runs multiply the same matrices; prefill batches (more tokens than any capture size) run
without graphs in both.

Needs CUDA and vLLM for the run; `plan` (what --dry-run of gpu_check prints) and the comparison helpers
need neither and are tested on a CPU (tests/vllm/test_vllm_graph_capture_bench.py).
"""

import gc
import os
import time

CAPTURE = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}
NO_CAPTURE = {"quant_method": "trace_fp4", "capture": False}

EAGER = "eager + capture"
NO_GRAPHS = "no graphs + capture"
GRAPHS = "graphs + capture"
GRAPHS_NO_CAPTURE = "graphs, no capture"
PACKED_KV = "graphs + capture, packed KV"

# (label, quant config, compilation_config (None: enforce_eager), take records). `requests` fills in
# the graph arms' capture size (see the module docstring).
ARMS = (
    (EAGER, CAPTURE, None, True),
    (NO_GRAPHS, CAPTURE, {"cudagraph_mode": "NONE"}, True),
    (GRAPHS, CAPTURE, {"cudagraph_capture_sizes": "requests"}, True),
    (GRAPHS_NO_CAPTURE, NO_CAPTURE, {"cudagraph_capture_sizes": "requests"}, False),
    # The packed NVFP4 cache on TRITON_ATTN, decode read by trace_kernels' Triton kernel inside the decode
    # graphs: that it runs, its tok/s and counters (its attention differs from the other arms' backend,
    # so its records are not compared).
    (PACKED_KV, CAPTURE, {"cudagraph_capture_sizes": "requests"}, True),
)
# Per-arm engine settings beyond the compilation config.
ARM_ENV = {PACKED_KV: {"TRACE_FP4_KV_DECODE_ATTENTION": "triton"}}
ARM_LLM = {PACKED_KV: {"attention_config": {"backend": "TRITON_ATTN"}}}


def arm_kwargs(compilation_config, requests: int, label: str | None = None) -> dict:
    """The LLM(...) keyword arguments of an arm that differ between arms."""
    extra = dict(ARM_LLM.get(label, {}))
    if compilation_config is None:
        return {"enforce_eager": True, **extra}
    comp = {k: ([requests] if v == "requests" else v) for k, v in compilation_config.items()}
    return {"enforce_eager": False, "compilation_config": comp, **extra}


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


def compare_where_tokens_agree(a: list, b: list, tokens_a: list, tokens_b: list) -> dict:
    """compare_records over the requests whose generated tokens agree in both runs."""
    keep = [i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x == y]
    out = compare_records([a[i] for i in keep], [b[i] for i in keep])
    out["tokens_agree"] = len(keep)
    out["requests"] = len(tokens_a)
    return out


def summarize(rows: dict, records: dict, eager_records: dict | None = None) -> dict:
    """rows: label -> {"tok_s", "seconds"}; the figures gpu_check reports."""
    out = {"arms": rows}
    g, n = rows.get(GRAPHS), rows.get(GRAPHS_NO_CAPTURE)
    e = rows.get(NO_GRAPHS)
    if g and n:
        out["capture_overhead"] = g["seconds"] / n["seconds"] - 1
    if g and e:
        out["graphs_vs_no_graphs_tok_s"] = g["tok_s"] / e["tok_s"]
    if g and rows.get(EAGER):
        out["graphs_vs_eager_tok_s"] = g["tok_s"] / rows[EAGER]["tok_s"]
    out["records"] = records
    out["records_identical"] = records.get("records", 0) > 0 and records.get("identical") == records.get("records")
    if eager_records is not None:
        out["eager_records"] = eager_records
    return out


def plan(model_dir: str, requests: int, tokens: int, repeats: int) -> dict:
    """What `engine_run` would do, checked without CUDA: the model builds, every arm's trace_fp4 config
    parses, every compilation config is one vLLM accepts. Raises on anything wrong."""
    from trace_fp4.tiny_model import build_tiny_qwen3_moe
    from trace_kernels import TraceConfig, envs

    model = build_tiny_qwen3_moe(model_dir)
    arms = []
    for label, qc, comp, take in ARMS:
        TraceConfig.from_dict({k: v for k, v in qc.items() if k != "quant_method"})
        kw = arm_kwargs(comp, requests, label)
        try:
            from vllm.config import AttentionConfig, CompilationConfig
        except ImportError:  # a device machine may lack vLLM: then step 4 is skipped, and so is this check
            AttentionConfig = CompilationConfig = None
        if CompilationConfig is not None and "compilation_config" in kw:
            CompilationConfig(**kw["compilation_config"])
        if AttentionConfig is not None and "attention_config" in kw:
            AttentionConfig(**kw["attention_config"])
        env = ARM_ENV.get(label, {})
        for name, value in env.items():
            envs.ENV_VARS[name].parse(value)  # a value trace_fp4 would refuse fails here
        arms.append({"label": label, "quantization_config": qc, "llm_kwargs": kw, "env": env, "records": take})
    return {"model": str(model), "requests": requests, "max_tokens": tokens, "repeats": repeats, "arms": arms,
            "compared": {"records_identical": f"{GRAPHS} vs {NO_GRAPHS}", "reported": f"{EAGER} vs {GRAPHS}"}}


def _run_arm(model, quant_config, llm_kwargs, env, take, prompts, tokens, repeats):
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    import trace_vllm_plugin as tvp

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # read by the worker (in this process) while the model is built
    try:
        llm = LLM(model=str(model), dtype="bfloat16", gpu_memory_utilization=0.25, max_model_len=1024,
                  max_num_seqs=len(prompts), seed=0, enable_prefix_caching=False,
                  hf_overrides={"quantization_config": quant_config}, **llm_kwargs)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
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
        token_ids = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    keep = ("cuda_graphs_kept_for_capture", "cuda_graphs_disabled_for_capture", "steps_missing_capture",
            "capture_buffer_overflow_steps", "kv_cache_dequantized_fallback", "kv_cache_packed_layers",
            "kv_decode_attention_triton_calls")
    return {"tok_s": generated / best, "seconds": best,
            "counters": {k: counters[k] for k in keep if k in counters}}, records, token_ids


def engine_run(model_dir: str, requests: int = 16, tokens: int = 64, repeats: int = 3) -> dict:
    """The arms one after another in this process (one engine at a time)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    p = plan(model_dir, requests, tokens, repeats)
    prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog " * (1 + i % 3) for i in range(requests)]
    rows, recs, toks = {}, {}, {}
    for arm in p["arms"]:
        label = arm["label"]
        rows[label], recs[label], toks[label] = _run_arm(
            p["model"], arm["quantization_config"], arm["llm_kwargs"], arm["env"], arm["records"], prompts, tokens,
            repeats)
        print(f"  {label:20s}: {rows[label]['tok_s']:9.1f} tok/s  {rows[label]['counters']}")
    eager = compare_where_tokens_agree(recs[EAGER], recs[GRAPHS], toks[EAGER], toks[GRAPHS])
    out = summarize(rows, compare_records(recs[NO_GRAPHS], recs[GRAPHS]), eager)
    out["tokens_identical_graphs_vs_no_graphs"] = toks[GRAPHS] == toks[NO_GRAPHS]
    out["packed_kv_records"] = len(recs[PACKED_KV])
    out["packed_kv_tokens_agree_with_graphs"] = sum(a == b for a, b in zip(toks[PACKED_KV], toks[GRAPHS]))
    print(f"  capture overhead (graphs): {out.get('capture_overhead', float('nan')):+.1%}; records identical "
          f"graphs vs no graphs: {out['records_identical']} ({out['records']}); eager vs graphs: tokens agree in "
          f"{eager['tokens_agree']} of {eager['requests']}, records identical {eager['identical']} of those")
    return out
