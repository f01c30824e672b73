"""The align job's rollout stage in vLLM, run as its own process (`python -m trace_fp4.rollout_vllm`).

An RL system runs the engine and the trainer in separate processes; so does this job, which also keeps
vLLM's and Megatron's torch.distributed set-ups apart. Output directory:
  rollout.json                 per sample: prompt token ids, generated token ids, their log-probabilities
  records/<i>.safetensors      (fp4 only) the guidance record of sample i, full codes at every layer
  stats.json                   (fp4 only) the plugin's counters: MoE / KV calls per layer, fallbacks
"""

import argparse
import json
import os
import time
from pathlib import Path

# Full guidance at every layer: the compact record the trainer would get is derived from it later
# (GuidanceRecord.reencode), so every TRACE mode is measured on the same rollout.
CAPTURE_CONFIG = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}


def capture_config(block_scale: str = "6") -> dict:
    """The rollout's quantization_config: full capture at every layer, with `block_scale` when not the default."""
    return CAPTURE_CONFIG if block_scale == "6" else {**CAPTURE_CONFIG, "block_scale": block_scale}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="trace-fp4 align: rollout stage (vLLM)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--precision", choices=["bf16", "fp4"], required=True)
    ap.add_argument("--prompts", required=True, help="JSON file: a list of prompt strings")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--expert-parallel", action="store_true")
    ap.add_argument("--pipeline-parallel-size", type=int, default=1)
    ap.add_argument("--block-scale", choices=["6", "4over6"], default="6", help="TraceConfig.block_scale")
    ap.add_argument("--turns", type=int, default=1,
                    help="assistant turns per sample, a fixed observation between them (trace_fp4.multi_turn)")
    args = ap.parse_args(argv)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    from vllm import LLM, SamplingParams

    import trace_vllm_plugin

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(Path(args.prompts).read_text())
    engine_args = dict(
        model=args.model, dtype="bfloat16", enforce_eager=True, seed=args.seed,
        kv_cache_memory_bytes=args.kv_cache_bytes, max_model_len=1024, max_num_seqs=len(prompts),
    )
    if args.precision == "fp4":
        engine_args["hf_overrides"] = {"quantization_config": capture_config(args.block_scale)}
    ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    if ranks > 1:
        # Workers are spawned processes; on a CPU each needs its own share of the cores.
        trace_vllm_plugin.bind_cpu_threads(ranks)
        engine_args["tensor_parallel_size"] = args.tensor_parallel_size
        engine_args["pipeline_parallel_size"] = args.pipeline_parallel_size
        engine_args["enable_expert_parallel"] = args.expert_parallel
    llm = LLM(**engine_args)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, logprobs=0, seed=args.seed)
    if args.turns > 1:
        _multi_turn(llm, prompts, params, args, out)
        return
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    samples = []
    for o in outputs:
        gen = o.outputs[0]
        logprobs = [step[token].logprob for step, token in zip(gen.logprobs, gen.token_ids)]
        samples.append(
            {"prompt": o.prompt, "prompt_token_ids": list(o.prompt_token_ids),
             "output_token_ids": list(gen.token_ids), "logprobs": logprobs}
        )
    if args.precision == "fp4":
        (out / "records").mkdir(exist_ok=True)
        for i, record in enumerate(trace_vllm_plugin.get_records(llm, outputs, store=False)):  # inline: saved below
            record.save(out / "records" / f"{i}.safetensors")
        (out / "stats.json").write_text(json.dumps(trace_vllm_plugin.stats(llm), indent=2, default=str))
    generated = sum(len(x["output_token_ids"]) for x in samples)
    (out / "rollout.json").write_text(json.dumps({
        "engine": "vllm", "precision": args.precision, "samples": samples,
        "tensor_parallel_size": args.tensor_parallel_size, "expert_parallel": args.expert_parallel,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "tokens_per_second": generated / seconds,
    }))


def _multi_turn(llm, prompts, params, args, out: Path) -> None:
    """N turns per sample; each trajectory's turn records stitched into one (the verl adapter's code)."""
    import trace_vllm_plugin
    from trace_kernels.records.stitch import stitch_turns, turn_row_spans

    from .multi_turn import OBSERVATION, run_turns

    fp4 = args.precision == "fp4"
    samples, turns, obs_tokens = run_turns(llm, prompts, params, args.turns, capture=fp4)
    info = {"turns": args.turns, "observation": OBSERVATION, "observation_tokens": obs_tokens}
    if fp4:
        (out / "records").mkdir(exist_ok=True)
        for i, sample_turns in enumerate(turns):
            stitch_turns(sample_turns, source=f"sample {i}").save(out / "records" / f"{i}.safetensors")
            samples[i]["turn_row_spans"] = turn_row_spans(sample_turns)
        (out / "stats.json").write_text(json.dumps(trace_vllm_plugin.stats(llm), indent=2, default=str))
    (out / "rollout.json").write_text(json.dumps({"engine": "vllm", "precision": args.precision, "samples": samples,
                                                  "rollout": info}))


if __name__ == "__main__":
    main()
