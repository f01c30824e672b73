"""BF16, native FP4 and native FP4 with capture as three engines alive in one process, their generates
interleaved: the ratios of `bench/vllm_capture.py --paired N`.

Why: on a shared 2-core host the speed drifts by tens of percent within a minute. Rows measured one
engine after another (even in rounds, each row its best) compare different windows: two runs of the
same code a minute apart read +0.4% and +64.5% capture overhead. Here the three engines are started
once and stay up; each of N passes runs one generate on each, back to back (forward order on even passes,
reversed on odd ones, so no engine always follows the same one), and every ratio is taken within a pass
(~1 s), then the median over passes. A drift slower than a pass cancels in each ratio.

Same prompts, sampling and engine settings as `vllm_capture.run`; the capture engine's generate is timed
with its take (`get_records`), as in the capture rows there. The in-process engines share torch's one
OpenMP thread and the process; only the capture engine records.
"""

import statistics
import time


def _ratios(num, den):
    """Per-pass num/den, the median and the spread over passes."""
    r = [a / b for a, b in zip(num, den)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r), "per_pass": r}


def paired(model, args, engine_kwargs, prompts, params, base_config) -> dict:
    """Start the three engines, warm each, run `args.paired` interleaved passes; return the figures."""
    import os

    from vllm import LLM

    import trace_vllm_plugin as tvp

    if os.environ.get("TRACE_FP4_CPU_BACKEND") != "native":
        raise RuntimeError("paired engines run the native CPU path: set TRACE_FP4_CPU_BACKEND=native first")
    configs = {"bf16": None, "fp4_native": {**base_config, "capture": False}, "fp4_capture_native": base_config}
    engines = {}
    for name, qc in configs.items():
        kw = dict(engine_kwargs)
        if qc is not None:
            kw["hf_overrides"] = {"quantization_config": qc}
        engines[name] = LLM(**kw)

    def generate(name):
        llm = engines[name]
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if name == "fp4_capture_native":
            tvp.get_records(llm, outs)  # the take, as the capture rows time it
        return time.perf_counter() - t0, time.process_time() - c0, sum(len(o.outputs[0].token_ids) for o in outs)

    for name in engines:  # warm-up: first calls compile and allocate
        generate(name)
        generate(name)
    wall = {n: [] for n in engines}
    cpu = {n: [] for n in engines}
    tokens = {}
    order = list(engines)
    for i in range(args.paired):
        for name in order if i % 2 == 0 else order[::-1]:
            w, c, tokens[name] = generate(name)
            wall[name].append(w)
            cpu[name].append(c)
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    if len(set(tokens.values())) != 1:
        raise RuntimeError(f"the paired engines generated different token counts: {tokens}")
    return {
        "passes": args.paired,
        "order": order,
        "wall_s": wall,
        "cpu_s": cpu,
        # tok/s ratio = inverse time ratio: same prompts, same tokens per generate (checked above)
        "native_vs_bf16_tok_s": _ratios(wall["bf16"], wall["fp4_native"]),
        "capture_overhead_wall": {k: (v - 1 if k != "per_pass" else [x - 1 for x in v])
                                  for k, v in _ratios(wall["fp4_capture_native"], wall["fp4_native"]).items()},
        "capture_overhead_cpu": {k: (v - 1 if k != "per_pass" else [x - 1 for x in v])
                                 for k, v in _ratios(cpu["fp4_capture_native"], cpu["fp4_native"]).items()},
    }


def report(p: dict) -> str:
    """The lines the bench prints."""
    n, c, cc = p["native_vs_bf16_tok_s"], p["capture_overhead_wall"], p["capture_overhead_cpu"]
    return (f"\npaired engines ({p['passes']} passes, the three engines alive at once, ratios within each pass, "
            f"median [min, max]):\n"
            f"  FP4 native vs BF16 tok/s: {n['median']:.3f}x [{n['min']:.3f}, {n['max']:.3f}]\n"
            f"  capture overhead on native, wall: {c['median']:+.1%} [{c['min']:+.1%}, {c['max']:+.1%}]; "
            f"CPU: {cc['median']:+.1%} [{cc['min']:+.1%}, {cc['max']:+.1%}]")
