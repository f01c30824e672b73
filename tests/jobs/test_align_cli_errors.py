"""`trace-fp4 align --model` refuses a bad model directory before any engine starts: one line on stderr,
exit status 2, naming the field. The real CLI in a subprocess; each case fails within seconds (an
engine start would take far longer and print its own traceback)."""

import os
import subprocess
import sys
import time

import pytest

from align_helpers import config_variant
from trace_fp4.tiny_model import build_tiny_qwen3_moe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny") / "moe")


def _without(key):
    def edit(cfg):
        cfg.pop(key)
        return cfg
    return edit


def _with(**kw):
    def edit(cfg):
        cfg.update(kw)
        return cfg
    return edit


CASES = [
    ("config_is_a_list", lambda cfg: [cfg], "holds a JSON list, expected an object"),
    ("no_num_hidden_layers", _without("num_hidden_layers"), "config.json has no 'num_hidden_layers'"),
    ("moe_intermediate_40", _with(moe_intermediate_size=40), "moe_intermediate_size=40 is not divisible by 16"),
    ("hidden_not_int", _with(hidden_size="64"), "hidden_size='64' must be an integer >= 1"),
    ("top_k_above_experts", _with(num_experts_per_tok=99), "num_experts_per_tok=99 exceeds the"),
    ("kv_heads_not_divisor", _with(num_key_value_heads=3), "is not a multiple of num_key_value_heads=3"),
    ("head_dim_40", _with(head_dim=40), "head_dim=40 is not divisible by 16"),
    ("bad_trace_config", _with(quantization_config={"quant_method": "trace_fp4", "guided_layers": [0, 99]}),
     r"guided_layers names [99] but the model has"),
    ("other_quantization", _with(quantization_config={"quant_method": "fp8"}), "already quantized (quant_method='fp8')"),
    ("not_json", lambda cfg: "{", "not valid JSON"),
]


SUBPROCESS = ("config_is_a_list", "no_num_hidden_layers", "moe_intermediate_40")  # the three, via the real CLI


@pytest.mark.parametrize("name,edit,match", CASES, ids=[c[0] for c in CASES])
def test_bad_model_is_one_line_and_exit_2_before_any_engine(tiny, tmp_path, capsys, name, edit, match):
    d = config_variant(tiny, tmp_path, edit)
    workdir = tmp_path / "work"
    argv = ["align", "--model", str(d), "--workdir", str(workdir)]
    t0 = time.monotonic()
    if name in SUBPROCESS:
        p = subprocess.run([sys.executable, "-m", "trace_fp4.cli", *argv],
                           capture_output=True, text=True, env=os.environ.copy(), timeout=300)
        rc, err = p.returncode, p.stderr
    else:  # the same entry point in this process (cheaper: no interpreter start)
        from trace_fp4.cli import main

        rc = main(argv)
        err = capsys.readouterr().err
    elapsed = time.monotonic() - t0
    assert rc == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trace-fp4 align: error: "), err[-2000:]
    assert match in lines[0]
    assert not workdir.exists(), "a workdir was created: the check ran after the job started"
    assert elapsed < 60, f"took {elapsed:.0f} s: did an engine start?"


def test_missing_weights_are_named(tiny, tmp_path, capsys):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text((tiny / "config.json").read_text())
    from trace_fp4.cli import main

    assert main(["align", "--model", str(d)]) == 2
    err = capsys.readouterr().err
    assert "no *.safetensors weights" in err and err.count("\n") == 1
