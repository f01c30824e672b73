"""`trace_fp4` as an SGLang quantization method (SGLang 0.5.23, see versions.py).

Selected by `--quantization trace_fp4`, or by `quantization_config: {"quant_method": "trace_fp4", ...}` in
the model's config.json. The TRACE settings are `trace_kernels.TraceConfig` (unknown keys and bad values
fail at model load, naming the key). Only the routed experts get a quantized method; every other linear
layer stays in the model dtype. The KV cache path is installed by hooks (kv.py), not per layer.

The config owns the engine's `EngineState` (state.py): its MoE methods report to it, and
capture_setup.init_capture completes it once the KV pool exists.
"""

from typing import Any

import torch
from sglang.srt.layers.quantization.base_config import QuantizationConfig

from trace_kernels import TraceConfig
from trace_kernels.config import QUANT_METHOD

from .state import EngineState

# Keys SGLang's loader adds to the checkpoint's quantization_config before `from_config`.
_SGLANG_ADDED_KEYS = ("packed_modules_mapping", "hf_config", "requantization_method")


class TraceFp4SGLangConfig(QuantizationConfig):
    def __init__(self, trace: TraceConfig | None = None):
        super().__init__()
        self.trace = trace if trace is not None else TraceConfig()
        self.state = EngineState(self.trace)

    def __getstate__(self):
        # A copy (or a pickle to another process) is a config, not this engine's state.
        state = dict(self.__dict__)
        state["state"] = None
        return state

    def __setstate__(self, d):
        self.__dict__.update(d)
        self.state = EngineState(self.trace)

    def __repr__(self) -> str:
        return f"TraceFp4SGLangConfig({self.trace.to_json()})"

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # Fake quantization runs anywhere (CPU included); FP4 GEMMs are a later backend.
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        # No separate file: settings come from config.json's quantization_config, or defaults.
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "TraceFp4SGLangConfig":
        d = {k: v for k, v in config.items() if k not in _SGLANG_ADDED_KEYS}
        try:
            trace = TraceConfig.from_dict(d)
        except ValueError as e:
            raise ValueError(f"trace_fp4: bad quantization_config in the model's config.json: {e}") from e
        return cls(trace)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from sglang.srt.layers.linear import LinearBase
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
        from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

        if isinstance(layer, FusedMoE):
            from .moe import TraceFp4MoEMethod

            return TraceFp4MoEMethod(self.trace, prefix, self.state)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        return None

    def get_scaled_act_names(self) -> list[str]:
        return []
