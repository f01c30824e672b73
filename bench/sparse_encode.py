"""Engine-side cost of a sparse record: building one 70-token record of the embedded tiny model's shape
(4 layers x 4 sites), the reference encoder (in-memory guide, then wire.pack) beside the fused one
(fused_encode.encode_payload, what RecordBuilder runs), with and without the audit. One run, side by
side; process CPU time, best of --repeats.

    .venv/bin/python bench/sparse_encode.py [--tokens 70] [--repeats 30] [--json FILE]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from record_factory import captured_builder  # noqa: E402

import trace_kernels as tk  # noqa: E402
from trace_kernels.guides import sparse as sg  # noqa: E402
from trace_kernels.guides.sparse.rates import layer_rates  # noqa: E402


def reference_build(builder, config):
    """The record's sparse payloads as the reference encoder writes them (no audit)."""
    shape = builder.shape
    out = {}
    for (layer, site), parts in builder._rows.items():
        q = tk.NVFP4Tensor(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "global_amax")))
        out[(layer, site)] = sg.pack(sg.encode(q, site, layer_rates(config, layer, site, shape.row_shape(site)[-1])))
    return out


def best(fn, repeats):
    """Best process CPU time of `repeats` calls: on a shared machine wall time counts the other jobs too."""
    ts = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        ts.append(time.process_time() - t)
    return min(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=70)
    ap.add_argument("--repeats", type=int, default=30)
    from results_io import add_json_arg, write_results

    add_json_arg(ap, "sparse_encode")
    args = ap.parse_args()
    torch.set_num_threads(1)
    builder = captured_builder(tk.TraceConfig(guidance="full", guided_layers="all"), steps=(args.tokens,))
    no_audit = tk.TraceConfig(sparse_audit=0.0)
    fused = builder.build(no_audit)
    ref = reference_build(builder, no_audit)
    assert all(torch.equal(fused.tensors[f"layer.{l}.{s}.sparse"], t) for (l, s), t in ref.items())
    figures = {
        "reference_encode_s": best(lambda: reference_build(builder, no_audit), args.repeats),
        "fused_build_s": best(lambda: builder.build(no_audit), args.repeats),
        "fused_build_with_audit_s": best(lambda: builder.build(tk.TraceConfig()), args.repeats),
        "compact_build_s": best(lambda: builder.build(tk.TraceConfig(guidance="compact")), args.repeats),
    }
    for k, v in figures.items():
        print(f"  {k:<28} {v * 1e3:8.2f} ms per {args.tokens}-token record")
    print(f"  fused / reference: {figures['fused_build_s'] / figures['reference_encode_s']:.2f}x")
    write_results(args.json, "sparse_encode", {"tokens": args.tokens, "repeats": args.repeats, **figures})


if __name__ == "__main__":
    main()
