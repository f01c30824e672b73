"""activation_scale="static" is honoured everywhere: vLLM, SGLang and the Megatron trainer quantize every
captured site with the calibrated amax (`trace_kernels.site_amax`), so on identical inputs their codes
are identical, and every value above the amax is counted, never clamped silently.

Per engine, against that engine's own BF16 inputs (probes independent of the capture path):
  * every recorded row's global amax is the configured value (per-row amax would differ row by row);
  * the recorded codes are `trace_kernels.quantize(input, static amax)`: what any other engine or the
    trainer computes from the same input;
  * the engine's saturation counter equals the values above the amax, counted here from the inputs.
Across engines: rows whose BF16 inputs are identical in vLLM and SGLang have identical codes, and there
are enough such rows at every site and layer that this is not vacuous.
"""

import shutil

import pytest
import torch
from tokenizers import Tokenizer

import trace_kernels as tk
from sglang_helpers import EngineProcess, base_engine_kwargs, probe_forward_hooks, sglang_skip_reason, write_quantization_config
from trace_fp4.tiny_model import build_tiny_qwen3_moe

TEXT = "Four bit floating point has only eight magnitudes: zero, one half, one, one and a half, two, three."
LAYERS = 4
SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")
PROBED = {"moe_fc1_in": "x", "k": "k", "v": "v"}  # fc2's input exists only inside the expert loop
# Calibrated-looking values, small enough that some inputs exceed them (saturation must be counted).
AMAX = {"moe_fc1_in": 1.5, "moe_fc2_in": 0.05, "k": 2.0, "v": 0.05}
STATIC = {
    "quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all", "activation_scale": "static",
    "static_activation_amax": {f"{i}.{s}": AMAX[s] for i in range(LAYERS) for s in SITES},
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = build_tiny_qwen3_moe(tmp_path_factory.mktemp("static") / "moe")
    write_quantization_config(d, STATIC)
    return d


@pytest.fixture(scope="module")
def ids(model):
    return Tokenizer.from_file(str(model / "tokenizer.json")).encode(TEXT).ids


def _check_engine(record, probes, saturated: dict, T: int, engine: str):
    """The per-engine assertions of the module docstring; returns {(layer, site): row-equal bool [T]}."""
    assert record.config.activation_scale == "static"
    for layer in range(LAYERS):
        for site in SITES:
            q = record.site(layer, site)
            want = torch.tensor(AMAX[site])
            assert (q.global_amax == want).all(), f"{engine} layer {layer} {site}: global amax is not the static value"
            if site not in PROBED:
                continue
            x = probes[PROBED[site]][layer][:T].reshape(q.shape)
            ref = tk.quantize(x, torch.tensor([AMAX[site]]))
            assert torch.equal(tk.codewords(q), tk.codewords(ref)), f"{engine} layer {layer} {site}: codes != quantize(input, static)"
            assert torch.equal(q.scales, ref.scales), f"{engine} layer {layer} {site}: scales differ"
            expect = int(tk.count_saturated(x, torch.tensor([AMAX[site]])))
            assert saturated.get(f"{layer}.{site}", 0) == expect, (engine, layer, site, saturated.get(f"{layer}.{site}"), expect)


@pytest.fixture(scope="module")
def sglang_run(model, ids, tmp_path_factory):
    reason = sglang_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    from trace_sglang_plugin.transport import payload_from_meta_info, record_from_meta_info

    tmp = tmp_path_factory.mktemp("sglang")
    probe_dir = tmp / "probe"
    kw = base_engine_kwargs(model, forward_hooks=probe_forward_hooks(probe_dir), disable_radix_cache=True)
    params = {"temperature": 0.0, "max_new_tokens": 1}
    with EngineProcess(kw, log_path=tmp / "engine.log") as eng:
        first = eng.call("generate", input_ids=ids, sampling_params=params)
        shutil.rmtree(probe_dir, ignore_errors=True)  # probes and counter deltas of the second request only
        out = eng.call("generate", input_ids=ids, sampling_params=params)
    before = payload_from_meta_info(first["meta_info"])["counters"]
    after = payload_from_meta_info(out["meta_info"])["counters"]
    saturated = {k[len("saturated."):]: after[k] - before.get(k, 0) for k in after if k.startswith("saturated.")}
    probes = {"x": {}, "k": {}, "v": {}}
    for f in sorted(probe_dir.glob("*.pt")):
        d = torch.load(f)
        for name in ("x", "k", "v"):
            if name in d:
                probes[name].setdefault(d["layer"], []).append(d[name])
    probes = {n: {i: torch.cat(v) for i, v in per.items()} for n, per in probes.items()}
    return record_from_meta_info(out["meta_info"]), probes, saturated


@pytest.fixture(scope="module")
def vllm_run(model, ids, sglang_run):  # after SGLang: one engine at a time
    vllm_helpers = pytest.importorskip("vllm_helpers")
    tvp = pytest.importorskip("trace_vllm_plugin")
    llm = vllm_helpers.make_llm(model, quant_config=STATIC)
    try:
        before = tvp.stats(llm)["saturated_values"]  # the profiling run's dummy batch is counted too
        llm.apply_model(vllm_helpers.install_probes)
        out = llm.generate([{"prompt_token_ids": ids}], vllm_helpers.greedy(1))[0]
        probes = llm.apply_model(vllm_helpers.take_probes)[0]
        after = tvp.stats(llm)["saturated_values"]
        record = tvp.get_record(llm, out)
    finally:
        vllm_helpers.shutdown(llm)
    probes = {n: {i: torch.cat(v) for i, v in per.items()} for n, per in probes.items()}
    return record, probes, {k: v - before.get(k, 0) for k, v in after.items()}


def test_sglang_quantizes_every_site_with_the_static_amax(sglang_run, ids):
    record, probes, saturated = sglang_run
    _check_engine(record, probes, saturated, len(ids), "sglang")
    assert sum(saturated.values()) > 0, "no value exceeded the static amax: the counter was not exercised"


def test_vllm_quantizes_every_site_with_the_static_amax(vllm_run, ids):
    record, probes, saturated = vllm_run
    _check_engine(record, probes, saturated, len(ids), "vllm")
    assert sum(saturated.values()) > 0


def test_identical_inputs_give_identical_codes_across_engines(sglang_run, vllm_run, ids):
    T = len(ids)
    (rs, ps, _), (rv, pv, _) = sglang_run, vllm_run
    for layer in range(LAYERS):
        for site, probe in PROBED.items():
            a, b = rs.site(layer, site), rv.site(layer, site)
            xs, xv = ps[probe][layer][:T].reshape(T, -1), pv[probe][layer][:T].reshape(T, -1)
            same_input = (xs == xv).all(-1)
            same_codes = (tk.codewords(a) == tk.codewords(b)).reshape(T, -1).all(-1)
            assert same_codes[same_input].all(), f"layer {layer} {site}: identical inputs, different codes"
    # Not vacuous: layer 0's V (v_proj of the normed embedding) is computed identically by both engines.
    assert (ps["v"][0][:T].reshape(T, -1) == pv["v"][0][:T].reshape(T, -1)).all()


def test_megatron_quantizes_every_site_with_the_static_amax(model, ids, vllm_run):
    import megatron_cpu as mc

    mc.init_parallel()
    import trace_megatron
    from trace_fp4 import hf_to_megatron as h2m
    from trace_fp4.hf_checkpoint import load_tensors, read_config

    hf = read_config(model)
    static = tk.TraceConfig.from_dict(STATIC)
    config = h2m.transformer_config(hf, params_dtype=torch.bfloat16, bf16=True)
    with pytest.raises(ValueError, match=r"guided_layers names \[9\] but the TransformerConfig has 4 layers"):
        trace_megatron.get_gpt_decoder_block_with_trace_spec(config, normalization="RMSNorm",
                                                             trace_config=tk.TraceConfig(guided_layers=[0, 9]))
    spec = trace_megatron.get_gpt_decoder_block_with_trace_spec(config, normalization="RMSNorm", trace_config=static)
    model_ = h2m.build_gpt_model(hf, spec, config)
    h2m.load_into(model_, h2m.convert_state_dict(load_tensors(model), hf, dtype=torch.bfloat16))
    model_.eval()
    T = len(ids)
    tokens = torch.tensor(ids)[None]
    layout = trace_megatron.TokenLayout.padded([T], T)
    with torch.no_grad(), trace_megatron.capture(model_, layout, keep_values=True) as batch:  # no records: RTN
        model_(tokens, torch.arange(T)[None], mc.causal_mask(T))
    metrics = batch.metrics()
    record_v, probes_v, _ = vllm_run
    same_rows = 0
    for layer in range(LAYERS):
        for site in SITES:
            q, x = batch.captured(layer, site), batch.captured_values(layer, site)
            amax = torch.tensor([AMAX[site]])
            assert (q.global_amax == amax).all(), f"megatron layer {layer} {site}: RTN amax is not the static value"
            ref = tk.quantize(x, amax)
            assert torch.equal(tk.codewords(q), tk.codewords(ref)) and torch.equal(q.scales, ref.scales)
            got = metrics[f"trace/layer{layer}/{site}/saturated_values"]
            # the trainer quantizes a token's fc1 input once per routed expert (top_k copies)
            copies = hf.top_k if site == "moe_fc1_in" else 1
            assert got == copies * int(tk.count_saturated(x, amax)), (layer, site, got)
            if site in PROBED:  # trainer vs vLLM on the rows whose inputs are identical
                xv = probes_v[PROBED[site]][layer][:T].float().reshape(x.shape)
                rows = (xv == x).reshape(T, -1).all(-1)
                eq = (tk.codewords(q) == tk.codewords(record_v.site(layer, site))).reshape(T, -1).all(-1)
                assert eq[rows].all(), f"layer {layer} {site}: trainer and vLLM inputs identical, codes differ"
                same_rows += int(rows.sum())
    assert sum(v for k, v in metrics.items() if k.startswith("trace/all/") and k.endswith("saturated_values")) > 0
    print(f"trainer rows with inputs identical to vLLM's: {same_rows}")
    assert same_rows > 0, "no trainer row had the same input as vLLM: the cross-check proved nothing"
