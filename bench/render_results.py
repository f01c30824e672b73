"""Write the measurement tables of docs/measurements.md (and the README's headline table) from
bench/results/*.json.

Each table sits between `<!-- results:NAME -->` and `<!-- /results:NAME -->`; NAME picks a renderer
below and the JSON it reads. Everything between the markers is replaced, nothing outside them is
touched, so hand-written text around a table survives and re-running the renderer on unchanged JSONs
changes nothing. A block whose JSON is missing is left as it is (and named on stderr).

    .venv/bin/python bench/render_results.py           # rewrite the tables
    .venv/bin/python bench/render_results.py --check   # exit 1 if a table differs from its JSON
"""

import argparse
import json
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
TARGETS = [REPO / "docs" / "measurements.md", REPO / "README.md"]
BLOCK = re.compile(r"(<!-- results:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)", re.S)

ALIGN_COMMAND = "make align"  # trace-fp4 align, 8 prompts x 24 tokens; its --json copied to bench/results/align.json
ALIGN_MODES = {
    "bf16": "bf16 (yardstick)",
    "fp4_rtn": "fp4_rtn (plain FP4 QAT)",
    "trace_full": "trace_full",
    "trace_compact": "trace_compact (every layer)",
    "trace_sparse": "**trace_sparse (every layer: the default)**",
    "trace_default": "trace_default (`PAPER_CONFIG`: compact, deeper half)",
}


def _load(name: str):
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _cpu(cpu) -> str:
    if isinstance(cpu, str):
        return cpu
    text = f"{cpu['model']}, torch kernels {cpu['torch_cpu_capability']}"
    if cpu.get("cores"):
        text += f", {cpu['cores']} cores"
    if cpu.get("load_average_1min") is not None:
        text += f", load average {cpu['load_average_1min']} at the end"
    return text


def _source(result: dict) -> str:
    when = f", {result['measured_utc']} UTC" if result.get("measured_utc") else ""
    return f"\nMade by `{result['command']}`; CPU: {_cpu(result['cpu'])}{when}.\n"


def _pct(x, digits=1) -> str:
    return f"{100 * x:.{digits}f}%"


def align(r):
    m = r["modes"]
    rows = []
    for key, label in ALIGN_MODES.items():
        if key not in m:
            continue
        d = m[key]
        fp4 = key != "bf16"
        rows.append([
            label,
            _pct(d["codeword_mismatch_rate"], 3) if fp4 else "-",
            _pct(d["codeword_mismatch_rate_adjacent"], 3) if fp4 else "-",
            f"{d['logprob_abs_diff_mean']:.4f}",
            f"{d['logprob_abs_diff_vs_bf16']:.2f}x",
            f"{d['k3_kl']:.2e}",
            f"{d['guidance_bytes_per_token']:.1f}",
            f"{d['guidance_bits_per_value']:.3f}",
            _pct(d["mismatch_removed_vs_rtn"], 2) if "mismatch_removed_vs_rtn" in d else "-",
        ])
    table = _table(["mode", "codeword mismatch", "mismatch where reachable", "mean \\|delta logp\\|", "vs BF16",
                    "k3 KL", "guidance B/token", "bits/value", "RTN mismatches removed"], rows)
    return (f"{table}\n\n{r['model']}, {r['engine']} rollouts, {r['num_samples']} samples, "
            f"{r['num_generated_tokens']} generated tokens. Made by `{ALIGN_COMMAND}`; CPU: {_cpu(r['cpu'])}.\n")


def align_details(r):
    m = r["modes"]
    lines = []
    if "trace_sparse" in m and "sparse_decode" in m["trace_sparse"]:
        s = m["trace_sparse"]["sparse_decode"]
        lines.append(f"trace_sparse decode: {s['sparse_segments']:,.0f} segments, "
                     f"{s['sparse_unresolved_code_segments']:.0f} with unresolved codes, "
                     f"{s['sparse_unresolved_scale_segments']:.0f} with unresolved scales, "
                     f"{s['sparse_code_flips']:,.0f} mantissa bits flipped from the trainer's own rounding, "
                     f"{s['sparse_amax_list_rows']:.0f} rows' amax list-decoded.")
    with_header = [f"{k} {m[k]['guidance_bits_per_value_file']:.2f}" for k in ALIGN_MODES
                   if k in m and m[k].get("guidance_bits_per_value_file")]
    if with_header:
        lines.append("Bits per value with the safetensors header and metadata counted (one record per sample): "
                     + ", ".join(with_header) + ".")
    sites = [k for k in ("moe_fc1_in", "moe_fc2_in", "k", "v", "kv_latent") if k in m["fp4_rtn"]["per_layer"][0]]
    rows = [[row["layer"], row["kind"], *(_pct(row[s], 2) for s in sites)] for row in m["fp4_rtn"]["per_layer"]]
    lines.append("\nPlain FP4 QAT (`fp4_rtn`) against the FP4 rollout, codeword mismatch per layer and site:\n")
    lines.append(_table(["layer", "kind", *sites], rows))
    return "\n".join(lines) + f"\n\nSame run as the table above (`{ALIGN_COMMAND}`).\n"


def guidance_size(r):
    d = r["data"]
    modes = ["full, all layers", "compact, all layers", "sparse, all layers", "compact, deeper half (paper)"]
    rows = []
    for name, e in d["models"].items():
        s, full = e["shape"], e["modes"]["full, all layers"]["bytes_per_token"]
        cells = [f"{name} ({s['num_layers']} layers, hidden {s['hidden_size']}, MoE {s['moe_intermediate_size']}, "
                 f"top-{s['top_k']}, {s['num_kv_heads']} KV x {s['head_dim']})"]
        for mode in modes:
            b = e["modes"][mode]["bytes_per_token"]
            extra = "" if mode.startswith("full") else f" ({full / b:.2f}x smaller, {e['modes'][mode]['bits_per_value']:.3f} b/value)"
            cells.append(f"{b / 1024:.1f} KB{extra}")
        rows.append(cells)
    table = _table(["model", "full, all layers", "compact, all layers", "sparse, all layers (default)",
                    "compact, deeper half (paper)"], rows)
    return f"{table}\n\nPayload bytes per generated token, from records of {d['tokens']} captured tokens." + _source(r)


def kernels(r):
    d = r["data"]
    cases = ["fake-quant RTN, no capture", "fake-quant RTN + capture", "guided full (trainer)", "guided compact (trainer)"]
    cols = sorted(d["elementwise"])
    header = ["path (bf16)"] + [f"{c}, {d['elementwise'][c]['rows']} x {d['elementwise'][c]['cols']}" for c in cols]
    rows = []
    for case in cases:
        cells = [case]
        for c in cols:
            ms = d["elementwise"][c]["ms"]
            ratio = ms[case] / ms[cases[0]]
            cells.append(f"{ms[case]:.1f} ms" + ("" if case == cases[0] else f" ({ratio:.2f}x)"))
        rows.append(cells)
    out = _table(header, rows)
    moe = d.get("moe_layer", {})
    if moe:
        mrows = []
        for c in sorted(moe):
            e = moe[c]
            mrows.append([c, f"T={e['T']}, H={e['H']}, I={e['I']}, {e['E']} experts, top-{e['top_k']}",
                          f"{e['ms']:.2f} ms ({e['clock']} time)", f"{e['ms_with_capture']:.2f} ms "
                          f"({e['ms_with_capture'] / e['ms'] - 1:+.0%})"])
        out += "\n\nThe MoE layer on packed weights (`run_moe`, both expert GEMMs):\n\n"
        out += _table(["device / backend", "layer", "per call", "with capture"], mrows)
    return out + "\n" + _source(r)


def megatron_step(r):
    d = r["data"]
    if "step_s" in d:
        t = {k: 1e3 * v for k, v in d["step_s"].items()}
    else:  # results written before step_s (milliseconds, the compact and sparse modes under longer names)
        old = d["ms_per_step"]
        t = {"bf16": old["bf16"], "fp4_rtn": old["fp4_rtn"], "paper": old["trace_compact_deeper_half"],
             "sparse": old["trace_sparse_every_layer"]}
    labels = {"bf16": "BF16 (Megatron local spec)", "fp4_rtn": "FP4 RTN fake-quant",
              "paper": "TRACE compact, deeper half (the paper's default)",
              "compact": "TRACE compact, every layer",
              "sparse": "TRACE sparse, every layer (the default)",
              "fp4_rtn_compiled": "FP4 RTN fake-quant, compiled CPU path",
              "paper_compiled": "TRACE compact, deeper half, compiled CPU path",
              "sparse_compiled": "TRACE sparse, every layer, compiled CPU path",
              "fp4_rtn_native": "FP4 RTN fake-quant, native CPU path",
              "paper_native": "TRACE compact, deeper half, native CPU path",
              "sparse_native": "TRACE sparse, every layer, native CPU path",
              "sparse_native_prepared": "TRACE sparse, every layer, native CPU path, record tables prepared before the step"}
    labels = {k: v for k, v in labels.items() if k in t}
    rows = []
    for k, label in labels.items():
        backend = next((b for b in ("compiled", "native") if k.endswith(f"_{b}") or f"_{b}_" in k), None)
        rtn = f"fp4_rtn_{backend}" if backend else "fp4_rtn"  # each path against its own backend's RTN
        ratio = "1.00x" if k == "bf16" else f"{t[k] / t['bf16']:.2f}x BF16" + ("" if k in ("bf16", rtn) else f", {t[k] / t[rtn]:.2f}x FP4 RTN")
        if k == rtn and backend:
            ratio += f", {t[k] / t['fp4_rtn']:.2f}x eager FP4 RTN"
        rows.append([label, f"{t[k]:.1f}", ratio])
    prep = d.get("prep_s", {})
    note = (f"\n\nThe prepared row's record tables took {1e3 * prep['sparse_native']:.1f} ms per micro-batch to build "
            "(`trace_megatron.prepare`, before the step; the sparse decode still runs in every step)."
            if "sparse_native" in prep else "")
    return (_table(["path", "ms/step", "ratio"], rows) + note
            + f"\n\nTiny MoE: {d['layers']} layers, hidden {d['hidden']}, 8 experts top-2, batch {d['batch']} x "
              f"{d['seq']}, bf16, best of {d['steps']} steps, {d['threads']} threads." + _step_paired(d.get("paired"))
            + _source(r))


def _step_paired(p) -> str:
    """`--paired N`: RTN and sparse steps alternating in one process, ratios within each pass (bench/megatron_paired.py)."""
    if not p:
        return ""
    w, c, d = p["sparse_vs_rtn_wall"], p["sparse_vs_rtn_cpu"], p["wall_minus_cpu_ratio"]
    dw, dc = p["sparse_minus_rtn_wall_s"], p["sparse_minus_rtn_cpu_s"]
    return (f"\n\nPaired ({p['passes']} passes on the {p['backend']} path; one FP4 RTN and one sparse step per pass, "
            f"alternating in one process, the ratio within each pass, median [min, max]): sparse "
            f"{w['median']:.3f}x FP4 RTN wall [{w['min']:.3f}, {w['max']:.3f}], {c['median']:.3f}x CPU "
            f"[{c['min']:.3f}, {c['max']:.3f}] (wall minus CPU {d['median']:+.3f}); sparse minus RTN "
            f"{1e3 * dw['median']:+.1f} ms wall [{1e3 * dw['min']:+.1f}, {1e3 * dw['max']:+.1f}], "
            f"{1e3 * dc['median']:+.1f} ms CPU [{1e3 * dc['min']:+.1f}, {1e3 * dc['max']:+.1f}].")


def kv_capacity(r):
    d = r["data"]
    rows = [[m["model"], f"{m['bf16_tokens']:,}", f"{m['trace_fp4_tokens']:,}", f"{m['trace_fp4_tokens'] / m['bf16_tokens']:.2f}x"]
            for m in d["models"]]
    q = d["qwen3_30b_a3b_bytes_per_token"]
    rows.append(["Qwen3-30B-A3B shape (48 layers, 4 KV x 128), bytes per token by vLLM's page accounting",
                 f"{q['bf16']:,} B", f"{q['trace_fp4']:,} B", f"{q['bf16'] / q['trace_fp4']:.2f}x"])
    return (_table(["model", "BF16", "trace_fp4 (packed NVFP4 cache)", "ratio"], rows)
            + f"\n\nvLLM's own reported KV capacity for `kv_cache_memory_bytes` = {d['kv_mib']} MiB, CPU_ATTN." + _source(r))


def record_travel(r):
    d = r["data"]
    off = d["rows"][0]
    rows = []
    for row in d["rows"]:
        rel = row is not off
        rows.append([
            row["label"],
            f"{row['seconds']:.2f}" + (f" ({row['seconds'] / off['seconds']:.2f}x)" if rel else ""),
            f"{row['computed_prompt_tokens']:.0f}" + (f" ({row['computed_prompt_tokens'] / off['computed_prompt_tokens']:.2f}x)" if rel else ""),
            f"{row['shared_bytes']:,}" + (f" ({row['shared_bytes'] / off['shared_bytes']:.2f}x)" if rel else ""),
            f"{row['whole_bytes']:,}", f"{row['whole_bytes'] / row['shared_bytes']:.2f}x",
        ])
    identical = all(row["identical"] for row in d["rows"])
    return (_table(["vLLM", "rollout s (generate + records into the store)", "prompt tokens computed",
                    "bytes stored (prompt part shared)", "bytes if every record stored whole", "whole / shared"], rows)
            + f"\n\nOne prompt of {off['prompt_tokens']} tokens, n={d['n']} samples x {d['tokens']} tokens, compact "
              f"records, LocalStore, best of {d['repeats']}; stored records byte-identical to whole ones: {identical}."
            + _source(r))


def vllm_capture(r):
    d = r["data"]
    base = d["rows"][0]
    rows = []
    for row in d["rows"]:
        rec = f"{row['record_bytes'] / row['record_tokens']:.0f}" if row["record_tokens"] else "-"
        rows.append([row["label"], f"{row['tok_s']:.0f}", f"{row['tok_s'] / base['tok_s']:.2f}x", f"{row['cpu_s']:.2f}",
                     f"{row['cpu_s'] / base['cpu_s']:.2f}x", f"{row['expert_bytes']:,}",
                     f"{row['expert_bytes'] / row['expert_bf16_bytes']:.3f}", rec])
    # Rows of another CPU backend (--cpu-compiled, --cpu-native: "trace_fp4 X", "+ capture, sparse, X")
    # compare with that backend's engine without capture.
    nocap = {row["label"].split()[-1]: row for row in d["rows"] if row["label"].startswith("trace_fp4 ")
             and row is not d["rows"][1]}

    def ref(row):
        tail = row["label"].rsplit(", ", 1)[-1]
        return nocap[tail] if row["label"].startswith("+ capture, sparse, ") and tail in nocap else d["rows"][1]

    overhead = "; ".join(f"{row['label']}: {row['cpu_s'] / ref(row)['cpu_s'] - 1:+.0%}"
                         for row in d["rows"][2:] if row not in nocap.values())
    if "tok_s" in d:
        t = d["tok_s"]
        overhead += (f". tok/s: FP4 {t['fp4'] / t['bf16']:.2f}x BF16; the default capture {t['fp4_capture'] / t['fp4'] - 1:+.1%} "
                     f"over FP4 without capture")
        for b in ("native",):  # (the compiled rows are discussed in the text)
            if f"fp4_{b}" in t:
                overhead += (f"; FP4 {b} {t[f'fp4_{b}'] / t['bf16']:.2f}x BF16 ({t[f'fp4_{b}'] / t['fp4']:.2f}x eager FP4), "
                             f"its capture {t[f'fp4_capture_{b}'] / t[f'fp4_{b}'] - 1:+.1%}")
    return (_table(["engine", "tok/s (wall)", "vs BF16", "CPU s", "CPU vs BF16", "routed-expert bytes held",
                    "vs BF16", "record B/token"], rows)
            + f"\n\nCapture CPU time over trace_fp4 without capture: {overhead}. {d['requests']} requests x "
              f"{d['tokens']} tokens, greedy, {'compiled' if d['compiled'] else 'eager'}, best of {d['repeats']}"
              + (f" x {d['rounds']} rounds in turn (BF16 and native rows)" if d.get("rounds", 1) > 1 else "")
              + f", {d['threads']} OpenMP thread(s)." + _paired(d.get("paired")) + _source(r))


def _paired(p) -> str:
    """`--paired N`: the three engines alive at once, ratios within each pass (bench/vllm_paired.py)."""
    if not p:
        return ""
    n, w, c = p["native_vs_bf16_tok_s"], p["capture_overhead_wall"], p["capture_overhead_cpu"]
    return (f"\n\nPaired ({p['passes']} passes; BF16, native FP4 and native FP4 with capture alive at once, one "
            f"generate each per pass, the ratio within each pass, median [min, max]): FP4 native "
            f"{n['median']:.3f}x BF16 tok/s [{n['min']:.3f}, {n['max']:.3f}]; capture on native {w['median']:+.1%} "
            f"wall [{w['min']:+.1%}, {w['max']:+.1%}], {c['median']:+.1%} CPU.")


def sglang_capture(r):
    d = r["data"]
    v = d["variants"]
    base = v["bf16"]["tok_s"]
    rows = []
    for name, row in v.items():
        held = f"{row['expert_bytes'] / row['expert_bf16_bytes']:.3f}" if row.get("expert_bf16_bytes") else "-"
        rows.append([name, f"{row['tok_s']:.1f}", f"{row['tok_s'] / base:.2f}x",
                     f"{row['record_bytes'] / 1024:.0f} KiB" if row["record_bytes"] else "-", held])
    return (_table(["engine", "tok/s", "vs BF16", "records", "routed-expert bytes vs BF16"], rows)
            + f"\n\nTiny Qwen3-MoE with hidden {d['hidden']}, moe_intermediate {d['intermediate']}, {d['prompts']} "
              f"requests x {d['new_tokens']} tokens, best of {d['rounds']} alternating rounds, test-only `sgl_kernel` "
              f"stand-in." + _source(r))


def verl_records(r):
    d = r["data"]
    rows = []
    for s in d["stores"]:
        mb = s["resolved_bytes_per_rank"] / 1e6
        rows.append([f"`{s['store']}:`", f"{s['put_ms']:.0f} ms",
                     f"{s['resolve_ms_per_rank']:.0f} ms for {mb:.1f} MB ({s['micro_batches_per_rank']:.0f} micro-batches)",
                     f"{mb / (s['resolve_ms_per_rank'] / 1e3):.0f} MB/s"])
    return (_table(["store", f"put, all {d['samples']} records (rollout side)", "resolve, one rank's share",
                    "per-rank throughput"], rows)
            + f"\n\n{d['samples']} samples x ~{d['tokens']} tokens, {d['layers']} Qwen3-30B-A3B-shaped layers, compact "
              f"deeper half: {d['bytes_per_step'] / 1e6:.1f} MB per step "
              f"({d['bytes_per_step'] / d['tokens_per_step'] / 1e3:.1f} KB/token), {d['dp']} data-parallel ranks; "
              f"resolving includes decoding and checking every tensor's SHA-256." + _source(r))


def rl_miniature(r):
    sys.path.insert(0, str(REPO))
    from trace_fp4.rl.experiment import table

    c = r["config"]
    return (table(r) + f"\n\n{c['steps']} steps per arm, {c['prompts_per_step']} prompts x {c['group_size']} samples per "
            f"step, lr {c['lr']}; {r['wall_s'] / 60:.0f} min in all. Made by `make rl-miniature`; CPU: {_cpu(r['cpu'])}.\n")


RENDERERS = {
    "align": ("align", align),
    "align_details": ("align", align_details),
    "guidance_size": ("guidance_size", guidance_size),
    "kernels": ("kernels", kernels),
    "megatron_step": ("megatron_step", megatron_step),
    "kv_capacity": ("kv_capacity", kv_capacity),
    "record_travel": ("record_travel", record_travel),
    "vllm_capture": ("vllm_capture", vllm_capture),
    "vllm_capture_native": ("vllm_capture_native", vllm_capture),  # --cpu-native, its own run
    "sglang_capture": ("sglang_capture", sglang_capture),
    "verl_records": ("verl_records", verl_records),
    "rl_miniature": ("rl_miniature", rl_miniature),
}


def render(text: str, path: Path) -> str:
    def block(m):
        name = m.group("name")
        if name not in RENDERERS:
            raise SystemExit(f"{path}: unknown results block {name!r} (known: {', '.join(RENDERERS)})")
        source, fn = RENDERERS[name]
        result = _load(source)
        if result is None:
            print(f"{path.name}: {name}: bench/results/{source}.json missing, block left as it is", file=sys.stderr)
            return m.group(0)
        return m.group(1) + fn(result) + m.group(4)

    return BLOCK.sub(block, text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs from its JSON")
    args = ap.parse_args()
    stale = []
    for path in TARGETS:
        if not path.exists():
            continue
        old = path.read_text()
        new = render(old, path)
        if new != old:
            stale.append(path.relative_to(REPO))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("tables differ from bench/results: " + ", ".join(map(str, stale)), file=sys.stderr)
        sys.exit(1)
    print(("stale: " if args.check else "rewrote: ") + (", ".join(map(str, stale)) or "nothing"))


if __name__ == "__main__":
    main()
