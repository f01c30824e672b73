"""slime for the tests: where its source is, its real argument parser, a CPU accelerator for its trainer.

slime is not on PyPI. The tests read the pinned snapshot `../shared/vendor/slime-624b824` beside the
repository (THUDM/slime @624b824), or the folder TRACE_FP4_SLIME_PATH names, and skip where neither is.
"""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SLIME = REPO.parent / "shared" / "vendor" / "slime-624b824"
GET_SLIME = ("slime not found at {path}: clone THUDM/slime (git clone https://github.com/THUDM/slime; git checkout "
             "624b824) and set TRACE_FP4_SLIME_PATH to it")


def slime_path() -> Path:
    from trace_kernels import envs

    return Path(envs.read("TRACE_FP4_SLIME_PATH") or DEFAULT_SLIME)


def slime_skip_reason() -> str | None:
    path = slime_path()
    if not (path / "slime" / "__init__.py").is_file():
        return GET_SLIME.format(path=path)
    return None


def put_slime_on_path() -> Path:
    """slime on sys.path (this process) and PYTHONPATH (its children); Python 3.11's typing.override."""
    path = str(slime_path())
    if path not in sys.path:
        sys.path.insert(0, path)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if path not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([path, *parts])
    from trace_fp4_patches import python311_override

    python311_override.install()
    return Path(path)


def slime_argv(model_dir, *, num_layers: int, rollout_batch_size: int, n_samples: int, max_response_len: int,
               max_tokens_per_gpu: int, extra=()) -> list[str]:
    """A slime train.py command line for the tiny Qwen3-MoE with the README's TRACE flags."""
    gbs = rollout_batch_size * n_samples
    return [
        "train.py", "--hf-checkpoint", str(model_dir),
        # the tiny Qwen3-MoE (trace_fp4.tiny_model) as Megatron arguments
        "--num-layers", str(num_layers), "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--kv-channels", "32", "--ffn-hidden-size", "256", "--num-experts", "8",
        "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--swiglu", "--normalization", "RMSNorm",
        "--norm-epsilon", "1e-6", "--qk-layernorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--vocab-size", "384", "--position-embedding-type", "rope", "--rotary-base", "10000", "--seq-length", "256",
        "--max-position-embeddings", "2048", "--bf16", "--transformer-impl", "local",
        "--moe-token-dispatcher-type", "alltoall",
        # rollout and batches
        "--prompt-data", "/dev/null", "--input-key", "prompt", "--label-key", "label", "--num-rollout", "2",
        "--rollout-batch-size", str(rollout_batch_size), "--n-samples-per-prompt", str(n_samples),
        "--global-batch-size", str(gbs), "--micro-batch-size", "1", "--rollout-max-response-len", str(max_response_len),
        "--rollout-temperature", "1.0", "--rm-type", "math", "--advantage-estimator", "grpo",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(max_tokens_per_gpu),
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
        "--rollout-num-gpus-per-engine", "1",
        # TRACE (README): the servers' quantization_config is in the checkpoint's config.json
        "--custom-generate-function-path", "trace_slime.generate",
        "--spec", "trace_slime", "get_trace_spec",
        "--custom-megatron-before-log-prob-hook-path", "trace_slime.before_log_prob_hook",
        "--custom-megatron-before-train-step-hook-path", "trace_slime.before_train_step_hook",
        *extra,
    ]


def parse_slime_args(argv: list[str]):
    """slime's own `parse_args` (Megatron's and SGLang's parsers included) on `argv`."""
    from slime.utils.arguments import parse_args

    saved = sys.argv
    sys.argv = list(argv)
    try:
        return parse_args()
    finally:
        sys.argv = saved


def use_cpu_accelerator() -> None:
    """slime's trainer asks its accelerator registry for a device; this machine has no GPU. A stand-in
    that answers "cpu" (test-only: slime has no CPU backend)."""
    import torch
    from slime.utils import accelerator
    from slime.utils.accelerator.torch_accelerator import TorchAccelerator

    class CPUAccelerator(TorchAccelerator):
        name = "cpu"
        device_type = "cpu"
        communication_backend_name = "gloo"

        def _module(self):
            return torch.cpu

        def is_available(self) -> bool:
            return True

        def device_name(self, index=None) -> str:
            return "cpu"

        def current_device(self):
            return "cpu"

    accelerator.set_accelerator(CPUAccelerator())


def cpu_pipeline_schedules() -> None:
    """Megatron-Core's `forward_backward_no_pipelining` (which slime's `forward_only` calls) counts tokens
    in `torch.zeros(..., device="cuda")`. On this CPU machine that one allocation goes to the CPU: the
    schedules module gets a `torch` whose `zeros` maps device "cuda" to "cpu" (nothing else changes)."""
    import types

    import torch
    from megatron.core.pipeline_parallel import schedules

    if isinstance(schedules.torch, types.SimpleNamespace):
        return

    def zeros(*args, device=None, **kwargs):
        if device is not None and str(device).startswith("cuda"):
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)

    proxy = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.zeros = zeros
    schedules.torch = proxy
