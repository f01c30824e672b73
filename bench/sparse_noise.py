"""What the sparse guidance rates were tuned on: trainer-vs-rollout noise at every captured site.

Takes an align work directory (`trace-fp4 align --workdir DIR` keeps the rollout's full records), runs the
Megatron-Core trainer with full guidance at every layer (so every earlier site is exact, as with a working
sparse guide) keeping each site's unquantized inputs, and measures per site:
  - how far the bf16 row amax moved (in bf16 ulps: the histogram of rollout minus trainer), how many
    block scales and codes the trainer's own rounding flips with the rollout's scales (rates, and the
    histogram of flips per syndrome segment), where the flipped codes rank among their segment's values
    by distance to a midpoint (the decoder searches the CANDIDATES nearest), and P(flip | distance to
    the nearest E2M1 midpoint);
  - what `trace_kernels.guides.sparse` at its current rates sends (bits per value) and removes
    (share of the same-activation RTN mismatches), offline on those values, and how many rows it left
    with a wrong amax or wrong block scales (the codeword mismatch does not show those).
Not a test.

    .venv/bin/python bench/sparse_noise.py DIR [--model MODEL_DIR]
"""

import argparse
import json
import time
from pathlib import Path

import torch

import trace_kernels as tk
from trace_kernels import reference
from trace_kernels.guides import sparse as sg
from trace_kernels.guides.sparse.decoder import code_flip_costs
from trace_kernels.format import E2M1_MIDPOINTS

EDGES = (0.0, 0.004, 0.008, 0.016, 0.03, 0.05, 0.08, 0.12, 10.0)


def trainer_values(workdir: Path, model_dir: Path) -> dict:
    import trace_megatron
    from trace_fp4 import megatron_cpu
    from trace_fp4.hf_checkpoint import read_config
    from trace_fp4.recompute import MODE_CONFIGS, Trainer

    hf = read_config(model_dir)
    fp4 = json.loads((workdir / "rollout_fp4" / "rollout.json").read_text())
    records = [tk.GuidanceRecord.load(workdir / "rollout_fp4" / "records" / f"{i}.safetensors") for i in range(len(fp4["samples"]))]
    model = Trainer(model_dir, hf).build("trace_full")
    shape = hf.model_shape()
    out = {s: {"x": [], "codes": [], "scales": [], "amax": []} for layer in range(hf.num_layers) for s in shape.layer_sites(layer)}
    with torch.no_grad():
        for i, sample in enumerate(fp4["samples"]):
            tokens = torch.tensor(sample["prompt_token_ids"] + sample["output_token_ids"][:-1])
            T = tokens.numel()
            layout = trace_megatron.TokenLayout.padded([T], T)
            with trace_megatron.capture(model, layout, records=[records[i].reencode(MODE_CONFIGS["trace_full"])], keep_values=True) as b:
                model(tokens[None], torch.arange(T)[None], megatron_cpu.causal_mask(T))
            for layer in range(hf.num_layers):
                for site in shape.layer_sites(layer):
                    x, q = b.captured_values(layer, site), records[i].site(layer, site)
                    K = x.shape[-1]
                    out[site]["x"].append(x.reshape(-1, K))
                    out[site]["codes"].append(q.codes.reshape(-1, K // 2))
                    out[site]["scales"].append(q.scales.reshape(-1, K // 16))
                    out[site]["amax"].append(q.global_amax.reshape(-1))
    return {s: {k: torch.cat(v) for k, v in d.items()} for s, d in out.items()}


def dkey_signed(x: torch.Tensor, q) -> torch.Tensor:
    """Trainer minus rollout row amax, in bf16 ulps."""
    return (tk.row_amax(x).view(torch.int32) >> 16) - (q.global_amax.view(torch.int32) >> 16)


def report(values: dict) -> None:
    mids = torch.tensor(E2M1_MIDPOINTS)
    bits = vals = mis = rtn_all = 0
    decode_s = 0.0
    for site, t in values.items():
        x, q = t["x"], tk.NVFP4Tensor(t["codes"], t["scales"], t["amax"])
        R, K = x.shape
        dkey = ((tk.row_amax(x).view(torch.int32) >> 16) - (q.global_amax.view(torch.int32) >> 16)).abs()
        g_enc, g_dec = reference.global_scales(q.global_amax)
        xb = x.reshape(R, K // 16, 16)
        own_scale, _ = reference.block_scales(xb, g_enc)
        y = reference._scaled(xb, reference.decode_e4m3(q.scales), g_dec).reshape(R, K)
        flip = (reference.e2m1_index(y.abs()) & 1) != (reference.unpack_nibbles(q.codes).int() & 1)
        dist = (y.abs()[..., None] - mids).abs().amin(-1)
        bins = torch.bucketize(dist, torch.tensor(EDGES)) - 1
        pflip = " ".join(f"<{EDGES[i + 1]:g}: {float(flip[bins == i].float().mean()):.3f}" for i in range(len(EDGES) - 2))
        print(f"{site}: {R} rows of {K}; amax moved <=1 ulp {float((dkey <= 1).float().mean()):.4f}, <=3 "
              f"{float((dkey <= 3).float().mean()):.4f}; scales flipped {float((own_scale != q.scales.int()).float().mean()):.4f}; "
              f"codes flipped {float(flip.float().mean()):.4f}")
        print(f"    P(flip | distance to midpoint) {pflip}")
        seg = sg.segment(K)
        hist = lambda t: dict(zip(*[v.tolist() for v in torch.unique(t, return_counts=True)]))  # noqa: E731
        print(f"    amax rollout - trainer (bf16 ulps): {hist(-dkey_signed(x, q))}")
        print(f"    scale flips per segment of {seg}: {hist((own_scale != q.scales.int()).reshape(R * K // seg, -1).sum(-1))}")
        fs = flip.reshape(R * K // seg, seg)
        print(f"    code flips per segment of {seg}: {hist(fs.sum(-1))}")
        rank = code_flip_costs(y.abs()).reshape(R * K // seg, seg).argsort(-1).argsort(-1)
        print(f"    rank of each flipped code by distance to a midpoint in its segment: "
              f"{torch.bincount(torch.clamp(rank[fs], max=16), minlength=17).tolist()} (last: 16 or more)")
        guide = sg.encode(q, site)
        unpacked = sg.unpack(sg.pack(guide), (R,), K)
        t0 = time.perf_counter()
        decoded = sg.decode(unpacked, x)
        dt = time.perf_counter() - t0
        decode_s += dt
        cw = tk.codewords(q)
        m = int((tk.codewords(decoded) != cw).sum())
        r = int((tk.codewords(tk.quantize(x, tk.row_amax(x))) != cw).sum())
        b = sg.payload_bits(guide)
        print(f"    rows left with a wrong amax {int((decoded.global_amax != q.global_amax).sum())}, "
              f"wrong block scales {int((decoded.scales != q.scales).any(-1).sum())} (of {R})")
        print(f"    sparse at {sg.rates_for(site, K)}: {b / x.numel():.3f} bits/value, removes {1 - m / max(r, 1):.4f} of {r} RTN mismatches; "
              f"decode {dt * 1e3:.0f} ms ({x.numel() / dt / 1e6:.2f} M values/s, {torch.get_num_threads()} threads)")
        bits, vals, mis, rtn_all = bits + b, vals + x.numel(), mis + m, rtn_all + r
    print(f"all sites: {bits / vals:.3f} bits/value (site payloads, no routing ids), removes {1 - mis / max(rtn_all, 1):.4f}; "
          f"decode {decode_s:.2f} s for {vals} values (the first call builds the pattern tables)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--model", type=Path, help="default: the embedded tiny model in the work directory")
    args = ap.parse_args()
    report(trainer_values(args.workdir, args.model or args.workdir / "tiny-qwen3-moe"))


if __name__ == "__main__":
    main()
