"""`bench/megatron_step.py --paired N` (bench/megatron_paired.py): the FP4 RTN and sparse steps of a tiny
Megatron MoE alternate in one process and every ratio is taken within its pass. Runs the bench itself on
the native path (real models, real records, real decode) with a small N."""

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import megatron_paired  # noqa: E402


def test_paired_steps_alternate_and_each_ratio_is_within_its_pass(tmp_path, monkeypatch):
    import megatron_step

    out = tmp_path / "step.json"
    monkeypatch.setattr(sys, "argv", ["megatron_step.py", "--layers", "1", "--hidden", "64", "--seq", "8", "--batch", "2",
                                      "--steps", "1", "--warmup", "1", "--cpu-native", "--paired", "3", "--json", str(out)])
    before = os.environ.get("TRACE_FP4_CPU_BACKEND")
    try:
        megatron_step.main()
    finally:  # the bench sets the backend before every step: the tests after this one get theirs back
        if before is None:
            os.environ.pop("TRACE_FP4_CPU_BACKEND", None)
        else:
            os.environ["TRACE_FP4_CPU_BACKEND"] = before
    assert os.environ.get("TRACE_FP4_CPU_BACKEND") == before
    p = json.loads(out.read_text())["data"]["paired"]
    assert p["passes"] == 3 and p["backend"] == "native"
    rtn, sparse = p["times"]["fp4_rtn"], p["times"]["sparse"]
    assert len(rtn["wall_s"]) == len(sparse["cpu_s"]) == 3
    assert all(t > 0 for t in rtn["wall_s"] + rtn["cpu_s"] + sparse["wall_s"] + sparse["cpu_s"])
    # each pass's ratio is that pass's sparse over that pass's RTN, and the summary is their median / min / max
    wall = [s / r for r, s in zip(rtn["wall_s"], sparse["wall_s"])]
    cpu = [s / r for r, s in zip(rtn["cpu_s"], sparse["cpu_s"])]
    assert p["sparse_vs_rtn_wall"]["per_pass"] == pytest.approx(wall)
    assert p["sparse_vs_rtn_cpu"]["per_pass"] == pytest.approx(cpu)
    assert p["sparse_vs_rtn_wall"]["median"] == pytest.approx(sorted(wall)[1])
    assert (p["sparse_vs_rtn_cpu"]["min"], p["sparse_vs_rtn_cpu"]["max"]) == pytest.approx((min(cpu), max(cpu)))
    assert p["wall_minus_cpu_ratio"]["per_pass"] == pytest.approx([w - c for w, c in zip(wall, cpu)])
    assert p["sparse_minus_rtn_wall_s"]["per_pass"] == pytest.approx([s - r for r, s in zip(rtn["wall_s"], sparse["wall_s"])])


class _Clock:
    """A step whose (wall, CPU) seconds are fixed, logging the order the passes call the steps in."""

    def __init__(self, name, log, wall, cpu):
        self.name, self.log, self.wall, self.cpu = name, log, wall, cpu

    def step(self, record=True):
        assert record is False  # the paired steps stay out of the rows' bests
        self.log.append(self.name)
        return self.wall, self.cpu


def test_the_order_swaps_every_pass_and_no_pass_is_refused():
    log = []
    p = megatron_paired.paired(_Clock("r", log, 0.1, 0.2), _Clock("s", log, 0.12, 0.3), 4)
    assert log == ["r", "s", "s", "r", "r", "s", "s", "r"]  # neither step always follows the other
    assert p["sparse_vs_rtn_wall"]["median"] == pytest.approx(1.2) and p["sparse_vs_rtn_cpu"]["max"] == pytest.approx(1.5)
    assert p["wall_minus_cpu_ratio"]["median"] == pytest.approx(-0.3)
    assert p["sparse_minus_rtn_cpu_s"]["min"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="at least one pass"):
        megatron_paired.paired(_Clock("r", log, 1, 1), _Clock("s", log, 1, 1), 0)
