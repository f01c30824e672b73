"""Trainer recompute time per parallel layout against the single-rank trainer (one run, side by side).

    .venv/bin/python bench/trainer_layouts.py [--samples 4] [--tokens 64] [--layouts tp1,tp=2,tp=2:ep=2,cp=2,pp=2] [--json FILE]

Every layout runs `trace_fp4.trainer_layout` (what `trace-fp4 align --trainer-parallel` runs): the
embedded tiny Qwen3-MoE's converted BF16 weights as gloo ranks, one process per rank, the Megatron BF16
spec and the trace spec guided by full records, forward over every sample (batch of one, model build
excluded; the slowest rank's wall time). tp1 is the same code with one process, so the ratios compare
layouts, not code paths; |dlogp| is against tp1's log-probs. Records come from a single-rank capture with every value moved by up to 0.2%
(a second engine's arithmetic), so guidance has codes to correct. On a 2-core CPU a second rank adds
communication and no compute: the ratios say what the layouts cost in bookkeeping and messages here,
not what they gain on a cluster.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import add_json_arg, write_results  # noqa: E402


def _other_engine(x):
    # a function of each value alone: a token row sent to two experts must round the same way in both
    # kept in fp32: cast back to BF16, a 0.2% move would mostly round away
    return x.float() * (1 + 2e-3 * torch.cos(1e4 * x.float()))


def _parse_layout(name: str) -> dict:
    from trace_fp4.recompute import parse_trainer_parallel

    return parse_trainer_parallel("" if name == "tp1" else name.replace(":", ","))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per sample (prompt 8, the rest generated)")
    ap.add_argument("--layouts", default="tp1,tp=2,tp=2:ep=2,cp=2,pp=2")
    add_json_arg(ap, "trainer_layouts")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="trace-fp4-bench-layouts-") as d:  # model and records: gone after
        _run(args, Path(d))


def _run(args, tmp: Path) -> None:
    import trace_megatron
    from trace_fp4 import megatron_cpu, trainer_layout
    from trace_fp4.hf_checkpoint import read_config
    from trace_fp4.recompute import MODE_CONFIGS, Trainer
    from trace_fp4.tiny_model import build_tiny_qwen3_moe

    model_dir = build_tiny_qwen3_moe(tmp / "model", seed=0)
    hf = read_config(model_dir)
    engine = Trainer(model_dir, hf).build("fp4_rtn")
    g = torch.Generator().manual_seed(1)
    samples, paths = [], []
    for i in range(args.samples):
        ids = torch.randint(1, hf.vocab_size, (args.tokens + 1,), generator=g).tolist()
        samples.append({"prompt_token_ids": ids[:8], "output_token_ids": ids[8:]})
        tokens = torch.tensor(ids[:-1])
        T = tokens.numel()
        with torch.no_grad(), trace_megatron.capture(engine, trace_megatron.TokenLayout.padded([T], T),
                                                     perturb=_other_engine) as cap:
            engine(tokens[None], torch.arange(T)[None], megatron_cpu.causal_mask(T))
        paths.append(tmp / f"{i}.safetensors")
        cap.build_records(MODE_CONFIGS["trace_full"], token_ids=[tokens])[0].save(paths[-1])
    # |dlogp| against the tp1 layout's own log-probs (the first layout listed is the reference)
    rows, ref = {}, None
    for name in args.layouts.split(","):
        parallel = _parse_layout(name)
        trainer_layout.check_layout(parallel, hf)
        res = trainer_layout.run(model_dir, parallel, {"bf16": samples, "trace_full": samples}, paths, None)
        lp = {m: torch.tensor([v for s in res["logprobs"][m] for v in s]) for m in ("bf16", "trace_full")}
        ref = ref or lp
        rows[name] = {"ranks": res["world_size"], "seconds": res["seconds"],
                      "mismatch": res["trace_full"]["codeword_mismatch_rate"],
                      "dlogp_trace_full": float((lp["trace_full"] - ref["trace_full"]).abs().mean()),
                      "dlogp_bf16": float((lp["bf16"] - ref["bf16"]).abs().mean())}
        print(f"{name}: {rows[name]}", file=sys.stderr)
    base = rows.get("tp1")
    print(f"{args.samples} samples x {args.tokens} tokens, forward of every sample per layout (model build excluded)")
    print(f"{'layout':<12} {'ranks':>5} {'bf16 s':>8} {'trace s':>8} {'bf16 vs tp1':>12} {'trace vs tp1':>13} "
          f"{'mismatch':>9} {'|dlogp| trace':>14} {'|dlogp| bf16':>13}")
    for name, r in rows.items():
        ratio = lambda m: r["seconds"][m] / base["seconds"][m] if base else float("nan")  # noqa: E731
        r["vs_tp1"] = {m: ratio(m) for m in ("bf16", "trace_full")}
        print(f"{name:<12} {r['ranks']:>5} {r['seconds']['bf16']:>8.2f} {r['seconds']['trace_full']:>8.2f} "
              f"{r['vs_tp1']['bf16']:>12.2f} {r['vs_tp1']['trace_full']:>13.2f} {100 * r['mismatch']:>8.3f}% "
              f"{r['dlogp_trace_full']:>14.2e} {r['dlogp_bf16']:>13.2e}")
    write_results(args.json, "trainer_layouts", {"samples": args.samples, "tokens": args.tokens, "layouts": rows})


if __name__ == "__main__":
    main()
