"""trace_sglang_plugin: TRACE FP4 rollouts in SGLang (`--quantization trace_fp4`).

Loaded by SGLang's `sglang.srt.plugins` entry point group in every SGLang process (engine, scheduler,
detokenizer). `register()` checks the SGLang version, registers the `trace_fp4` quantization method and
installs the hooks (hooks.py). Records come back in each finished response's `meta_info["trace_fp4"]`;
decode them with `record_from_meta_info`.
"""

from .transport import META_KEY, RECORD_DIR_ENV, payload_from_meta_info, record_from_meta_info
from .versions import SUPPORTED_SGLANG_VERSIONS, UnsupportedSGLangVersion, check_sglang_version


def bind_cpu_threads(ranks: int):
    """Before starting SGLang's CPU engine with `ranks` TP ranks: one share of the allowed cores per rank
    unless SGLANG_CPU_OMP_THREADS_BIND is set (logged). See tensor_parallel.py."""
    from .tensor_parallel import bind_cpu_threads as bind

    return bind(ranks)


__all__ = [
    "META_KEY",
    "RECORD_DIR_ENV",
    "SUPPORTED_SGLANG_VERSIONS",
    "UnsupportedSGLangVersion",
    "bind_cpu_threads",
    "check_sglang_version",
    "payload_from_meta_info",
    "record_from_meta_info",
    "register",
]

_registered = False


def register() -> None:
    """Entry point (`sglang.srt.plugins`): idempotent per process."""
    global _registered
    if _registered:
        return
    check_sglang_version()
    _init_cpu_amx()
    from .registry import register_quantization_method
    from .hooks import register_hooks

    register_quantization_method()
    register_hooks()
    _registered = True


def _init_cpu_amx() -> None:
    # On CPUs with AMX, a process that runs bf16 attention must initialise AMX tile state first
    # (else SIGILL); SGLang's CPU engine does not do it in every process. Harmless elsewhere.
    import os

    import torch

    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()
