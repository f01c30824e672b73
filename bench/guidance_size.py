"""Guidance bytes per generated token for real MoE shapes, full vs compact (DESIGN.md section 5).

Measured, not computed by formula: for each model shape it captures a few tokens of random activations
at every site of every layer through trace_kernels, builds the records the engines would build, and
divides their exact payload by the token count. Not a test.

    .venv/bin/python bench/guidance_size.py
"""

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
PUBLISHED_FULL_KB = 50  # DESIGN.md section 1 / the TRACE paper, Qwen3.5-35B-A3B
PUBLISHED_COMPACT_RATIO = 6


def captured(shape: tk.ModelShape, tokens: int) -> tk.RecordBuilder:
    b = tk.RecordBuilder(shape, tk.TraceConfig())
    g = torch.Generator().manual_seed(0)
    for layer in range(shape.num_layers):
        b.add_routing(layer, torch.randint(0, shape.num_experts, (tokens, shape.top_k), generator=g))
        for site in SITES:
            x = torch.randn(tokens, *shape.row_shape(site), generator=g, dtype=torch.bfloat16)
            b.add(layer, site, tk.quantize(x, tk.row_amax(x)))
    return b


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4)
    args = ap.parse_args()
    modes = {
        "full, all layers": tk.TraceConfig(guidance="full", guided_layers="all"),
        "compact, all layers": tk.TraceConfig(guidance="compact", guided_layers="all"),
        "compact, deeper half (default)": tk.TraceConfig(),
        "routing ids only": tk.TraceConfig(guided_layers="none"),
    }
    print(f"guidance bytes per token (payload; {args.tokens} tokens captured per model)\n")
    print(f"{'model':<18} {'mode':<32} {'KB/token':>9} {'vs full':>8}  per site (KB/token)")
    for name, shape in MODELS.items():
        t0 = time.perf_counter()
        builder = captured(shape, args.tokens)
        full_bytes = None
        for mode, config in modes.items():
            record = builder.build(config)
            per_token = record.nbytes / args.tokens
            full_bytes = full_bytes or per_token
            sites = ", ".join(f"{k} {v / args.tokens / 1024:.1f}" for k, v in record.size_by_site().items())
            print(f"{name:<18} {mode:<32} {per_token / 1024:>9.1f} {full_bytes / per_token:>7.2f}x  {sites}")
        print(f"{'':<18} (captured and encoded in {time.perf_counter() - t0:.1f} s)")
    print(f"\npublished (TRACE paper, Qwen3.5-35B-A3B): about {PUBLISHED_FULL_KB} KB/token full, "
          f"compact default about {PUBLISHED_COMPACT_RATIO}x smaller")


if __name__ == "__main__":
    main()
