"""BF16 boundary layers in the trainer: TraceConfig(bf16_layers=...) leaves those layers' experts and
K/V unquantized and every other layer exactly as before (real Megatron-Core, CPU)."""

import pytest
import torch

pytest.importorskip("megatron.core")
import megatron_cpu as mc  # noqa: E402

mc.init_parallel()

from trace_kernels import TraceConfig  # noqa: E402

NO_FP4 = TraceConfig(quantize_expert_weights=False, quantize_expert_inputs=False, quantize_kv=False)


_RUNS = {}


def _run(trace_config, seed=3):
    """(model, logits, per-layer outputs) of one tiny model under `trace_config` (built once per config)."""
    key = (trace_config.to_json(), seed)
    if key not in _RUNS:
        _RUNS[key] = _build_and_run(trace_config, seed)
    return _RUNS[key]


def _build_and_run(trace_config, seed):
    cfg = mc.tiny_config()
    model = mc.tiny_model(cfg, trace_config=trace_config, seed=seed)
    outs = {}
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: outs.__setitem__(i, (out[0] if isinstance(out, tuple) else out).detach()))
    ids, pos, mask = mc.padded_batch([16, 12], 16)
    with torch.no_grad():
        logits = model(ids, pos, mask)
    return model, logits, outs


def test_every_layer_bf16_is_the_unquantized_model_bit_for_bit():
    _, bf16_all, _ = _run(TraceConfig(bf16_layers=[0, 1]))
    _, ablation, _ = _run(NO_FP4)
    assert torch.equal(bf16_all, ablation)


def test_only_the_named_layer_is_bf16():
    model, mixed, mixed_layers = _run(TraceConfig(bf16_layers=[1]))
    _, fp4, fp4_layers = _run(TraceConfig())
    _, bf16, _ = _run(NO_FP4)
    assert torch.equal(mixed_layers[0], fp4_layers[0])  # layer 0 is FP4 as before
    assert not torch.equal(mixed_layers[1], fp4_layers[1])  # layer 1 is not
    assert not torch.allclose(mixed, fp4) and not torch.allclose(mixed, bf16)
    fc1 = [layer.mlp.experts.local_experts[0].linear_fc1.trace_config for layer in model.decoder.layers]
    assert fc1[0].quantize_expert_weights and not fc1[1].quantize_expert_weights
