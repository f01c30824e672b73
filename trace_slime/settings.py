"""The slime flags that turn TRACE on, and the combinations refused before anything runs.

Rollout side:  quantization_config {"quant_method": "trace_fp4", <TraceConfig keys>} in
               --sglang-json-model-override-args or the --hf-checkpoint's config.json (or
               --sglang-quantization trace_fp4, see rollout_on): every SGLang server runs trace_fp4
               --custom-generate-function-path trace_slime.generate
Trainer side:  --spec trace_slime get_trace_spec        the trace decoder-block spec
               --custom-megatron-before-log-prob-hook-path trace_slime.before_log_prob_hook
               --custom-megatron-before-train-step-hook-path trace_slime.before_train_step_hook
Both:          TRACE_FP4_RECORD_STORE=<spec> in the environment of every slime process (Ray's runtime
               env): the SGLang servers put each record there and return its handle; the Megatron
               actors resolve only that store's handles.

The TraceConfig is read once, from what the SGLang servers load: `quantization_config` in
--sglang-json-model-override-args, else in the --hf-checkpoint's config.json, else the defaults. slime
passes the same `args` to the rollout manager and to every Megatron actor, so both sides read one
config. Every process checks the whole set (`check_args`): the rollout manager at its first generate,
each actor when it builds its model.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from trace_kernels import TraceConfig
from trace_kernels.config import QUANT_METHOD

GENERATE_PATH = "trace_slime.generate"
SPEC = ("trace_slime", "get_trace_spec")
LOG_PROB_HOOK_PATH = "trace_slime.before_log_prob_hook"
TRAIN_STEP_HOOK_PATH = "trace_slime.before_train_step_hook"


# How a user turns TRACE on in the SGLang servers (named in the refusals).
ROLLOUT_HOW = ("'{\"quantization_config\": {\"quant_method\": \"trace_fp4\"}}' in --sglang-json-model-override-args "
               "(or in the checkpoint's config.json)")


class TraceSlimeError(ValueError):
    """A slime command line TRACE cannot run with; the message names the flag to change."""


@dataclass(frozen=True)
class SlimeTrace:
    trace_config: TraceConfig
    store: str  # TRACE_FP4_RECORD_STORE: where the servers put records, the only store actors resolve


def _quantization_config(args) -> tuple[dict | None, str]:
    """The quantization_config the SGLang servers load, and where it was found."""
    over = getattr(args, "sglang_json_model_override_args", None) or "{}"
    over = json.loads(over) if isinstance(over, str) else dict(over)
    if over.get("quantization_config") is not None:
        return dict(over["quantization_config"]), "--sglang-json-model-override-args"
    if getattr(args, "hf_checkpoint", None):
        path = Path(args.hf_checkpoint) / "config.json"
        if path.is_file():
            qc = json.loads(path.read_text()).get("quantization_config")
            if qc is not None:
                return dict(qc), str(path)
    return None, ""


def rollout_on(args) -> bool:
    """The SGLang servers run trace_fp4: by the flag, or by the quantization_config they load (slime's
    parser takes `--sglang-quantization trace_fp4` only where trace_sglang_plugin registered the choice
    before it was built; a quantization_config needs nothing of the driver)."""
    if getattr(args, "sglang_quantization", None) == QUANT_METHOD:
        return True
    qc, _ = _quantization_config(args)
    return qc is not None and qc.get("quant_method") == QUANT_METHOD


def trainer_on(args) -> bool:
    spec = getattr(args, "spec", None)
    return spec is not None and tuple(spec) == SPEC


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def trace_config_of(args) -> TraceConfig:
    """The TraceConfig the SGLang servers load (json_model_override_args over the checkpoint's config)."""
    qc, where = _quantization_config(args)
    if qc is None:
        return TraceConfig()
    method = qc.pop("quant_method", QUANT_METHOD)
    if method != QUANT_METHOD:
        raise TraceSlimeError(
            f"{where}: quantization_config.quant_method={method!r}, but the SGLang servers run trace_fp4"
        )
    try:
        return TraceConfig.from_dict(qc)
    except (TypeError, ValueError) as e:
        raise TraceSlimeError(f"{where}: quantization_config is not a TraceConfig: {e}") from e


def check_args(args) -> SlimeTrace | None:
    """The TRACE settings of a slime command line; None when TRACE is off; TraceSlimeError when half-set."""
    rollout, trainer = rollout_on(args), trainer_on(args)
    if not rollout and not trainer:
        if getattr(args, "custom_generate_function_path", None) == GENERATE_PATH:
            raise TraceSlimeError(
                f"--custom-generate-function-path {GENERATE_PATH} without TRACE: set {ROLLOUT_HOW} and "
                f"--spec {' '.join(SPEC)}, or use slime's own generate"
            )
        return None
    if rollout and not trainer:
        raise TraceSlimeError(
            "TRACE on the rollout only: the SGLang servers run trace_fp4 and make records, but the trainer is not "
            f"guided by them: set --spec {' '.join(SPEC)} (and the two hooks, see the README)"
        )
    if trainer and not rollout:
        raise TraceSlimeError(
            f"TRACE on the trainer only: --spec {' '.join(SPEC)} needs the rollout's records: set "
            f"{ROLLOUT_HOW}"
        )
    wanted = {
        "custom_generate_function_path": GENERATE_PATH,
        "custom_megatron_before_log_prob_hook_path": LOG_PROB_HOOK_PATH,
        "custom_megatron_before_train_step_hook_path": TRAIN_STEP_HOOK_PATH,
    }
    for key, value in wanted.items():
        if getattr(args, key, None) != value:
            raise TraceSlimeError(f"TRACE needs {_flag(key)} {value} (it is {getattr(args, key, None)!r})")
    for key in ("use_rollout_routing_replay", "use_routing_replay"):
        if getattr(args, key, False):
            raise TraceSlimeError(
                f"{_flag(key)} cannot be combined with TRACE: under TRACE the routes come from the guidance "
                "record (the trace MoE layer replays them); drop the flag"
            )
    if getattr(args, "use_critic", False):
        raise TraceSlimeError(
            "--use-critic cannot be combined with TRACE yet: the critic is built from the same --spec and "
            "would be guided by the rollout's records, which its weights did not make"
        )
    for key in ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                "rollout_num_gpus_per_engine"):
        if int(getattr(args, key, 1) or 1) != 1:
            raise TraceSlimeError(
                f"{_flag(key)}={getattr(args, key)}: trace_slime supports 1 here for now (the guidance layout "
                "of sequence-, context- and pipeline-parallel shards and the records of a multi-GPU SGLang "
                "server are not built yet); use expert / data parallelism and more SGLang servers"
            )
    from trace_kernels import envs
    from trace_kernels.stores import STORE_ENV

    store = envs.read(STORE_ENV)
    if not store:
        raise TraceSlimeError(
            f"TRACE without a record store: set {STORE_ENV}='file:/shared/dir' (one machine or a shared "
            "filesystem) or 'ray:<namespace>' in the environment of every slime process (before `ray start`, "
            "or in Ray's runtime env): the SGLang servers put records there, the Megatron actors resolve them"
        )
    return SlimeTrace(trace_config_of(args), str(store))
