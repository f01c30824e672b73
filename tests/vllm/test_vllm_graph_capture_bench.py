"""The CPU-runnable parts of the end-to-end GPU check (bench/gpu_engine.py, run by bench/gpu_check.py on
a CUDA machine): the record comparison that decides "records identical between graph replay and
eager", and the figures it reports. The engine run itself needs CUDA and is not run here."""

import sys
from pathlib import Path

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


def test_summary_reports_overhead_and_identity():
    rows = {"no graphs + capture": {"tok_s": 100.0, "seconds": 2.0}, "graphs + capture": {"tok_s": 300.0, "seconds": 1.03},
            "graphs, no capture": {"tok_s": 310.0, "seconds": 1.0}}
    out = gpu_engine.summarize(rows, {"records": 3, "identical": 3, "first_difference": None})
    assert abs(out["capture_overhead"] - 0.03) < 1e-9 and out["graphs_vs_no_graphs_tok_s"] == 3.0
    assert out["records_identical"] is True
    assert gpu_engine.summarize(rows, {"records": 3, "identical": 2, "first_difference": "x"})["records_identical"] is False
    # Every arm the summary reads is one the run makes.
    assert {a[0] for a in gpu_engine.ARMS} == set(rows)


def test_gpu_check_imports_cleanly_without_cuda():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import gpu_check

    assert callable(gpu_check.engine_check) and callable(gpu_check.main)
