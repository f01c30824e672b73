"""Parity: for the same model, weights and tokens, the codes captured by SGLang and by vLLM agree
wherever the two engines' BF16 inputs agree; the rates are printed (run with -s to see them).

The engines' BF16 kernels differ, so identical inputs are rare past layer 0 (layer 0's V is the one site
both compute bit for bit): comparing the two engines only there would prove little. So each engine's
captured codes and scales are also checked, at every row of every probed site (expert input, K, V) and
layer, against tests/helpers/nvfp4_oracle.py (an implementation of the contract that shares no code with
trace_kernels) applied to that engine's own BF16 input with its per-row amax: both engines quantize the
right tensor, with the right amax, and file every row under the right token.

Both engines prefill the same token ids (max 1 new token, so the record covers exactly the prompt).
vLLM runs in-process (tests/helpers/vllm_helpers.py, probes through `apply_model`); SGLang in its child process
(tests/helpers/sglang_helpers.py, probes through `forward_hooks`).
"""

import shutil

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

import nvfp4_oracle as oracle
import trace_kernels
from sglang_helpers import EngineProcess, base_engine_kwargs, probe_forward_hooks, sglang_skip_reason, write_quantization_config
from trace_fp4.tiny_model import build_tiny_qwen3_moe
from trace_sglang_plugin.transport import record_from_meta_info

pytestmark = pytest.mark.skipif(sglang_skip_reason() is not None, reason=str(sglang_skip_reason()))

FULL_ALL = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}
TEXT = "Four bit floating point has only eight magnitudes: zero, one half, one, one and a half, two, three."
LAYERS = 4


def _vllm_record(model, ids, config):
    vllm_helpers = pytest.importorskip("vllm_helpers")
    tvp = pytest.importorskip("trace_vllm_plugin")
    llm = vllm_helpers.make_llm(model, quant_config=config)
    try:
        llm.apply_model(vllm_helpers.install_probes)
        out = llm.generate([{"prompt_token_ids": ids}], vllm_helpers.greedy(1))[0]
        probes = llm.apply_model(vllm_helpers.take_probes)[0]
        record = tvp.get_record(llm, out)
    finally:
        vllm_helpers.shutdown(llm)
    return record, {name: {i: torch.cat(v) for i, v in per_layer.items()} for name, per_layer in probes.items()}


def _sglang_record(model, ids, tmp_path):
    probe_dir = tmp_path / "probe"
    kw = base_engine_kwargs(model, forward_hooks=probe_forward_hooks(probe_dir))
    with EngineProcess(kw, log_path=tmp_path / "engine.log") as eng:
        shutil.rmtree(probe_dir, ignore_errors=True)
        out = eng.call("generate", input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": 1})
    record = record_from_meta_info(out["meta_info"])
    probes = {"x": {}, "k": {}, "v": {}}
    for f in sorted(probe_dir.glob("*.pt")):
        d = torch.load(f)
        if "x" in d:
            probes["x"].setdefault(d["layer"], []).append(d["x"])
        else:
            for name in ("k", "v"):
                probes[name].setdefault(d["layer"], []).append(d[name])
    return record, {name: {i: torch.cat(v) for i, v in per_layer.items()} for name, per_layer in probes.items()}


def _check_against_oracle(q, x, amax, block_scale, where):
    """The captured rows `q` are the contract's quantization of `x`: the oracle's, bit for bit ("6"); for
    4over6, trace_kernels' bit for bit and the published rule's oracle except at float near-ties of its
    two candidates' errors (tests/kernels/test_four_over_six.py)."""
    K = x.shape[-1]
    got = oracle.unpack(q.codes.reshape(-1, K // 2))
    scales = q.scales.reshape(-1, K // 16).numpy()
    if block_scale == "6":
        codes, want = oracle.quantize(x, amax)
        assert (oracle.signed_value(got) == oracle.signed_value(codes)).all(), where
        assert (scales == want).all(), where
        return
    ours = trace_kernels.quantize(x, amax, block_scale=block_scale)
    assert torch.equal(trace_kernels.codewords(ours), trace_kernels.codewords(q).reshape(-1, K)), where
    assert (ours.scales.numpy() == scales).all(), where
    _, want, _, e6, e4 = oracle.quantize_4over6(x, amax)
    near_tie = np.abs(e4 - e6) <= 1e-5 * np.maximum(e6, e4)
    assert ((scales == want) | near_tie).all(), where
    assert (scales[scales != 0x7F] <= 0x7C).all(), where  # 4over6 scales stay <= 384 (the default reaches 448)


@pytest.mark.parametrize("block_scale", ["6", "4over6"])
def test_sglang_and_vllm_capture_the_same_codes_from_the_same_inputs(tmp_path, block_scale):
    config = FULL_ALL if block_scale == "6" else {**FULL_ALL, "block_scale": block_scale}
    model = build_tiny_qwen3_moe(tmp_path / "moe")
    write_quantization_config(model, config)
    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(TEXT).ids
    T = len(ids)
    rs, ps = _sglang_record(model, ids, tmp_path)
    rv, pv = _vllm_record(model, ids, config)
    assert rs.num_tokens == rv.num_tokens == T
    assert rs.config.block_scale == rv.config.block_scale == block_scale
    # Both engines hold the checkpoint's experts quantized with the rule (the records' weights digest).
    from trace_kernels.grouped_mm import PackedExperts
    from trace_kernels.weight_digest import layer_digest
    from vllm_helpers import checkpoint_expert_codes

    want = {layer: layer_digest(*(PackedExperts(w[f"{n}_codes"], w[f"{n}_scales"], w[f"{n}_amax"]) for n in ("w13", "w2")))
            for layer, w in checkpoint_expert_codes(model / "model.safetensors", block_scale).items()}
    assert rs.identity.weights_digest == rv.identity.weights_digest == trace_kernels.weights_digest(want)

    # Every row of every probed site and layer, each engine against the oracle on its own input.
    checked = 0
    for engine, record, probes in (("sglang", rs, ps), ("vllm", rv, pv)):
        for layer in range(LAYERS):
            for site, probe in (("moe_fc1_in", "x"), ("k", "k"), ("v", "v")):
                q = record.site(layer, site)
                K = q.shape[-1]
                x = probes[probe][layer][:T].reshape(-1, K)
                amax = torch.from_numpy(x.float().abs().numpy().max(-1))
                _check_against_oracle(q, x, amax, block_scale, (engine, layer, site))
                assert torch.equal(q.global_amax.reshape(-1), amax), (engine, layer, site)
                checked += x.shape[0]
    rows_per_layer = T * (1 + 2 * rs.shape.num_kv_heads)
    assert checked == 2 * LAYERS * rows_per_layer

    report = []
    same_codes = total_codes = identical_rows = 0
    for layer in range(LAYERS):
        routing_same = (rs.routed_experts(layer).sort(-1).values == rv.routed_experts(layer).sort(-1).values).all(-1)
        for site, probe in (("moe_fc1_in", "x"), ("k", "k"), ("v", "v"), ("moe_fc2_in", None)):
            a, b = rs.site(layer, site), rv.site(layer, site)
            # Codewords (sign and magnitude, +0 == -0): the rollout-side quantity TRACE cares about. Rows
            # whose inputs differ also get different per-row scales, so their dequantized values would
            # differ almost everywhere even where the codes agree.
            equal = trace_kernels.codewords(a) == trace_kernels.codewords(b)
            same_codes += int(equal.sum())
            total_codes += equal.numel()
            if probe is None:
                # fc2 input is internal to the experts: same BF16 input rows and same routing -> same codes.
                rows_same_input = routing_same & (ps["x"][layer][:T] == pv["x"][layer][:T]).all(-1)
                assert equal[rows_same_input].all(), f"layer {layer} {site}: codes differ on rows with identical inputs"
            else:
                xs = ps[probe][layer][:T].reshape(T, -1)
                xv = pv[probe][layer][:T].reshape(T, -1)
                rows_same_input = (xs == xv).all(-1)
                eq_rows = equal.reshape(T, -1).all(-1)
                assert eq_rows[rows_same_input].all(), f"layer {layer} {site}: codes differ on rows with identical BF16 inputs"
            identical_rows += int(rows_same_input.sum())
            report.append(f"layer {layer} {site:10s}: BF16-identical rows {rows_same_input.float().mean():.3f}, "
                          f"code agreement {equal.float().mean():.4f}")
        report.append(f"layer {layer} routing   : {routing_same.float().mean():.3f} of tokens")
    print("\n".join(report))
    print(f"SGLang vs vLLM code agreement, all sites: {same_codes / total_codes:.4f} of {total_codes} values")
    # The cross-engine comparison is not empty: layer 0's V (v_proj of the normed embedding) is computed
    # identically by both engines. (The oracle check above covers every row of every site and layer.)
    assert identical_rows >= T, "no row had identical BF16 inputs in both engines; the comparison proved nothing"
    v0 = trace_kernels.dequantize(rs.site(0, "v")) == trace_kernels.dequantize(rv.site(0, "v"))
    assert v0.all()
