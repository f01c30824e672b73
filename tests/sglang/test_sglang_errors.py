"""Bad trace_fp4 set-ups fail clearly when the SGLang engine starts, naming the problem."""

import pytest

import trace_sglang_plugin
from sglang_helpers import EngineError, EngineProcess, base_engine_kwargs, sglang_skip_reason, write_quantization_config
from trace_fp4.tiny_model import build_tiny_qwen3_dense, build_tiny_qwen3_moe

needs_sglang = pytest.mark.skipif(sglang_skip_reason() is not None, reason=str(sglang_skip_reason()))


def _start_fails(model_dir, tmp_path, **kw) -> str:
    with pytest.raises(EngineError) as err:
        with EngineProcess(base_engine_kwargs(model_dir, **kw), log_path=tmp_path / "engine.log"):
            pass
    return str(err.value)


@needs_sglang
def test_unknown_quantization_config_key_fails_at_start(tmp_path):
    model = build_tiny_qwen3_moe(tmp_path / "moe")
    write_quantization_config(model, {"quant_method": "trace_fp4", "guidance": "full", "guidence_layers": "all"})
    msg = _start_fails(model, tmp_path)
    assert "unknown TraceConfig key(s) ['guidence_layers']" in msg


@needs_sglang
def test_dense_model_is_refused_at_start(tmp_path):
    model = build_tiny_qwen3_dense(tmp_path / "dense")
    msg = _start_fails(model, tmp_path, quantization="trace_fp4")
    # the one per-layer definition (trace_kernels.model_shape_from_hf) names what is missing
    assert "trace_fp4 quantizes routed experts (Mixture-of-Experts models), but the config has none" in msg


@needs_sglang
def test_config_naming_layers_the_model_lacks_is_refused_at_start(tmp_path):
    model = build_tiny_qwen3_moe(tmp_path / "moe")
    write_quantization_config(model, {"quant_method": "trace_fp4", "guidance": "full", "full_layers": [7]})
    msg = _start_fails(model, tmp_path)
    assert "full_layers names [7] but model" in msg and "has 4 layers" in msg


def test_other_sglang_versions_are_refused(monkeypatch):
    from trace_sglang_plugin import versions

    monkeypatch.setattr(versions, "sglang_version", lambda: "0.5.22")
    with pytest.raises(trace_sglang_plugin.UnsupportedSGLangVersion, match="supports SGLang 0.5.23 only; found SGLang 0.5.22"):
        versions.check_sglang_version()
