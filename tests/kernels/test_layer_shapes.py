"""Per-layer model shapes: dense-MLP layers, layers without a KV cache, MLA's latent row.

The shapes come from transformers' own config classes of each family (no download: the classes build
configs offline), so a field the family renames or drops is caught here, not in an engine.
"""

import json

import pytest
import torch

import trace_kernels as tk
from trace_kernels.records import FORMAT_VERSION, canonical_header, metadata_digest, read_metadata

from record_factory import captured_builder

FULL = tk.TraceConfig(guidance="full", guided_layers="all")
# DeepSeek-V3-like: a dense first layer, MLA everywhere (one latent row of 512 per token).
MLA = tk.ModelShape(num_layers=3, hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2,
                    num_kv_heads=1, head_dim=512, moe_layers=(1, 2), kv_kind="mla")
# Qwen3-Next-like: K/V only in the last layer (the others are linear attention).
HYBRID = tk.ModelShape(num_layers=4, hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2,
                       num_kv_heads=2, head_dim=32, kv_layers=[3])


def test_layer_sites_follow_the_shape():
    assert MLA.layer_sites(0) == ("kv_latent",)
    assert MLA.layer_sites(1) == ("moe_fc1_in", "moe_fc2_in", "kv_latent")
    assert HYBRID.layer_sites(0) == ("moe_fc1_in", "moe_fc2_in")
    assert HYBRID.layer_sites(3) == ("moe_fc1_in", "moe_fc2_in", "k", "v")
    assert MLA.row_shape("kv_latent") == (1, 512)
    assert MLA.describe_layers() == ["dense+mla", "moe+mla", "moe+mla"]
    with pytest.raises(ValueError, match="site 'k' does not exist in a model with kv_kind='mla'"):
        MLA.row_shape("k")
    # naming every layer is the same shape as naming none
    same = tk.ModelShape(**{**HYBRID.to_dict(), "kv_layers": None, "moe_layers": [3, 2, 1, 0]})
    assert same.moe_layers is None and same != HYBRID


@pytest.mark.parametrize("bad, match", [
    ({"moe_layers": []}, "moe_layers is empty"),
    ({"moe_layers": [4]}, r"moe_layers=\[4\] outside the 4 layers"),
    ({"kv_layers": "all"}, "kv_layers must be layer indices"),
    ({"kv_kind": "latent"}, "kv_kind must be one of"),
    ({"kv_kind": "mla"}, "num_kv_heads=1"),
])
def test_bad_layer_fields_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        tk.ModelShape(**{**HYBRID.to_dict(), **bad})


@pytest.mark.parametrize("shape", [MLA, HYBRID], ids=["mla_dense_first", "hybrid_linear_attention"])
@pytest.mark.parametrize("guidance", ["full", "compact", "sparse"])
def test_records_round_trip_per_layer(shape, guidance):
    config = tk.TraceConfig(guidance=guidance, guided_layers="all")
    rec = captured_builder(FULL, steps=(4, 1), shape=shape).build(config)
    back = tk.GuidanceRecord.from_bytes(rec.to_bytes(), expect_shape=shape, expect_config=config)
    assert back.num_tokens == 5
    for layer in range(shape.num_layers):
        for site in shape.layer_sites(layer):
            assert back.site(layer, site) is not None
        if shape.has_moe(layer):
            assert torch.equal(back.routed_experts(layer), rec.routed_experts(layer))
    if shape is MLA:
        # the dense layer carries no routing and no moe payload, only its latent KV
        assert {n.split(".")[2] for n in back.tensors if n.startswith("layer.0.")} == {"kv_latent"}
        with pytest.raises(tk.RecordError, match="layer 0 has no routed experts"):
            back.routed_experts(0)
        with pytest.raises(tk.RecordError, match="layer 0 has no site moe_fc1_in"):
            back.site(0, "moe_fc1_in")
    else:
        with pytest.raises(tk.RecordError, match=r"layer 1 has no site k "):
            back.site(1, "k")


def test_builder_refuses_sites_a_layer_does_not_have():
    b = tk.RecordBuilder(MLA, FULL)
    with pytest.raises(ValueError, match="layer 0 has no routed experts"):
        b.add_routing(0, torch.zeros(2, 2, dtype=torch.int64))
    x = torch.randn(2, 2, 32)
    with pytest.raises(ValueError, match="layer 0 has no site moe_fc2_in"):
        b.add(0, "moe_fc2_in", tk.quantize(x, tk.row_amax(x)))


def test_a_record_is_refused_by_a_model_of_other_layers():
    rec = captured_builder(FULL, steps=(3,), shape=HYBRID).build()
    other = tk.ModelShape(**{**HYBRID.to_dict(), "kv_layers": [2, 3]})
    with pytest.raises(tk.RecordError, match=r"kv_layers: record \(3,\) vs model \(2, 3\)"):
        tk.GuidanceRecord.from_bytes(rec.to_bytes(), expect_shape=other)


def _as_version_2(data: bytes) -> bytes:
    """Rewrite a version-3 record's header as the version-2 writer produced it (no per-layer fields)."""
    import struct


    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header["__metadata__"]
    shape = json.loads(meta["model_shape"])
    for key in ("moe_layers", "kv_layers", "kv_kind"):
        shape.pop(key)
    meta.update(version="2", model_shape=json.dumps(shape, sort_keys=True))
    meta.pop("metadata_checksum")
    meta["metadata_checksum"] = metadata_digest(meta)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return canonical_header(struct.pack("<Q", len(text)) + text + data[8 + n :])


def test_version_2_records_still_load():
    from record_factory import SHAPE

    rec = captured_builder(FULL, steps=(3, 1)).build()
    assert FORMAT_VERSION == 3 and read_metadata(rec.to_bytes(), "r")["version"] == "3"
    old = tk.GuidanceRecord.from_bytes(_as_version_2(rec.to_bytes()), source="old.safetensors", expect_shape=SHAPE)
    assert old.shape == SHAPE
    for layer in range(SHAPE.num_layers):
        assert torch.equal(old.site(layer, "k").codes, rec.site(layer, "k").codes)


# ---- the HF configs of the families people RL-train ------------------------------------------------
def _deepseek_v3():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(num_hidden_layers=3, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=512,
                            num_attention_heads=2, num_key_value_heads=2, n_group=2, topk_group=1)


def _glm4_moe():
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def _qwen3_next():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(num_hidden_layers=4, hidden_size=64, moe_intermediate_size=32, num_experts=8,
                           num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                           layer_types=["linear_attention"] * 3 + ["full_attention"])


def _gpt_oss():
    from transformers import GptOssConfig

    return GptOssConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=32, num_local_experts=8,
                        num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        layer_types=["sliding_attention", "full_attention"])


def _mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=32, num_local_experts=8,
                         num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("make, moe, kv, kind, kv_row", [
    (_deepseek_v3, [1, 2], [0, 1, 2], "mla", (1, 512)),
    (_glm4_moe, [1, 2], [0, 1, 2], "kv", (1, 32)),
    (_qwen3_next, [0, 1, 2, 3], [3], "kv", (1, 32)),
    (_gpt_oss, [0, 1], [0, 1], "kv", (1, 32)),
    (_mixtral, [0, 1], [0, 1], "kv", (1, 32)),
], ids=["deepseek_v3", "glm4_moe", "qwen3_next", "gpt_oss", "mixtral"])
def test_model_shape_from_transformers_configs(make, moe, kv, kind, kv_row):
    cfg = make()
    for source in (cfg, json.loads(cfg.to_json_string())):  # the object and its config.json
        shape = tk.model_shape_from_hf(source)
        assert shape.moe_layer_list() == moe and shape.kv_layer_list() == kv and shape.kv_kind == kind
        assert shape.row_shape(shape.kv_sites()[0]) == kv_row
        assert shape.row_shape("moe_fc2_in") == (2, 32)


@pytest.mark.parametrize("change, match", [
    ({"num_experts": 0, "num_local_experts": 0}, "has none"),
    ({"layer_types": ["full_attention", "mamba"]}, r"layer_types \['mamba'\] are not supported"),
    ({"layer_types": ["full_attention"]}, "must name each of the 2 layers"),
    ({"mlp_only_layers": [0, 1]}, "none of the 2 layers has routed experts"),
    ({"hidden_size": 72}, "hidden_size=72 is not divisible by 16"),
])
def test_model_shape_from_hf_names_what_is_wrong(change, match):
    cfg = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "moe_intermediate_size": 32,
           "num_experts": 8, "num_experts_per_tok": 2, **change}
    with pytest.raises(ValueError, match=match):
        tk.model_shape_from_hf(cfg, where="m")
