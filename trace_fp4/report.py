"""The align job's output: a table per mode on the terminal, the same figures as JSON, a PNG plot.

JSON layout (other tools read these names):
  {"model": ..., "engine": ..., "num_samples": N, "num_generated_tokens": N,
   "cpu": {"model": str, "features": [avx512*, amx*, ...], "torch_cpu_capability": str},  # kernels differ by CPU
   "block_scale": "6" | "4over6",    # TraceConfig.block_scale of the FP4 rollout and the trainer
   "engine_counters": {name: int},   # the FP4 rollout engine plugin's counters: fallbacks, saturated.<layer>.<site>
   "trainer": {"parallel": {tp, ep, cp, pp: int},  # --trainer-parallel; with a layout other than all 1 also
               "layout": {...}},                 # trace_fp4/trainer_layout.py: per-layer trace_full mismatch,
                                                 # |dlogp| vs the single-rank trainer (bf16 and trace_full), seconds
   "modes": {"bf16" | "fp4_rtn" | "trace_full" | "trace_compact" | "trace_sparse" | "trace_default": {
        "codeword_mismatch_rate": float | null,     # null for bf16: nothing is quantized there
        "codeword_mismatch_rate_adjacent": float | null,  # among sites whose rollout code neighbours the trainer value
        "non_adjacent_rate": float | null,          # sites guidance cannot reach (reported, not hidden)
        "logprob_abs_diff_mean": float, "logprob_abs_diff_max": float, "k3_kl": float,
        "logprob_abs_diff_vs_bf16": float,          # this mode's |delta logp| / the bf16 yardstick's
        "guidance_bytes_per_token": float,          # record tensors (payload) per token
        "guidance_bits_per_value": float,           # record tensors, bits per captured value (every layer's sites)
        "guidance_bits_per_value_file": float,      # the same with the safetensors header and metadata
        "mismatch_removed_vs_rtn": float | null,     # 1 - mismatches / the same-activation RTN mismatches
        "sparse_decode": {...}, "sparse_decode_by_site": {"layer<L>/<site>": {...}},  # trace_sparse only:
                                                    # segments, unresolved code / scale segments, code flips
        "fallback_rows": float,                     # rows rounded without a record (counted), and
        "fallback_rows_by_reason": {...},           # by reason: not_guided, no_record, route_mismatch
        "rtn_mismatch_rate_same_activations": float,  # the trainer's own RTN on this mode's activations
        "quantization_error_vs_bf16": float,        # that RTN's relative squared error vs the BF16 values,
        "quantization_error_vs_bf16_default_rule": float,  # and the default "6" rule's on the same values
        "trainer_logprobs": [[float per generated token] per sample],
        "trainer_counters": {"saturated_values.<site>", "routing_fallback_rows", "spec.<name>": float},
        "per_layer": [{"layer": i, "<site>": mismatch rate, "<site>_rtn": own-RTN rate on the same
                       activations, "<site>_non_adjacent": rate, "<site>_mismatch_adjacent": rate,
                       sparse modes: "<site>_audit": audited residual, "<site>_audit_values": int,
                       "<site>_rates": [amax_bits, scale_bits, code_bits]}, ...],
        sparse modes: "audit": {"audited_residual", "true_residual", "audit_values", "audit_rows",
                                "audit_rtn_flips", "sampling_error_2sigma" (design-based: rows drawn per
                                record, layer and site; audit_sampling.py), "sampling_error_2sigma_binomial",
                                "expected_audit_mismatch", "p_audit_sees_none", "rows_with_mismatch", "site_rows",
                                "true_mismatch_at_audited_rows", "audit_counts_true_rows",
                                "agrees_within_sampling_error"},
                      "sparse_rates": {"<layer>.<site>": [amax_bits, scale_bits, code_bits]}}},
        # "trace_sparse_calibrated": as trace_sparse, the kept calibration pass (present only when one was kept)
   "rate_calibration": {"controller": {...}, "measured_with": str, "residual_by_site": {"<layer>.<site>": float | null},
                        "changes": [{"site", "from", "to", "residual", "target", "flip_density",
                                     "charged_from_downstream", "audit_values", "version"}],  # the kept passes'
                        "passes": [{"changes", "mismatched_values", "rtn_mismatched_values", "mismatch_removed_vs_rtn",
                                    "residual_by_site", "rates_version", "kept", "seconds",
                                    "unresolved_code_segments": {"<layer>.<site>": int},  # the changed sites', after it
                                    "futile_sites_run_anyway": [str], "next": str}],  # "continue: ..." or "stop: ..."
                        "passes_run": int, "max_passes": int, "stop_share_of_rtn": float, "stopped": str,
                        # a pass predicted to gain nothing (rate_calibration.futile_changes) and not run, or null
                        "skipped_pass": {"changes": [...], "unresolved_code_segments": {"<layer>.<site>": int}} | None,
                        "ran_calibrated_pass": bool, "kept_rates": bool, "final_mismatch_removed_vs_rtn": float,
                        "bits_per_value_change_by_site": {...}, "bits_per_value_change_by_layer": {"<layer>": float},
                        "sparse_rates": {...}}}
"""

import json
import math
from pathlib import Path

MODES = ("bf16", "fp4_rtn", "trace_full", "trace_compact", "trace_sparse", "trace_default")
MODE_TITLES = {
    "bf16": "BF16 rollout vs BF16 trainer",
    "fp4_rtn": "FP4 rollout vs FP4 round-to-nearest trainer (plain QAT)",
    "trace_full": "TRACE, full guidance",
    "trace_compact": "TRACE, compact guidance at every layer",
    "trace_sparse": "TRACE, sparse guidance (syndromes) at every layer",
    "trace_default": "TRACE, the paper's compact default (compact guidance, deeper half of the layers)",
}
SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v", "kv_latent")


def present_sites(result: dict) -> list[str]:
    """The sites the model has in at least one layer (MLA models have kv_latent, not k and v)."""
    rows = [r for m in result["modes"].values() for r in m.get("per_layer", [])]
    return [s for s in SITES if any(s in r for r in rows)]


def _fmt(value, pct=False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{100 * value:.3f}%" if pct else f"{value:.3e}" if abs(value) < 1e-2 and value else f"{value:.4f}"


def table(result: dict) -> str:
    lines = [
        f"model: {result['model']}   engine: {result['engine']}   samples: {result['num_samples']}   "
        f"generated tokens: {result['num_generated_tokens']}",
        *([cpu_line(result["cpu"])] if "cpu" in result else []),
        "",
        f"{'mode':<14} {'mismatch':>10} {'mis|adj':>10} {'non-adj':>9} {'|dlogp|':>10} {'vs bf16':>8} "
        f"{'k3 KL':>10} {'bytes/tok':>10} {'bits/val':>9} {'removed':>9} {'fallback':>9}",
    ]
    for mode in MODES:
        m = result["modes"][mode]
        lines.append(
            f"{mode:<14} {_fmt(m['codeword_mismatch_rate'], True):>10} "
            f"{_fmt(m['codeword_mismatch_rate_adjacent'], True):>10} {_fmt(m['non_adjacent_rate'], True):>9} "
            f"{_fmt(m['logprob_abs_diff_mean']):>10} {_fmt(m['logprob_abs_diff_vs_bf16']):>8} "
            f"{_fmt(m['k3_kl']):>10} {m['guidance_bytes_per_token']:>10.1f} {m['guidance_bits_per_value']:>9.3f} "
            f"{_fmt(m.get('mismatch_removed_vs_rtn'), True):>9} {m['fallback_rows']:>9.0f}"
        )
    rtn = result["modes"].get("fp4_rtn", {})
    if rtn.get("quantization_error_vs_bf16") is not None:
        lines += ["", f"block scale {result.get('block_scale', '6')}: quantization error of the captured sites vs their "
                  f"BF16 values (relative squared error, trainer's own RTN on the fp4_rtn activations) "
                  f"{_fmt(rtn['quantization_error_vs_bf16'], True)}; default rule (6) on the same values "
                  f"{_fmt(rtn['quantization_error_vs_bf16_default_rule'], True)}"]
    sparse = result["modes"].get("trace_sparse", {}).get("sparse_decode")
    if sparse:
        lines += ["", "trace_sparse decode: {:.0f} segments, {:.0f} with unresolved codes, {:.0f} with unresolved scales, "
                  "{:.0f} mantissa bits flipped from the trainer's own rounding, {:.0f} rows' amax list-decoded".format(
                      sparse.get("sparse_segments", 0), sparse.get("sparse_unresolved_code_segments", 0),
                      sparse.get("sparse_unresolved_scale_segments", 0), sparse.get("sparse_code_flips", 0),
                      sparse.get("sparse_amax_list_rows", 0))]
    for mode in ("trace_sparse", "trace_sparse_calibrated"):
        audit = result["modes"].get(mode, {}).get("audit")
        if audit:
            lines.append(
                f"{mode} audit: residual {_fmt(audit['audited_residual'], True)} on {audit['audit_values']:.0f} audited "
                f"values ({audit['audit_rows']:.0f} rows) vs true {_fmt(audit['true_residual'], True)} "
                f"(2 sigma {_fmt(audit['sampling_error_2sigma'], True)}: "
                f"{'agree' if audit['agrees_within_sampling_error'] else 'DISAGREE'})"
                + (f"; {audit['rows_with_mismatch']} of {audit['site_rows']} rows hold the residual, "
                   f"P(audit sees none) {audit['p_audit_sees_none']:.2f}" if "p_audit_sees_none" in audit else ""))
    cal = result.get("rate_calibration")
    if cal is not None:
        if "trace_sparse_calibrated" in result["modes"]:
            m = result["modes"]["trace_sparse_calibrated"]
            net = {}  # per site, from the default rates to the kept ones (a site may move in several passes)
            for c in cal["changes"]:
                net[c["site"]] = (net.get(c["site"], (c["from"],))[0], c["to"])
            moved = ", ".join(f"{site} {a}->{b}" for site, (a, b) in sorted(net.items()))
            moved += " ([amax, scale, code] bits)"
            lines.append(f"rate calibration ({cal.get('passes_run', 1)} passes, stopped: {cal.get('stopped', '-')}): {moved}; "
                         f"last recompute: mismatch {_fmt(m['codeword_mismatch_rate'], True)}, "
                         f"{m['guidance_bits_per_value']:.3f} bits/val, removed {_fmt(m.get('mismatch_removed_vs_rtn'), True)}, "
                         f"|dlogp| {_fmt(m['logprob_abs_diff_mean'])}")
        elif cal["ran_calibrated_pass"]:
            lines.append(f"rate calibration: kept the default rates ({cal.get('stopped', '-')})")
        else:
            lines.append("rate calibration: the controller kept the default rates (no site's residual gave evidence "
                         "to move them): no second pass")
    lines.append("bits/val: record tensors per captured value (every layer's sites); with the safetensors header: "
                 + ", ".join(f"{m} {result['modes'][m]['guidance_bits_per_value_file']:.3f}" for m in MODES[2:]))
    for mode in MODES[1:]:
        per_layer = result["modes"][mode]["per_layer"]
        lines += ["", f"{MODE_TITLES[mode]}: codeword mismatch per layer and site"]
        sites = present_sites(result)
        lines.append(f"  {'layer':>5} {'kind':>8} " + " ".join(f"{s:>11}" for s in sites))
        for row in per_layer:
            # "-": the layer has no such site (dense MLP, linear attention); "n/a": not measured.
            cells = [_fmt(row.get(s), True) if s in row else "-" for s in sites]
            lines.append(f"  {row['layer']:>5} {row.get('kind', ''):>8} " + " ".join(f"{c:>11}" for c in cells))
    layout = (result.get("trainer") or {}).get("layout")
    if layout:
        name = ",".join(f"{k}={v}" for k, v in layout["parallel"].items() if v != 1)
        full, agree = layout["trace_full"], layout["logprob_vs_single_rank"]
        worst = max((v for row in full["per_layer"] for k, v in row.items() if k != "layer" and not k.endswith("_rtn")),
                    default=0.0)
        lines += ["", f"trainer layout {name} ({layout['world_size']} gloo ranks) vs the single-rank trainer:",
                  f"  trace_full mismatch {_fmt(full['codeword_mismatch_rate'], True)} (worst layer/site "
                  f"{_fmt(worst, True)}); |dlogp| vs single rank, mean / max: trace_full "
                  f"{_fmt(agree['trace_full']['logprob_abs_diff_mean'])} / {_fmt(agree['trace_full']['logprob_abs_diff_max'])}, "
                  f"Megatron BF16 {_fmt(agree['bf16']['logprob_abs_diff_mean'])} / {_fmt(agree['bf16']['logprob_abs_diff_max'])}"]
    return "\n".join(lines)


def cpu_line(cpu: dict) -> str:
    from .cpu_info import describe

    return describe(cpu)


def write_json(result: dict, path) -> None:
    Path(path).write_text(json.dumps(result, indent=2, sort_keys=True, allow_nan=False))


def write_plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    styles = {"fp4_rtn": ("o", "-"), "trace_full": ("s", "-"), "trace_compact": ("x", "--"), "trace_sparse": ("d", "-."),
              "trace_default": ("^", ":")}
    sites = present_sites(result)
    fig, axes = plt.subplots(1, len(sites), figsize=(4 * len(sites), 3.4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, site in zip(axes, sites):
        for mode in MODES[1:]:
            rows = [r for r in result["modes"][mode]["per_layer"] if site in r]
            marker, line = styles[mode]
            layers = [r["layer"] for r in rows]
            ax.plot(layers, [100 * (r.get(site) or 0.0) for r in rows], marker=marker, linestyle=line, label=mode)
            ax.set_xticks(layers)
        ax.set_title(site)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("codeword mismatch vs rollout (%)")
    axes[-1].legend()
    fig.suptitle(f"trace-fp4 align: {result['model']} ({result['engine']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
