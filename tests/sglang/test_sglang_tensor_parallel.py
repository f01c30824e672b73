"""SGLang's CPU engine with tp_size=2 and trace_fp4 capture (two TP scheduler processes). SGLang's CPU
all-reduce is torch.distributed (gloo) where sgl_kernel's shared-memory all-reduce is unavailable (it
needs AMX or arm64 and sgl_kernel's CPU build, which does not exist on PyPI; the tests' stand-in
provides none of its ops), so TP itself runs here on SGLang's own code.

Each rank captures its part (its slice of the expert intermediate dimension, its KV heads); TP rank 0
gathers the parts and assembles one record per request in the single-rank layout with the same code as
vLLM's driver (trace_kernels.engine.rank_parts). Checked: the record's shape and token identity, the
weights digest equals a single-rank load's, and a single-rank Megatron trainer guided by the records
reproduces every captured code (0 mismatch at every layer and site).

The tiny model has moe_intermediate_size 64: SGLang's CPU engine pads it to a multiple of 32 x tp_size
(refused by the plugin, tensor_parallel.refuse_padded_layout)."""

import pytest

import trace_kernels
import trace_sglang_plugin as tsp
from parallel_helpers import fresh_load_digest, single_rank_trainer_mismatch
from sglang_helpers import EngineProcess, base_engine_kwargs, sglang_skip_reason, write_quantization_config
from trace_fp4.tiny_model import build_tiny_qwen3_moe
from trace_sglang_plugin.tensor_parallel import bind_cpu_threads

pytestmark = pytest.mark.skipif(sglang_skip_reason() is not None, reason=str(sglang_skip_reason()))

FULL_ALL = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}
TP = 2
PROMPTS = [[11, 42, 7, 99, 3, 250, 17], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 200], [300, 1]]
NEW_TOKENS = [6, 3, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = build_tiny_qwen3_moe(tmp_path_factory.mktemp("sglang_tp") / "moe", moe_intermediate_size=64)
    write_quantization_config(d, FULL_ALL)
    return d


@pytest.fixture(scope="module")
def rollout(model_dir, tmp_path_factory):
    env = {}
    bound = bind_cpu_threads(TP, environ=env)  # what a first run on this CPU needs (SGLang asserts otherwise)
    assert bound is not None and len(bound.split("|")) == TP and env["SGLANG_CPU_OMP_THREADS_BIND"] == bound
    log = tmp_path_factory.mktemp("sglang_tp_logs") / "engine.log"
    with EngineProcess(base_engine_kwargs(model_dir, tp_size=TP), env_extra=env, log_path=log) as eng:
        outs = [eng.call("generate", input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": n,
                                                                       "ignore_eos": True})
                for ids, n in zip(PROMPTS, NEW_TOKENS)]
    return outs, [tsp.record_from_meta_info(o["meta_info"]) for o in outs]


def test_one_record_per_request_in_the_single_rank_layout(rollout):
    outs, records = rollout
    shape = records[0].shape
    assert shape.moe_intermediate_size == 64 and shape.num_kv_heads == 2  # the model's, not a rank's
    for ids, out, rec in zip(PROMPTS, outs, records):
        tokens = list(ids) + list(out["output_ids"])
        trace_kernels.check_identity(rec, source="sglang tp2", token_ids=tokens[:-1])
        for layer in range(shape.num_layers):
            for site in shape.layer_sites(layer):
                assert tuple(rec.site(layer, site).shape) == (rec.num_tokens, *shape.row_shape(site)), (layer, site)
    counters = tsp.payload_from_meta_info(outs[-1]["meta_info"])["counters"]
    assert counters.get("records_assembled_from_ranks", 0) == len(PROMPTS)


def test_weights_digest_covers_both_ranks_and_equals_a_single_rank_load(rollout, model_dir):
    _, records = rollout
    assert {r.identity.weights_digest for r in records} == {fresh_load_digest(model_dir)}


def test_a_single_rank_trainer_guided_by_tp2_records_has_no_mismatch(rollout, model_dir):
    outs, records = rollout
    samples = [{"prompt_token_ids": list(ids), "output_token_ids": list(o["output_ids"])} for ids, o in zip(PROMPTS, outs)]
    guided, rtn = single_rank_trainer_mismatch(model_dir, samples, records)
    assert rtn["codeword_mismatch_rate"] > 0  # unguided, the trainer's codes do differ from the rollout's
    shape = records[0].shape
    for row in guided["per_layer"]:
        for site in shape.layer_sites(row["layer"]):
            assert row[site] == 0.0, (row["layer"], site, row[site])


def test_a_layout_sglang_padded_is_refused_naming_it():
    from types import SimpleNamespace

    from trace_sglang_plugin.tensor_parallel import refuse_padded_layout

    padded = SimpleNamespace(moe_intermediate_size=64, original_moe_intermediate_size=32, num_key_value_heads=2)
    with pytest.raises(NotImplementedError, match="padded moe_intermediate_size from 32 to 64"):
        refuse_padded_layout(padded, 2)
    refuse_padded_layout(SimpleNamespace(moe_intermediate_size=64, num_key_value_heads=2), 2)  # unpadded: fine
