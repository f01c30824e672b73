"""Trained Megatron-Core weights as export input: back to Hugging Face names first.

A GPTModel state dict (local spec, SequentialMLP experts: the names `trace_fp4.hf_to_megatron` writes
and the RL miniature trains) saved with `torch.save` or as safetensors, plus the Hugging Face checkpoint
it came from (config.json, tokenizer). `trace_fp4.rl.export.to_hf` is the converter's inverse.
"""

import shutil
import tempfile
from pathlib import Path

import torch

from .experts import ExportError


def load_megatron_state(path) -> dict[str, torch.Tensor]:
    p = Path(path)
    if not p.is_file():
        raise ExportError(f"--megatron-state {p}: no such file")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(p))
        else:
            state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged or foreign file: one line naming it
        raise ExportError(f"--megatron-state {p}: cannot read a state dict ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for k, v in state.items() if not k.endswith("_extra_state")):
        raise ExportError(f"--megatron-state {p}: expected a mapping of tensor names to tensors (a GPTModel state_dict)")
    return {k: v for k, v in state.items() if not k.endswith("_extra_state")}


def hf_checkpoint_from_megatron(state_path, model_dir, dtype=torch.bfloat16) -> tempfile.TemporaryDirectory:
    """A temporary Hugging Face checkpoint: `model_dir`'s config and tokenizer with the Megatron weights."""
    from safetensors.torch import save_file

    from trace_fp4.hf_checkpoint import CheckpointError, read_config
    from trace_fp4.rl.export import to_hf

    try:
        hf = read_config(model_dir)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    state = load_megatron_state(state_path)
    try:
        tensors = to_hf(state, hf)
    except KeyError as e:
        raise ExportError(f"--megatron-state {state_path}: no tensor {e} (not a GPTModel of --model's shape?)") from None
    except ValueError as e:
        raise ExportError(f"--megatron-state {state_path}: {e}") from None
    tmp = tempfile.TemporaryDirectory(prefix="trace-fp4-export-")
    shutil.copytree(model_dir, tmp.name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(Path(tmp.name) / "model.safetensors"),
              metadata={"format": "pt"})
    return tmp
