"""The wide flip-pattern search that widens with a segment's code bits (search.wide_search_for) beside
the old fixed 6 flips / 20 candidates, on the same sparse guides, one run: decode time, segments left
unresolved, and values decoded wrong (a wrong pattern with the right syndrome), per code rate.

Rows of 128 values (two 64-value segments, as the Qwen2-MoE's fc1), trainer values with relative noise
`--noise` around the rollout's (the tail of crowded segments the first search cannot explain). Process
CPU time, best of --repeats.

    .venv/bin/python bench/sparse_wide_search.py [--rows 512] [--noise 0.03] [--bits 16 20 24] [--json FILE]
"""

import argparse
import json
import time

import torch

import trace_kernels as tk
from trace_kernels.guides import sparse as sg
from trace_kernels.guides.sparse import decoder, search
from trace_kernels.guides.sparse.rates import Rates


def _decode(guide, x_t, widths_fn):
    """One decode with decoder.wide_search_for replaced by `widths_fn` (the arm under test)."""
    saved = decoder.wide_search_for
    decoder.wide_search_for = widths_fn
    try:
        report = sg.DecodeReport()
        t0 = time.process_time()
        out = sg.decode(guide, x_t, report, backend="torch")
        return out, report, time.process_time() - t0
    finally:
        decoder.wide_search_for = saved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--noise", type=float, default=0.03)
    ap.add_argument("--bits", type=int, nargs="+", default=[16, 20, 24])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    K = 128
    x = (torch.randn(a.rows, K, generator=g) * torch.rand(a.rows, 1, generator=g) * 4).to(torch.bfloat16)
    q = tk.quantize(x, tk.row_amax(x))
    x_t = x.float() * (1 + a.noise * torch.randn(x.shape, generator=g))
    rtn = (tk.codewords(tk.quantize(x_t, tk.row_amax(x_t))) != tk.codewords(q)).sum().item()
    arms = {"old 6/20": lambda bits, seg: (search.WIDE_FLIPS, search.WIDE_CANDIDATES), "wide_search_for": search.wide_search_for}
    out = {"rows": a.rows, "K": K, "noise": a.noise, "rtn_mismatched_values": rtn, "by_bits": {}}
    print(f"{a.rows} rows x {K}, noise {a.noise}: {rtn} RTN mismatched values")
    for bits in a.bits:
        guide = sg.unpack(sg.pack(sg.encode(q, rates=Rates(3, 3, bits))), (a.rows,), K)
        res = {}
        for name, fn in arms.items():
            best = None
            for _ in range(a.repeats):
                dec, rep, t = _decode(guide, x_t, fn)
                best = t if best is None else min(best, t)
            wrong = int((tk.codewords(dec) != tk.codewords(q)).sum())
            res[name] = {"widths": list(fn(bits, 64)), "cpu_s": best, "wrong_values": wrong,
                         "unresolved_code_segments": rep.unresolved_code_segments}
            print(f"  {bits} code bits, {name:>16} {tuple(fn(bits, 64))}: {best:6.2f} s, "
                  f"{wrong} values wrong, {rep.unresolved_code_segments} segments unresolved")
        res["time_ratio"] = res["wide_search_for"]["cpu_s"] / res["old 6/20"]["cpu_s"]
        print(f"  {bits} code bits: time ratio {res['time_ratio']:.2f}x")
        out["by_bits"][str(bits)] = res
    if a.json:
        open(a.json, "w").write(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
