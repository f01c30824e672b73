"""Every TRACE_FP4_* environment variable trace_fp4 reads, in one place (in the spirit of vllm/envs.py).

Each variable is declared once, with its type, default and meaning, and read here only. Reads are lazy
(`trace_kernels.envs.TRACE_FP4_KV_CACHE` parses `os.environ` at that moment), so a test that sets
`os.environ` or uses `monkeypatch.setenv` sees its value. A value that does not parse raises ValueError
naming the variable.

Everything a user sets per model lives in `TraceConfig` (the model's quantization_config); these
variables are per process: memory budgets of the engine worker, where records travel, and switches an
operator flips without touching the checkpoint.
"""

import os
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ENV_VARS", "EnvVar", "KV_CACHE_MODES", "describe", "read"]

KV_CACHE_MODES = ("packed", "dequantized")
KV_DECODE_ATTENTION = ("auto", "scratch", "triton", "native")
CPU_BACKENDS = ("eager", "compiled", "native")
RECORD_BACKENDS = ("auto", "eager", "native")


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]  # the raw string (set and not empty) -> value; raises ValueError
    default: Any  # when unset (or, for the optional strings, empty)
    doc: str


def _bytes(raw: str) -> int:
    return int(raw)


def _flag(raw: str) -> bool:
    # Any value but these switches it on (an operator's "yes", "1", "true" all do).
    return raw not in ("0", "false", "False")


def _kv_cache_mode(raw: str) -> str:
    if raw not in KV_CACHE_MODES:
        raise ValueError(f"expected one of {KV_CACHE_MODES}")
    return raw


def _kv_decode_attention(raw: str) -> str:
    if raw not in KV_DECODE_ATTENTION:
        raise ValueError(f"expected one of {KV_DECODE_ATTENTION}")
    return raw


def _cpu_backend(raw: str) -> str:
    if raw not in CPU_BACKENDS:
        raise ValueError(f"expected one of {CPU_BACKENDS}")
    return raw


def _record_backend(raw: str) -> str:
    if raw not in RECORD_BACKENDS:
        raise ValueError(f"expected one of {RECORD_BACKENDS}")
    return raw


def _text(raw: str) -> str:
    return raw


ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "TRACE_FP4_CAPTURE_MAX_BYTES", _bytes, 2 << 30,
            "vLLM worker: bytes of captured rows held for running and finished requests; over it the oldest "
            "finished captures are dropped first, then the largest running one (each drop counted, and "
            "reported when its record is taken).",
        ),
        EnvVar(
            "TRACE_FP4_PREFIX_CACHING", _flag, False,
            "vLLM worker: keep vLLM's prefix caching on while capturing, and serve prefix-cache hits from "
            "the prefix-rows cache (otherwise prefix caching is switched off for capture).",
        ),
        EnvVar(
            "TRACE_FP4_KEEP_ABORTED", _flag, False,
            "vLLM worker: keep an aborted request's captured rows to be taken (a partial rollout: verl's "
            "fully async partial rollout, slime's abort-and-continue resume it under new weights and "
            "stitch its record with the continuation's); the caller takes or discards them. Otherwise "
            "an aborted request's rows are dropped (counted).",
        ),
        EnvVar(
            "TRACE_FP4_PREFIX_ROWS_MAX_BYTES", _bytes, 256 << 20,
            "vLLM worker: bytes of prompt rows kept to serve prefix-cache hits (oldest out first, counted).",
        ),
        EnvVar(
            "TRACE_FP4_KV_CACHE", _kv_cache_mode, "packed",
            "Both engines: 'packed' keeps packed NVFP4 rows in the KV cache (about 3.4x the tokens of BF16 "
            "at head_dim 128); 'dequantized' keeps the dequantized values in the model dtype (the same "
            "bits every read sees, 1.0x memory).",
        ),
        EnvVar(
            "TRACE_FP4_KV_DECODE_ATTENTION", _kv_decode_attention, "auto",
            "vLLM worker, packed KV cache: how batches attend. 'scratch' dequantizes the blocks in "
            "use into a model-dtype scratch and runs the backend's own kernel; 'triton' runs "
            "trace_kernels.attention's decode kernel on the packed pages for decode batches (CUDA-graph "
            "safe; on a CPU it runs interpreted, for tests); 'native' runs the numba kernel "
            "(trace_kernels.cpu_native.attention) on the packed pages of a CPU cache for every batch, decode "
            "and prefill (outputs within a bf16 ulp of the scratch path's, not bit-identical); 'auto' is "
            "'native' where TRACE_FP4_CPU_BACKEND=native, else 'scratch'. vLLM's GPU backends (TRITON_ATTN, "
            "FLASH_ATTN) keep a packed cache only with 'triton' (otherwise the dequantized fallback, counted).",
        ),
        EnvVar(
            "TRACE_FP4_CPU_BACKEND", _cpu_backend, "eager",
            "Engines and trainers on a CPU: what backend='auto' runs on CPU tensors. 'eager' is the torch "
            "reference; 'compiled' the same pieces compiled by torch.compile (inductor's C++ backend, no "
            "build step at install, first call compiles; bit-identical to eager: quantize, guided rounding, "
            "dequantize, the grouped GEMM, the packed KV write, sparse encode and decode). Pieces that run "
            "eager on the compiled path are counted in trace_kernels.cpu_compiled.FALLBACKS. 'native' runs "
            "numba kernels (trace_kernels.cpu_native: whole loop nests, control flow included, bit-identical "
            "to eager); pieces without one run eager, counted in trace_kernels.cpu_native.FALLBACKS.",
        ),
        EnvVar(
            "TRACE_FP4_RECORD_BACKEND", _record_backend, "auto",
            "Engines on a CPU: what encodes the records (the sparse encoder of every guided site). 'auto' "
            "follows TRACE_FP4_CPU_BACKEND; 'native' runs the numba encoder (trace_kernels.cpu_native."
            "sparse_encode, byte-identical payloads) while the layers keep their own backend; 'eager' the "
            "torch reference.",
        ),
        EnvVar(
            "TRACE_FP4_RECORD_STORE", _text, None,
            "Engines and API callers: a record store spec ('file:/dir' or 'ray:<namespace>'); when set, "
            "records are put there and only their handles travel.",
        ),
        EnvVar(
            "TRACE_FP4_ALLOWED_STORES", _text, None,
            "Trainers: further record stores whose handles may be resolved, comma-separated specs "
            "(besides the stores the process opened and TRACE_FP4_RECORD_STORE); any other store's "
            "handle is refused.",
        ),
        EnvVar(
            "TRACE_FP4_SLIME_PATH", _text, None,
            "Tests: the folder holding slime's `slime` package (slime is not on PyPI); default "
            "../shared/vendor/slime-624b824 beside the repository.",
        ),
        EnvVar(
            "TRACE_FP4_SGLANG_RECORD_DIR", _text, None,
            "SGLang scheduler: write each record to <dir>/<request id>.trace.safetensors and return its "
            "path (TRACE_FP4_RECORD_STORE takes precedence).",
        ),
    )
}


def _raw(var: EnvVar) -> str | None:
    raw = os.environ.get(var.name)
    if raw is None:
        return None
    if raw == "" and var.parse in (_text, _flag):
        return None  # an empty optional string or flag reads as unset
    return raw


def read(name: str):
    """The current value of variable `name` (its default when unset)."""
    var = ENV_VARS[name]
    raw = _raw(var)
    if raw is None:
        return var.default
    try:
        return var.parse(raw)
    except ValueError as e:
        raise ValueError(f"trace_fp4: {name}={raw!r}: {e}") from None


def describe() -> str:
    """One paragraph per variable: name, default, meaning (for docs and `--help` texts)."""
    return "\n".join(f"{v.name} (default {v.default!r}): {v.doc}" for v in ENV_VARS.values())


def __getattr__(name: str):
    if name in ENV_VARS:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*__all__, *ENV_VARS])
