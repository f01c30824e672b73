"""Why Qwen3-Next has no trainer side here: each fact behind trace_fp4.archs.qwen3_next.TRAINER_MISSING,
checked against the installed Megatron-Core. When the environment changes (Transformer Engine or a
CPU-capable flash-linear-attention installed, a local Gated DeltaNet spec in Megatron), a test here
fails and says which refusal to lift."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from trace_fp4.archs import qwen3_next


@pytest.fixture(scope="module")
def gdn_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_cpu import init_parallel

    init_parallel()
    t = qwen3_next.TINY
    return TransformerConfig(
        num_layers=t["num_hidden_layers"], hidden_size=t["hidden_size"], num_attention_heads=t["num_attention_heads"],
        num_query_groups=t["num_key_value_heads"], kv_channels=t["head_dim"], ffn_hidden_size=t["intermediate_size"],
        normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, gated_linear_unit=True, activation_func=F.silu,
        bias_activation_fusion=False, transformer_impl="local", deterministic_mode=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
        linear_conv_kernel_dim=t["linear_conv_kernel_dim"], linear_key_head_dim=t["linear_key_head_dim"],
        linear_value_head_dim=t["linear_value_head_dim"], linear_num_key_heads=t["linear_num_key_heads"],
        linear_num_value_heads=t["linear_num_value_heads"],
    )


def test_transformer_engine_and_fla_are_not_installed():
    assert importlib.util.find_spec("transformer_engine") is None, "Transformer Engine is installed now"
    assert importlib.util.find_spec("fla") is None, "flash-linear-attention is installed now"


def test_the_gated_deltanet_block_spec_requires_transformer_engine(gdn_config):
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as ex

    with pytest.raises(AssertionError, match="only supports transformer engine"):
        ex.get_transformer_block_with_experimental_attention_variant_spec(gdn_config)


def test_the_local_gated_deltanet_spec_has_no_input_projection_and_needs_fla(gdn_config):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as ex
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import common
    from megatron.core.transformer.spec_utils import build_module

    spec = ex.get_gated_delta_net_module_spec(gdn_config, backend=LocalSpecProvider())
    assert spec.submodules.in_proj is None  # no fused layer-norm + linear in the local backend
    assert common.HAVE_FLA is False
    with pytest.raises(ImportError, match="FLA is not installed"):
        build_module(spec, config=gdn_config, layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def test_the_rest_of_qwen3_next_exists_in_megatron():
    """What a future converter would use: gated attention, gated shared expert, (1 + w) norms, partial RoPE."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__
    for name in ("attention_output_gate", "moe_shared_expert_gate", "layernorm_zero_centered_gamma"):
        assert name in fields, name
