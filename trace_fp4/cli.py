"""The `trace-fp4` command.

    trace-fp4 align [--model DIR] [--engine vllm|sglang] [--json FILE] [--plot FILE] ...
    trace-fp4 inspect RECORD_OR_HANDLE [--verify] [--json]
    trace-fp4 export --model DIR --out DIR [--format compressed-tensors|modelopt] [--megatron-state FILE]
    trace-fp4 compile-kernels [--only GROUP ...]

Errors a user can fix (a bad --model, a missing engine) print one line naming the problem and exit
with status 2; anything else is a bug and keeps its traceback.
"""

import argparse
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="trace-fp4", description="TRACE: FP4 rollouts without train-rollout drift")
    sub = ap.add_subparsers(dest="command", required=True)
    al = sub.add_parser(
        "align",
        help="rollout in a real engine, recompute in Megatron-Core, measure the train-rollout gap",
        description="Generate rollouts with trace_fp4 capture, recompute their log-probabilities in "
        "Megatron-Core under four modes (bf16, fp4_rtn, trace_full, trace_compact) and report the gap.",
    )
    al.add_argument("--model", type=Path, default=None,
                    help="local Hugging Face Qwen3-MoE / Qwen2-MoE checkpoint (default: the embedded tiny model)")
    al.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    al.add_argument("--num-prompts", type=int, default=8, help="how many of the default prompts to use (max 8)")
    al.add_argument("--max-tokens", type=int, default=24, help="tokens generated per prompt")
    al.add_argument("--seed", type=int, default=0)
    al.add_argument("--turns", type=int, default=1,
                    help="assistant turns per sample (vllm), a fixed observation between them; the turns' records "
                    "are stitched into one per trajectory and the JSON gains rollout.turns and per-mode per_turn")
    al.add_argument("--block-scale", choices=["6", "4over6"], default="6",
                    help="NVFP4 block-scale rule of the FP4 rollout and the trainer (TraceConfig.block_scale): 6, or "
                    "4over6 (Four Over Six); the JSON gains quantization_error_vs_bf16 beside the default rule's")
    al.add_argument("--stale", type=int, default=0,
                    help="also recompute with the trainer's weights 1..K expert updates newer than the rollout's "
                    "(off-policy); the JSON gains stale.per_k with mismatch and |delta logp| per mode")
    al.add_argument("--workdir", type=Path, default=None, help="where rollouts and records go (default: a temp dir)")
    al.add_argument("--json", type=Path, default=None, help="write every figure of the table to this JSON file")
    al.add_argument("--plot", type=Path, default=None, help="write a PNG of per-layer codeword mismatch")
    al.add_argument("--no-calibrate-rates", dest="calibrate_rates", action="store_false",
                    help="skip the rate controller's pass on trace_sparse's audited residuals (default: run it, and "
                         "recompute with the new rates where it moved any)")
    al.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="rollout engine tensor parallelism (vLLM); the records keep the single-rank layout")
    al.add_argument("--expert-parallel", action="store_true",
                    help="FP4 rollout with expert parallelism over the TP ranks (vLLM; the BF16 yardstick stays TP only)")
    al.add_argument("--pipeline-parallel-size", type=int, default=1,
                    help="rollout engine pipeline parallelism (vLLM); each stage captures its layers, the records keep the single-rank layout")
    al.add_argument("--trainer-parallel", default="",
                    help="also recompute bf16 and trace_full with the trainer under this layout, e.g. "
                         "tp=2,ep=2,cp=2,pp=2 (any subset; gloo processes, one per tp x cp x pp rank); the JSON "
                         "gains trainer.layout (per-layer mismatch, |dlogp| vs the single-rank trainer)")
    ins = sub.add_parser(
        "inspect",
        help="what a guidance record holds (shape, config, identity, tokens, bytes per layer and site)",
        description="Print a guidance record's model shape, TRACE config, identity, token rows, layer modes "
        "and payload bytes per site and per layer; --verify re-checks every tensor's checksum.",
    )
    ins.add_argument("record", help="a record file (.safetensors) or a record handle 'trace-fp4:<store>:...'")
    ins.add_argument("--verify", action="store_true", help="re-check every tensor's SHA-256, reporting each one")
    ins.add_argument("--json", action="store_true", help="print the summary as JSON")
    _add_export(sub)
    ck = sub.add_parser(
        "compile-kernels",
        help="compile the CPU native kernels into their disk cache now, not at a worker's first step",
        description="Compile (or load from the disk cache) every numba kernel of the CPU native path by running "
        "each public entry point once on a tiny input with the native backend. Optional: a kernel not compiled "
        "ahead compiles on its first call. Run it where the cache is written once (an image build; "
        "scripts/setup_venv.sh does).",
    )
    ck.add_argument("--only", nargs="+", default=None, metavar="GROUP",
                    help="kernel groups to compile (default: all): quantize guided sparse kv_and_attention experts audit_draw")
    return ap


def _run_compile_kernels(args) -> int:
    from trace_kernels.native_warmup import WARMUPS, compile_all

    unknown = sorted(set(args.only or ()) - set(WARMUPS))
    if unknown:
        print(f"trace-fp4 compile-kernels: error: unknown kernel group(s) {unknown}; known: {sorted(WARMUPS)}",
              file=sys.stderr)
        return 2
    seconds = compile_all(args.only)
    print(f"compiled or loaded {len(seconds)} kernel group(s) in {sum(seconds.values()):.1f} s")
    return 0


def _add_export(sub) -> None:
    ex = sub.add_parser(
        "export",
        help="write the routed experts as an NVFP4 checkpoint stock vLLM / SGLang serve (compressed-tensors or ModelOpt)",
        description="Copy a Hugging Face MoE checkpoint with every routed expert in NVFP4: the codes and scales "
        "the trace_fp4 engines run (gate and up share one global scale), everything else unchanged.",
    )
    ex.add_argument("--model", type=Path, required=True,
                    help="local Hugging Face Qwen3-MoE / Qwen2-MoE checkpoint (BF16); with --megatron-state: its config and tokenizer")
    ex.add_argument("--megatron-state", type=Path, default=None,
                    help="trained Megatron-Core GPTModel state_dict (torch.save or .safetensors) to export instead of --model's weights")
    ex.add_argument("--out", type=Path, required=True, help="directory for the NVFP4 checkpoint")
    ex.add_argument("--format", choices=["compressed-tensors", "modelopt"], default="compressed-tensors")
    ex.add_argument("--trace-config", type=Path, default=None,
                    help="TraceConfig JSON (static activation amax -> input scales); default: the checkpoint's own")
    ex.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                    help="dtype the engines serve in: weights are cast to it before quantization (default bfloat16)")
    ex.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty --out")


def _run_export(args) -> int:
    import json

    from trace_kernels import TraceConfig

    from .export import ExportError, export_checkpoint

    try:
        tc = None
        if args.trace_config is not None:
            try:
                tc = TraceConfig.from_dict(json.loads(args.trace_config.read_text()))
            except (OSError, ValueError) as e:
                raise ExportError(f"--trace-config {args.trace_config}: {e}") from None
        src, tmp = args.model, None
        if args.megatron_state is not None:
            from .export.megatron_input import hf_checkpoint_from_megatron

            tmp = hf_checkpoint_from_megatron(args.megatron_state, args.model)
            src = Path(tmp.name)
        try:
            summary = export_checkpoint(src, args.out, fmt=args.format, trace_config=tc, dtype=args.dtype,
                                        overwrite=args.overwrite)
        finally:
            if tmp is not None:
                tmp.cleanup()
    except ExportError as e:
        print(f"trace-fp4 export: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "export":
        return _run_export(args)
    if args.command == "compile-kernels":
        return _run_compile_kernels(args)
    if args.command == "inspect":
        from .inspect_cmd import InspectError, run_inspect

        try:
            return run_inspect(args)
        except InspectError as e:
            print(f"trace-fp4 inspect: error: {e}", file=sys.stderr)
            return 2
    from .align import AlignError, run_align

    try:
        run_align(args)
    except AlignError as e:
        print(f"trace-fp4 {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
