"""Architecture support beyond Qwen2/Qwen3-MoE, one module per model family.

The Qwen MoE families live in hf_checkpoint.py / hf_to_megatron.py / tiny_model.py (they came first).
Every other family is a module here, registered in `FAMILIES` below by the Hugging Face architecture
names it serves. A family module provides:

- `read_config(cfg: dict, where: str) -> ArchConfig` (or a subclass): the checked config.json, one
  line naming the field on bad input (CheckpointError);
- `build_tiny(out_dir, seed=0) -> Path`: a tiny random checkpoint made with transformers' own config
  and model classes, for tests and `trace-fp4 align`;
- for the trainer side, when Megatron-Core can run the family here: `transformer_config(hf, *,
  params_dtype, **overrides)`, `convert_state_dict(hf_state, hf, dtype)` and `build_gpt_model(hf,
  layer_spec, config, *, max_sequence_length)`. Where it cannot, `ArchConfig.trainer_missing` says
  what is missing, and `trace-fp4 align` refuses the model before any engine starts. A family's
  `transformer_config` passes only its own fields to `megatron_config.megatron_config`, which holds
  the settings every family's trainer shares (routing replay, no dropout, CPU initialisation, ...).

Modules are imported when their architecture is asked for, so a family's imports cost nothing to the
others.
"""

import importlib
from dataclasses import dataclass, field

# HF architecture name -> family module (relative to this package).
FAMILIES: dict[str, str] = {
    "DeepseekV3ForCausalLM": "deepseek_v3",  # DeepSeek-V3 and Kimi K2 (same architecture name)
    "Glm4MoeForCausalLM": "glm4_moe",
    "GptOssForCausalLM": "gpt_oss",  # expert biases, clamped SwiGLU, sinks, sliding window
    "MixtralForCausalLM": "mixtral",
    "Qwen3NextForCausalLM": "qwen3_next",  # rollout side only: ArchConfig.trainer_missing says why
}


@dataclass(frozen=True, eq=False)
class ArchConfig:
    """What every family's checked config carries; families add their own fields in a subclass."""

    architecture: str
    num_layers: int
    vocab_size: int
    raw: dict = field(repr=False)  # the config.json object
    where: str = "model"
    # Why Megatron-Core cannot train this family on this machine (None: it can).
    trainer_missing: str | None = None

    def model_shape(self):
        from trace_kernels import model_shape_from_hf

        return model_shape_from_hf(self.raw, where=self.where)


def family(architecture: str):
    """The family module serving `architecture`, or None."""
    name = FAMILIES.get(architecture)
    return importlib.import_module(f"{__name__}.{name}") if name else None


def supported() -> tuple[str, ...]:
    return tuple(sorted(FAMILIES))
