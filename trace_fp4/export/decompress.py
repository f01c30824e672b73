"""Read an exported compressed-tensors checkpoint back through compressed-tensors' own decompressor.

This is what a stock loader without an NVFP4 kernel sees: each expert projection dequantized by
`NVFP4PackedCompressor.decompress` (bf16 `code * (scale / weight_global_scale)`), i.e. the W4A16
weights. Used by the RL miniature's final evaluation and by the tests.
"""

import json
from pathlib import Path

import torch

from .experts import ExportError

_FIELDS = ("weight_packed", "weight_scale", "weight_global_scale")


def decompressed_experts(export_dir) -> dict[str, torch.Tensor]:
    """{"<prefix>.<e>.<proj>.weight": bf16 [N, K]} for every NVFP4 module of a compressed-tensors export."""
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    d = Path(export_dir)
    q = json.loads((d / "config.json").read_text()).get("quantization_config") or {}
    if q.get("format") != "nvfp4-pack-quantized":
        raise ExportError(f"{d}: not a compressed-tensors nvfp4-pack-quantized checkpoint (format={q.get('format')!r})")
    qc = QuantizationConfig.model_validate(q)
    if len(qc.config_groups) != 1:
        raise ExportError(f"{d}: expected one config group (the routed experts), found {sorted(qc.config_groups)}")
    scheme = next(iter(qc.config_groups.values()))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out = {}
    for name in sorted(n for n in tensors if n.endswith(".weight_packed")):
        module = name[: -len(".weight_packed")]
        part = {k: tensors[f"{module}.{k}"] for k in _FIELDS}
        out[f"{module}.weight"] = NVFP4PackedCompressor.decompress(part, scheme)["weight"]
    return out
