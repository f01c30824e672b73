"""Engine-side cost of a sparse record: building one 70-token record of the embedded tiny model's shape
(4 layers x 4 sites), the reference encoder (in-memory guide, then wire.pack) beside the fused one
(fused_encode.encode_payload, what RecordBuilder runs), with and without the audit. One run, side by
side; process CPU time, best of --repeats.

Then the Triton kernels (kernels/guides/sparse/triton_jit.py) beside the torch path on the same sites:
the encode (payload bits from codes and scales) and the trainer's decode (syndromes, flip search,
guided codes) of trainer values a little off the rollout's, checked bit-identical in the run. On a CPU
the kernels run under the Triton interpreter (numpy, one Python step per kernel op): that ratio measures
the interpreter, not the kernel; the figure that matters comes from a GPU (`--device cuda`), which this
project's CI machine does not have.

    .venv/bin/python bench/sparse_encode.py [--tokens 70] [--repeats 30] [--kernel-repeats 3] [--device cpu] [--json FILE]
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
from trace_kernels.guides.sparse.fused_encode import encode_payload  # noqa: E402
from trace_kernels.guides.sparse.rates import layer_rates  # noqa: E402


def reference_build(builder, config):
    """The record's sparse payloads as the reference encoder writes them (no audit)."""
    shape = builder.shape
    out = {}
    for (layer, site), parts in builder._rows.items():
        q = tk.NVFP4Tensor(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "global_amax")))
        out[(layer, site)] = sg.pack(sg.encode(q, site, layer_rates(config, layer, site, shape.row_shape(site)[-1])))
    return out


def site_rows(builder, config, device):
    """{(layer, site): (rollout rows NVFP4Tensor, rates)} of the record, on `device`."""
    out = {}
    for (layer, site), parts in builder._rows.items():
        q = tk.NVFP4Tensor(*(torch.cat([getattr(p, f) for p in parts]).to(device) for f in ("codes", "scales", "global_amax")))
        out[(layer, site)] = (q, layer_rates(config, layer, site, q.shape[-1]))
    return out


def kernel_figures(builder, config, device, repeats, kernel_repeats, clock):
    """Encode and decode of every site, torch beside Triton, outputs checked equal."""
    rows = site_rows(builder, config, device)
    g = torch.Generator().manual_seed(0)
    trainer = {}
    for key, (q, rates) in rows.items():
        x = q.dequantize(torch.float32)
        noise = 1 + 2e-3 * torch.randn(x.shape, generator=g).to(device)  # moves a few codes and scales
        guide = sg.unpack(encode_payload(q, key[1], rates).cpu(), tuple(q.shape[:-1]), q.shape[-1])
        trainer[key] = (x * noise, sg.SparseGuide(*(t.to(device) for t in guide.fields())))

    def encode(backend):
        return [encode_payload(q, site, rates, backend=backend) for (_, site), (q, rates) in rows.items()]

    def decode(backend):
        return [sg.decode(guide, x, backend=backend) for x, guide in trainer.values()]

    assert all(torch.equal(a, b) for a, b in zip(encode("torch"), encode("triton")))
    assert all(torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
               for a, b in zip(decode("torch"), decode("triton")))
    return {
        "encode_torch_s": clock(lambda: encode("torch"), repeats),
        "encode_triton_s": clock(lambda: encode("triton"), kernel_repeats),
        "decode_torch_s": clock(lambda: decode("torch"), kernel_repeats),
        "decode_triton_s": clock(lambda: decode("triton"), kernel_repeats),
    }


def best_wall_cuda(fn, repeats):
    ts = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return min(ts)


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
    ap.add_argument("--kernel-repeats", type=int, default=3, help="repeats of the Triton and decode timings")
    ap.add_argument("--device", default="cpu", help="cpu: Triton under its interpreter; cuda: compiled kernels")
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
    clock = best_wall_cuda if args.device == "cuda" else best
    kernels = kernel_figures(builder, no_audit, torch.device(args.device), args.repeats, args.kernel_repeats, clock)
    where = "compiled" if args.device == "cuda" else "under the Triton interpreter (numpy; not a kernel speed)"
    print(f"  Triton kernels on {args.device}, {where}; outputs bit-identical to torch:")
    for k, v in kernels.items():
        print(f"  {k:<28} {v * 1e3:8.2f} ms per {args.tokens}-token record")
    print(f"  encode triton / torch: {kernels['encode_triton_s'] / kernels['encode_torch_s']:.2f}x;"
          f" decode triton / torch: {kernels['decode_triton_s'] / kernels['decode_torch_s']:.2f}x")
    write_results(args.json, "sparse_encode", {"tokens": args.tokens, "repeats": args.repeats, **figures,
                                               "kernel_device": args.device, "kernel_repeats": args.kernel_repeats,
                                               "kernels_interpreted": args.device != "cuda", **kernels})


if __name__ == "__main__":
    main()
