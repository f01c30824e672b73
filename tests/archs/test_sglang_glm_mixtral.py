"""trace_fp4 in a real SGLang engine (CPU) on GLM-4.5 and Mixtral: the record has routing and moe sites
only for the routed-expert layers and K/V for every layer; its routing is SGLang's own top-k (GLM-4.5:
sigmoid + e_score_correction_bias), and its codes are quantize() of the engine's own tensors, seen by
SGLang's forward_hooks probe (sglang_probe.py) independently of the plugin."""

import pytest
import torch

import trace_kernels
from sglang_helpers import (
    EngineProcess, base_engine_kwargs, engine_env, sglang_skip_reason, write_quantization_config,
)
from trace_fp4.archs import glm4_moe, mixtral
from trace_sglang_plugin.transport import payload_from_meta_info, record_from_meta_info

pytestmark = pytest.mark.skipif(sglang_skip_reason() is not None, reason=str(sglang_skip_reason()))

FULL_ALL = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}
PROMPT = "Mixture of experts models route every token to a few experts, so most parameters stay idle."
# family -> (builder, SGLang's model module, the MoE block's attribute, routed-expert layers)
FAMILIES = {
    "glm4_moe": (glm4_moe.build_tiny, "glm4_moe", "mlp", [1, 2, 3]),
    "mixtral": (mixtral.build_tiny, "mixtral", "block_sparse_moe", [0, 1, 2, 3]),
}


def _probe_hooks(probe_dir, moe_attr):
    cfg = {"dir": str(probe_dir)}
    return [
        {"name": "trace_probe_moe", "target_modules": [f"model.layers.*.{moe_attr}.experts"],
         "hook_factory": "sglang_probe:moe_probe", "config": cfg},
        {"name": "trace_probe_attn", "target_modules": ["model.layers.*.self_attn.attn"],
         "hook_factory": "sglang_probe:attn_probe", "config": cfg},
    ]


@pytest.fixture(scope="module", params=list(FAMILIES))
def run(request, tmp_path_factory):
    name = request.param
    build, module, attr, moe_layers = FAMILIES[name]
    d = build(tmp_path_factory.mktemp(f"sglang_{name}") / name)
    write_quantization_config(d, FULL_ALL)
    probe_dir = tmp_path_factory.mktemp(f"probe_{name}")
    # SGLang imports only the model modules not disabled (test-only speed-up, see sglang_helpers)
    disabled = engine_env()["SGLANG_DISABLED_MODEL_ARCHS"].split(",")
    env = {"SGLANG_DISABLED_MODEL_ARCHS": ",".join(m for m in disabled if m != module)}
    kw = base_engine_kwargs(d, chunked_prefill_size=64, forward_hooks=_probe_hooks(probe_dir, attr))
    with EngineProcess(kw, env_extra=env, log_path=tmp_path_factory.mktemp("logs") / f"{name}.log") as eng:
        out = eng.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True})
    probe = {"moe": {}, "attn": {}}
    for f in sorted(probe_dir.glob("*.pt")):
        entry = torch.load(f)
        probe[f.stem.split("-")[1]].setdefault(entry["layer"], []).append(entry)
    return name, moe_layers, out, probe


def _rows(entries, key, n):
    return torch.cat([e[key] for e in entries])[:n]


def _same(a, b) -> bool:
    return torch.equal(a.scales, b.scales) and torch.equal(trace_kernels.dequantize(a), trace_kernels.dequantize(b))


def test_record_is_per_layer_and_holds_the_engines_codes(run):
    name, moe_layers, out, probe = run
    meta = out["meta_info"]
    record = record_from_meta_info(meta)
    counters = payload_from_meta_info(meta)["counters"]
    T = meta["prompt_tokens"] + meta["completion_tokens"] - 1
    assert record.num_tokens == T
    assert record.shape.moe_layer_list() == moe_layers
    assert sorted(probe["moe"]) == moe_layers  # SGLang's FusedMoE exists only in the MoE layers
    # Mixtral: the FusedMoE MixtralForCausalLM, not SGLang's QuantMixtralForCausalLM (architectures.py)
    assert (counters.get("mixtral_fused_moe_kept", 0) > 0) == (name == "mixtral"), counters
    shape = record.shape
    for layer in range(4):
        assert (counters.get(f"moe_calls.layer{layer}", 0) > 0) == (layer in moe_layers), counters
        assert counters.get(f"kv_writes.layer{layer}", 0) > 0, counters
        for site in ("k", "v"):
            t = _rows(probe["attn"][layer], site, T).reshape(T, shape.num_kv_heads, shape.head_dim)
            assert _same(record.site(layer, site), trace_kernels.quantize(t, trace_kernels.row_amax(t))), (layer, site)
        if layer not in moe_layers:
            with pytest.raises(trace_kernels.RecordError):
                record.routed_experts(layer)
            continue
        x = _rows(probe["moe"][layer], "x", T)
        ids = _rows(probe["moe"][layer], "topk_ids", T)
        assert torch.equal(record.routed_experts(layer), ids.to(torch.int64)), layer
        assert _same(record.site(layer, "moe_fc1_in"), trace_kernels.quantize(x, trace_kernels.row_amax(x))), layer
