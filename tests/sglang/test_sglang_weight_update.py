"""`--quantization trace_fp4` (no quantization_config in the checkpoint: TraceConfig defaults), records
by handle through a local record store (TRACE_FP4_RECORD_STORE), records' weights identity, and weight updates (`update_weights_from_tensor` inside SGLang's
begin/end_weight_update session) re-quantizing the experts to exactly what a fresh load gives."""

import pytest
import torch
from safetensors.torch import load_file

import trace_kernels
from trace_kernels.grouped_mm import PackedExperts
from sglang_helpers import EngineProcess, base_engine_kwargs, sglang_skip_reason
from trace_fp4.tiny_model import build_tiny_qwen3_moe
from trace_kernels import stores
from trace_sglang_plugin.transport import payload_from_meta_info, record_from_meta_info
from trace_kernels.weight_digest import layer_digest, model_digest

pytestmark = pytest.mark.skipif(sglang_skip_reason() is not None, reason=str(sglang_skip_reason()))

LAYERS, EXPERTS = 4, 8
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
PROMPT = "A small model, a short prompt, a few generated words."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("sglang_tiny") / "moe")


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sglang_records")


@pytest.fixture(scope="module")
def storage_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sglang_storage")


def _storage(directory) -> dict:
    """{layer: {tensor: {data_ptr seen}}} over every MoE call the storage probe saw."""
    seen: dict = {}
    for f in sorted(directory.glob("*-storage-*.pt")):
        d = torch.load(f)
        for name, ptr in d["ptrs"].items():
            seen.setdefault(d["layer"], {}).setdefault(name, set()).add(ptr)
    return seen


@pytest.fixture(scope="module")
def engine(model_dir, record_dir, storage_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("sglang_logs") / "engine.log"
    kw = base_engine_kwargs(model_dir, quantization="trace_fp4")
    kw["forward_hooks"] = [{"name": "trace_storage", "target_modules": ["model.layers.*.mlp.experts"],
                            "hook_factory": "sglang_probe:storage_probe", "config": {"dir": str(storage_dir)}}]
    with EngineProcess(kw, env_extra={stores.STORE_ENV: f"file:{record_dir}"}, log_path=log) as eng:
        yield eng


def fresh_load_digest(weights: dict[str, torch.Tensor]) -> str:
    """What loading `weights` gives: per expert RTN NVFP4 with the expert's own tensor amax."""
    digests = {}
    for layer in range(LAYERS):
        pre = f"model.layers.{layer}.mlp.experts"
        w13 = torch.stack([torch.cat([weights[f"{pre}.{e}.gate_proj.weight"], weights[f"{pre}.{e}.up_proj.weight"]]) for e in range(EXPERTS)])
        w2 = torch.stack([weights[f"{pre}.{e}.down_proj.weight"] for e in range(EXPERTS)])
        qs = []
        for w in (w13, w2):
            q = [trace_kernels.quantize(w[e], trace_kernels.tensor_amax(w[e])) for e in range(EXPERTS)]
            amax = torch.cat([trace_kernels.tensor_amax(w[e]) for e in range(EXPERTS)])
            qs.append(PackedExperts(torch.stack([x.codes for x in q]), torch.stack([x.scales for x in q]), amax))
        digests[layer] = layer_digest(*qs)
    return model_digest(digests)


def expert_tensors(weights):
    return [(k, v) for k, v in weights.items() if ".mlp.experts." in k]


def test_cli_flag_selects_trace_fp4_with_default_config(engine, record_dir):
    out = engine.generate(PROMPT, GREEDY)
    payload = payload_from_meta_info(out["meta_info"])
    assert payload["record"] is None and payload["path"] is None
    assert payload["handle"].startswith(f"trace-fp4:file:{record_dir}#")
    assert stores.open_store(record_dir).stats()["outstanding"] == 1
    record = record_from_meta_info(out["meta_info"])  # resolves (and consumes) the handle
    assert stores.open_store(record_dir).stats()["outstanding"] == 0
    assert record.identity.num_prompt_tokens == out["meta_info"]["prompt_tokens"]
    assert record.identity.token_digest is not None and record.identity.weights_version == 0
    # TraceConfig defaults: sparse guidance at every layer, routing for all.
    assert record.modes == ("sparse",) * 4
    assert record.num_tokens == out["meta_info"]["prompt_tokens"] + out["meta_info"]["completion_tokens"] - 1
    assert type(record.site(0, "k")).__name__ == "SparseGuide" and record.site(3, "k") is not None


def test_weight_update_requantizes_to_the_codes_of_a_fresh_load(engine, model_dir, storage_dir):
    original = load_file(str(model_dir / "model.safetensors"))
    engine.call("flush_cache")
    before = engine.generate(PROMPT, GREEDY)
    assert payload_from_meta_info(before["meta_info"])["weight_digest"] == fresh_load_digest(original)

    gen = torch.Generator().manual_seed(1234)
    updated = {k: (torch.randn(v.shape, generator=gen) * v.float().std()).to(v.dtype) for k, v in expert_tensors(original)}
    result = engine.call("update_weights", list(updated.items()))
    assert result[0] is True or result.get("success", True), result
    engine.call("flush_cache")
    after = engine.generate(PROMPT, GREEDY)
    assert payload_from_meta_info(after["meta_info"])["weight_digest"] == fresh_load_digest({**original, **updated})
    r_before, r_after = record_from_meta_info(before["meta_info"]), record_from_meta_info(after["meta_info"])
    assert r_after.num_tokens == r_before.num_tokens
    # The record itself names the weights that made it: a trainer refuses the pre-update one.
    assert r_before.identity.weights_digest == fresh_load_digest(original)
    assert r_after.identity.weights_digest == fresh_load_digest({**original, **updated})
    assert r_after.identity.weights_version == r_before.identity.weights_version + 1
    with pytest.raises(trace_kernels.RecordError, match="weights differ"):
        trace_kernels.check_identity(r_before, source="record of sample 0", weights_version=r_after.identity.weights_version)

    engine.call("update_weights", expert_tensors(original))
    engine.call("flush_cache")
    back = engine.generate(PROMPT, GREEDY)
    assert payload_from_meta_info(back["meta_info"])["weight_digest"] == fresh_load_digest(original)
    assert back["output_ids"] == before["output_ids"]
    rb, r0 = record_from_meta_info(back["meta_info"]), r_before  # a handle is taken once
    for name, t in r0.tensors.items():
        assert torch.equal(rb.tensors[name], t), name
    # Both updates wrote into the tensors the first forward used: one address per packed tensor.
    storage = _storage(storage_dir)
    assert sorted(storage) == list(range(LAYERS)), sorted(storage)
    moved = {(layer, name): ptrs for layer, d in storage.items() for name, ptrs in d.items() if len(ptrs) != 1}
    assert not moved, moved
