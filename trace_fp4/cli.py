"""The `trace-fp4` command.

    trace-fp4 align [--model DIR] [--engine vllm|sglang] [--json FILE] [--plot FILE] ...
    trace-fp4 inspect RECORD_OR_HANDLE [--verify] [--json]

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
    al.add_argument("--stale", type=int, default=0,
                    help="also recompute with the trainer's weights 1..K expert updates newer than the rollout's "
                    "(off-policy); the JSON gains stale.per_k with mismatch and |delta logp| per mode")
    al.add_argument("--workdir", type=Path, default=None, help="where rollouts and records go (default: a temp dir)")
    al.add_argument("--json", type=Path, default=None, help="write every figure of the table to this JSON file")
    al.add_argument("--plot", type=Path, default=None, help="write a PNG of per-layer codeword mismatch")
    ins = sub.add_parser(
        "inspect",
        help="what a guidance record holds (shape, config, identity, tokens, bytes per layer and site)",
        description="Print a guidance record's model shape, TRACE config, identity, token rows, layer modes "
        "and payload bytes per site and per layer; --verify re-checks every tensor's checksum.",
    )
    ins.add_argument("record", help="a record file (.safetensors) or a record handle 'trace-fp4:<store>:...'")
    ins.add_argument("--verify", action="store_true", help="re-check every tensor's SHA-256, reporting each one")
    ins.add_argument("--json", action="store_true", help="print the summary as JSON")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
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
