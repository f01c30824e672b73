"""bench/gpu_grouped_ablation.py, the prepared GPU timing of the grouped GEMM with one stage left out at a
time: on a CPU every variant compiles for sm_90 and the exact ones equal the torch reference (interpreter),
so a lent GPU's minutes are not spent on a variant that cannot build; a kernel edit that removes a variant's
anchor is an error naming the variant."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_grouped_ablation as ablation  # noqa: E402


def test_every_variant_compiles_for_cuda_and_the_exact_ones_are_exact(tmp_path):
    out = tmp_path / "smoke.json"
    assert ablation.main(["--cpu-smoke", "--json", str(out)]) == 0
    import json

    report = json.loads(out.read_text())
    assert set(report) == set(ablation.VARIANTS)
    assert all(r["compiles_for_cuda"] for r in report.values())
    assert [n for n, r in report.items() if r["exact"]] == ["kernel", "no_capture", "unroll2"]


def test_a_kernel_without_a_variants_anchor_is_an_error_naming_it():
    src = ablation.KERNEL.read_text().replace(ablation.DOT, "partial = acc")
    with pytest.raises(ValueError, match="no_dot"):
        ablation.no_dot(src)
    with pytest.raises(ValueError, match="unroll2"):
        ablation.unroll(src.replace(ablation.K_LOOP, ""), 2)
