"""trace_slime: TRACE in slime (THUDM/slime 0.3.1) through its own flags, no fork of slime.

  --sglang-json-model-override-args '{"quantization_config": {"quant_method": "trace_fp4"}}'  the servers capture
  --custom-generate-function-path trace_slime.generate                 slime's generate + the record handle
  --spec trace_slime get_trace_spec                                    the trace decoder-block spec
  --custom-megatron-before-log-prob-hook-path trace_slime.before_log_prob_hook
  --custom-megatron-before-train-step-hook-path trace_slime.before_train_step_hook
  TRACE_FP4_RECORD_STORE=file:/shared/dir (or ray:<namespace>) in every slime process's environment

How the handle travels: handles.py. Refused combinations: settings.py. The README and docs/rl-stacks.md
give the whole command line. Attributes are loaded when slime asks for them, so the rollout manager
does not import Megatron-Core and the actors do not import slime's rollout code for them.
"""

from .handles import HANDLE_KEY
from .settings import TraceSlimeError, check_args

__all__ = ["HANDLE_KEY", "TraceSlimeError", "before_log_prob_hook", "before_train_step_hook", "check_args",
           "generate", "get_trace_spec"]

_LAZY = {
    "generate": ("rollout", "generate"),
    "get_trace_spec": ("spec", "get_trace_spec"),
    "before_log_prob_hook": ("hooks", "before_log_prob_hook"),
    "before_train_step_hook": ("hooks", "before_train_step_hook"),
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'trace_slime' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
