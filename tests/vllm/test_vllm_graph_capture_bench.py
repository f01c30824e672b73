"""The CPU-runnable parts of the end-to-end GPU check (bench/gpu_engine.py, run by bench/gpu_check.py on
a CUDA machine): the record comparisons that decide "records identical between graph replay and the
run without graphs" and report eager's agreement, the figures it reports, and its --dry-run (the plan,
checked against trace_fp4's and vLLM's own config classes). The engine run itself needs CUDA and has not
been run here."""

import sys
from pathlib import Path

import pytest

import trace_kernels as tk
from record_factory import captured_builder

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_engine  # noqa: E402

CONFIG = tk.TraceConfig(guidance="full", guided_layers="all")


def _records(seeds):
    return [captured_builder(CONFIG, steps=(3, 1), seed=s).build() for s in seeds]


def test_identical_records_are_recognised_and_a_single_difference_is_named():
    assert gpu_engine.compare_records(_records([0, 1]), _records([0, 1])) == {
        "records": 2, "identical": 2, "first_difference": None}
    cmp = gpu_engine.compare_records(_records([0, 1]), _records([0, 2]))
    assert cmp["identical"] == 1 and cmp["first_difference"].startswith("record 1: ")
    assert gpu_engine.compare_records(_records([0]), _records([0, 1]))["identical"] == 0


def test_eager_records_are_compared_only_where_the_tokens_agree():
    got = gpu_engine.compare_where_tokens_agree(_records([0, 1, 2]), _records([0, 5, 2]), [[1], [2], [3]], [[1], [2], [4]])
    # Request 2's tokens differ (not compared); request 1's records differ.
    assert (got["requests"], got["tokens_agree"], got["records"], got["identical"]) == (3, 2, 2, 1)
    assert got["first_difference"].startswith("record 1: ")


def test_summary_reports_overhead_and_identity():
    rows = {gpu_engine.EAGER: {"tok_s": 50.0, "seconds": 4.0}, gpu_engine.NO_GRAPHS: {"tok_s": 100.0, "seconds": 2.0},
            gpu_engine.GRAPHS: {"tok_s": 300.0, "seconds": 1.03}, gpu_engine.GRAPHS_NO_CAPTURE: {"tok_s": 310.0, "seconds": 1.0},
            gpu_engine.PACKED_KV: {"tok_s": 320.0, "seconds": 0.97}}
    out = gpu_engine.summarize(rows, {"records": 3, "identical": 3, "first_difference": None})
    assert abs(out["capture_overhead"] - 0.03) < 1e-9 and out["graphs_vs_no_graphs_tok_s"] == 3.0
    assert out["graphs_vs_eager_tok_s"] == 6.0 and out["records_identical"] is True
    assert gpu_engine.summarize(rows, {"records": 3, "identical": 2, "first_difference": "x"})["records_identical"] is False
    # Every arm the summary reads is one the run makes.
    assert {a[0] for a in gpu_engine.ARMS} == set(rows)


def test_gpu_check_dry_run_checks_and_prints_its_plan(tmp_path, capsys):
    import gpu_check

    assert gpu_check.main(["--dry-run", "--model-dir", str(tmp_path / "model"), "--engine-requests", "8"]) == 0
    assert (tmp_path / "model" / "config.json").is_file()
    out = capsys.readouterr().out
    assert '"dry_run": true' in out and "tests/kernels/test_grouped_mm.py" in out
    planned = {a["label"]: a for a in gpu_engine.plan(str(tmp_path / "model"), 8, 4, 1)["arms"]}
    arms = {label: a["llm_kwargs"] for label, a in planned.items()}
    assert arms[gpu_engine.EAGER] == {"enforce_eager": True}
    # The packed-KV arm: TRITON_ATTN with the Triton decode read, in the graphs.
    assert arms[gpu_engine.PACKED_KV]["attention_config"] == {"backend": "TRITON_ATTN"}
    assert planned[gpu_engine.PACKED_KV]["env"] == {"TRACE_FP4_KV_DECODE_ATTENTION": "triton"}
    # Graph arms capture exactly the decode batch (no padded rows); the no-graph arm is the same compiled model.
    assert arms[gpu_engine.GRAPHS]["compilation_config"] == {"cudagraph_capture_sizes": [8]}
    assert arms[gpu_engine.NO_GRAPHS]["compilation_config"] == {"cudagraph_mode": "NONE"}
    # A configuration vLLM would refuse is caught by the dry run, not on the GPU.
    bad = gpu_engine.ARMS + (("bad", gpu_engine.CAPTURE, {"cudagraph_mode": "SOMETIMES"}, True),)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu_engine, "ARMS", bad)
        with pytest.raises(Exception, match="SOMETIMES"):
            gpu_engine.plan(str(tmp_path / "model"), 8, 4, 1)
