"""`trace-fp4 align --model <tiny Qwen3-Next>` refuses before any engine starts, in one line that names
what the trainer side is missing (Megatron-Core's Gated DeltaNet needs Transformer Engine and fla here;
tests/archs/test_qwen3_next_megatron.py checks those facts), and a bad Qwen3-Next config.json is named too."""

import subprocess
import sys
import time

import pytest

from align_helpers import config_variant
from trace_fp4.archs import qwen3_next


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return qwen3_next.build_tiny(tmp_path_factory.mktemp("q3n") / "qwen3_next")


def _align(model, workdir, *, subprocess_cli: bool, capsys=None):
    argv = ["align", "--model", str(model), "--workdir", str(workdir)]
    t0 = time.monotonic()
    if subprocess_cli:
        p = subprocess.run([sys.executable, "-m", "trace_fp4.cli", *argv], capture_output=True, text=True, timeout=300)
        rc, err = p.returncode, p.stderr
    else:
        from trace_fp4.cli import main

        rc = main(argv)
        err = capsys.readouterr().err
    return rc, err, time.monotonic() - t0


def test_align_names_the_missing_trainer_side_before_any_engine(tiny, tmp_path):
    workdir = tmp_path / "work"
    rc, err, elapsed = _align(tiny, workdir, subprocess_cli=True)
    assert rc == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trace-fp4 align: error: "), err[-2000:]
    for words in ("Qwen3NextForCausalLM", "Gated DeltaNet", "Transformer Engine", "transformer_engine", "fla"):
        assert words in lines[0], words
    assert not workdir.exists(), "the job started before refusing"
    assert elapsed < 60, f"took {elapsed:.0f} s: did an engine start?"


def test_the_record_shape_follows_layer_types(tiny):
    from trace_fp4.hf_checkpoint import read_config

    hf = read_config(tiny)
    shape = hf.model_shape()
    assert shape.kv_layer_list() == [3] and shape.moe_layer_list() == [0, 1, 2, 3]
    assert [shape.layer_sites(i) for i in range(4)] == [("moe_fc1_in", "moe_fc2_in")] * 3 + [
        ("moe_fc1_in", "moe_fc2_in", "k", "v")
    ]


@pytest.mark.parametrize("edit,match", [
    (lambda c: {**c, "layer_types": ["linear_attention"] * 3}, "must name each of the 4 layers"),
    (lambda c: {**c, "layer_types": ["linear_attention"] * 3 + ["mamba"]}, "layer_types ['mamba'] are not supported"),
    (lambda c: {**c, "vocab_size": "384"}, "vocab_size='384' must be a positive integer"),
], ids=["layer_types_short", "layer_type_unknown", "vocab_not_int"])
def test_a_bad_qwen3_next_config_is_named(tiny, tmp_path, capsys, edit, match):
    d = config_variant(tiny, tmp_path, edit)
    rc, err, _ = _align(d, tmp_path / "work", subprocess_cli=False, capsys=capsys)
    assert rc == 2 and err.count("\n") == 1 and match in err, err
