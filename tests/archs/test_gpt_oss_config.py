"""gpt-oss config.json checks: read_config refuses what the engines or the converter cannot run (an
MXFP4 checkpoint, another swiglu_limit, bad layer_types, a missing field, another rope) naming it, and
`trace-fp4 align --model` turns that into one line and exit status 2 before any engine starts (the
real CLI in a subprocess, once: each start costs tens of seconds on a loaded 2-core machine)."""

import subprocess
import sys

import pytest

from align_helpers import config_variant
from trace_fp4.archs.gpt_oss import build_tiny
from trace_fp4.hf_checkpoint import CheckpointError, read_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("gpt_oss") / "tiny")


def test_the_tiny_checkpoint_reads_as_every_layer_moe_with_kv(tiny):
    hf = read_config(tiny)
    shape = hf.model_shape()
    assert hf.architecture == "GptOssForCausalLM" and shape.num_experts == 8 and shape.moe_intermediate_size == 32
    assert all(shape.layer_sites(i) == ("moe_fc1_in", "moe_fc2_in", "k", "v") for i in range(shape.num_layers))


# case -> (the edited config.json, the error's words)
CASES = {
    "mxfp4": (lambda c: {**c, "quantization_config": {"quant_method": "mxfp4"}}, "MXFP4 gpt-oss checkpoint"),
    "swiglu_limit": (lambda c: {**c, "swiglu_limit": 5.0}, "swiglu_limit=5.0"),
    "layer_types": (lambda c: {**c, "layer_types": ["sliding_attention"]}, "layer_types must list 4 entries"),
    "sliding_window": (lambda c: {k: v for k, v in c.items() if k != "sliding_window"}, "sliding_window=None"),
    "rope": (lambda c: {**c, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_type='default'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_read_config_refuses_by_name(case, tiny, tmp_path):
    edit, message = CASES[case]
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace("[", r"\[")):
        read_config(config_variant(tiny, tmp_path, edit))


def test_align_refuses_an_mxfp4_checkpoint_before_an_engine_starts(tiny, tmp_path):
    edit, message = CASES["mxfp4"]
    d = config_variant(tiny, tmp_path, edit)
    proc = subprocess.run([sys.executable, "-m", "trace_fp4.cli", "align", "--model", str(d)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line and "warn" not in line]
    assert message in proc.stderr and len([line for line in lines if "error" in line.lower()]) <= 1, proc.stderr[-2000:]
