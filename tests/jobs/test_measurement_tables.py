"""The measurement tables in README.md and docs/measurements.md are rendered from bench/results/*.json
(bench/render_results.py): a table edited by hand, or a JSON re-measured without re-rendering, fails here."""

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_results", REPO / "bench" / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_rendered_table_equals_its_json():
    rr = _renderer()
    for path in rr.TARGETS:
        text = path.read_text()
        assert rr.BLOCK.search(text), f"{path} has no rendered results block"
        assert rr.render(text, path) == text, f"{path.relative_to(REPO)}: re-run bench/render_results.py"


def test_a_changed_figure_changes_the_table(monkeypatch):
    rr = _renderer()
    align = json.loads((REPO / "bench" / "results" / "align.json").read_text())
    align["modes"]["fp4_rtn"]["codeword_mismatch_rate"] = 0.5
    monkeypatch.setattr(rr, "_load", lambda name: align if name == "align" else None)
    readme = REPO / "README.md"
    text = readme.read_text()
    rendered = rr.render(text, readme)
    assert rendered != text and "50.000%" in rendered


def test_the_prepared_sparse_step_and_its_preparation_are_rendered(monkeypatch):
    rr = _renderer()
    step = json.loads((REPO / "bench" / "results" / "megatron_step.json").read_text())
    step["data"]["step_s"]["sparse_native_prepared"] = 0.150
    step["data"]["prep_s"] = {"sparse_native": 0.0123}
    table = rr.megatron_step(step)
    row = next(line for line in table.splitlines() if "record tables prepared before the step" in line)
    rtn = step["data"]["step_s"]["fp4_rtn_native"]
    assert "| 150.0 |" in row and f"{0.150 / rtn:.2f}x FP4 RTN" in row  # against the native RTN step
    assert "took 12.3 ms per micro-batch" in table


def test_paired_engine_ratios_are_rendered_under_the_capture_table():
    rr = _renderer()
    run = json.loads((REPO / "bench" / "results" / "vllm_capture.json").read_text())
    assert "Paired (" not in rr.vllm_capture(run) or "paired" in run["data"]  # only from a --paired run
    ratio = lambda m, lo, hi: {"median": m, "min": lo, "max": hi, "per_pass": [lo, m, hi]}  # noqa: E731
    run["data"]["paired"] = {"passes": 3, "native_vs_bf16_tok_s": ratio(0.618, 0.616, 0.714),
                             "capture_overhead_wall": ratio(0.186, 0.154, 0.272),
                             "capture_overhead_cpu": ratio(0.188, 0.153, 0.265)}
    table = rr.vllm_capture(run)
    assert "Paired (3 passes" in table
    assert "FP4 native 0.618x BF16 tok/s [0.616, 0.714]" in table
    assert "capture on native +18.6% wall [+15.4%, +27.2%], +18.8% CPU" in table


def test_paired_trainer_steps_are_rendered_under_the_step_table():
    rr = _renderer()
    step = json.loads((REPO / "bench" / "results" / "megatron_step.json").read_text())
    assert "Paired (" not in rr.megatron_step(step) or "paired" in step["data"]  # only from a --paired run
    spread = lambda m, lo, hi: {"median": m, "min": lo, "max": hi, "per_pass": [lo, m, hi]}  # noqa: E731
    step["data"]["paired"] = {"backend": "native", "passes": 3, "sparse_vs_rtn_wall": spread(1.183, 1.141, 1.212),
                              "sparse_vs_rtn_cpu": spread(1.171, 1.150, 1.190),
                              "wall_minus_cpu_ratio": spread(0.012, -0.009, 0.022),
                              "sparse_minus_rtn_wall_s": spread(0.0151, 0.0122, 0.0198),
                              "sparse_minus_rtn_cpu_s": spread(0.0233, 0.0201, 0.0260)}
    table = rr.megatron_step(step)
    assert "Paired (3 passes on the native path" in table
    assert "sparse 1.183x FP4 RTN wall [1.141, 1.212], 1.171x CPU [1.150, 1.190] (wall minus CPU +0.012)" in table
    assert "sparse minus RTN +15.1 ms wall [+12.2, +19.8], +23.3 ms CPU [+20.1, +26.0]" in table
