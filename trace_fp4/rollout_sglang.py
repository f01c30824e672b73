"""The align job's rollout stage in SGLang, run as its own process (`python -m trace_fp4.rollout_sglang`).

Same output as `rollout_vllm`: rollout.json (+ records/<i>.safetensors and stats.json for fp4).
SGLang takes the TRACE config from the checkpoint's `quantization_config`, so the FP4 run uses a
view of the model directory (links to every file, config.json rewritten) and never edits the user's.
On a machine without CUDA SGLang runs its CPU engine, which still needs the `sgl_kernel` package:
PyPI has no CPU build of it, so there this stage stops with a message saying so.
"""

import argparse
import json
import os
from pathlib import Path

from .rollout_vllm import capture_config


def _fp4_view(model_dir: Path, out: Path, block_scale: str = "6") -> Path:
    view = out / "model_trace_fp4"
    view.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        target = view / f.name
        if f.name == "config.json" or target.exists():
            continue
        target.symlink_to(f.resolve())
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"] = capture_config(block_scale)
    (view / "config.json").write_text(json.dumps(cfg, indent=2))
    return view


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="trace-fp4 align: rollout stage (SGLang)")
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--precision", choices=["bf16", "fp4"], required=True)
    ap.add_argument("--prompts", required=True, help="JSON file: a list of prompt strings")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-scale", choices=["6", "4over6"], default="6", help="TraceConfig.block_scale")
    args = ap.parse_args(argv)

    import torch

    cpu = not torch.cuda.is_available()
    if cpu:
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        try:
            import sgl_kernel  # noqa: F401
        except ImportError:
            raise SystemExit(
                "SGLang needs the sgl_kernel package, which has no CPU build on PyPI; on a machine without "
                "CUDA use --engine vllm"
            ) from None
    import sglang

    import trace_sglang_plugin

    args.out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(Path(args.prompts).read_text())
    model = _fp4_view(args.model, args.out, args.block_scale) if args.precision == "fp4" else args.model
    engine_args = dict(model_path=str(model), dtype="bfloat16", random_seed=args.seed, log_level="warning",
                       max_running_requests=len(prompts), disable_radix_cache=True)
    if cpu:
        engine_args.update(device="cpu", mem_fraction_static=0.05, max_total_tokens=4096, disable_cuda_graph=True)
    if args.precision == "fp4":
        engine_args["quantization"] = "trace_fp4"
    engine = sglang.Engine(**engine_args)
    try:
        params = {"temperature": 1.0, "max_new_tokens": args.max_tokens, "sampling_seed": args.seed}
        outputs = engine.generate(prompt=prompts, sampling_params=params, return_logprob=True)
        tokenizer = engine.tokenizer_manager.tokenizer
        samples, records = [], []
        for prompt, o in zip(prompts, outputs):
            meta = o["meta_info"]
            steps = meta["output_token_logprobs"]  # [(logprob, token id, text)] per generated token
            samples.append({
                "prompt": prompt,
                "prompt_token_ids": tokenizer.encode(prompt),
                "output_token_ids": [int(t) for _, t, _ in steps],
                "logprobs": [float(lp) for lp, _, _ in steps],
            })
            if args.precision == "fp4":
                records.append(trace_sglang_plugin.record_from_meta_info(meta))
    finally:
        engine.shutdown()
    if args.precision == "fp4":
        (args.out / "records").mkdir(exist_ok=True)
        for i, (record, s) in enumerate(zip(records, samples)):
            expected = len(s["prompt_token_ids"]) + len(s["output_token_ids"]) - 1
            if record.num_tokens != expected:
                raise SystemExit(f"sample {i}: record has {record.num_tokens} rows, prompt + generated - 1 = {expected}")
            record.save(args.out / "records" / f"{i}.safetensors")
        # The plugin's counters (fallbacks, saturated values) travel with each record's meta_info.
        # Each is a snapshot taken when its request finished; counters only grow, so take the largest.
        from trace_sglang_plugin.transport import payload_from_meta_info

        counters = {}
        for o in outputs:
            for k, v in (payload_from_meta_info(o["meta_info"]).get("counters") or {}).items():
                counters[k] = max(counters.get(k, 0), v)
        (args.out / "stats.json").write_text(json.dumps({"counters": counters}, indent=2, default=str))
    (args.out / "rollout.json").write_text(json.dumps({"engine": "sglang", "precision": args.precision, "samples": samples}))


if __name__ == "__main__":
    main()
