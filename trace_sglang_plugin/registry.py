"""Registers `trace_fp4` in SGLang 0.5.23's quantization registry and CLI choices, CPU included."""

from trace_kernels.config import QUANT_METHOD


def register_quantization_method() -> None:
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES, add_quantization_method_choices
    from sglang.srt.layers import quantization as q

    from .config import TraceFp4SGLangConfig

    for table in (q.BASE_QUANTIZATION_METHODS, q.QUANTIZATION_METHODS, q.CPU_QUANTIZATION_METHODS):
        existing = table.get(QUANT_METHOD)
        if existing is not None and existing is not TraceFp4SGLangConfig:
            raise RuntimeError(f"trace_fp4: SGLang already has a quantization method named {QUANT_METHOD!r}: {existing}")
        table[QUANT_METHOD] = TraceFp4SGLangConfig
    if QUANT_METHOD not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([QUANT_METHOD])
