"""A miniature of the paper's Table 1: GRPO on a toy task with BF16, plain FP4 QAT and TRACE.

    .venv/bin/python bench/rl_miniature.py --steps 30 --arms bf16,fp4_qat,trace,trace_default \
        --seeds 0,1 --json bench/results/rl_miniature.json --plot bench/results/rl_miniature.png

Real vLLM rollouts (trace_fp4 for the FP4 arms), real Megatron-Core training with the trace spec,
the routed-expert weights synced into the engine after every step. See trace_fp4/rl/ and docs/rl-stacks.md
section "RL miniature". A benchmark, not a test (tests/jobs/test_rl_miniature.py runs 2 steps per arm).
"""

import argparse
import sys
import tempfile
from pathlib import Path

from trace_fp4.rl.arms import ARMS
from trace_fp4.rl.experiment import run_experiment, table, write_json, write_plot
from trace_fp4.rl.loop import RunConfig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--length", type=int, default=4, help="digits per string")
    ap.add_argument("--sft-target", type=float, default=0.3)
    ap.add_argument("--num-eval", type=int, default=512, help="held-out strings for the final greedy evaluation")
    ap.add_argument("--workdir", default=None, help="keeps the SFT init for reuse (default: a temporary dir)")
    ap.add_argument("--record-dir", default=None,
                    help="the record store's directory (default: under /dev/shm when it exists, else the workdir): "
                         "one machine, so a RAM-backed directory; the store fsyncs every record")
    ap.add_argument("--no-export-eval", action="store_true",
                    help="skip exporting each arm's final policy as an NVFP4 checkpoint and evaluating it decompressed")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    if args.group_size < 2:
        ap.error("--group-size must be at least 2 (group-normalised advantages)")
    cfg = RunConfig(steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size, lr=args.lr,
                    export_eval=not args.no_export_eval)
    tmp = tempfile.TemporaryDirectory(prefix="rl-miniature-") if args.workdir is None else None
    workdir = Path(args.workdir or tmp.name)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    result = run_experiment([a for a in args.arms.split(",") if a], [int(s) for s in args.seeds.split(",")], cfg,
                            workdir, length=args.length, sft_target=args.sft_target, num_eval=args.num_eval, partial_json=args.json,
                            record_dir=args.record_dir, log=log)
    print(table(result))
    if args.json:
        write_json(result, args.json)
    if args.plot:
        write_plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
