"""`trace-fp4 export`: a BF16 Hugging Face MoE checkpoint -> an NVFP4 checkpoint stock engines serve.

Input: a local Hugging Face Qwen3-MoE / Qwen2-MoE checkpoint (config.json + safetensors), e.g. the
trained policy written back in Hugging Face layout. Output: a copy of it in which every routed expert
projection is NVFP4 (compressed-tensors `nvfp4-pack-quantized` or ModelOpt `NVFP4`) with exactly the
codes and scales the trace_fp4 engines run, and every other tensor byte for byte as it was.

Activations: a trace_fp4 quantization_config with `activation_scale="static"` (in the checkpoint's
config.json, or given as `trace_config`) exports its calibrated amax as the input scales (W4A4).
Otherwise the checkpoint declares weight-only NVFP4 (W4A16): stock engines have no per-token global
scale in their checkpoint formats (docs/export.md says what they compute instead).
"""

import json
import shutil
from pathlib import Path

import torch

from trace_kernels import TraceConfig

from . import compressed_tensors_format, modelopt_format
from .experts import ExportError, check_expert_tensors, expert_weight_names, quantize_expert

FORMATS = ("compressed-tensors", "modelopt")
_SITE_OF = {"gate_proj": "moe_fc1_in", "up_proj": "moe_fc1_in", "down_proj": "moe_fc2_in"}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ExportError(f"{path}: cannot read JSON ({e})") from e
    if not isinstance(d, dict):
        raise ExportError(f"{path}: holds a JSON {type(d).__name__}, expected an object")
    return d


def _trace_config(cfg: dict, trace_config: TraceConfig | None, where: str) -> TraceConfig | None:
    """The TraceConfig whose activation scales the export follows: the given one, else the
    checkpoint's own trace_fp4 quantization_config; a checkpoint quantized otherwise is refused."""
    quant = cfg.get("quantization_config")
    if quant is not None:
        if not isinstance(quant, dict) or quant.get("quant_method") != "trace_fp4":
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ExportError(f"{where}: the checkpoint is already quantized (quant_method={method!r}); export needs BF16 weights")
        if trace_config is None:
            try:
                trace_config = TraceConfig.from_dict(quant)
            except ValueError as e:
                raise ExportError(f"{where}: config.json quantization_config: {e}") from None
    return trace_config


def _input_amax(tc: TraceConfig | None, layer: int, where: str) -> dict[str, torch.Tensor] | None:
    if tc is None or tc.activation_scale != "static" or not tc.quantize_expert_inputs:
        return None
    out = {}
    for proj, site in _SITE_OF.items():
        key = f"{layer}.{site}"
        if key not in tc.static_activation_amax:
            raise ExportError(f"{where}: activation_scale='static' but static_activation_amax has no {key!r}")
        out[proj] = torch.tensor([tc.static_activation_amax[key]], dtype=torch.float32)
    return out


# Projections engines fuse into one layer (vLLM and SGLang name the fused layer, not its shards).
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _skipped_modules(state: dict, expert_names: set[str]) -> list[str]:
    """Every module with a 2-D weight that is not a routed expert, listed by name so that the engines
    keep it unquantized (compressed-tensors `ignore`, ModelOpt `exclude_modules`). Engines that fuse
    q/k/v or gate/up look the fused name up, so it is listed too where all its shards are."""
    names = {n[: -len(".weight")] for n, t in state.items()
             if n.endswith(".weight") and t.dim() == 2 and n not in expert_names}
    fused = set()
    for name in names:
        parent, _, leaf = name.rpartition(".")
        for fused_leaf, shards in _FUSED.items():
            if leaf == shards[0] and all(f"{parent}.{s}" in names for s in shards):
                fused.add(f"{parent}.{fused_leaf}")
    return sorted(names | fused)


def export_checkpoint(model_dir, out_dir, *, fmt: str = "compressed-tensors", trace_config: TraceConfig | None = None,
                      dtype: str = "bfloat16", overwrite: bool = False) -> dict:
    """Write the NVFP4 checkpoint; returns a summary (format, experts, bytes, activation mode)."""
    from safetensors.torch import save_file

    from trace_fp4.hf_checkpoint import CheckpointError, load_tensors, read_config

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if dtype not in _DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
    src, out = Path(model_dir), Path(out_dir)
    where = f"--model {src}"
    if not (src / "config.json").is_file():
        raise ExportError(f"{where}: no config.json (not a Hugging Face checkpoint)")
    if out.resolve() == src.resolve():
        raise ExportError(f"--out {out} is the input checkpoint; write the export to another directory")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out {out} exists and is not empty (pass --overwrite to replace its files)")
    cfg = _read_json(src / "config.json")
    tc = _trace_config(cfg, trace_config, where)
    try:
        state = load_tensors(src)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    experts = expert_weight_names(state)
    if not experts:
        raise ExportError(f"{where}: no routed-expert weights (*.mlp.experts.<e>.{{gate,up,down}}_proj.weight) in the checkpoint")
    check_expert_tensors(state, experts)  # names the tensor; before the config checks, which name fields
    try:
        hf = read_config(src)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    if tc is not None:
        try:
            tc.check_layers(hf.num_layers, where="the model", shape=hf.model_shape())
        except ValueError as e:
            raise ExportError(f"{where}: {e}") from None

    expert_names = {n for names in experts.values() for n in names.values()}
    writer = compressed_tensors_format if fmt == "compressed-tensors" else modelopt_format
    tensors = {n: t for n, t in state.items() if n not in expert_names}
    static = False
    block_scale = tc.block_scale if tc is not None else "6"
    for (layer, expert), names in sorted(experts.items()):
        q = quantize_expert(state, layer, expert, names, _DTYPES[dtype], block_scale)
        amax = _input_amax(tc, layer, where)
        static = amax is not None
        tensors.update(writer.expert_tensors(q, amax, block_scale))
    skipped = _skipped_modules(state, expert_names)

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json", "hf_quant_config.json"):
            shutil.copy2(f, out / f.name)
    for old in out.glob("*.safetensors"):
        old.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if fmt == "compressed-tensors":
        cfg["quantization_config"] = compressed_tensors_format.quantization_config(static, skipped)
    else:
        from importlib.metadata import PackageNotFoundError, version

        try:
            ver = version("trace-fp4")
        except PackageNotFoundError:
            ver = "0"
        cfg["quantization_config"] = modelopt_format.quantization_config(static, skipped)
        (out / "hf_quant_config.json").write_text(json.dumps(modelopt_format.hf_quant_config(static, skipped, ver), indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return {
        "format": fmt,
        "out": str(out),
        "experts": len(experts),
        "layers": len({layer for layer, _ in experts}),
        "activations": "static input scales (W4A4)" if static else "weight-only (W4A16)",
        "block_scale": block_scale,
        "unquantized_modules": len(skipped),
        "bytes": (out / "model.safetensors").stat().st_size,
    }

