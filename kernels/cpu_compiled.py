"""The CPU compiled path: the torch reference's pieces compiled by torch.compile (inductor's C++ backend).

No build step at install: inductor generates C++ for each piece on its first call (gcc), caches it on
disk (`TORCHINDUCTOR_CACHE_DIR`, default /tmp/torchinductor_<user>), and later processes load it. The
pieces are the reference functions themselves, so they compute the same float32 steps; inductor fuses
the small torch ops of a piece into a few loops, which is what the CPU paths lacked (a [16, 64] tensor
ran ~40 ops of a few microseconds each per quantization). Bit-identity with eager is tested on
adversarial inputs (tests/kernels/test_cpu_compiled.py); inductor's C++ flags keep that possible:
`-ffp-contract=off` (no FMA contraction), `-fno-unsafe-math-optimizations` (no reassociation, no
reciprocal for division), and the contract's roundings are integer and comparison arithmetic.

Selected with `TRACE_FP4_CPU_BACKEND=compiled` (every "auto" backend on CPU tensors) or `backend=
"compiled"` at an entry point. Covered: round-to-nearest quantize (and its dequantized output), guided
rounding (full and compact), dequantize, the grouped GEMM's A quantization, operand decode and fixed-order
accumulation, the packed KV write's quantization, the sparse decoder's dense stages (scale and code
candidates with their flip costs and syndromes, the pattern search of one stage) and the sparse
encoder's parity bits.

Kept eager (not compiled), by design, and counted per call in `FALLBACKS` under `kept_eager:<piece>`:
  sparse_search_staging  the staged search's row selection (torch.nonzero, rows leaving after each
                         stage): data-dependent shapes, a graph break each; its dense inner step is
                         compiled.
  amax_list              the decoder's amax list decoding (data-dependent rows); it calls the compiled
                         stages on those rows.
  grouped_mm_per_expert  the grouped GEMM of large layers (one expert at a time, a host loop); its A
                         quantization is compiled.
Every other fallback is counted too: a piece whose compilation fails (no C++ compiler, an inductor
error) runs eager from then on, counted under `compile_failed:<piece>` per call, with the error kept in
`FAILURES` and warned once; dynamo's recompile limit raises instead of silently running eager.
"""

import warnings
from collections import Counter
from typing import Callable

import torch

from . import envs

FALLBACKS: Counter = Counter()  # "<why>:<piece>" -> calls that ran eager on the compiled path
FAILURES: dict[str, str] = {}  # piece -> the compile error that sent it back to eager
KEPT_EAGER = {
    "sparse_search_staging": "data-dependent row sets (torch.nonzero per stage): graph breaks; the dense "
    "pattern step inside is compiled",
    "amax_list": "data-dependent rows (the rows at the coset window's edge); the stages it runs are compiled",
    "block_scale_4over6": "the compiled pieces implement the default block scale; 4over6 rows run the eager "
    "reference",
    "grouped_mm_per_expert": "layers over BATCHED_DECODE_MAX weight elements loop over experts on the host "
    "(bounded memory); their A quantization is compiled",
}

def _compile_errors() -> tuple:
    # Read when a piece first runs: importing dynamo and inductor costs ~1.5 s, which a process that
    # never takes the compiled path (every default one) must not pay at `import trace_kernels`.
    import torch._dynamo
    import torch._inductor.exc

    return (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError,
            torch._inductor.exc.CppCompileError)


def enabled() -> bool:
    """True when `TRACE_FP4_CPU_BACKEND=compiled`: "auto" backends on CPU tensors take this path."""
    return envs.TRACE_FP4_CPU_BACKEND == "compiled"


def applies(x: torch.Tensor) -> bool:
    """Whether work on `x` takes the compiled path: a CPU tensor with TRACE_FP4_CPU_BACKEND=compiled."""
    return x.device.type == "cpu" and enabled()


def piece_or_eager(name: str, fn: Callable, compiled: bool):
    """The compiled piece `name` of `fn` where `compiled`, else `fn` itself."""
    return piece(name, fn) if compiled else fn


def count_eager(piece: str) -> None:
    """Count one call of a piece the compiled path runs eager by design (KEPT_EAGER)."""
    FALLBACKS[f"kept_eager:{piece}"] += 1


def fallbacks() -> dict[str, int]:
    """The counted fallbacks so far (a copy)."""
    return dict(FALLBACKS)


class Piece:
    """One reference function, compiled on first use (dynamic shapes, one graph: fullgraph=True, so a
    graph break is an error here, not a silent split)."""

    def __init__(self, name: str, fn: Callable, recompile_limit: int = 16):
        self.name, self.fn, self.recompile_limit = name, fn, recompile_limit
        self._compiled = None

    def __call__(self, *args):
        if self.name in FAILURES:
            FALLBACKS[f"compile_failed:{self.name}"] += 1
            return self.fn(*args)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=True, fullgraph=True, backend="inductor")
        try:
            # A recompile past dynamo's limit would otherwise run the function eagerly without a word.
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=self.recompile_limit):
                return self._compiled(*args)
        except _compile_errors() as e:
            FAILURES[self.name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            FALLBACKS[f"compile_failed:{self.name}"] += 1
            warnings.warn(f"trace_fp4: the compiled CPU path runs {self.name!r} eager from now on "
                          f"(counted in trace_kernels.cpu_compiled.FALLBACKS): {FAILURES[self.name]}")
            return self.fn(*args)


_PIECES: dict[str, Piece] = {}


def piece(name: str, fn: Callable, recompile_limit: int = 16) -> Piece:
    """The compiled piece `name` of `fn` (one per process). Shapes are dynamic, but a piece is compiled
    again for sizes 0 and 1 and for sizes its Python loops run over: `recompile_limit` bounds how many
    graphs one piece may have (past it, the piece runs eager, counted)."""
    if name not in _PIECES:
        _PIECES[name] = Piece(name, fn, recompile_limit)
    return _PIECES[name]


# ---- the contract's entry points (rows [R, K], one float32 amax per row) -------------------------------

def _quantize(x, amax):
    from . import reference

    return reference.quantize(x, amax)


def _quantize_dq(x, amax):
    from . import reference

    codes, scales = reference.quantize(x, amax)
    return codes, scales, reference.dequantize(codes, scales, amax)


def _guided_full(x, scales, amax, codes):
    from . import reference

    return reference.quantize_guided(x, scales, amax, codes=codes)


def _guided_full_dq(x, scales, amax, codes):
    from . import reference

    c, s = reference.quantize_guided(x, scales, amax, codes=codes)
    return c, s, reference.dequantize(c, s, amax)


def _guided_compact(x, scales, amax, mbits):
    from . import reference

    return reference.quantize_guided(x, scales, amax, mbits=mbits)


def _guided_compact_dq(x, scales, amax, mbits):
    from . import reference

    c, s = reference.quantize_guided(x, scales, amax, mbits=mbits)
    return c, s, reference.dequantize(c, s, amax)


def _dequantize(codes, scales, amax):
    from . import reference

    return reference.dequantize(codes, scales, amax)


def _cast(result, out_dtype):
    # The cast to the model dtype stays eager: inductor's float32 -> bf16 conversion writes every NaN as
    # the canonical 0x7FC0, eager keeps the float32 NaN's sign and payload bits (a bad block's values).
    codes, scales, out = result
    return codes, scales, out.to(out_dtype)


def quantize(x2: torch.Tensor, amax: torch.Tensor, out_dtype=None):
    """`reference.quantize` (+ its dequantized values in `out_dtype`, fused): (codes, scales, out or None)."""
    if out_dtype is None:
        return (*piece("quantize", _quantize)(x2, amax), None)
    return _cast(piece("quantize_dequantize", _quantize_dq)(x2, amax), out_dtype)


def quantize_guided(x2, scales, amax, *, codes=None, mbits=None, out_dtype=None):
    """`reference.quantize_guided` (full: packed `codes`; compact: `mbits` one int per element)."""
    if codes is not None:
        if out_dtype is None:
            return (*piece("guided_full", _guided_full)(x2, scales, amax, codes), None)
        return _cast(piece("guided_full_dequantize", _guided_full_dq)(x2, scales, amax, codes), out_dtype)
    if out_dtype is None:
        return (*piece("guided_compact", _guided_compact)(x2, scales, amax, mbits), None)
    return _cast(piece("guided_compact_dequantize", _guided_compact_dq)(x2, scales, amax, mbits), out_dtype)


def dequantize(codes, scales, amax):
    return piece("dequantize", _dequantize)(codes, scales, amax)
