"""trace_verl: TRACE in verl 0.9.1 by configuration alone (no fork of verl).

Installing trace-fp4 registers `trace_verl.plugin` in verl's `verl.plugins` entry-point group, which
verl imports on `import verl` in every process. It re-registers the rollout replica "vllm" (and
"sglang") with servers that put each request's guidance record in a store and return its handle in
`TokenOutput.extra_fields`, and extends verl's Megatron engine so every forward is guided by its
micro-batch's records. Config keys, refused combinations: settings.py and the README.
"""

from .settings import HANDLE_FIELD, KEY, TraceConfigError, check_config, rollout_settings, trainer_settings

__all__ = ["HANDLE_FIELD", "KEY", "TraceConfigError", "check_config", "register", "rollout_settings", "trainer_settings"]

_registered = False


def register() -> None:
    """Register the TRACE rollout servers and Megatron engine with verl (idempotent)."""
    global _registered
    if _registered:
        return
    from .versions import check_verl

    check_verl()
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    # Loaders, as verl's own: the engine is imported only where a replica of that kind is made.
    RolloutReplicaRegistry.register("vllm", _load_vllm)
    RolloutReplicaRegistry.register("sglang", _load_sglang)
    from .lazy import after_import

    # Registered when verl imports its Megatron engine (which registers MegatronEngineWithLMHead), so
    # processes that never train do not import Megatron-Core for it.
    after_import("verl.workers.engine.megatron.transformer_impl", _register_engine)
    # verl's fully async client rebuilds a partial rollout's extra_fields and would drop the handle.
    after_import("verl.workers.rollout.llm_server", _keep_partial_rollout_handles)
    _registered = True


def _keep_partial_rollout_handles(_module) -> None:
    from trace_fp4_patches.verl_partial_rollout import install

    install(HANDLE_FIELD)


def _register_engine(_module) -> None:
    from .engine import register_engine

    register_engine()


def _load_vllm():
    from .rollout_vllm import TraceVLLMReplica

    return TraceVLLMReplica


def _load_sglang():
    from verl.workers.rollout import replica

    replica._load_sglang()  # verl's own loader first: the environment it sets up to import SGLang
    from .rollout_sglang import load_replica

    return load_replica()
