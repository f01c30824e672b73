"""The packed NVFP4 KV pool in a real SGLang engine (CPU, torch-native attention).

Two engines on one tiny Qwen3-MoE with head_dim 128 (the Qwen3-30B-A3B head), full records on every
layer: the default packed pool and TRACE_FP4_KV_CACHE=dequantized (model-dtype pool holding the
dequantized NVFP4 values). A forward hook (sglang_kv_probe.py) reads the pool after every attention
layer. Asserted: uint8 buffers 3.37x smaller for the same slots, identical greedy tokens and
log-probs bit for bit, pool bytes at a token's slot equal to its record rows, the backend got the
quantized K/V (one quantization per layer and forward, reused by the cache write), and reads
dequantize only the batch's slots.
"""

import shutil

import pytest
import torch

from sglang_helpers import EngineProcess, base_engine_kwargs, sglang_skip_reason, write_quantization_config
from trace_fp4.tiny_model import build_tiny_qwen3_moe
from trace_kernels.kv_layout import pack_rows, packed_row_bytes
from trace_sglang_plugin.transport import payload_from_meta_info, record_from_meta_info

pytestmark = pytest.mark.skipif(sglang_skip_reason() is not None, reason=str(sglang_skip_reason()))

FULL_ALL = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}
HEAD_DIM = 128
NUM_KV_HEADS = 2
NUM_LAYERS = 4
CHUNK = 64
PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a tiny model that learned to count",
    # ~150 tokens: prefilled in chunks that read earlier chunks back from the pool
    "Mixture of experts models route every token to a few experts, so most parameters stay idle. Low precision "
    "rollouts are cheap, but the trainer and the engine then round numbers differently. Four bit floating point "
    "has only eight magnitudes: zero, one half, one, one and a half, two, three, four and six, times a block scale.",
]
PARAMS = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = build_tiny_qwen3_moe(tmp_path_factory.mktemp("sglang_kv") / "moe", head_dim=HEAD_DIM)
    write_quantization_config(d, FULL_ALL)
    return d


def _engine(model_dir, probe_dir, log, mode):
    hooks = [{"name": "trace_kv_pool_probe", "target_modules": ["model.layers.*.self_attn.attn"],
              "hook_factory": "sglang_kv_probe:pool_probe", "config": {"dir": str(probe_dir)}}]
    kw = base_engine_kwargs(model_dir, chunked_prefill_size=CHUNK, forward_hooks=hooks)
    return EngineProcess(kw, env_extra={"TRACE_FP4_KV_CACHE": mode}, log_path=log)


def _probes(probe_dir):
    return [torch.load(p) for p in sorted(probe_dir.glob("*.pt"))]


def _generate(engine, probe_dir):
    engine.call("flush_cache")
    shutil.rmtree(probe_dir, ignore_errors=True)
    outs = [engine.generate(p, PARAMS, return_logprob=True) for p in PROMPTS]
    return outs, _probes(probe_dir)


def _tokens_and_logprobs(outs):
    return [(o["output_ids"], [lp[:2] for lp in o["meta_info"]["output_token_logprobs"]]) for o in outs]


@pytest.fixture(scope="module")
def dequantized(model_dir, tmp_path_factory):
    probe_dir = tmp_path_factory.mktemp("kv_probe_dq")
    with _engine(model_dir, probe_dir, tmp_path_factory.mktemp("logs") / "dq.log", "dequantized") as eng:
        outs, probes = _generate(eng, probe_dir)
    return {"outs": outs, "probes": probes}


@pytest.fixture(scope="module")
def packed(model_dir, tmp_path_factory, dequantized):
    probe_dir = tmp_path_factory.mktemp("kv_probe_packed")
    with _engine(model_dir, probe_dir, tmp_path_factory.mktemp("logs") / "packed.log", "packed") as eng:
        outs, probes = _generate(eng, probe_dir)
    return {"outs": outs, "probes": probes}


def test_pool_holds_packed_rows(packed, dequantized):
    p, d = packed["probes"][0], dequantized["probes"][0]
    assert p["pool_class"] == "TraceFp4PackedKVPool" and p["buffer_dtype"] == "torch.uint8"
    assert d["pool_class"] == "MHATokenToKVPool" and d["buffer_dtype"] == "torch.bfloat16"
    assert p["slots"] == d["slots"]
    assert p["k_rows"].shape[1:] == (NUM_KV_HEADS, packed_row_bytes(HEAD_DIM))
    ratio = d["pool_bytes"] / p["pool_bytes"]
    print(f"SGLang KV pool for {p['slots']} slots: packed {p['pool_bytes']} B, dequantized {d['pool_bytes']} B ({ratio:.2f}x)")
    assert ratio == pytest.approx(2 * HEAD_DIM / packed_row_bytes(HEAD_DIM), rel=1e-3)
    assert ratio >= 3.2


def test_outputs_equal_the_dequantized_pool_bit_for_bit(packed, dequantized):
    got, want = _tokens_and_logprobs(packed["outs"]), _tokens_and_logprobs(dequantized["outs"])
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0], f"prompt {i}: generated tokens differ"
        assert g[1] == w[1], f"prompt {i}: log-probs differ"


def test_pool_bytes_are_the_captured_rows(packed):
    # The last request ran alone after the others finished: its forwards are the probes whose slots it owns.
    out = packed["outs"][-1]
    record = record_from_meta_info(out["meta_info"])
    T = record.num_tokens
    for layer in range(NUM_LAYERS):
        calls = [p for p in packed["probes"] if p["layer"] == layer]
        k = torch.cat([c["k_rows"] for c in calls])[-T:]
        v = torch.cat([c["v_rows"] for c in calls])[-T:]
        assert torch.equal(k, pack_rows(record.site(layer, "k"))), (layer, "k")
        assert torch.equal(v, pack_rows(record.site(layer, "v"))), (layer, "v")


def test_attention_got_the_quantized_kv_and_reads_only_the_batch(packed):
    counters = payload_from_meta_info(packed["outs"][-1]["meta_info"])["counters"]
    assert counters["kv_pool_packed_layers"] == NUM_LAYERS
    for layer in range(NUM_LAYERS):
        # Every cache write reused the K/V the attention backend received (no second quantization).
        assert counters[f"kv_quantized_for_attention.layer{layer}"] == counters[f"kv_writes.layer{layer}"] > 0
    assert "kv_quantized_at_write" not in counters
    # SGLang sized its pool with the packed bytes per token (the budget then admits 3.37x the tokens;
    # here max_total_tokens caps both engines at the same slots).
    dense, packed_cell = counters["kv_pool_cell_bytes_model_dtype"], counters["kv_pool_cell_bytes_packed"]
    assert dense % (NUM_LAYERS * NUM_KV_HEADS * 2 * HEAD_DIM * 2) == 0
    assert dense * packed_row_bytes(HEAD_DIM) == packed_cell * 2 * HEAD_DIM
    assert "kv_full_pool_reads" not in counters
    # Rows dequantized per read = the batch's context, far below the pool's 4096+ slots per layer read.
    reads = counters[f"kv_writes.layer0"] * NUM_LAYERS
    slots = packed["probes"][0]["slots"]
    assert 0 < counters["kv_rows_dequantized.k"] < reads * slots / 8
