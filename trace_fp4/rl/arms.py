"""The arms of the miniature (the paper's Table 1 rows, in small).

  bf16           BF16 rollout, BF16 trainer (Megatron's local spec): the reference
  fp4_qat        FP4 rollout, FP4 round-to-nearest trainer (the trace spec with no layer guided:
                 plain FP4 QAT; routes replayed from the record, as `trace-fp4 align`'s fp4_rtn)
  trace          FP4 rollout, trainer guided by full records at every layer
  trace_default  FP4 rollout, the paper's default TraceConfig (PAPER_CONFIG: compact guidance, deeper half)
"""

from dataclasses import dataclass

from trace_kernels import PAPER_CONFIG, TraceConfig


@dataclass(frozen=True)
class Arm:
    name: str
    engine: str  # "bf16" or "fp4"
    trainer: object  # "bf16" or the trainer's TraceConfig

    @property
    def fp4(self) -> bool:
        return self.engine == "fp4"


ARMS = {
    "bf16": Arm("bf16", "bf16", "bf16"),
    "fp4_qat": Arm("fp4_qat", "fp4", TraceConfig(guided_layers="none")),
    "trace": Arm("trace", "fp4", TraceConfig(guidance="full", guided_layers="all")),
    "trace_default": Arm("trace_default", "fp4", PAPER_CONFIG),  # the paper's default (named before sparse)
}


def get_arms(names) -> list[Arm]:
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; choose from {sorted(ARMS)}")
    return [ARMS[n] for n in names]
