"""Export of a trained MoE policy as an NVFP4 checkpoint for stock vLLM / SGLang (docs/export.md)."""

from .checkpoint import FORMATS, export_checkpoint
from .experts import ExportError

__all__ = ["FORMATS", "ExportError", "export_checkpoint"]
