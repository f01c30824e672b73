"""Guidance bytes per generated token for real MoE shapes, full vs compact vs sparse.

Measured, not computed by formula: for each model shape it captures a few tokens of random activations
at every site of every layer through trace_kernels, builds the records the engines would build, and
divides their exact payload by the token count. Not a test.

Sparse records are fixed-rate: their size depends on the shape and on the per-site rates of
`trace_kernels.guides.sparse.SITE_RATES`, which were tuned on the flip densities `trace-fp4 align`
measured (tiny models; pass `--align-json` to print the densities of an align run next to the sizes).
How much of the mismatch those rates remove was measured on the tiny models only.

    .venv/bin/python bench/guidance_size.py [--align-json align.json]
"""

import json

import argparse
import time

import torch

import trace_kernels as tk
from trace_kernels.config import SITES

MODELS = {
    # Qwen3-30B-A3B (config.json on its model card)
    "Qwen3-30B-A3B": tk.ModelShape(48, 2048, 768, 128, 8, 4, 128),
    # Qwen3-235B-A22B
    "Qwen3-235B-A22B": tk.ModelShape(94, 4096, 1536, 128, 8, 4, 128),
    # Mixtral-8x7B: 8 experts, top-2, intermediate 14336
    "Mixtral-8x7B": tk.ModelShape(32, 4096, 14336, 8, 2, 8, 128),
}
SHAPE_FIELDS = ("num_layers", "hidden_size", "moe_intermediate_size", "num_experts", "top_k", "num_kv_heads", "head_dim")
PUBLISHED_FULL_KB = 50  # the TRACE paper, Qwen3.5-35B-A3B
PUBLISHED_COMPACT_RATIO = 6


def captured(shape: tk.ModelShape, tokens: int) -> tk.RecordBuilder:
    b = tk.RecordBuilder(shape, tk.TraceConfig(guidance="full", guided_layers="all"))
    g = torch.Generator().manual_seed(0)
    for layer in range(shape.num_layers):
        b.add_routing(layer, torch.randint(0, shape.num_experts, (tokens, shape.top_k), generator=g))
        for site in shape.layer_sites(layer):
            x = torch.randn(tokens, *shape.row_shape(site), generator=g, dtype=torch.bfloat16)
            b.add(layer, site, tk.quantize(x, tk.row_amax(x)))
    return b


def _print_rates(align_json) -> None:
    from trace_kernels.guides import sparse as sg

    print("sparse rates per segment of 64 (amax bits per row; scale, code syndrome bits per segment), tuned on")
    print("the flip densities measured by `trace-fp4 align` (tiny models, every earlier site guided):")
    for site in SITES:
        r = sg.rates_for(site, 64)
        kind = "check only: the trainer computes these values exactly" if r.check else "corrected"
        print(f"  {site:<11} amax {r.amax_bits}, scales {r.scale_bits}, codes {r.code_bits}"
              f"  ({(r.scale_bits + r.code_bits) / 64:.3f} bits/value + amax; {kind})")
    if align_json:
        result = json.loads(open(align_json).read())
        rows = result["modes"]["trace_full"]["per_layer"]
        dens = {s: sum(r[f"{s}_rtn"] for r in rows) / len(rows) for s in SITES}
        print(f"  measured in {align_json} ({result['model']}): RTN flip density with every earlier site guided: "
              + ", ".join(f"{s} {100 * d:.2f}%" for s, d in dens.items()))
        sp = result["modes"].get("trace_sparse")
        if sp:
            print(f"  and trace_sparse there: {sp['guidance_bits_per_value']:.3f} bits/value, "
                  f"{100 * sp['mismatch_removed_vs_rtn']:.2f}% of the RTN mismatches removed")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--align-json", help="a `trace-fp4 align --json` output: print its measured flip densities")
    from results_io import add_json_arg, write_results

    add_json_arg(ap, "guidance_size")
    args = ap.parse_args()
    figures = {"tokens": args.tokens, "models": {}}
    modes = {
        "full, all layers": tk.TraceConfig(guidance="full", guided_layers="all"),
        "compact, all layers": tk.TraceConfig(guidance="compact", guided_layers="all"),
        "sparse, all layers": tk.TraceConfig(guidance="sparse", guided_layers="all"),
        "compact, deeper half (paper)": tk.TraceConfig(guidance="compact", guided_layers="deeper_half"),
        "routing ids only": tk.TraceConfig(guided_layers="none"),
    }
    print(f"guidance bytes per token (payload; {args.tokens} tokens captured per model)\n")
    _print_rates(args.align_json)
    print(f"{'model':<18} {'mode':<32} {'KB/token':>9} {'vs full':>8} {'bits/val':>8}  per site (KB/token)")
    for name, shape in MODELS.items():
        t0 = time.perf_counter()
        builder = captured(shape, args.tokens)
        full_bytes = None
        entry = figures["models"][name] = {"shape": {k: getattr(shape, k) for k in SHAPE_FIELDS}, "modes": {}}
        values = shape.num_layers * (shape.hidden_size + shape.top_k * shape.moe_intermediate_size
                                     + 2 * shape.num_kv_heads * shape.head_dim)
        for mode, config in modes.items():
            record = builder.build(config)
            per_token = record.nbytes / args.tokens
            full_bytes = full_bytes or per_token
            sites = ", ".join(f"{k} {v / args.tokens / 1024:.1f}" for k, v in record.size_by_site().items())
            entry["modes"][mode] = {"bytes_per_token": per_token, "bits_per_value": 8 * per_token / values,
                                    "bytes_per_token_by_site": {k: v / args.tokens for k, v in record.size_by_site().items()}}
            print(f"{name:<18} {mode:<32} {per_token / 1024:>9.1f} {full_bytes / per_token:>7.2f}x "
                  f"{8 * per_token / values:>8.3f}  {sites}")
        print(f"{'':<18} (captured and encoded in {time.perf_counter() - t0:.1f} s)")
    print(f"\npublished (TRACE paper, Qwen3.5-35B-A3B): about {PUBLISHED_FULL_KB} KB/token full, "
          f"compact default about {PUBLISHED_COMPACT_RATIO}x smaller")
    write_results(args.json, "guidance_size", figures)


if __name__ == "__main__":
    main()
